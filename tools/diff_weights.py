#!/usr/bin/env python3
"""Compare the weights of two checkpoints, tensor by tensor (docs/alignment.md, docs/distributed.md).

    python3 tools/diff_weights.py A.pth B.pth [--atol 1e-6] [--rtol 0] [--all] [--state]
    python3 tools/diff_weights.py A.pth B.pth --atol 0 --state           # bit for bit, training state too
    python3 tools/diff_weights.py A.pth B.pth --d-value 0.0005          # the PP-YOLO notes' rule

Prints, per tensor, max |a - b|, the max relative difference and the sum of squared differences
(only the tensors outside the tolerance unless --all), names tensors present in only one file, skips
bookkeeping buffers (num_batches_tracked). A tensor is within tolerance when every element has
|a - b| <= atol + rtol * |b| (for a BatchNorm running_mean: rtol * max(|b|, sqrt(running_var)), the
scale of the activations it averages). `--d-value D` (also spelt `--d_value`, as in the PP-YOLO
alignment notes) judges each tensor by its sum of squared differences instead, aligned when it is
<= D (the notes use 5e-4); given with --atol, a tensor must pass both rules. Both figures are listed
either way. `--state` compares the training state of two gnetmdk checkpoints as well: the EMA of the
weights (ema.*), the optimizer's per-parameter state (optimizer.<index>.<slot>) and the caps.
Exit code: 0 all within tolerance, 1 otherwise, 2 a file cannot be read.
"""
import argparse
import os
import sys

from gnetmdk.align.compare import diff_files
from gnetmdk.config.cli import Parser, fail
from gnetmdk.engine.cli import tool_main


@tool_main
def main(argv) -> int:
    """Compare the two checkpoints; returns the exit status (0 aligned, 1 not, 2 a file cannot be read)."""
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("a", help="first checkpoint (.pth: gnetmdk checkpoint or state_dict)")
    p.add_argument("b", help="second checkpoint, the reference for --rtol")
    p.add_argument("--atol", type=float, default=None,
                   help="absolute tolerance (default 1e-6, or none when --d-value is given alone)")
    p.add_argument("--rtol", type=float, default=0.0, help="relative tolerance (default 0)")
    p.add_argument("--d-value", "--d_value", dest="d_value", type=float, default=None, metavar="D",
                   help="per tensor: aligned when the sum of squared differences is <= D (the notes: 0.0005)")
    p.add_argument("--all", action="store_true", help="print every tensor, not only those that differ")
    p.add_argument("--state", action="store_true",
                   help="also the EMA, the optimizer's state and the caps of gnetmdk checkpoints")
    args = p.parse_args(argv)
    if args.atol is None and args.d_value is None:
        args.atol = 1e-6
    if (args.atol is not None and args.atol < 0) or args.rtol < 0 or (args.d_value is not None and args.d_value < 0):
        return fail("--atol, --rtol and --d-value must be >= 0")
    rep = diff_files(args.a, args.b, args.atol, args.rtol, args.d_value, full=args.state)   # CompareError: 2
    print(rep.format(show_all=args.all, a_name=os.path.basename(args.a) or "A", b_name=os.path.basename(args.b) or "B"))
    return 0 if rep.ok else 1


if __name__ == "__main__":
    sys.exit(main())
