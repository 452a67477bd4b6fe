#!/usr/bin/env python3
"""Convert a step-4 checkpoint into the chip model, GTI's text/JSON files and an ONNX model.

    python3 tools/convert_to_chip.py                                   # checkpoint/step4/best.pth -> model/
    python3 tools/convert_to_chip.py checkpoint/step4/best.pth --out model/ --check-images 8

Writes into --out: chip_model.json (the open chip-model file), chip_model.onnx (the integer network),
filter.txt, bias.txt, relu_cap.txt, <chip>_gnetdet_dat_<size>.json, <chip>_gnetdet_model_<size>.json.
A checkpoint that is not step 4, or that breaks a limit of its chip, is refused with the reason.
Exit status: 0 converted; 1 the optional --check-images self-check found mismatches; 2 a user error.
See docs/chip.md.
"""
from __future__ import annotations

import argparse
import os
import sys

from gnetmdk.config.cli import Parser, at_least
from gnetmdk.engine.cli import tool_main


def parse_args(argv):
    """Parse the command line (see the module docstring); config overrides are returned separately where taken."""
    p = Parser(description=__doc__.split("\n")[0],
               formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("checkpoint", nargs="?", default=None,
                   help="step-4 checkpoint (default <checkpoint_root>/step4/best.pth from the config)")
    p.add_argument("--config", default=None, help="configs.py (only for the default paths, with any KEY VALUE "
                                                  "overrides after the options; default ./configs.py)")
    p.add_argument("--out", default=None, help="output folder (default the config's model_root, 'model')")
    p.add_argument("--name", default="chip_model", help="base name of the chip-model and ONNX files (default chip_model)")
    p.add_argument("--classes", default=None, help="comma-separated class names (default: the checkpoint's VOC_CLASSES)")
    p.add_argument("--no-onnx", action="store_true", help="do not write the ONNX model")
    p.add_argument("--check-images", type=at_least(0), default=0, metavar="N",
                   help="self-check: run N random 8-bit images through the step-4 model and the emulator, compare "
                        "every layer (the real check on a dataset is tools/chip_eval.py --check)")
    return p.parse_with_overrides(argv)


@tool_main
def main(argv) -> int:
    """Run the tool; returns the exit status (0 ok, 1 check failed where applicable, 2 user error)."""
    args, overrides = parse_args(argv)
    from gnetmdk.checkpoint.io import CheckpointError
    from gnetmdk.utils.atomic import atomic_write_set, text_writer
    from gnetmdk.config import load_config
    from gnetmdk.chip import ChipEmulator, check_bit_exact, convert_checkpoint
    from gnetmdk.chip.model_file import FLOAT32_EXACT_LIMIT
    from gnetmdk.chip.export import gti_file_names, gti_file_texts
    cfg = None
    if args.checkpoint is None or args.out is None or overrides:
        cfg = load_config(args.config, overrides)
    ckpt = args.checkpoint or os.path.join(cfg.checkpoint_dir(4), "best.pth")
    out = args.out or cfg.model_root
    from gnetmdk.checkpoint.outputs import check_output_folder
    check_output_folder(out, "the chip model files", "--out")   # before any work: a file, a path below one, ...
    names = [c.strip() for c in args.classes.split(",") if c.strip()] if args.classes else None
    cm, model = convert_checkpoint(ckpt, names, cap_file=os.path.join(out, "relu_cap.txt"))
    os.makedirs(out, exist_ok=True)
    cm_path = os.path.join(out, args.name + ".json")
    onnx_path = os.path.join(out, args.name + ".onnx")
    # every file of the conversion is made in memory first, then written as one set: a full disk or a
    # failure on the way leaves the previous conversion's files as they were (never a mix of the two)
    writers = {cm_path: text_writer(cm.to_json(cm_path))}
    gti = gti_file_texts(cm, out, data_file=os.path.basename(cm_path))
    writers.update({p: text_writer(t) for p, t in gti.items()})
    if not args.no_onnx:
        from gnetmdk.chip.onnx_export import onnx_bytes
        data = onnx_bytes(cm)
        writers[onnx_path] = lambda fh: fh.write(data)
    try:
        # an ONNX file of an earlier conversion would not match this one: removed with --no-onnx
        atomic_write_set(writers, remove=[onnx_path] if args.no_onnx else [])
    except OSError as exc:
        raise CheckpointError(f"cannot write the chip files to '{out}' ({exc.strerror or exc}): free disk space "
                              "or pass another --out; the previous files there are unchanged") from None
    paths = {k: os.path.join(out, v) for k, v in gti_file_names(cm).items()}
    if args.no_onnx:
        onnx_path = None
    print(f"converted {ckpt} ({cm.source.get('stage')}, best mAP {cm.source.get('best_map')}) for chip {cm.chip}, "
          f"input {cm.input_size}x{cm.input_size}, {len(cm.layers)} sublayers in {len(cm.major_layers())} major layers")
    print(f"{'conv':<6} {'major.sub':<9} {'in->out':>11} {'bits':>4} {'shift':>5} {'pool':>4} {'max|acc|':>10} "
          f"{'f32 exact':>9}")
    for i, l in enumerate(cm.layers):
        print(f"{i + 1:<6} {f'{l.major + 1}.{l.index_in_major + 1}':<9} {f'{l.in_channels}->{l.out_channels}':>11} "
              f"{l.weight_format:>4} {l.shift:>5} {'yes' if l.pool_after else '':>4} {l.max_abs_acc():>10} "
              f"{'yes' if l.float32_exact() else 'NO':>9}")
    if cm.output_channels > cm.used_channels:
        print(f"output: {cm.used_channels} channels (10 + {cm.num_classes} classes) padded with zero filters to "
              f"{cm.output_channels}; host scale cap_last/31 = {cm.output_scale:.8g}")
    if not all(l.float32_exact() for l in cm.layers):
        print(f"note: partial sums can reach 2^24 = {FLOAT32_EXACT_LIMIT} in the layers marked NO: float32 convolution "
              "would round there; the step-4 model evaluates in float64 and the emulator in integers")
    from gnetmdk.gti.memory import memory_note
    note = memory_note(cm)
    if note:
        print(f"note: {note}")
    if cm.calibrated_caps() is None:
        print("note: the checkpoint does not record the calibrated caps; relu_cap.txt keeps calibration's file if it "
              "matches, else holds the chip's caps (31)")
    for p in [cm_path] + list(paths.values()) + ([onnx_path] if onnx_path else []):
        print(f"wrote {p}")
    if args.check_images > 0:
        import numpy as np
        rng = np.random.default_rng(0)
        imgs = rng.integers(0, 256, (args.check_images, cm.input_size, cm.input_size, 3), dtype=np.uint8)
        rep = check_bit_exact(model, ChipEmulator(cm).run, cm, images=imgs)
        print(rep.format())
        return 0 if rep.ok else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
