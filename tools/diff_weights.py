#!/usr/bin/env python3
"""Compare the weights of two checkpoints, tensor by tensor (docs/alignment.md, docs/distributed.md).

    python3 tools/diff_weights.py A.pth B.pth [--atol 1e-6] [--rtol 0] [--all]

Prints, per tensor, max |a - b|, the max relative difference and the sum of squared differences
(only the tensors outside the tolerance unless --all), names tensors present in only one file, skips
bookkeeping buffers (num_batches_tracked). A tensor is within tolerance when every element has
|a - b| <= atol + rtol * |b| (for a BatchNorm running_mean: rtol * max(|b|, sqrt(running_var)), the
scale of the activations it averages). Exit code: 0 all within tolerance, 1 otherwise, 2 a file cannot be read.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gnetmdk.align.compare import CompareError, diff_files  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("a", help="first checkpoint (.pth: gnetmdk checkpoint or state_dict)")
    p.add_argument("b", help="second checkpoint, the reference for --rtol")
    p.add_argument("--atol", type=float, default=1e-6, help="absolute tolerance (default 1e-6)")
    p.add_argument("--rtol", type=float, default=0.0, help="relative tolerance (default 0)")
    p.add_argument("--all", action="store_true", help="print every tensor, not only those that differ")
    args = p.parse_args(argv)
    if args.atol < 0 or args.rtol < 0:
        print("error: --atol and --rtol must be >= 0", file=sys.stderr)
        return 2
    try:
        rep = diff_files(args.a, args.b, args.atol, args.rtol)
    except CompareError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(rep.format(show_all=args.all, a_name=os.path.basename(args.a) or "A", b_name=os.path.basename(args.b) or "B"))
    return 0 if rep.ok else 1


if __name__ == "__main__":
    sys.exit(main())
