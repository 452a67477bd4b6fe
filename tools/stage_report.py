#!/usr/bin/env python3
"""Stage alignment report: mAP and mean output difference for step1 -> step2 -> step3 -> step4 -> chip model.

    python3 tools/stage_report.py                                  # the config's checkpoints, valid split
    python3 tools/stage_report.py --config examples/cards.py --split train max_val_images=50
    python3 tools/stage_report.py --chip model/chip_model.json --step3 runs/a/step3.pth

Each stage's checkpoint defaults to <checkpoint_root>/step<N>/best.pth (missing ones are skipped);
the chip row runs <model_root>/chip_model.json with the integer emulator, or, when that file is
absent, the step-4 checkpoint converted in memory. All stages see the same images and are decoded
with the config's thresholds. Columns: mAP@0.5, its change from the stage before, mean and max
|prediction difference| from the stage before, and mean |difference| from the first stage (step 1,
the float model). Step 4 -> chip must read exactly 0. Under the table, with a step-3 checkpoint:
the mAP of step 3's weights with every activation float (the checkpoint under step 2's switches,
gnetmdk.chip.report.float_activation_map), its change from step 1 (the part of step 3's cost that lies
in the weights) and step 3's mAP minus it (the part its 5-bit activations cost).

A second table gives each sublayer's output drift from step 1 (relative L2 error, in value units:
code-domain stages scaled back by their calibrated caps) on the first --drift-images images, so a
user sees in which layer accuracy leaves; `--drift-images 0` leaves it out. `--plots DIR` writes
stage_report.png/.json: mAP per stage above the per-layer drift (needs matplotlib).
Exit status: 0 ok (1 when step 4 and the chip model differ); 2 a user error.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from gnetmdk.config.cli import Parser, at_least
from gnetmdk.engine.cli import tool_main


def parse_args(argv):
    """Parse the command line (see the module docstring); config overrides are returned separately where taken."""
    p = Parser(description=__doc__.split("\n")[0],
               formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--config", default=None, help="configs.py (default ./configs.py)")
    p.add_argument("--split", choices=["valid", "train"], default="valid")
    for k in range(1, 5):
        p.add_argument(f"--step{k}", default=None, help=f"step-{k} checkpoint (default <checkpoint_root>/step{k}/best.pth)")
    p.add_argument("--chip", default=None, help="chip model (default <model_root>/chip_model.json, else converted "
                                                "from the step-4 checkpoint)")
    p.add_argument("--no-chip", action="store_true", help="leave out the chip row")
    p.add_argument("--batch-size", type=at_least(1), default=16)
    p.add_argument("--drift-images", type=at_least(0), default=64,
                   help="images for the per-layer drift table (default 64; 0 leaves the table out)")
    p.add_argument("--plots", default=None, metavar="DIR",
                   help="write stage_report.png/.json in DIR: mAP per stage and per-layer drift (needs matplotlib)")
    return p.parse_with_overrides(argv)


@tool_main
def main(argv) -> int:
    """Run the tool; returns the exit status (0 ok, 1 check failed where applicable, 2 user error)."""
    args, overrides = parse_args(argv)
    import torch
    from gnetmdk.config import load_config
    from gnetmdk.dataset.dataset import build_dataset
    from gnetmdk.chip import ChipModelError, convert_checkpoint, load_chip_model
    from gnetmdk.chip.report import format_report, stage_report
    if args.plots is not None:                 # refused before the evaluation, not after it
        from gnetmdk.evaluation.plots import prepare_plot_dir, require_matplotlib
        prepare_plot_dir(args.plots)
        require_matplotlib()
    cfg = load_config(args.config, overrides)
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    ckpts = {}
    for k in range(1, 5):
        given = getattr(args, f"step{k}")
        if given and not os.path.isfile(given):
            raise FileNotFoundError(f"--step{k} '{given}' does not exist")
        path = given or os.path.join(cfg.checkpoint_dir(k), "best.pth")
        ckpts[f"step{k}"] = path if os.path.isfile(path) else None
    chip = None
    chip_note = ""
    if not args.no_chip:
        chip_path = args.chip or os.path.join(cfg.model_root, "chip_model.json")
        if os.path.isfile(chip_path) or args.chip:
            chip = load_chip_model(chip_path)
            chip_note = chip_path
        elif ckpts["step4"]:
            chip, _ = convert_checkpoint(ckpts["step4"], list(cfg.VOC_CLASSES))
            chip_note = f"converted in memory from {ckpts['step4']}"
        if chip is not None and list(chip.class_names) != list(cfg.VOC_CLASSES):
            raise ChipModelError(f"chip model {chip_note} has classes {chip.class_names}, the config "
                                 f"{list(cfg.VOC_CLASSES)}: pass the matching --config")
    if not any(ckpts.values()) and chip is None:
        raise FileNotFoundError(f"no checkpoint found under {cfg.checkpoint_root}/step1..4 and no chip model: "
                                "train first, or pass --step1..--step4 / --chip")
    dataset = build_dataset(cfg, args.split)
    dataset.augment = False                   # evaluation: the train split without augmentation too
    t0 = time.time()
    rows = stage_report(dataset, ckpts, chip, cfg.conf_thresh, cfg.nms_thresh, cfg.max_detections,
                        args.batch_size, cfg)
    drift = None
    if args.drift_images > 0:
        from gnetmdk.chip.report import layer_drift
        drift = layer_drift(dataset, ckpts, chip, min(args.batch_size, 4), cfg, args.drift_images)
    missing = [k for k, v in ckpts.items() if v is None]
    print(f"stage report: {cfg.DS_NAME} {args.split} split, {len(dataset)} images, decode conf {cfg.conf_thresh:g} "
          f"nms {cfg.nms_thresh:g}; {time.time() - t0:.1f}s" + (f"; missing: {', '.join(missing)}" if missing else ""))
    if chip_note:
        print(f"chip model: {chip_note}")
    print(format_report(rows))
    by = {r.name: r for r in rows}
    if "step3" in by:
        from gnetmdk.chip.report import float_activation_map
        flt = float_activation_map(dataset, ckpts["step3"], cfg.conf_thresh, cfg.nms_thresh, cfg.max_detections,
                                   args.batch_size, cfg)
        base = f", {flt - by['step1'].map:+.4f} from step 1 (the weights)" if "step1" in by else ""
        print(f"step 3's weights with float activations (step 2's switches): mAP {flt:.4f}{base}; with step 3's "
              f"5-bit activations {by['step3'].map - flt:+.4f} (the activations)")
    if drift is not None:
        from gnetmdk.chip.report import format_drift
        print()
        print(format_drift(drift))
    if args.plots is not None:
        from gnetmdk.evaluation.plots import plot_layer_drift
        written = plot_layer_drift(drift.layers if drift else [], drift.stages if drift else {},
                                   os.path.join(args.plots, "stage_report.png"),
                                   drift.reference if drift else "step1", {r.name: r.map for r in rows},
                                   title=f"{cfg.DS_NAME} {args.split}: mAP and per-layer drift per stage")
        print(f"plots: {', '.join(written)}")
    if "chip" in by and "step4" in by and rows.index(by["chip"]) == rows.index(by["step4"]) + 1:
        if by["chip"].max_diff_prev != 0.0 or by["chip"].d_map != 0.0:
            print("step 4 and the chip model DIFFER: run tools/chip_eval.py --check for the layer that breaks")
            return 1
        print("step 4 -> chip: identical outputs and mAP (bit-exact)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
