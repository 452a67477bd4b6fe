#!/usr/bin/env python3
"""VOC mAP@0.5 of a checkpoint on the config's dataset, with the checkpoint's stage switches.

    python3 tools/eval_voc.py checkpoint/step4/best.pth
    python3 tools/eval_voc.py checkpoint/step1/best.pth --config configs.py --split train batch-size 8
    python3 tools/eval_voc.py checkpoint/step4/best.pth --plots plots/step4     # + PR curves, confusion matrix

The model is rebuilt from the checkpoint (it must fit the config: classes, input size, width, chip)
and evaluated as its stage runs (STAGES[stage]; a cal checkpoint as step 3: capped 5-bit activations;
step 4 in float64, bit-exact with the chip). The dataset paths and the decode thresholds come from the
config (configs.py, then KEY VALUE / KEY=VALUE overrides after the options).
--plots DIR also writes pr_curves.png/.json (per-class precision-recall, the arrays each AP comes from)
and confusion_matrix.png/.json (detections scoring above 0.3 against the ground truth, IoU >= 0.5, with a
background row and column) for the evaluated split (gnetmdk.evaluation.plots; needs matplotlib).
--stitch (a dataset cut by tools/tile_voc.py) also scores the whole source images of the split: every
tile is run, the detections are shifted back and merged by NMS across the seams
(gnetmdk.evaluation.stitch).
--json FILE also writes the numbers: {"checkpoint", "stage", "split", "map", "ap" (per class; null
where there is no ground truth), "num_images"} and with --stitch "stitched": the same for the whole
images plus "num_tiles".
Exit status: 0 ok, 2 a user error (one line on stderr).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from gnetmdk.config.cli import Parser, at_least, fail
from gnetmdk.engine.cli import tool_main


def parse_args(argv):
    """Parse the command line (see the module docstring); config overrides are returned separately where taken."""
    p = Parser(description=__doc__.split("\n")[0],
               formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("checkpoint", help="a gnetmdk checkpoint (.pth) of any stage")
    p.add_argument("--config", default=None, help="configs.py (default ./configs.py)")
    p.add_argument("--split", choices=["valid", "train"], default="valid")
    p.add_argument("--batch-size", type=at_least(0), default=0,
                   help="images per forward, the last batch padded (default 0: the config's eval_batch_size, else "
                        "its batch_size, as training evaluates)")
    p.add_argument("--coco", action="store_true", help="also COCO mAP@[.5:.95], AP50, AP75 (pycocotools)")
    p.add_argument("--plots", default=None, metavar="DIR",
                   help="also write pr_curves.png/.json and confusion_matrix.png/.json (score > 0.3) in DIR "
                        "(created if missing; needs matplotlib)")
    p.add_argument("--stitch", action="store_true",
                   help="also mAP on the whole images of a tiled dataset (tools/tile_voc.py's tiles.json)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write mAP and per-class AP as JSON to FILE")
    return p.parse_with_overrides(argv)


@tool_main
def main(argv) -> int:
    """Run the tool; returns the exit status (0 ok, 1 check failed where applicable, 2 user error)."""
    args, overrides = parse_args(argv)
    from gnetmdk.chip.cli_util import eval_device, load_eval_model
    import torch
    from torch.utils.data import DataLoader
    from gnetmdk.config import load_config
    from gnetmdk.dataset.dataset import build_dataset, collate
    from gnetmdk.evaluation.evaluator import eval_batch, evaluate_model
    from gnetmdk.evaluation.voc import format_ap_table
    cfg = load_config(args.config, overrides)
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    model, ckpt = load_eval_model(args.checkpoint, cfg)
    dataset = build_dataset(cfg, args.split)
    dataset.augment = False                   # evaluation: the train split without augmentation too
    device = eval_device(cfg)
    model.to(device)
    # forwards of one size, the last batch padded, as the trainer evaluates (evaluator.predict_loader):
    # the same outputs per image, so this mAP is the one training recorded for the checkpoint
    batch = args.batch_size or eval_batch(cfg)
    loader = DataLoader(dataset, batch_size=batch, collate_fn=collate, num_workers=cfg.num_workers)
    if args.plots is not None:                # refused before the evaluation, not after it
        from gnetmdk.evaluation.plots import prepare_plot_dir, require_matplotlib
        prepare_plot_dir(args.plots)
        require_matplotlib()
    if args.stitch:                           # refused before the evaluation, not after it
        from gnetmdk.dataset.tiling import load_manifest
        load_manifest(cfg.dataset_dir)
    t0 = time.time()
    res = evaluate_model(model, loader, dataset, device, cfg.conf_thresh, cfg.nms_thresh, cfg.max_detections,
                         coco=args.coco or cfg.eval_coco, keep_detections=args.plots is not None, pad_to=batch)
    stage = ckpt.get("stage")
    print(f"{args.checkpoint}: stage {stage}{' (evaluated as step3)' if stage == 'cal' else ''}, "
          f"{cfg.DS_NAME} {args.split} split, {res['num_images']} images, {time.time() - t0:.1f}s on {device}; "
          f"decode conf {cfg.conf_thresh:g} nms {cfg.nms_thresh:g} max {cfg.max_detections}")
    print(format_ap_table(res, cfg.VOC_CLASSES))
    if "coco" in res:
        c = res["coco"]
        print(f"COCO mAP@[.5:.95] {c['map']:.4f}  AP50 {c['ap50']:.4f}  AP75 {c['ap75']:.4f} (pycocotools)")
    if args.stitch:
        from gnetmdk.evaluation.stitch import evaluate_stitched
        t0 = time.time()
        st = evaluate_stitched(model, cfg, device, args.batch_size,
                               split="val" if args.split == "valid" else "train")
        print(f"stitched: {st['num_images']} whole images from {st['num_tiles']} tiles, {time.time() - t0:.1f}s; "
              f"merged by class-wise NMS at {cfg.nms_thresh:g}")
        print(format_ap_table(st, cfg.VOC_CLASSES))
    if args.json:
        import json
        import math

        def numbers(r, *extra):
            out = {"map": None if math.isnan(r["map"]) else r["map"], "ap": [None if math.isnan(a) else a for a in r["ap"]],
                   "num_images": r["num_images"]}
            out.update({k: r[k] for k in extra})
            return out
        doc = {"checkpoint": args.checkpoint, "stage": stage, "split": args.split, **numbers(res)}
        if args.stitch:
            doc["stitched"] = numbers(st, "num_tiles")
        folder = os.path.dirname(os.path.abspath(args.json))
        try:
            os.makedirs(folder, exist_ok=True)
            with open(args.json + ".tmp", "w") as fh:
                json.dump(doc, fh, indent=1)
            os.replace(args.json + ".tmp", args.json)
        except OSError as exc:
            return fail(f"cannot write --json {args.json}: {exc}")
    if args.plots is not None:
        from gnetmdk.evaluation.plots import write_eval_plots
        written = write_eval_plots(args.plots, res, res["detections"], res["truths"], cfg.VOC_CLASSES,
                                   title=f"{stage} {cfg.DS_NAME} {args.split}")
        print(f"plots: {', '.join(written)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
