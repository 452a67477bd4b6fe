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
--bootstrap N also gives the 95% bootstrap interval of the mAP over N resamples of the images (with
--stitch of the whole images), and --against CHECKPOINT scores a second checkpoint the same way and
gives the difference of the two mAPs with its paired interval (and in --json every resample's
difference): how far the difference can move with the val images drawn (gnetmdk.evaluation.voc.bootstrap_map; docs/pipeline.md, "How far a mAP can
move with the val images"). Both go into --json as "bootstrap".
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
    p.add_argument("--bootstrap", type=at_least(0), default=None, metavar="N",
                   help="also the bootstrap interval of the mAP over N resamples of the images (default 0, "
                        "1000 with --against)")
    p.add_argument("--against", default=None, metavar="CHECKPOINT",
                   help="also score this checkpoint and give the paired bootstrap interval of the difference "
                        "(first checkpoint - this one)")
    p.add_argument("--level", type=float, default=0.95, help="the bootstrap interval's coverage (default 0.95)")
    p.add_argument("--seed", type=at_least(0), default=0, help="the bootstrap's random seed (default 0)")
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
    resamples = args.bootstrap if args.bootstrap is not None else (1000 if args.against else 0)
    if args.bootstrap == 0 and args.against:
        return fail("--against compares the two mAPs by a bootstrap: give --bootstrap N >= 1 or leave it out")
    if not 0.0 < args.level < 1.0:
        return fail(f"--level must lie between 0 and 1 (0.95 is a 95% interval), got {args.level}")
    model, ckpt = load_eval_model(args.checkpoint, cfg)
    other = load_eval_model(args.against, cfg) if args.against else None   # refused before any evaluation
    dataset = build_dataset(cfg, args.split)
    dataset.augment = False                   # evaluation: the train split without augmentation too
    device = eval_device(cfg)
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
    keep = args.plots is not None or resamples > 0

    def score(name, net, stage):
        """Evaluate one model as the stage runs; print its tables; returns (split result, stitched or None)."""
        net.to(device)
        t0 = time.time()
        res = evaluate_model(net, loader, dataset, device, cfg.conf_thresh, cfg.nms_thresh, cfg.max_detections,
                             coco=args.coco or cfg.eval_coco, keep_detections=keep, pad_to=batch)
        print(f"{name}: stage {stage}{' (evaluated as step3)' if stage == 'cal' else ''}, "
              f"{cfg.DS_NAME} {args.split} split, {res['num_images']} images, {time.time() - t0:.1f}s on {device}; "
              f"decode conf {cfg.conf_thresh:g} nms {cfg.nms_thresh:g} max {cfg.max_detections}")
        print(format_ap_table(res, cfg.VOC_CLASSES))
        if "coco" in res:
            c = res["coco"]
            print(f"COCO mAP@[.5:.95] {c['map']:.4f}  AP50 {c['ap50']:.4f}  AP75 {c['ap75']:.4f} (pycocotools)")
        st = None
        if args.stitch:
            from gnetmdk.evaluation.stitch import evaluate_stitched
            t0 = time.time()
            st = evaluate_stitched(net, cfg, device, args.batch_size, split="val" if args.split == "valid" else "train",
                                   keep_detections=keep)
            print(f"stitched: {st['num_images']} whole images from {st['num_tiles']} tiles, {time.time() - t0:.1f}s; "
                  f"merged by class-wise NMS at {cfg.nms_thresh:g}")
            print(format_ap_table(st, cfg.VOC_CLASSES))
        return res, st

    stage = ckpt.get("stage")
    res, st = score(args.checkpoint, model, stage)
    boot = None
    if resamples:
        from gnetmdk.evaluation.voc import bootstrap_map
        base = st if st is not None else res           # their ranked TP / FP flags: keep_detections
        what = f"the {base['num_images']} whole images" if st is not None else f"the {base['num_images']} images"
        ranked_b = None
        if other is not None:
            model_b, ckpt_b = other
            res_b, st_b = score(args.against, model_b, ckpt_b.get("stage"))
            ranked_b = st_b if st_b is not None else res_b
        b = bootstrap_map(base, ranked_b, resamples, args.seed, args.level)
        pct = f"{100 * args.level:g}%"
        print(f"bootstrap over {what}, {resamples} resamples (seed {args.seed}): mAP {b['map_a']:.4f}, "
              f"{pct} interval [{b['interval_a'][0]:.4f}, {b['interval_a'][1]:.4f}]")
        boot = {k: b[k] for k in ("map_a", "interval_a", "resamples", "seed", "level", "num_images")}
        if other is not None:
            print(f"against {args.against}: mAP {b['map_b']:.4f}, {pct} interval [{b['interval_b'][0]:.4f}, "
                  f"{b['interval_b'][1]:.4f}]; difference {b['diff']:+.4f}, {pct} paired interval "
                  f"[{b['interval_diff'][0]:+.4f}, {b['interval_diff'][1]:+.4f}]; the first below the second in "
                  f"{100 * b['share_below']:.1f}% of the resamples")
            boot.update({k: b[k] for k in ("map_b", "interval_b", "diff", "interval_diff", "share_below")})
            # every resample's difference, in draw order: runs scored on the same images with the same --seed
            # draw the same resamples, so their differences can be averaged per resample (a mean over seeds)
            boot["samples_diff"] = [float(x) for x in b["samples_diff"]]
            boot["against"] = args.against
        boot["images"] = "whole" if st is not None else args.split
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
        if boot is not None:
            doc["bootstrap"] = {k: list(v) if isinstance(v, tuple) else v for k, v in boot.items()}
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
