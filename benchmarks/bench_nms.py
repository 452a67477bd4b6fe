#!/usr/bin/env python3
"""Time of the greedy pass of NMS (gnetmdk.evaluation.boxes.greedy_keep) against the same pass over
torch tensors element by element, the way it was written before, on random boxes; both must keep the
same boxes (the script exits 1 if not). Prints milliseconds per call and the ratio.

    python3 benchmarks/bench_nms.py [--sizes 50,300,1000] [--repeats 50] [--iou 0.5]

A GNetDet-224 output with 3 classes has 2 x 7 x 7 x 3 = 294 (box, class) candidates an image at the
evaluation's score threshold 0.01; GNetDet-448 with 20 classes has 7840, of which NMS takes the best
1000 (``pre_nms_top``).
"""
import argparse
import sys
import time

import torch

from gnetmdk.evaluation.boxes import box_iou, greedy_keep


def torch_loop_keep(suppresses: torch.Tensor) -> torch.Tensor:
    """The greedy pass over torch tensors: a bool read and an in-place or per visited box."""
    suppressed = torch.zeros(suppresses.shape[0], dtype=torch.bool)
    keep = []
    for i in range(suppresses.shape[0]):
        if suppressed[i]:
            continue
        keep.append(i)
        suppressed |= suppresses[i]
    return torch.tensor(keep, dtype=torch.long)


def random_boxes(n: int, g: torch.Generator) -> torch.Tensor:
    """(n, 4) float32 xyxy boxes in the unit square, sides 0.01-0.31."""
    xy = torch.rand(n, 2, generator=g)
    return torch.cat([xy, xy + torch.rand(n, 2, generator=g) * 0.3 + 0.01], 1)


def per_call_ms(fn, arg, repeats: int) -> float:
    """Median over 5 rounds of the mean time of ``repeats`` calls, in milliseconds."""
    rounds = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(repeats):
            fn(arg)
        rounds.append((time.perf_counter() - t) / repeats * 1e3)
    return sorted(rounds)[2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="50,300,1000")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--iou", type=float, default=0.5)
    args = ap.parse_args()
    try:
        sizes = [int(v) for v in args.sizes.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1 or args.repeats < 1 or not 0.0 <= args.iou <= 1.0:
        print(f"bench_nms: --sizes must be whole numbers of boxes above 0 separated by commas (got {args.sizes!r}), "
              f"--repeats at least 1 (got {args.repeats}) and --iou in [0, 1] (got {args.iou})", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    print(f"{'boxes':>6} {'kept':>5} {'torch loop ms':>14} {'greedy_keep ms':>15} {'ratio':>6}")
    ok = True
    for n in sizes:
        b = random_boxes(n, g)
        sup = box_iou(b, b) > args.iou
        same = torch.equal(greedy_keep(sup), torch_loop_keep(sup))
        ok &= same
        old, new = per_call_ms(torch_loop_keep, sup, args.repeats), per_call_ms(greedy_keep, sup, args.repeats)
        print(f"{n:>6} {len(greedy_keep(sup)):>5} {old:>14.3f} {new:>15.3f} {old / new:>6.1f}"
              + ("" if same else "  KEPT OTHER BOXES"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
