"""Resolving a run's configuration: config file, per-step values and command-line overrides.

Command-line overrides come after the ``--`` options as ``key value`` or ``key=value`` pairs;
``-`` in a key is read as ``_`` (``batch-size 32`` == ``batch_size=32``). Values are converted by
the field's declared type: ``bool`` accepts true/false/1/0/yes/no/on/off, ``List[T]`` accepts
``1,2,3`` or ``[1, 2, 3]``. An unknown key is refused with the closest known names.
"""
from __future__ import annotations

import math

import ast
import difflib
import importlib.util
import os
import typing
from typing import Any, Dict, List, Sequence, Tuple, Type

from .base import BaseConfig, ConfigError, ConfigSection, ensure_sections, tf32_mode
from .registry import get_family

_TRUE = {"1", "true", "yes", "y", "on"}
_FALSE = {"0", "false", "no", "n", "off"}

KNOWN_CHIPS = ("2801", "2803", "5801")
#: string fields that were booleans once and still take true / false ("on" / "off")
_SWITCH_STRINGS = {"tf32"}


def convert_value(name: str, raw: Any, typ: Any) -> Any:
    """Convert ``raw`` (usually a command-line string) to the field type ``typ``.

    Raises:
        ConfigError: naming the field, the value and the expected type.
    """
    if not isinstance(raw, str):
        return raw
    origin = typing.get_origin(typ)
    try:
        if typ is bool:
            low = raw.strip().lower()
            if low in _TRUE:
                return True
            if low in _FALSE:
                return False
            raise ValueError("not a boolean")
        if typ is int:
            f = float(raw)
            if not f.is_integer():
                raise ValueError("not an integer")
            return int(f)
        if typ is float:
            return float(raw)
        if typ is str:
            return raw
        if origin in (list, tuple, List):
            (inner,) = typing.get_args(typ) or (str,)
            text = raw.strip()
            if text.startswith("["):
                items = ast.literal_eval(text)
                items = [str(i) if not isinstance(i, str) else i for i in items]
            else:
                items = [t for t in text.split(",") if t.strip() != ""]
            return [convert_value(name, item.strip(), inner) for item in items]
        if origin in (dict, Dict):
            raise ValueError("dict fields are set in configs.py, not on the command line")
    except (ValueError, SyntaxError) as exc:
        tname = getattr(typ, "__name__", str(typ))
        raise ConfigError(f"config field '{name}': cannot read {raw!r} as {tname} ({exc})") from None
    return raw


def check_value(name: str, value: Any, typ: Any) -> Any:
    """A value from configs.py, ``per_step`` or the command line, as the field's type: strings are read as
    :func:`convert_value` reads the command line (``"4"`` -> 4, ``"no"`` -> False), other values must
    already be of the type (an int is a float; a whole float is an int), and numbers must be finite.

    Raises:
        ConfigError: naming the field, the value and the type it needs.
    """
    tname = getattr(typ, "__name__", str(typ))
    if isinstance(value, str) and typ is not str:
        value = convert_value(name, value, typ)
    origin = typing.get_origin(typ)

    def bad(why: str) -> ConfigError:
        return ConfigError(f"config field '{name}' = {value!r}: {why}")

    if typ is bool:
        if not isinstance(value, bool):
            raise bad("must be true or false")
    elif typ is int:
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad("must be an integer")
    elif typ is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad("must be a number")
        value = float(value)
        if not math.isfinite(value):
            raise bad("must be a finite number")
    elif typ is str:
        if isinstance(value, bool) and name in _SWITCH_STRINGS:   # tf32 = True from an older configs.py
            value = "on" if value else "off"
        if not isinstance(value, str):
            raise bad("must be a string")
    elif origin in (list, tuple, List):
        if not isinstance(value, (list, tuple)):
            raise bad(f"must be a list ({tname})")
        (inner,) = typing.get_args(typ) or (Any,)
        if inner is not Any:
            value = [check_value(f"{name}[{i}]", v, inner) for i, v in enumerate(value)]
        else:
            value = list(value)
    elif origin in (dict, Dict):
        if not isinstance(value, dict):
            raise bad("must be a dict")
    return value


def split_overrides(tokens: Sequence[str]) -> List[Tuple[str, str]]:
    """``key value`` / ``key=value`` words -> [(key, raw value)], keys with ``-`` read as ``_``.

    Raises:
        ConfigError: a key without a value.
    """
    out: List[Tuple[str, str]] = []
    i = 0
    tokens = list(tokens)
    while i < len(tokens):
        tok = tokens[i]
        if "=" in tok:
            key, value = tok.split("=", 1)
            i += 1
        else:
            key = tok
            if i + 1 >= len(tokens):
                raise ConfigError(f"override '{tok}' has no value: write '{tok} VALUE' or '{tok}=VALUE'")
            value = tokens[i + 1]
            i += 2
        out.append((key.lstrip("-").replace("-", "_"), value))
    return out


def _resolve_key(key: str, known: Dict[str, Any]) -> str:
    """``key`` itself, or its case-insensitive match among ``known``.

    Raises:
        ConfigError: unknown key, with the closest known names.
    """
    if key in known:
        return key
    lower = {k.lower(): k for k in known}
    if key.lower() in lower:
        return lower[key.lower()]
    close = difflib.get_close_matches(key, list(known), n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise ConfigError(f"unknown config field '{key}'{hint} (fields are declared in gnetmdk/config/base.py, the "
                      "families' sections in gnetmdk/models/<family>/config.py, and configs.py)")


def parse_overrides(tokens: Sequence[str], known: Dict[str, Any]) -> Dict[str, Any]:
    """Parse ``key value`` / ``key=value`` tokens into ``{field: converted value}``.

    Args:
        tokens: the command-line words after the ``--`` options.
        known: field name -> declared type (``BaseConfig.field_types()``, or :func:`known_fields`).

    Raises:
        ConfigError: a key that is not a field (with the closest known names), a key without a
        value, or a value that does not convert.
    """
    out: Dict[str, Any] = {}
    for key, value in split_overrides(tokens):
        key = _resolve_key(key, known)
        out[key] = check_value(key, value, known[key])
    return out


def override_names() -> set:
    """Every word that names a config value on a command line, for any model family: the top-level
    fields, ``section.field``, and each section's fields by their own names. Tools whose positional
    arguments are optional use it to tell the first override word from a path."""
    names = set(BaseConfig.field_types())
    for name, fields in BaseConfig.section_types().items():
        names.update(f"{name}.{f}" for f in fields)
        names.update(fields)
    return names


def known_fields(klass: Type[BaseConfig], family: str | None) -> Dict[str, Any]:
    """Every name a config value may be given under, mapped to its type: the top-level fields, each
    section's fields as ``section.field``, and the fields of ``family``'s section by their own names
    (where no top-level field has that name)."""
    known = dict(klass.field_types())
    sections = klass.section_types()
    for name, fields in sections.items():
        known.update({f"{name}.{f}": t for f, t in fields.items()})
    if family in sections:
        for f, t in sections[family].items():
            known.setdefault(f, t)
    return known


def _place(cfg: BaseConfig, key: str, value: Any, family: str, where: str) -> None:
    """Set a resolved value: a top-level field, ``section.field``, or a short name of the family's section."""
    top = type(cfg).field_types()
    if key in top:
        setattr(cfg, key, value)
        return
    if "." in key:
        sec, field = key.split(".", 1)
    else:
        sec, field = family, key
    section = getattr(cfg, sec, None)
    if not isinstance(section, ConfigSection) or field not in section.field_types():
        raise ConfigError(f"{where}: '{key}' is not a field of this config")
    setattr(section, field, value)


def _section_owner(field: str, sections: Dict[str, Dict[str, Any]]) -> List[str]:
    return [name for name, fields in sections.items() if field in fields]


def load_config_class(config_file: str | None) -> Type[BaseConfig]:
    """Import ``Config`` from a configs.py file (default: ./configs.py, then the repository's).

    Raises:
        ConfigError: file missing, or it defines no ``Config`` subclass of BaseConfig.
    """
    if config_file is None:
        candidates = [os.path.join(os.getcwd(), "configs.py"),
                      os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
                          os.path.abspath(__file__)))), "configs.py")]
        config_file = next((c for c in candidates if os.path.isfile(c)), None)
        if config_file is None:
            return BaseConfig
    if not os.path.isfile(config_file):
        raise ConfigError(f"config file '{config_file}' does not exist: pass --config PATH to a "
                          "file that defines 'class Config(BaseConfig)'")
    spec = importlib.util.spec_from_file_location(
        f"gnetmdk_user_config_{abs(hash(os.path.abspath(config_file)))}", config_file)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    except Exception as exc:
        raise ConfigError(f"config file '{config_file}' failed to import: {exc!r}") from exc
    klass = getattr(module, "Config", None)
    if not (isinstance(klass, type) and issubclass(klass, BaseConfig)):
        raise ConfigError(f"config file '{config_file}' defines no 'class Config(BaseConfig)'")
    return klass


def _check_class_fields(klass: Type[BaseConfig]) -> None:
    """Refuse attributes of a Config subclass (and of its bases between it and BaseConfig) that are not
    config fields: a misspelt field would otherwise be ignored. Helpers start with ``_``; methods and
    ``DEFAULT_STEP`` are allowed.

    Raises:
        ConfigError: naming the attribute and the closest field names.
    """
    known = dict(BaseConfig.field_types())
    for name, fields in BaseConfig.section_types().items():
        known[name] = dict
        known.update(fields)
    for k in klass.__mro__:
        if k is BaseConfig or not issubclass(k, BaseConfig):
            continue
        for name, v in vars(k).items():
            if name.startswith("_") or name in known or name == "DEFAULT_STEP":
                continue
            if callable(v) or isinstance(v, (property, classmethod, staticmethod)):
                continue
            close = difflib.get_close_matches(name, list(known), n=3, cutoff=0.6)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ConfigError(f"{k.__name__}.{name} is not a config field{hint} (fields: gnetmdk/config/base.py and "
                              "gnetmdk/models/<family>/config.py; a helper's name starts with '_')")


#: the keys of ``per_step``: the stages
STAGE_KEYS = (1, 2, 3, 4, "cal")


def _check_per_step(per_step: Any, known: Dict[str, Any], family: str, sections: Dict[str, Dict[str, Any]]) -> None:
    """Every stage's entry of ``per_step``: the stage keys, dicts, known fields of this config's family.

    Raises:
        ConfigError: a key that is not a stage, an entry that is not a dict, a field that is not one, or
            another family's section field (it would be ignored).
    """
    if not isinstance(per_step, dict):
        raise ConfigError(f"config field 'per_step' = {per_step!r}: must be a dict {{stage: {{field: value}}}}")
    for key, values in per_step.items():
        stage = key if key == "cal" else (int(key) if str(key).isdigit() else key)
        if stage not in STAGE_KEYS:
            raise ConfigError(f"per_step[{key!r}]: the stages are 1, 2, 3, 4 and 'cal'")
        if not isinstance(values, dict):
            raise ConfigError(f"per_step[{key!r}] = {values!r}: must be a dict of fields")
        for name, value in values.items():
            rkey = _resolve_key(str(name), known)
            _check_family(rkey, family, f"per_step[{key!r}]")
            check_value(rkey, value, known[rkey])


def _check_family(key: str, family: str, where: str) -> None:
    """Refuse ``section.field`` of another model family than the config's (it would be ignored)."""
    if "." in key:
        sec = key.split(".", 1)[0]
        if sec != family:
            raise ConfigError(f"{where}: '{key}' is a field of the {sec} family, but this config trains {family}: it "
                              f"would be ignored; drop it (or set model_name {sec})")


def build_config(klass: Type[BaseConfig], overrides: Sequence[str] = (), step: int | None = None,
                 cal: bool = False) -> BaseConfig:
    """Resolve a config: CLI > per_step[step] > Config > BaseConfig.

    Args:
        klass: the user's Config class (or BaseConfig).
        overrides: ``key value`` / ``key=value`` words.
        step: ``--step`` from the command line (None: Config.DEFAULT_STEP, else the ``step`` field).
        cal: ``--cal``: the calibration pass (step is set to 2, one pass over the training data).

    Returns:
        an instance of ``klass`` whose attributes hold the resolved values (checked by
        :func:`validate_config`).

    Raises:
        ConfigError: unknown keys, bad values, values out of range.
    """
    _check_class_fields(klass)
    top = klass.field_types()
    sections = klass.section_types()
    pairs = split_overrides(overrides)
    cfg = klass()
    # the instance starts with the class values; copy mutable defaults so edits stay per instance
    for name in top:
        value = check_value(name, getattr(klass, name), top[name])     # configs.py's values, as the CLI's
        setattr(cfg, name, list(value) if isinstance(value, (list, tuple)) else
                dict(value) if isinstance(value, dict) else value)
    default_step = getattr(klass, "DEFAULT_STEP", None)
    if default_step is not None:
        cfg.step = int(default_step)
    # the stage first (per_step depends on it), then the model family (short names depend on it)
    early = parse_overrides([w for k, v in pairs if k in ("step", "cal", "model_name") for w in (k, v)],
                            {k: top[k] for k in ("step", "cal", "model_name")})
    if "step" in early:
        cfg.step = early["step"]
    if step is not None:
        cfg.step = int(step)
    if cal or early.get("cal"):
        cfg.cal = True
        cfg.step = 2
    key = "cal" if cfg.cal else cfg.step
    stage_values = dict(cfg.per_step.get(key, {}) or cfg.per_step.get(str(key), {}) or {})
    if "model_name" in stage_values:
        cfg.model_name = stage_values["model_name"]
    if "model_name" in early:
        cfg.model_name = early["model_name"]
    family = get_family(cfg.model_name).name
    known = known_fields(klass, family)
    # the sections: defaults, then configs.py (a dict per section, or a section field by its own name)
    for name, sklass in ensure_sections().items():
        sec = sklass()
        for f in sklass.field_types():
            value = getattr(sklass, f)
            setattr(sec, f, list(value) if isinstance(value, (list, tuple)) else value)
        setattr(cfg, name, sec)
    for name in sections:
        given = getattr(klass, name, None)
        if given is None:
            continue
        if not isinstance(given, dict):
            raise ConfigError(f"{klass.__name__}.{name} must be a dict of {name} fields (e.g. {name} = "
                              f"dict({next(iter(sections[name]))}=...)), not {type(given).__name__}")
        for f, value in given.items():
            if f not in sections[name]:
                _resolve_key(f"{name}.{f}", known)              # refused with the closest names
            setattr(getattr(cfg, name), f, check_value(f"{name}.{f}", value, sections[name][f]))
    for f in _class_section_fields(klass, top, sections):
        owners = _section_owner(f, sections)
        if family not in owners:
            raise ConfigError(f"{klass.__name__}.{f} is a field of the {' / '.join(owners)} section, but this "
                              f"config trains {cfg.model_name}: remove it, or write "
                              f"{owners[0]} = dict({f}=...) to keep it for that family")
        setattr(getattr(cfg, family), f, check_value(f, getattr(klass, f), sections[family][f]))
    _check_per_step(cfg.per_step, known, family, sections)
    for name, value in stage_values.items():
        rkey = _resolve_key(str(name), known)
        _place(cfg, rkey, check_value(rkey, value, known[rkey]), family, f"per_step[{key!r}]")
    cli = parse_overrides([w for k, v in pairs for w in (k, v)], known)
    for name, value in cli.items():
        if name in ("step", "cal"):
            continue
        _check_family(name, family, "command line")
        _place(cfg, name, value, family, "command line")
    validate_config(cfg)
    return cfg


def _class_section_fields(klass, top, sections) -> List[str]:
    """Names set on the user's Config (or a base between it and BaseConfig) that are section fields
    given by their own names (configs.py written before the sections: ``score_head = "logit"``)."""
    names = set()
    for k in klass.__mro__:
        if k is BaseConfig or not issubclass(k, BaseConfig):
            continue
        names.update(n for n in vars(k) if not n.startswith("_") and n not in top and n not in sections)
    every = {f for fields in sections.values() for f in fields}
    return sorted(n for n in names if n in every)


#: the settings a resume compares with its checkpoint (gnetmdk.engine.resume, which re-exports these):
#: must be equal to the checkpoint's (a different batch or accumulation moves the position in the epoch;
#: another optimizer or cap_lr changes the optimizer's state layout)
RESUME_FIXED = ("batch_size", "accumulate", "optimizer", "cap_lr")
#: may differ when listed in resume_changes (world_size: the global batches and their arithmetic do not
#: depend on the process count, docs/distributed.md)
RESUME_CHANGEABLE = ("world_size", "num_epochs", "lr_scheduler", "learning_rate", "warmup_epochs", "warmup_factor",
                     "min_lr_ratio", "lr_step_size", "lr_milestones", "lr_gamma", "lr_restart_epochs",
                     "lr_restart_mult", "momentum", "nesterov", "weight_decay")
RESUME_CHECKED = RESUME_FIXED + RESUME_CHANGEABLE


def check_batch_split(batch_size: int, world: int = 1, accumulate: int = 1, how: str = "") -> None:
    """The one check that a global batch splits into ``world`` processes x ``accumulate`` micro-batches
    (the config, the launcher, the trainer and the sampler all call it).

    Args:
        how: how the process count is made up, for the message (e.g. "1 machine(s) x 2 per machine").
    Raises:
        ConfigError: naming the batch, the processes and micro-batches, and the two nearest valid batches.
    """
    unit = int(world) * int(accumulate)
    if unit > 0 and batch_size % unit == 0:
        return
    lower = (batch_size // unit) * unit
    choices = " or ".join(str(c) for c in (lower, lower + unit) if c > 0)
    into = f"evenly over {world} processes" + (f" ({how})" if how else "")
    if accumulate > 1:
        into = f"into {world} process(es) x {accumulate} accumulated micro-batches"
    raise ConfigError(f"batch_size {batch_size} does not split {into}: use a multiple of {unit} (e.g. {choices}); "
                      f"each process takes batch_size / {world} images and the learning rate is not rescaled")


def validate_config(cfg: BaseConfig) -> None:
    """Refuse values out of range at start-up, naming the field and the allowed values; then the
    model family's own checks of its section (DetectorFamily.check_config).

    Raises:
        ConfigError
    """
    def bad(field: str, msg: str) -> None:
        raise ConfigError(f"config field '{field}' = {getattr(cfg, field)!r}: {msg}")

    if cfg.step not in (1, 2, 3, 4):
        bad("step", "must be 1, 2, 3 or 4 (use --cal for calibration)")
    if cfg.batch_size < 1:
        bad("batch_size", "must be at least 1")
    if not cfg.learning_rate > 0:
        bad("learning_rate", "must be positive")
    if not cfg.weight_decay >= 0:
        bad("weight_decay", "must be >= 0 (0 = no weight decay)")
    if not 0 <= cfg.momentum < 1:
        bad("momentum", "must be in [0, 1) (SGD's momentum; 0.9 is usual)")
    if not cfg.grad_clip >= 0:
        bad("grad_clip", "must be >= 0 (the largest gradient norm; 0 = no clipping)")
    if cfg.num_epochs < 0:
        bad("num_epochs", "must be >= 0")
    if cfg.min_steps < 0:
        bad("min_steps", "must be >= 0 (the fewest optimizer steps a stage trains; 0 = num_epochs alone)")
    if cfg.num_workers < 0:
        bad("num_workers", "must be >= 0")
    if cfg.eval_batch_size < 0:
        bad("eval_batch_size", "must be >= 0 (images per evaluation forward; 0 = batch_size)")
    try:
        tf32_mode(cfg.tf32)
    except ValueError:
        bad("tf32", "must be auto (TF32 in step 1 on CUDA), on (steps 1-3) or off")
    if cfg.threads < 0:
        bad("threads", "must be >= 0 (0 leaves torch's default number of threads)")
    if cfg.virtual_ranks < 1:
        bad("virtual_ranks", "must be at least 1 (ranks per process; 1 = the process alone)")
    elif cfg.virtual_ranks > 1 and not cfg.sync_bn:
        bad("virtual_ranks", "synchronises BatchNorm over the ranks (as processes with sync_bn true): set sync_bn "
                             "true, or run real processes to see unsynchronised BatchNorm")
    elif cfg.virtual_ranks > 1 and (cfg.inplace_abn or cfg.recompute_stem):
        bad("virtual_ranks", f"runs the project's DistBatchNorm2d only: set "
                             f"{'inplace_abn' if cfg.inplace_abn else 'recompute_stem'} false (the recording to "
                             "replay must be made without it too)")
    so = list(cfg.shapes_objects)
    if len(so) != 2 or not 1 <= so[0] <= so[1]:
        bad("shapes_objects", "must be two numbers LO HI with 1 <= LO <= HI (shapes per image, --make-shapes)")
    si = list(cfg.shapes_images)
    if len(si) != 2 or si[0] < 1 or si[1] < 1:
        bad("shapes_images", "must be two numbers TRAIN VAL, each at least 1 (images --make-shapes writes)")
    if cfg.eval_interval < 1:
        bad("eval_interval", "must be at least 1 (epochs between evaluations; the last epoch is always evaluated)")
    if cfg.eval_from < 0:
        bad("eval_from", "must be 0 (evaluate from the first epoch) or the first epoch, counted from 1, to evaluate after")
    if cfg.eval_stitch and cfg.model_name != "gnetdet":
        bad("eval_stitch", f"scores GNetDet's tiles on their whole images; model {cfg.model_name!r} has no "
                           "tiled evaluation: set eval_stitch false")
    elif cfg.eval_stitch and cfg.eval_coco:
        bad("eval_stitch", "with eval_coco: the COCO metrics are of the tiles, not of the whole images the mAP is "
                           "of; set one of them false (tools/eval_voc.py --coco scores the tiles on their own)")
    if cfg.tb_images < 0:
        bad("tb_images", "must be >= 0 (val images drawn into tensorboard at each evaluation; 0 = none)")
    if cfg.patience < 0:
        bad("patience", "must be 0 (no early stopping) or a number of epochs without a better val mAP")
    elif 0 < cfg.patience < cfg.eval_interval:
        bad("patience", f"is shorter than eval_interval {cfg.eval_interval}: the mAP is measured every "
                        f"{cfg.eval_interval} epochs, so set patience to {cfg.eval_interval} or more")
    if not cfg.dist_timeout > 0:
        bad("dist_timeout", "must be a positive number of seconds")
    wrong = [k for k in cfg.resume_changes if k not in RESUME_CHANGEABLE]
    if wrong:
        bad("resume_changes", f"{', '.join(map(repr, wrong))} cannot change on a resume; these can: "
            f"{', '.join(RESUME_CHANGEABLE)}")
    if cfg.optimizer not in ("adamw", "adam", "sgd"):
        bad("optimizer", "must be adamw, adam or sgd")
    if cfg.bn_running_var not in ("unbiased", "biased"):
        bad("bn_running_var", "must be unbiased (torch's BatchNorm) or biased (PaddlePaddle's)")
    elif cfg.bn_running_var == "biased" and not cfg.sync_bn:
        bad("bn_running_var", "biased is computed by the project's DistBatchNorm2d, which sync_bn false turns "
                              "off: set sync_bn true (one process computes the same either way)")
    if cfg.lr_scheduler not in ("cosine", "cosine_restarts", "step", "multistep", "constant"):
        bad("lr_scheduler", "must be cosine, cosine_restarts, step, multistep or constant")
    if cfg.warmup_epochs < 0 or not 0 < cfg.warmup_factor <= 1:
        bad("warmup_factor" if cfg.warmup_epochs >= 0 else "warmup_epochs",
            "warmup_epochs must be >= 0 and warmup_factor in (0, 1]")
    if cfg.device not in ("auto", "cpu", "cuda"):
        bad("device", "must be auto, cpu or cuda")
    if cfg.image_size < 32 or cfg.image_size % 32:
        bad("image_size", "must be a multiple of 32, at least 32 (pixels)")
    if len(cfg.VOC_CLASSES) == 0:
        bad("VOC_CLASSES", "needs at least one class name")
    if len(set(cfg.VOC_CLASSES)) != len(cfg.VOC_CLASSES):
        bad("VOC_CLASSES", "has duplicate names")
    if cfg.amp_dtype not in ("bf16", "fp16"):
        bad("amp_dtype", "must be bf16 or fp16")
    if cfg.accumulate < 1:
        bad("accumulate", "must be at least 1")
    if cfg.accumulate >= 1 and cfg.batch_size >= 1:
        try:
            check_batch_split(cfg.batch_size, 1, cfg.accumulate)
        except ConfigError as exc:
            bad("accumulate", str(exc))
    if cfg.accumulate > 1 and (cfg.save_npz or cfg.replay_npz):
        bad("accumulate", "alignment record/replay (save_npz, replay_npz) needs accumulate 1")
    if not cfg.distill >= 0:
        bad("distill", "the distillation weight must be >= 0 (0 = off)")
    if cfg.distill_from and not cfg.distill:
        bad("distill_from", "names a teacher but distill is 0: set distill (e.g. 1.0) or drop distill_from")
    if not 0 <= cfg.ema_decay < 1 or cfg.ema_ramp < 0:
        bad("ema_decay" if not 0 <= cfg.ema_decay < 1 else "ema_ramp", "ema_decay must be in [0, 1), ema_ramp >= 0")
    if not 0 <= cfg.conf_thresh < 1:
        bad("conf_thresh", "must be in [0, 1): the lowest conf x class score kept for mAP (default 0.01)")
    if not 0 < cfg.nms_thresh <= 1:
        bad("nms_thresh", "must be in (0, 1]: the IoU above which NMS drops the lower-scored box")
    if cfg.max_detections < 1:
        bad("max_detections", "must be at least 1 (boxes kept per image)")
    if cfg.checkpoint_interval < 0:
        bad("checkpoint_interval", "must be >= 0")
    if cfg.disk_reserve_mb < 0:
        bad("disk_reserve_mb", "must be >= 0")
    family = get_family(cfg.model_name)
    if cfg.stage_name not in family.stages:
        bad("step" if not cfg.cal else "cal", f"the {family.name} family runs the stages {', '.join(family.stages)}; "
            f"{cfg.stage_name} is not one of them")
    family.check_config(cfg)


def load_config(config_file: str | None = None, overrides: Sequence[str] = (), step: int | None = None,
                cal: bool = False) -> BaseConfig:
    """Load ``Config`` from ``config_file`` (default configs.py) and resolve it (see build_config)."""
    return build_config(load_config_class(config_file), overrides, step=step, cal=cal)


def config_from_dict(values: Dict[str, Any], klass: Type[BaseConfig] = BaseConfig) -> BaseConfig:
    """Rebuild a config from ``to_dict()`` output (e.g. the one stored in a checkpoint), unchecked.

    Unknown keys are ignored (an older checkpoint may carry fields this version dropped). A config
    saved before the families' sections existed holds their fields at the top level: those are read
    into the sections that have them.
    """
    cfg = klass()
    known = klass.field_types()
    for name in known:
        setattr(cfg, name, values.get(name, getattr(klass, name)))
    for name, sklass in ensure_sections().items():
        sec = sklass()
        nested = values.get(name) if isinstance(values.get(name), dict) else {}
        for f in sklass.field_types():
            setattr(sec, f, nested.get(f, values.get(f, getattr(sklass, f))))
        setattr(cfg, name, sec)
    return cfg


def config_value(cfg: BaseConfig, name: str) -> Any:
    """A resolved value by name: a top-level field, ``section.field``, or a field of the config's own
    family section by its own name; None when the config has no such setting."""
    if "." in name:
        sec, field = name.split(".", 1)
        return getattr(getattr(cfg, sec, None), field, None)
    if name in type(cfg).field_types():
        return getattr(cfg, name)
    try:
        return getattr(cfg.section(), name, None)
    except ConfigError:
        return None
