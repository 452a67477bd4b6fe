"""Model families (docs/architecture.md, "Families are plug-ins"): one sub-package per family behind one
protocol (gnetmdk.models.base.DetectorFamily), and the registry that maps names to families and builders.

    family = get_family(cfg.model_name)        # the family object
    model = model_from_config(cfg)             # a fresh model of the config's family
    model = create_model(meta["name"], **kw)   # by registered builder name (checkpoints, tests)

The trainer, evaluator, dataset and checkpoint code use these and know no family by name.
"""
from __future__ import annotations

import torch.nn as nn

# the registry itself is a leaf below the models (gnetmdk.config.registry), so that the config, the
# checkpoints and the datasets find a family without importing one; its names are re-exported here
from gnetmdk.config.registry import (FAMILIES, MODELS, get_family, register_family, register_model,
                                     unknown_name_error)
from .base import ALL_STAGES, DetectorFamily


def family_of(model: nn.Module) -> DetectorFamily:
    """The family of a built model (from its ``meta()["name"]``)."""
    return get_family(model.meta()["name"])


def create_model(name: str, **kwargs) -> nn.Module:
    """Build a model by name: a builder registered with register_model, or a family's model class.

    Raises:
        ConfigError: unknown name, with the closest registered names.
    """
    if name in MODELS:
        return MODELS[name][0](**kwargs)
    if name in FAMILIES:
        return FAMILIES[name].create(**kwargs)
    raise unknown_name_error(name, "model", list(FAMILIES) + list(MODELS))


def model_from_config(cfg, **overrides) -> nn.Module:
    """A fresh model of the config's family (``model_name``), built from the config's values
    (``overrides``, e.g. ``use_bn=False``, replace config-derived arguments)."""
    family = get_family(cfg.model_name)
    if cfg.model_name in MODELS and cfg.model_name not in FAMILIES:
        return family.build(cfg, builder=MODELS[cfg.model_name][0], **overrides)
    return family.build(cfg, **overrides)


# the families of this package (each registers itself)
from . import gnetdet  # noqa: E402,F401
from . import ppyolo  # noqa: E402,F401

__all__ = ["ALL_STAGES", "DetectorFamily", "FAMILIES", "MODELS", "create_model", "family_of", "get_family",
           "model_from_config", "register_family", "register_model"]
