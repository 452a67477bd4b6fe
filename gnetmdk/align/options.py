"""Command-line options of the alignment tooling, shared by train.py and train-dist.py.

Each option is a config override as well (``save_npz DIR`` == ``--save-npz DIR``); the options exist
so that they show in ``--help``.
"""
from __future__ import annotations

import argparse
from typing import List


def add_alignment_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the alignment group (--save-npz, --replay-npz, --max-iters, --replay-merged, --deterministic)
    to ``parser``."""
    g = parser.add_argument_group("alignment (docs/distributed.md, docs/alignment.md)")
    g.add_argument("--save-npz", metavar="DIR", default=None,
                   help="record every iteration's batches (per rank), losses and the starting weights into DIR")
    g.add_argument("--replay-npz", metavar="DIR", default=None,
                   help="train on the batches recorded in DIR (any process count dividing the batch) and "
                        "compare the losses per iteration")
    g.add_argument("--max-iters", metavar="K", type=int, default=None,
                   help="stop after K iterations and save last.pth")
    g.add_argument("--replay-merged", action="store_true",
                   help="replay: each process trains on its share of the recorded ranks' batches as one batch "
                        "(the plain comparison, round-off expected) instead of the recorded ranks as virtual ranks")
    g.add_argument("--deterministic", action="store_true",
                   help="alignment mode: augmentation off, deterministic torch algorithms, every reduction over "
                        "ranks in rank order")


def alignment_overrides(args: argparse.Namespace) -> List[str]:
    """The config overrides the alignment options stand for."""
    out: List[str] = []
    if getattr(args, "save_npz", None) is not None:
        out += ["save_npz", args.save_npz]
    if getattr(args, "replay_npz", None) is not None:
        out += ["replay_npz", args.replay_npz]
    if getattr(args, "max_iters", None) is not None:
        out += ["max_iters", str(args.max_iters)]
    if getattr(args, "replay_merged", False):
        out += ["replay_merged", "true"]
    if getattr(args, "deterministic", False):
        out += ["deterministic", "true"]
    return out
