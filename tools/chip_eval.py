#!/usr/bin/env python3
"""Evaluate the chip model: VOC mAP through the integer emulator (or onnxruntime), and the bit-exact check.

    python3 tools/chip_eval.py                                  # model/chip_model.json on the config's valid split
    python3 tools/chip_eval.py model/chip_model.json --backend onnx
    python3 tools/chip_eval.py --check                          # + every layer's codes vs checkpoint/step4/best.pth
    python3 tools/chip_eval.py --check checkpoint/step4/best.pth --config configs.py --split train max_train_images=20
    python3 tools/chip_eval.py --plots plots/chip                # + PR curves, confusion matrix of the chip model

The dataset comes from the config (configs.py; overrides after the options, KEY VALUE or KEY=VALUE).
Decoding uses the thresholds stored in the chip model unless conf_thresh / nms_thresh / max_detections
are overridden. With --check the step-4 model (eval mode) and the chip runner are compared on every
activation code of every layer of every image (mismatch count per layer), and the step-4 model's
mAP (the same evaluator as tools/eval_voc.py) must equal the chip's.
--plots DIR also writes pr_curves.png/.json and confusion_matrix.png/.json (score > 0.3, IoU >= 0.5) of
the chip model's detections on the split (gnetmdk.evaluation.plots; needs matplotlib).
Exit status: 0 ok; 1 mismatching codes or mAP; 2 a user error (one line on stderr).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from gnetmdk.config.cli import Parser, at_least
from gnetmdk.engine.cli import tool_main


_CHECK_DEFAULT = "<from chip model>"


def parse_args(argv):
    """Parse the command line (see the module docstring); config overrides are returned separately where taken."""
    p = Parser(description=__doc__.split("\n")[0],
               formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("chip_model", nargs="?", default=None,
                   help="chip-model file or its folder (default <model_root>/chip_model.json)")
    p.add_argument("--config", default=None, help="configs.py (default ./configs.py)")
    p.add_argument("--split", choices=["valid", "train"], default="valid")
    p.add_argument("--backend", choices=["emulator", "onnx"], default="emulator",
                   help="integer emulator (default) or onnxruntime on the exported ONNX model")
    p.add_argument("--onnx", default=None, help="ONNX file for --backend onnx (default: exported from the chip "
                                                "model in memory)")
    p.add_argument("--check", nargs="?", const=_CHECK_DEFAULT, default=None, metavar="CHECKPOINT",
                   help="compare with the step-4 checkpoint (default: the one the chip model was converted from)")
    p.add_argument("--batch-size", type=at_least(1), default=16)
    p.add_argument("--plots", default=None, metavar="DIR",
                   help="also write pr_curves.png/.json and confusion_matrix.png/.json (score > 0.3) of the chip "
                        "model's detections in DIR (created if missing; needs matplotlib)")
    p.add_argument("--threads", type=int, default=0, help="torch / onnxruntime threads (0 = the config's 'threads', "
                                                          "else the library default)")
    return p.parse_with_overrides(argv)


@tool_main
def main(argv) -> int:
    """Run the tool; returns the exit status (0 ok, 1 check failed where applicable, 2 user error)."""
    args, overrides = parse_args(argv)
    from gnetmdk.chip.cli_util import eval_device
    import torch
    from gnetmdk.config import load_config
    from gnetmdk.config.overrides import known_fields, parse_overrides
    from gnetmdk.dataset.dataset import build_dataset
    from gnetmdk.evaluation.voc import format_ap_table
    from gnetmdk.chip import ChipEmulator, ChipModelError, check_bit_exact, evaluate_chip, load_chip_model
    cfg = load_config(args.config, overrides)
    threads = args.threads or cfg.threads
    if threads > 0:
        torch.set_num_threads(threads)
    path = args.chip_model or os.path.join(cfg.model_root, "chip_model.json")
    cm = load_chip_model(path)
    if list(cfg.VOC_CLASSES) != list(cm.class_names):
        raise ChipModelError(f"chip model '{path}' has classes {cm.class_names} but the config's VOC_CLASSES are "
                             f"{list(cfg.VOC_CLASSES)}: pass the config of the dataset it was trained on (--config)")
    if cfg.image_size != cm.input_size:
        raise ChipModelError(f"chip model '{path}' takes {cm.input_size}x{cm.input_size} images but the config's "
                             f"image_size is {cfg.image_size}: set image_size={cm.input_size}")
    from gnetmdk.models import get_family
    # the names load_config took (section fields too: gnetdet.size_head), to see which were given
    keys = parse_overrides(overrides, known_fields(type(cfg), get_family(cfg.model_name).name))
    conf = cfg.conf_thresh if "conf_thresh" in keys else cm.conf_thresh
    nms = cfg.nms_thresh if "nms_thresh" in keys else cm.nms_thresh
    maxd = cfg.max_detections if "max_detections" in keys else cm.max_detections
    dataset = build_dataset(cfg, args.split)
    dataset.augment = False                   # evaluation: the train split without augmentation too
    if args.backend == "onnx":
        from gnetmdk.chip.onnx_export import OnnxChipRunner
        if args.onnx:
            if not os.path.isfile(args.onnx):
                raise FileNotFoundError(f"ONNX model '{args.onnx}' does not exist: export it with "
                                        "tools/convert_to_chip.py")
            with open(args.onnx, "rb") as fh:
                runner = OnnxChipRunner(fh.read(), threads=threads)
        else:
            runner = OnnxChipRunner(cm, threads=threads, all_layers=args.check is not None)
    else:
        runner = ChipEmulator(cm)
    model = None
    if args.check is not None:
        from gnetmdk.chip.cli_util import load_eval_model
        ckpt_path = cm.source.get("checkpoint") if args.check == _CHECK_DEFAULT else args.check
        if not ckpt_path:
            raise ChipModelError(f"chip model '{path}' does not name its checkpoint: pass --check CHECKPOINT")
        model, _ = load_eval_model(ckpt_path, cfg, require_stage="step4")
        device = eval_device(cfg)              # the step-4 model on the GPU when there is one
        model.to(device)
    if args.plots is not None:                # refused before the evaluation, not after it
        from gnetmdk.evaluation.plots import prepare_plot_dir, require_matplotlib
        prepare_plot_dir(args.plots)
        require_matplotlib()

    print(f"chip model {path} (chip {cm.chip}, {cm.input_size}px, {len(cm.layers)} sublayers), backend "
          f"{args.backend}, {args.split} split: {len(dataset)} images; decode conf {conf:g} nms {nms:g} max {maxd}")
    status = 0
    if model is not None:
        t0 = time.perf_counter()
        per_layer = not (args.backend == "onnx" and args.onnx)
        if not per_layer:
            print("note: an ONNX file has only the output codes: --check compares those (every layer: leave out --onnx)")
        rep = check_bit_exact(model, runner.run, cm, dataset=dataset, batch_size=args.batch_size, all_layers=per_layer)
        print(f"\nbit-exactness vs {ckpt_path} (step-4 model in eval mode), {time.perf_counter() - t0:.1f}s:")
        print(rep.format())
        if not rep.ok:
            status = 1
    res = evaluate_chip(runner.run, cm, dataset, args.batch_size, conf, nms, maxd,
                        keep_predictions=args.plots is not None)
    predictions = res.pop("predictions", None)
    print(f"\nchip mAP@0.5 ({args.backend}, {res['images_per_s']:.1f} images/s):")
    print(format_ap_table(res, cm.class_names))
    if model is not None:
        from torch.utils.data import DataLoader
        from gnetmdk.dataset.dataset import collate
        from gnetmdk.evaluation.evaluator import evaluate_model
        loader = DataLoader(dataset, batch_size=args.batch_size, collate_fn=collate, num_workers=0)
        ref = evaluate_model(model, loader, dataset, device, conf, nms, maxd)
        same = ref["map"] == res["map"] or (ref["map"] != ref["map"] and res["map"] != res["map"])
        print(f"\nstep-4 checkpoint mAP {ref['map']:.6f} | chip mAP {res['map']:.6f} | "
              f"{'equal' if same else 'DIFFERENT'}")
        if not same:
            status = 1
    if args.plots is not None:
        written = write_chip_plots(args.plots, predictions, cm, dataset, args.batch_size, conf, nms, maxd,
                                   title=f"chip {args.backend} {cfg.DS_NAME} {args.split}")
        print(f"plots: {', '.join(written)}")
    return status


def write_chip_plots(folder, predictions, cm, dataset, batch_size, conf, nms, maxd, title=""):
    """The --plots files for the chip model's detections: its predictions (evaluate_chip's
    ``keep_predictions``, the runner is not run again) decoded batch by batch as evaluate_chip decodes
    them, so the curves and the confusion matrix are of exactly the detections whose mAP was printed."""
    from gnetmdk.evaluation.plots import write_eval_plots
    from gnetmdk.evaluation.voc import evaluate_detections
    from gnetmdk.chip.host import decode_predictions
    n = len(dataset)
    detections = []
    for start in range(0, n, batch_size):
        idx = range(start, min(n, start + batch_size))
        detections += decode_predictions(predictions[start:start + len(idx)], cm,
                                         [tuple(dataset.original_size(i)) for i in idx], conf, nms, maxd)
    truths = [dataset.ground_truth(i) for i in range(n)]
    res = evaluate_detections(detections, truths, dataset.num_classes, return_curves=True)
    return write_eval_plots(folder, res, detections, truths, cm.class_names, title=title)


if __name__ == "__main__":
    sys.exit(main())
