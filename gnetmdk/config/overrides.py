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
import sys
import typing
from typing import Any, Dict, List, Sequence, Tuple, Type

from .base import BaseConfig, ConfigError

_TRUE = {"1", "true", "yes", "y", "on"}
_FALSE = {"0", "false", "no", "n", "off"}

KNOWN_CHIPS = ("2801", "2803", "5801")


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


def parse_overrides(tokens: Sequence[str], known: Dict[str, Any]) -> Dict[str, Any]:
    """Parse ``key value`` / ``key=value`` tokens into ``{field: converted value}``.

    Args:
        tokens: the command-line words after the ``--`` options.
        known: field name -> declared type (``BaseConfig.field_types()``).

    Raises:
        ConfigError: a key that is not a field (with the closest known names), a key without a
        value, or a value that does not convert.
    """
    out: Dict[str, Any] = {}
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
        key = key.lstrip("-").replace("-", "_")
        if key not in known:
            lower = {k.lower(): k for k in known}
            if key.lower() in lower:
                key = lower[key.lower()]
            else:
                close = difflib.get_close_matches(key, list(known), n=3, cutoff=0.5)
                hint = f"; did you mean {', '.join(close)}?" if close else ""
                raise ConfigError(f"unknown config field '{key}'{hint} (fields are declared in "
                                  "gnetmdk/config/base.py and configs.py)")
        out[key] = convert_value(key, value, known[key])
    return out


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
    """Refuse attributes in a Config subclass that look like misspelt fields."""
    known = BaseConfig.field_types()
    for k in klass.__dict__:
        if k.startswith("_") or k in known or k == "DEFAULT_STEP":
            continue
        v = klass.__dict__[k]
        if callable(v) or isinstance(v, (property, classmethod, staticmethod)):
            continue
        close = difflib.get_close_matches(k, list(known), n=1, cutoff=0.8)
        if close:
            raise ConfigError(f"{klass.__name__}.{k} is not a config field; did you mean {close[0]}?")


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
    known = klass.field_types()
    cli = parse_overrides(overrides, known)
    cfg = klass()
    # the instance starts with the class values; copy mutable defaults so edits stay per instance
    for name in known:
        value = getattr(klass, name)
        setattr(cfg, name, list(value) if isinstance(value, (list, tuple)) else
                dict(value) if isinstance(value, dict) else value)
    default_step = getattr(klass, "DEFAULT_STEP", None)
    if default_step is not None:
        cfg.step = int(default_step)
    if "step" in cli:
        cfg.step = cli["step"]
    if step is not None:
        cfg.step = int(step)
    if cal or cli.get("cal"):
        cfg.cal = True
        cfg.step = 2
    key = "cal" if cfg.cal else cfg.step
    stage_values = dict(cfg.per_step.get(key, {}) or cfg.per_step.get(str(key), {}) or {})
    for name, value in stage_values.items():
        if name not in known:
            raise ConfigError(f"per_step[{key!r}] sets unknown field '{name}'")
        setattr(cfg, name, convert_value(name, value, known[name]))
    for name, value in cli.items():
        if name in ("step", "cal"):
            continue
        setattr(cfg, name, value)
    validate_config(cfg)
    return cfg


def validate_config(cfg: BaseConfig) -> None:
    """Refuse values out of range at start-up, naming the field and the allowed values.

    Raises:
        ConfigError
    """
    from gnetmdk.gti.spec import get_chip_spec  # late import: the chip table lives with the chip

    def bad(field: str, msg: str) -> None:
        raise ConfigError(f"config field '{field}' = {getattr(cfg, field)!r}: {msg}")

    if cfg.step not in (1, 2, 3, 4):
        bad("step", "must be 1, 2, 3 or 4 (use --cal for calibration)")
    if cfg.batch_size < 1:
        bad("batch_size", "must be at least 1")
    if not cfg.learning_rate > 0:
        bad("learning_rate", "must be positive")
    if cfg.num_epochs < 0:
        bad("num_epochs", "must be >= 0")
    if cfg.num_workers < 0:
        bad("num_workers", "must be >= 0")
    if cfg.threads < 0:
        bad("threads", "must be >= 0 (0 leaves torch's default number of threads)")
    if cfg.eval_interval < 1:
        bad("eval_interval", "must be at least 1 (epochs between evaluations; the last epoch is always evaluated)")
    if not cfg.dist_timeout > 0:
        bad("dist_timeout", "must be a positive number of seconds")
    from gnetmdk.engine.resume import RESUME_CHANGEABLE
    wrong = [k for k in cfg.resume_changes if k not in RESUME_CHANGEABLE]
    if wrong:
        bad("resume_changes", f"{', '.join(map(repr, wrong))} cannot change on a resume; these can: "
            f"{', '.join(RESUME_CHANGEABLE)}")
    if not 0 < cfg.cap_percentile <= 100:
        bad("cap_percentile", "must be in (0, 100]")
    if cfg.cap_method not in ("percentile", "mse"):
        bad("cap_method", "must be 'percentile' (GTI) or 'mse'")
    if not (math.isfinite(cfg.cap_lr) and cfg.cap_lr >= 0):
        bad("cap_lr", "must be a finite number >= 0 (0: the calibrated caps stay fixed in step 3)")
    if cfg.cap_lr > 0 and not cfg.gain_aware:
        bad("cap_lr", "learned caps need gain_aware true (the caps reach the loss through the gains); "
                      "set cap_lr 0 or gain_aware true")
    if cfg.weight_scale not in ("gti", "mse"):
        bad("weight_scale", "must be 'gti' or 'mse'")
    if cfg.score_head not in ("linear", "logit"):
        bad("score_head", "must be linear or logit")
    if not (math.isfinite(cfg.score_scale) and cfg.score_scale > 0):
        bad("score_scale", "must be a positive number (the logit head's sigmoid(score_scale * (output - score_offset)))")
    if cfg.box_slots not in (1, 2):
        bad("box_slots", "must be 1 (slot 1 always responsible) or 2 (YOLOv1: the slot with the better IoU)")
    for name in ("l_coord", "l_noobj", "l_class", "l_range"):
        if not (math.isfinite(getattr(cfg, name)) and getattr(cfg, name) >= 0):
            bad(name, "a loss weight must be a finite number >= 0")
    for name in ("flip_prob", "blur_prob", "mosaic_prob", "rotate_prob"):
        if not 0 <= getattr(cfg, name) <= 1:
            bad(name, "a probability must be in [0, 1]")
    if not 0 < cfg.output_cap_percentile <= 100:
        bad("output_cap_percentile", "must be in (0, 100]")
    if cfg.score_loss not in ("smooth_l1", "bce"):
        bad("score_loss", "must be smooth_l1 or bce")
    if cfg.optimizer not in ("adamw", "adam", "sgd"):
        bad("optimizer", "must be adamw, adam or sgd")
    if cfg.lr_scheduler not in ("cosine", "cosine_restarts", "step", "multistep", "constant"):
        bad("lr_scheduler", "must be cosine, cosine_restarts, step, multistep or constant")
    if cfg.warmup_epochs < 0 or not 0 < cfg.warmup_factor <= 1:
        bad("warmup_factor" if cfg.warmup_epochs >= 0 else "warmup_epochs",
            "warmup_epochs must be >= 0 and warmup_factor in (0, 1]")
    if cfg.device not in ("auto", "cpu", "cuda"):
        bad("device", "must be auto, cpu or cuda")
    if cfg.width_mult <= 0:
        bad("width_mult", "must be positive")
    if len(cfg.VOC_CLASSES) == 0:
        bad("VOC_CLASSES", "needs at least one class name")
    if len(set(cfg.VOC_CLASSES)) != len(cfg.VOC_CLASSES):
        bad("VOC_CLASSES", "has duplicate names")
    if cfg.amp_dtype not in ("bf16", "fp16"):
        bad("amp_dtype", "must be bf16 or fp16")
    if cfg.accumulate < 1:
        bad("accumulate", "must be at least 1")
    if cfg.accumulate >= 1 and cfg.batch_size >= 1 and cfg.batch_size % cfg.accumulate:
        bad("accumulate", f"batch_size {cfg.batch_size} does not split into {cfg.accumulate} micro-batches: "
            f"choose a batch_size that is a multiple of {cfg.accumulate}")
    if cfg.accumulate > 1 and (cfg.save_npz or cfg.replay_npz):
        bad("accumulate", "alignment record/replay (save_npz, replay_npz) needs accumulate 1")
    if not 0 <= cfg.ema_decay < 1 or cfg.ema_ramp < 0:
        bad("ema_decay" if not 0 <= cfg.ema_decay < 1 else "ema_ramp", "ema_decay must be in [0, 1), ema_ramp >= 0")
    if not 0 <= cfg.conf_thresh < 1:
        bad("conf_thresh", "must be in [0, 1): the lowest conf x class score kept for mAP (default 0.01)")
    if not 0 < cfg.nms_thresh <= 1:
        bad("nms_thresh", "must be in (0, 1]: the IoU above which NMS drops the lower-scored box")
    if cfg.max_detections < 1:
        bad("max_detections", "must be at least 1 (boxes kept per image)")
    for name in ("finetune", "freeze_convs", "freeze_at", "checkpoint_interval"):
        if getattr(cfg, name) < 0:
            bad(name, "must be >= 0")
    if cfg.disk_reserve_mb < 0:
        bad("disk_reserve_mb", "must be >= 0")
    spec = get_chip_spec(str(cfg.chip))  # raises ChipSpecError (a ConfigError) for unknown chips
    if cfg.image_size not in spec.input_sizes:
        bad("image_size", f"chip {cfg.chip} accepts input sizes {list(spec.input_sizes)}")
    for i, bits in enumerate(cfg.mask_bits):
        if bits not in spec.schemes:
            bad("mask_bits", f"major layer {i + 1} asks for scheme {bits}, chip {cfg.chip} has "
                f"{sorted(spec.schemes)}")
    if cfg.mask_bits and cfg.model_name == "gnetdet" and cfg.image_size in (224, 448):
        from gnetmdk.layers.gnetdet import GNETDET_224, GNETDET_448
        majors = len(GNETDET_224 if cfg.image_size == 224 else GNETDET_448)
        if len(cfg.mask_bits) != majors:
            bad("mask_bits", f"GNetDet-{cfg.image_size} has {majors} major layers: give one scheme per "
                f"major layer, or [] for the chip's default")


def load_config(config_file: str | None = None, overrides: Sequence[str] = (), step: int | None = None,
                cal: bool = False) -> BaseConfig:
    """Load ``Config`` from ``config_file`` (default configs.py) and resolve it (see build_config)."""
    return build_config(load_config_class(config_file), overrides, step=step, cal=cal)


def config_from_dict(values: Dict[str, Any], klass: Type[BaseConfig] = BaseConfig) -> BaseConfig:
    """Rebuild a config from ``to_dict()`` output (e.g. the one stored in a checkpoint).

    Unknown keys are ignored (an older checkpoint may carry fields this version dropped).
    """
    cfg = klass()
    known = klass.field_types()
    for name in known:
        setattr(cfg, name, values.get(name, getattr(klass, name)))
    return cfg


def die(msg: str, code: int = 2) -> "typing.NoReturn":
    """Print ``error: msg`` to stderr and exit with ``code`` (no traceback)."""
    print(f"error: {msg}", file=sys.stderr)
    raise SystemExit(code)
