"""The registry of model families, their model builders and their config sections.

A leaf: it imports no family (and nothing of gnetmdk at module level). Each family registers itself
when its package is imported (gnetmdk.models imports both); the lookups here import gnetmdk.models on
the first lookup that needs it (as mmengine's Registry imports its ``locations``), so code on the
floors below the models (the config, the checkpoints, the datasets) finds a family by name without
importing a family:

    family = get_family(cfg.model_name)    # the family object (gnetmdk.models.base.DetectorFamily)
    for name, klass in sections().items(): # every family's ConfigSection subclass, by section name
        ...

gnetmdk.models re-exports the registering functions (``register_family``, ``register_model``) and
``get_family``; gnetmdk.config.base re-exports ``SECTIONS`` and ``register_section``.
"""
from __future__ import annotations

import difflib
from typing import Callable, Dict, Iterable

#: family name -> the registered family object (gnetmdk.models.base.DetectorFamily)
FAMILIES: Dict[str, object] = {}
#: builder name -> (builder(**kwargs) -> nn.Module, family name)
MODELS: Dict[str, tuple] = {}
#: section name (a model family's) -> its ConfigSection subclass
SECTIONS: Dict[str, type] = {}

#: the package whose import registers every family and section (imported on the first lookup)
LOCATION = "gnetmdk.models"


def load_families() -> None:
    """Import :data:`LOCATION` (gnetmdk.models), whose families register themselves and their config
    sections; a second call costs a lookup in ``sys.modules``."""
    import gnetmdk.models  # noqa: F401  (the registry's one import of the families, on first lookup)


def register_family(family):
    """Register ``family`` (a DetectorFamily) under ``family.name``; returns it."""
    FAMILIES[family.name] = family
    return family


def register_model(name: str, family: str = "gnetdet") -> Callable:
    """Decorator: register a builder ``fn(**kwargs) -> nn.Module`` under ``name``, as a model of the
    registered ``family`` (a variant of its architecture, e.g. a test model; config ``model_name`` may
    then name it)."""
    def deco(fn):
        MODELS[name] = (fn, family)
        return fn
    return deco


def register_section(name: str, klass: type) -> type:
    """Register a family's config section (a ConfigSection subclass); every config then has ``cfg.<name>``."""
    SECTIONS[name] = klass
    return klass


def unknown_name_error(name: str, kind: str, known: Iterable[str]):
    """The ConfigError for an unknown ``kind`` name: the closest registered names and every one."""
    from .base import ConfigError
    known = list(known)
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.4)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    return ConfigError(f"unknown {kind} '{name}'{hint} (registered: {', '.join(sorted(known))})")


def get_family(name: str):
    """The family of a model name (a family name, or a builder registered with register_model); the
    families are loaded first when the name is not registered yet.

    Raises:
        ConfigError: unknown name, with the closest registered names.
    """
    if name not in FAMILIES and name not in MODELS:
        load_families()
    if name in FAMILIES:
        return FAMILIES[name]
    if name in MODELS:
        return FAMILIES[MODELS[name][1]]
    raise unknown_name_error(name, "model", list(FAMILIES) + list(MODELS))


def sections() -> Dict[str, type]:
    """The registered config sections ({name: ConfigSection subclass}), after loading the families
    that register them when none is registered yet."""
    if not SECTIONS:
        load_families()
    return SECTIONS
