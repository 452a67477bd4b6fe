#!/usr/bin/env python3
"""Cut a VOC dataset into n x n tiles per image, for objects too small for GNetDet's 14 x 14 grid.

    python3 tools/tile_voc.py data/shapes_dense data/shapes_dense_tiles --tiles 2 --overlap 16 \\
        --classes circle,square,triangle
    python3 tools/tile_voc.py SRC DST --tiles 3 --config configs.py      # the classes from the config

tools/xml_2_txt.py warns when most boxes are below a grid cell and names the n. The tiled copy is a
VOC dataset of its own (PNG tiles, their boxes, the source's train/val split kept per image) plus
tiles.json, which `tools/eval_voc.py CKPT --stitch` reads to score a model on the whole source images:
every tile is run, the detections are shifted back and merged by NMS across the seams.

A box is labelled in each tile holding at least --min-visible of its area (clipped to the tile). With
--overlap at least the largest box side, every box lies whole in some tile; the tool prints how many
do not. Nothing is written unless every annotation and image is good (one message on stderr).
Exit status: 0 ok, 2 a user error.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from gnetmdk.config.cli import Parser
from gnetmdk.engine.cli import tool_main


@tool_main
def main(argv) -> int:
    """Run the tool; returns the exit status (0 ok, 2 a user error)."""
    p = Parser(description=__doc__.split("\n")[0],
               formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("src", help="VOC dataset root (JPEGImages/, Annotations/, optional ImageSets/Main)")
    p.add_argument("dst", help="the tiled dataset's root (must not exist)")
    p.add_argument("--tiles", type=int, required=True, help="n: n x n tiles per image")
    p.add_argument("--overlap", type=int, default=0, help="least overlap of neighbouring tiles, pixels (default 0)")
    p.add_argument("--min-visible", type=float, default=0.5,
                   help="least share of a box's area inside a tile for it to be labelled there (default 0.5)")
    p.add_argument("--classes", default=None, metavar="a,b,c", help="class list (default: the config's VOC_CLASSES)")
    p.add_argument("--config", default=None, help="config for the class list (default ./configs.py)")
    p.add_argument("--val-fraction", type=float, default=0.2,
                   help="val share of the random split used when SRC has no ImageSets/Main lists (default 0.2)")
    p.add_argument("--seed", type=int, default=0, help="seed of that split (default 0)")
    p.add_argument("--fold", default=None, metavar="I/K",
                   help="val = the I-th of K disjoint folds of that split instead of its first --val-fraction "
                        "(the photos tools/xml_2_txt.py --fold I/K puts in val)")
    args = p.parse_args(argv)

    from gnetmdk.dataset.tiling import tile_voc_dataset
    from gnetmdk.dataset.voc import VOCFormatError
    try:
        if args.classes is not None:
            classes = [c.strip() for c in args.classes.split(",") if c.strip()]
        else:
            from gnetmdk.config import load_config
            path = args.config or "configs.py"
            if not os.path.isfile(path):
                raise ValueError(f"config file {path} not found: pass --classes a,b,c or --config FILE")
            classes = list(load_config(path, []).VOC_CLASSES)
        if not classes:
            raise ValueError("the class list is empty")
        t0 = time.time()
        from gnetmdk.dataset.voc import parse_fold
        rep = tile_voc_dataset(args.src, args.dst, classes, args.tiles, args.overlap, args.min_visible,
                               val_fraction=args.val_fraction, seed=args.seed,
                               fold=None if args.fold is None else parse_fold(args.fold))
    except (VOCFormatError, FileExistsError, ValueError, OSError) as exc:
        print(f"error: {exc} (tile_voc)", file=sys.stderr)
        return 2
    print(f"{args.src} ({rep['split_source']}): {rep['images']} images, {rep['boxes']} boxes -> {rep['tiles']} tiles "
          f"({args.tiles} x {args.tiles}, overlap {args.overlap} px), {rep['tile_boxes']} tile boxes; "
          f"wrote {args.dst} in {time.time() - t0:.1f} s")
    if rep["not_whole"]:
        print(f"warning: {rep['not_whole']} of {rep['boxes']} boxes lie whole in no tile (cut at a seam); "
              f"--overlap {int(-(-rep['max_side'] // 1))} (the largest box side) puts each whole in some tile",
              file=sys.stderr)
    print(f"next: point a config's dataset_path at {args.dst}, run tools/xml_2_txt.py (tiles without a box are "
          f"left out of training unless --keep-empty), train, and score the whole images with tools/eval_voc.py "
          f"CKPT --stitch")
    return 0


if __name__ == "__main__":
    sys.exit(main())
