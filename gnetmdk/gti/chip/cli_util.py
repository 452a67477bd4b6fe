"""Shared pieces of the chip tools' command lines (tools/convert_to_chip.py, chip_eval.py, predict.py,
eval_voc.py, stage_report.py): which errors are the user's, and how models are loaded for evaluation."""
from __future__ import annotations

import argparse
import sys
from typing import Any, Dict, Optional, Tuple

import torch


class Parser(argparse.ArgumentParser):
    """argparse with this project's one-line refusals: a bad option prints ``error: ...`` (naming the
    option, the value and the fix) and exits with status 2, without the usage block."""

    def error(self, message: str):  # noqa: D401 - argparse's hook
        print(f"error: {message} ({self.prog} --help lists the options)", file=sys.stderr, flush=True)
        raise SystemExit(2)

    def parse_with_overrides(self, argv):
        """Parse ``argv`` as the tools and train.py read a command line: options and positionals first,
        then config overrides (``KEY VALUE`` or ``KEY=VALUE``). The overrides start at the first word that
        is a config field name or holds "=" and is not the value of an option that takes one (an option
        with an optional value, such as ``--check``, never takes an override word), so an override is
        never read as a path.

        Returns:
            (argparse.Namespace, [override words]).
        Raises:
            SystemExit(2): one ``error:`` line for a bad option, or an option written after the overrides.
        """
        from gnetmdk.config.overrides import override_names
        fields = override_names()
        takes_value = {o for a in self._actions if a.option_strings and a.nargs is None
                       and not isinstance(a, (argparse._StoreTrueAction, argparse._StoreFalseAction,
                                              argparse._HelpAction, argparse._VersionAction,
                                              argparse._CountAction, argparse._StoreConstAction))
                       for o in a.option_strings}
        argv = list(argv)
        cut = len(argv)
        for i, tok in enumerate(argv):
            if tok.startswith("-") or (i and argv[i - 1] in takes_value):
                continue
            if "=" in tok or tok.replace("-", "_") in fields:
                cut = i
                break
        options, overrides = argv[:cut], argv[cut:]
        late = [t for t in overrides if t.startswith("--")]
        if late:
            self.error(f"option {late[0]} comes after the config overrides; write options first, then KEY VALUE "
                       "overrides")
        return self.parse_args(options), overrides


def at_least(low: int):
    """argparse type: an integer >= ``low``."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {v}")
        return v
    return parse


def fraction(low_open: bool = False, high_open: bool = False):
    """argparse type: a number in [0, 1] (``low_open``: above 0; ``high_open``: below 1), e.g. a score,
    an IoU threshold or an mAP difference."""
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not ((0 < v if low_open else 0 <= v) and (v < 1 if high_open else v <= 1)):
            raise argparse.ArgumentTypeError(f"must be in {'(0' if low_open else '[0'}, {'1)' if high_open else '1]'}, "
                                             f"got {v:g}")
        return v
    return parse


def parse_with_overrides(parser, argv):
    """``parser.parse_known_args``: the left-over words are config overrides (KEY VALUE / KEY=VALUE);
    an unknown ``--option`` among them is refused through ``parser.error`` (exit 2)."""
    args, rest = parser.parse_known_args(argv)
    bad = [t for t in rest if t.startswith("--")]
    if bad:
        parser.error(f"unrecognised option {bad[0]} (config overrides are written KEY VALUE or KEY=VALUE)")
    return args, rest


def user_errors() -> Tuple[type, ...]:
    """Exception types a user can cause (bad path, bad config, wrong checkpoint, a model the chip cannot
    run): the tools print them as one line ``error: ...`` and exit with status 2."""
    from gnetmdk.align.compare import CompareError
    from gnetmdk.checkpoint.io import CheckpointError
    from gnetmdk.checkpoint.paddle import PaddleFormatError
    from gnetmdk.config.base import ConfigError          # ChipModelError, ConversionError, ChipLimitError
    from gnetmdk.dataset.coco import CocoFormatError
    from gnetmdk.dataset.dataset import ImageReadError
    from gnetmdk.dataset.voc import MetaFormatError, VOCFormatError
    from gnetmdk.evaluation.plots import PlotError
    return (ConfigError, CheckpointError, ImageReadError, MetaFormatError, VOCFormatError, FileNotFoundError,
            PlotError, CocoFormatError, PaddleFormatError, CompareError)


def fail(msg: str, code: int = 2) -> int:
    """Print ``error: msg`` on stderr; return ``code`` (for ``return fail(...)`` in a main())."""
    print(f"error: {msg}", file=sys.stderr, flush=True)
    return code


def stage_of(ckpt: Dict[str, Any], path: str):
    """The Stage whose layer switches evaluate a checkpoint: STAGES[stage], and cal checkpoints as step 3.

    Raises:
        CheckpointError: the checkpoint names no known stage.
    """
    from gnetmdk.checkpoint.io import CheckpointError
    from gnetmdk.engine.stages import STAGES
    name = ckpt.get("stage")
    if name == "cal":
        return STAGES["step3"]
    if name not in STAGES:
        raise CheckpointError(f"checkpoint '{path}' has stage {name!r}; expected one of {', '.join(STAGES)}")
    return STAGES[name]


def load_eval_model(path: str, cfg=None, require_stage: Optional[str] = None, check_config: bool = True):
    """Rebuild a checkpoint's model with its stage's switches, in eval mode.

    Args:
        path: checkpoint .pth.
        cfg: resolved config; when given (and ``check_config``), the checkpoint must fit it
            (class count, input size, width, chip).
        require_stage: refuse other stages (e.g. "step4").
    Returns:
        (model, ckpt).
    Raises:
        CheckpointError: missing/unreadable, wrong stage, does not fit the config.
    """
    from gnetmdk.checkpoint.io import CheckpointError, build_model_from_checkpoint, check_compatible, load_checkpoint
    from gnetmdk.engine.stages import apply_stage
    ckpt = load_checkpoint(path)
    if require_stage and ckpt.get("stage") != require_stage:
        raise CheckpointError(f"checkpoint '{path}' is a {ckpt.get('stage')!r} checkpoint, not {require_stage}: "
                              f"pass checkpoint/{require_stage}/best.pth")
    if cfg is not None and check_config:
        check_compatible(ckpt, cfg, path)
    stage = stage_of(ckpt, path)
    model = build_model_from_checkpoint(ckpt, cfg, path)
    apply_stage(model, stage)
    model.eval()
    return model, ckpt


def eval_device(cfg=None) -> torch.device:
    """cuda when the config allows it (device auto/cuda) and a GPU is present, else cpu; on CUDA the
    backends are set as for training (TF32 only with ``tf32 true``: gnetmdk.engine.device)."""
    if cfg is not None and cfg.device in ("auto", "cuda") and torch.cuda.is_available():
        from gnetmdk.engine.device import set_tf32
        set_tf32(bool(getattr(cfg, "tf32", False)))
        return torch.device("cuda")
    return torch.device("cpu")
