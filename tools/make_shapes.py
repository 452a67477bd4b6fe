#!/usr/bin/env python3
"""Write the synthetic shapes dataset (VOC layout) used for quick end-to-end checks.

    python3 tools/make_shapes.py [OUT_DIR] [--num-train N] [--num-val N] [--seed S]
    python3 tools/make_shapes.py data/shapes_dense --dense     # 448 px, 30-80 shapes of 4-16 px each

OUT_DIR defaults to data/shapes under the repository root. Classes: circle, square, triangle.
Convert it afterwards with:
    python3 tools/xml_2_txt.py --name shapes --dataset-dir data/shapes \\
        --classes circle,square,triangle --out-dir data/meta
"""

from __future__ import annotations

import os
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from gnetmdk.config.cli import Parser  # noqa: E402
from gnetmdk.dataset.shapes import make_shapes_dataset  # noqa: E402
from gnetmdk.engine.cli import tool_main  # noqa: E402


@tool_main
def main(argv) -> int:
    """Write the shapes dataset; returns the exit status (0 ok, 2 a bad value or an unwritable folder)."""
    p = Parser(description="Generate the synthetic shapes detection dataset.")
    p.add_argument("out_dir", nargs="?", default=os.path.join(REPO_ROOT, "data", "shapes"),
                   help="output folder (default: data/shapes in the repository)")
    p.add_argument("--num-train", type=int, default=240, help="train images (default 240)")
    p.add_argument("--num-val", type=int, default=60, help="val images (default 60)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--min-size", type=int, default=256, help="smallest image side in pixels (default 256)")
    p.add_argument("--max-size", type=int, default=320, help="largest image side in pixels (default 320)")
    p.add_argument("--dense", action="store_true",
                   help="the dense small-object case: 448x448 images with 30-80 shapes of 4-16 px "
                        "(several per 32-px grid cell at times); overrides --min-size/--max-size")
    p.add_argument("--objects", type=int, nargs=2, metavar=("LO", "HI"), default=(1, 3),
                   help="shapes per image, LO to HI (default 1 3)")
    p.add_argument("--upright", action="store_true",
                   help="every triangle with its apex above its base (default: either way up, drawn at random); "
                        "the boxes and the rest of every image are the same either way")
    args = p.parse_args(argv)
    extra = dict(min_objects=args.objects[0], max_objects=args.objects[1])
    if args.dense:
        args.min_size = args.max_size = 448
        extra = dict(min_objects=30, max_objects=80, side_px=(4, 16))

    start = time.time()
    try:
        report = make_shapes_dataset(args.out_dir, num_train=args.num_train, num_val=args.num_val,
                                     image_size=(args.min_size, args.max_size), seed=args.seed,
                                     upright=args.upright, **extra)
    except (ValueError, OSError) as exc:
        print(f"make_shapes: error: {exc}", file=sys.stderr)
        return 2
    for split, st in report["splits"].items():
        per_class = ", ".join(f"{c} {n}" for c, n in st["per_class"].items())
        print(f"{split}: {st['images']} images, {st['boxes']} boxes ({per_class})")
    print(f"wrote {report['out_dir']} in {time.time() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
