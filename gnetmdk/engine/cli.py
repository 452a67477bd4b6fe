"""Command line shared by train.py and train-dist.py, and the start-up every tool shares (tool_main).

    train.py      [--config FILE] [--step N | --cal] [--resume] [KEY VALUE | KEY=VALUE ...]
    train-dist.py [--gpus N] [--world-size M --rank R --dist-url HOST:PORT] [--dist-timeout S] [same as train.py]
    both:         [--save-npz DIR | --replay-npz DIR] [--max-iters K] [--deterministic]   (docs/distributed.md)

Both scripts go through gnetmdk.dist.launch.launch(); train.py is world size 1 and runs in this process.

Overrides after the options: ``batch-size 32`` or ``learning-rate=3e-5`` (``-`` read as ``_``).
Precedence: command line > Config.per_step > Config (configs.py) > BaseConfig.
"""
from __future__ import annotations

import argparse
import functools
import sys
from typing import Callable, List, Sequence, Tuple

from gnetmdk.config import ConfigError, build_config, load_config_class
from gnetmdk.config.cli import fail


def build_parser(distributed: bool) -> argparse.ArgumentParser:
    """The argument parser of train.py (``distributed`` False) or train-dist.py (``distributed`` True:
    also --gpus, --world-size, --rank, --dist-url, --dist-timeout), with the alignment options."""
    prog = "train-dist.py" if distributed else "train.py"
    from gnetmdk.config.cli import Parser
    p = Parser(
        prog=prog, description="Train one stage of the gnetmdk pipeline (step1 -> step2 -> cal -> step3 -> step4).",
        epilog="Config overrides follow the options: KEY VALUE or KEY=VALUE, e.g. 'batch-size 32 learning-rate=3e-5'.")
    p.add_argument("--config", default=None, help="configs.py defining 'class Config(BaseConfig)' (default ./configs.py)")
    p.add_argument("--step", type=int, choices=[1, 2, 3, 4], default=None, help="stage to train (default DEFAULT_STEP)")
    p.add_argument("--cal", action="store_true", help="calibration pass: measure ReLU caps on the step-2 model")
    p.add_argument("--resume", action="store_true", help="continue this step from its last.pth")
    if distributed:
        p.add_argument("--gpus", type=int, default=1, help="processes on this machine (GPUs; CPU processes without one)")
        p.add_argument("--world-size", type=int, default=1, help="number of machines")
        p.add_argument("--rank", type=int, default=0, help="this machine's rank, from 0")
        p.add_argument("--dist-url", default="", help="machine 0's host:port (or tcp://host:port)")
        p.add_argument("--dist-timeout", type=float, default=None,
                       help="seconds to wait for peers to join and for each collective (default: dist_timeout, 300)")
    from gnetmdk.align.options import add_alignment_arguments
    add_alignment_arguments(p)
    return p


def parse(argv: Sequence[str], distributed: bool):
    """(args, cfg): parsed options and the resolved config. Raises ConfigError / SystemExit."""
    parser = build_parser(distributed)
    args, rest = parser.parse_known_args(list(argv))
    if args.cal and args.step is not None:
        raise ConfigError(f"--cal calibrates the step-2 model (checkpoint/step2/best.pth) and takes no --step: drop "
                     f"--step {args.step}, or --cal to train step {args.step}")
    unknown_opts = [t for t in rest if t.startswith("--") and "=" not in t and t[2:].replace("-", "_") not in
                    load_config_class(args.config).field_types()]
    if unknown_opts:
        parser.error(f"unrecognised option {unknown_opts[0]}")
    from gnetmdk.align.options import alignment_overrides
    overrides = list(rest) + alignment_overrides(args)
    if args.resume:
        overrides += ["resume", "true"]
    cfg = build_config(load_config_class(args.config), overrides, step=args.step, cal=args.cal)
    return args, cfg


def run_stage(cfg) -> dict:
    """Train (or calibrate) the stage ``cfg`` names in this process; returns the trainer's summary."""
    from .trainer import Trainer
    return Trainer(cfg).run()


def _worker_entry(recipe: dict) -> None:
    """What every process runs: resolve the config from the same command line, run the stage.
    (The config class lives in the user's file, so processes rebuild it rather than unpickle it.)"""
    _, cfg = parse(recipe["argv"], recipe["distributed"])
    run_stage(cfg)


def user_errors() -> Tuple[type, ...]:
    """Exception kinds that are the user's to fix, the one list for every tool, train.py and
    train-dist.py: a bad path, config, checkpoint, Paddle weight file, dataset (annotations, meta file,
    COCO json, an unreadable image), chip model or plot request, a comparison of two recordings that do
    not fit, the launcher's refusals (LaunchError) and the trainer's (TrainingError). Each is reported as
    one line ``error: ...`` with exit status 2 (or the error's ``exit_code``)."""
    from gnetmdk.align.compare import CompareError
    from gnetmdk.checkpoint.io import CheckpointError
    from gnetmdk.checkpoint.paddle import PaddleFormatError
    from gnetmdk.config.base import ConfigError          # ChipModelError, ConversionError, ChipLimitError
    from gnetmdk.dataset.coco import CocoFormatError
    from gnetmdk.dataset.image_io import ImageReadError
    from gnetmdk.dataset.voc import MetaFormatError, VOCFormatError
    from gnetmdk.dist.launch import LaunchError
    from gnetmdk.evaluation.plots import PlotError
    from .trainer import TrainingError
    return (ConfigError, CheckpointError, ImageReadError, MetaFormatError, VOCFormatError, FileNotFoundError,
            PlotError, CocoFormatError, PaddleFormatError, CompareError, LaunchError, TrainingError)


def tool_main(main: Callable[..., int]) -> Callable[..., int]:
    """Decorator of a tool's ``main(argv, ...) -> exit status``: the start-up every tool (tools/,
    benchmarks/) and train.py / train-dist.py share.

    ``main`` receives the command line as a list: ``sys.argv[1:]`` when called without one (the script's
    ``sys.exit(main())``), else the ``argv`` given (the tests' ``main([...])``). A user error
    (:func:`user_errors`) that leaves ``main`` is printed as one line ``error: ...`` on stderr and
    returned as the exit status (2, or the error's ``exit_code``), so the shell and a test calling
    ``main`` see the same status; any other exception is left to show its traceback.
    """
    @functools.wraps(main)
    def run(argv=None, *args, **kwargs) -> int:
        argv = list(sys.argv[1:] if argv is None else argv)
        try:
            return main(argv, *args, **kwargs)
        except Exception as exc:                  # not SystemExit: --help and argparse's refusals pass
            if not isinstance(exc, user_errors()):
                raise
            return fail(str(exc), getattr(exc, "exit_code", 2))
    return run


@tool_main
def main(argv: List[str], distributed: bool = False) -> int:
    """Entry point of train.py / train-dist.py (``argv``: the command line, default ``sys.argv[1:]``);
    returns the exit code. A user error (:func:`user_errors`) is one ``error:`` line with exit
    status 2, or the error's ``exit_code`` (tool_main, as for every tool); Ctrl-C is ``interrupted``, 130."""
    try:
        args, cfg = parse(argv, distributed)
        from gnetmdk.align.record import check_alignment_config
        from gnetmdk.dist.launch import launch, spec_from_args
        check_alignment_config(cfg)
        # one launch() for both scripts: train.py is world size 1 (runs here), train-dist.py spawns
        spec = spec_from_args(args, cfg)
        launch(_worker_entry, spec, ({"argv": argv, "distributed": distributed},), user_errors=user_errors())
        return 0
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
