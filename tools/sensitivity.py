#!/usr/bin/env python3
"""Per-layer quantization sensitivity of a GNetDet model, and the weight formats it suggests.

    python3 tools/sensitivity.py --config examples/cards.py                  # step1/best.pth, step2/cal.pth
    python3 tools/sensitivity.py --config C --weights CKPT --cal CAL --plots plots/sens --tolerance 0.01

The float model is the step-1 checkpoint (--weights) with its BatchNorm folded. Four tables on the
valid split (gnetmdk.gti.sensitivity): mAP@0.5 and output error with only one sublayer's weights
quantized (its weight format from the model's mask_bits); with only one major layer's weights quantized, for
each weight format the chip has; with only one layer's activation quantized to 5-bit codes, with the caps of
the calibration checkpoint (--cal; left out when there is none); and, with those caps, with only the box
centres, only the box sizes or only the scores on the output layer's 5-bit code grid (which of the
outputs that layer's resolution costs; box sizes are fractions of the input side, so small boxes
suffer first). Then the suggested mask_bits: per
major layer the fewest bits within --tolerance (mAP units, default 0.005 = half a point) of the float
model, then that choice evaluated with every major layer quantized at once, and while it misses the
tolerance the layer with the largest output error alone moved to its next weight format
(gnetmdk.gti.sensitivity.check_mask_bits): the suggestion printed last is the one measured whole. --plots DIR writes sensitivity.png/.json (bars of the mAP change per layer; needs matplotlib).
Exit status: 0 ok; 2 a user error (one line on stderr).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from gnetmdk.config.cli import Parser, at_least, fraction
from gnetmdk.engine.cli import tool_main


def parse_args(argv):
    """Parse the command line (module docstring); config overrides come back apart."""
    p = Parser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
               epilog=__doc__)
    p.add_argument("--config", default=None, help="configs.py (default ./configs.py)")
    p.add_argument("--weights", default=None, help="the float model (default <checkpoint_root>/step1/best.pth)")
    p.add_argument("--cal", default=None, help="calibration checkpoint for the caps (default "
                                               "<checkpoint_root>/step2/cal.pth when it exists)")
    p.add_argument("--split", choices=["valid", "train"], default="valid")
    p.add_argument("--batch-size", type=at_least(1), default=16)
    p.add_argument("--tolerance", type=fraction(high_open=True), default=0.005,
                   help="mAP a weight format may lose, in [0, 1) (default 0.005)")
    p.add_argument("--plots", default=None, metavar="DIR", help="write sensitivity.png/.json in DIR")
    return p.parse_with_overrides(argv)


def make_evaluator(dataset, cfg, batch_size: int):
    """``model -> (mAP@0.5, [outputs per batch])`` over ``dataset`` in order, on the CPU."""
    import torch
    from torch.utils.data import DataLoader
    from gnetmdk.dataset.dataset import collate
    from gnetmdk.evaluation.voc import evaluate_detections
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=0, collate_fn=collate)
    truths = [dataset.ground_truth(i) for i in range(len(dataset))]

    @torch.no_grad()
    def evaluate(model):
        dets, outs = [], []
        for images, _, _, sizes in loader:
            pred = model(images.float())
            outs.append(pred.detach().float().cpu())
            for d, (w, h) in zip(model.decode(pred, cfg.conf_thresh, cfg.nms_thresh, cfg.max_detections),
                                 sizes.tolist()):
                scale = torch.tensor([w, h, w, h], dtype=torch.float32)
                dets.append({"boxes": d["boxes"] * scale, "scores": d["scores"], "labels": d["labels"]})
        return evaluate_detections(dets, truths, dataset.num_classes)["map"], outs
    return evaluate


@tool_main
def main(argv) -> int:
    """Run the tool; returns the exit status (0 ok, 2 user error)."""
    args, overrides = parse_args(argv)
    import torch
    from gnetmdk.checkpoint.io import CheckpointError, load_checkpoint
    from gnetmdk.models.rebuild import build_model_from_checkpoint, check_compatible
    from gnetmdk.config import load_config
    from gnetmdk.dataset.dataset import build_dataset
    from gnetmdk.gti.sensitivity import check_mask_bits, format_sensitivity, measure_sensitivity, suggest_mask_bits
    from gnetmdk.gti.transforms import fold_bn
    if args.plots is not None:
        from gnetmdk.evaluation.plots import prepare_plot_dir, require_matplotlib
        prepare_plot_dir(args.plots)
        require_matplotlib()
    cfg = load_config(args.config, overrides)
    if cfg.model_name != "gnetdet":
        raise CheckpointError(f"tools/sensitivity.py measures GNetDet's chip quantization; the config's model is "
                              f"{cfg.model_name!r}")
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    path = args.weights or os.path.join(cfg.checkpoint_dir(1), "best.pth")
    ckpt = load_checkpoint(path, "train step 1 first (python3 train.py --step 1) or pass --weights")
    if ckpt.get("stage") != "step1":
        raise CheckpointError(f"--weights '{path}' is a {ckpt.get('stage')} checkpoint: pass the float "
                              "(step-1) model")
    check_compatible(ckpt, cfg, path)
    model = build_model_from_checkpoint(ckpt, cfg, path).eval()
    fold_bn(model)
    caps, cal_path = None, args.cal or os.path.join(cfg.checkpoint_dir(2), "cal.pth")
    if args.cal or os.path.isfile(cal_path):
        cal = load_checkpoint(cal_path)
        caps = [float(c) for c in cal.get("caps") or []]
        if not caps or not all(c > 0 for c in caps):
            raise CheckpointError(f"--cal '{cal_path}' holds no calibrated caps: run python3 train.py --cal")
    dataset = build_dataset(cfg, args.split)
    dataset.augment = False
    t0 = time.time()
    evaluate = make_evaluator(dataset, cfg, args.batch_size)
    sens = measure_sensitivity(model, evaluate, cfg.gnetdet.chip, caps)
    check = check_mask_bits(model, evaluate, cfg.gnetdet.chip, sens, suggest_mask_bits(sens, args.tolerance),
                            args.tolerance)
    print(f"sensitivity: {cfg.DS_NAME} {args.split} split, {len(dataset)} images, float model {path}"
          + (f", caps from {cal_path}" if caps else ", no calibration checkpoint (activations left out)")
          + f"; {time.time() - t0:.1f}s")
    print(format_sensitivity(sens, args.tolerance, check))
    if args.plots is not None:
        from gnetmdk.evaluation.plots import plot_sensitivity
        written = plot_sensitivity(sens, os.path.join(args.plots, "sensitivity.png"), check.chosen,
                                   title=f"{cfg.DS_NAME} {args.split}: mAP change with one layer quantized",
                                   check=check)
        print(f"plots: {', '.join(written)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
