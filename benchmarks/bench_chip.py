#!/usr/bin/env python3
"""Throughput of the chip model: integer emulator and onnxruntime against the PyTorch models, one run.

    python3 benchmarks/bench_chip.py                          # GNetDet-224 x0.25, 6 classes, 1 thread, batch 8
    python3 benchmarks/bench_chip.py --checkpoint checkpoint/step4/best.pth --threads 2 --batch 16

Every row runs the same network on the same batch of 8-bit images at the same input size:
  pytorch float32   the model with step-1 switches (float weights, plain ReLU), float32 conv
  pytorch step4     the step-4 model in eval mode (quantized weights, integer codes, float64 conv)
  emulator gemm     gnetmdk.chip.ChipEmulator, int8 im2col GEMM (the default backend)
  emulator conv     the same with integer conv2d
  onnxruntime       the exported ONNX model (ConvInteger), CPUExecutionProvider
Without --checkpoint the weights are random (He init) and the caps are calibrated on the images;
speed does not depend on the values. Images: the cards validation images when ../shared/data/cards
is present, else random pixels. Reported: images/s (median of --repeat timed batches after one
warm-up batch; the rows are timed round-robin, one batch each per round, so load changes on a shared
machine hit all rows alike) and the ratio to pytorch float32.
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import time

import numpy as np
import torch

from gnetmdk.config.cli import Parser
from gnetmdk.engine.cli import tool_main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CARDS = os.path.join(os.path.dirname(ROOT), "shared", "data", "cards")
CARD_CLASSES = ["nine", "ten", "jack", "queen", "king", "ace"]


def load_images(n: int, size: int) -> tuple:
    """(n, size, size, 3) uint8 BGR images (cards validation images, evaluation preprocessing, or random
    pixels without the dataset) and a description."""
    from gnetmdk.dataset.dataset import preprocess_image
    from gnetmdk.dataset.image_io import decode_image
    jpg = os.path.join(CARDS, "JPEGImages")
    if os.path.isdir(jpg):
        files = sorted(os.listdir(jpg))[:n]
        imgs = [preprocess_image(decode_image(os.path.join(jpg, f)), size) for f in files]
        while len(imgs) < n:
            imgs.append(imgs[len(imgs) % len(files)])
        return np.stack(imgs), "cards images"
    rng = np.random.default_rng(0)
    return rng.integers(0, 256, (n, size, size, 3), dtype=np.uint8), "random pixels"


def build_models(args, images):
    """(float32 model, step-4 model, chip model)."""
    from gnetmdk.engine.stages import STAGES, apply_stage
    from gnetmdk.chip import chip_model_from_gnetdet, convert_checkpoint
    from gnetmdk.gti.quantize import image_to_codes
    from gnetmdk.gti.transforms import fold_requant_multipliers
    from gnetmdk.models.gnetdet.model import GNetDet
    if args.checkpoint:
        chip, step4 = convert_checkpoint(args.checkpoint)
        from gnetmdk.checkpoint.io import load_checkpoint
        from gnetmdk.models.rebuild import build_model_from_checkpoint
        flt = build_model_from_checkpoint(load_checkpoint(args.checkpoint))
    else:
        torch.manual_seed(0)
        step4 = GNetDet(num_classes=len(CARD_CLASSES), image_size=args.size, width_mult=args.width, use_bn=False,
                        chip="5801")
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for conv in step4.convs():
                conv.weight.copy_(torch.randn(conv.weight.shape, generator=g) * math.sqrt(2.0 / (conv.in_channels * 9)))
                conv.bias.copy_(torch.randn(conv.bias.shape, generator=g) * 0.1)
            step4.convs()[0].weight.mul_(1 / 16)
        x = image_to_codes(torch.from_numpy(images)).permute(0, 3, 1, 2).float()
        from gnetmdk.engine.calibration import calibrate_caps
        calibrate_caps(step4, lambda: [x])
        flt = GNetDet(num_classes=len(CARD_CLASSES), image_size=args.size, width_mult=args.width, use_bn=False,
                      chip="5801")
        flt.load_state_dict(step4.state_dict())
        fold_requant_multipliers(step4)
        apply_stage(step4, STAGES["step4"])
        chip = chip_model_from_gnetdet(step4, CARD_CLASSES)
    apply_stage(flt, STAGES["step1"])
    flt.eval()
    step4.eval()
    return flt, step4, chip


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo (or platform's guess)."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def time_rows(rows, batch, repeat):
    """images/s per row: one warm-up batch each, then ``repeat`` rounds timing every row once per
    round (interleaved, so a change of machine load hits every row alike); median per row."""
    for _, fn in rows:
        fn(batch)
    times = {name: [] for name, _ in rows}
    for _ in range(repeat):
        for name, fn in rows:
            t0 = time.perf_counter()
            fn(batch)
            times[name].append(time.perf_counter() - t0)
    return {name: len(batch) / statistics.median(t) for name, t in times.items()}


@tool_main
def main(argv) -> int:
    """Build the models, time every row, print the table."""
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default=None, help="a step-4 checkpoint (default: random weights)")
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--width", type=float, default=0.25, help="width_mult without --checkpoint")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--skip", default="", help="comma-separated rows to skip (e.g. 'emulator conv')")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from gnetmdk.chip import ChipEmulator
    from gnetmdk.chip.emulator import int8_gemm_exact
    from gnetmdk.gti.quantize import image_to_codes
    images, what = load_images(args.batch, args.size)
    flt, step4, chip = build_models(args, images)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}

    def torch_fn(model):
        @torch.no_grad()
        def fn(imgs):
            return model(image_to_codes(torch.from_numpy(imgs)).permute(0, 3, 1, 2).float())
        return fn

    rows = [("pytorch float32", torch_fn(flt)), ("pytorch step4", torch_fn(step4)),
            ("emulator gemm", ChipEmulator(chip, "gemm", batch_size=args.batch).run),
            ("emulator conv", ChipEmulator(chip, "conv", batch_size=args.batch).run)]
    try:
        from gnetmdk.chip.onnx_export import OnnxChipRunner
        rows.append(("onnxruntime", OnnxChipRunner(chip, threads=args.threads).run))
    except Exception as exc:  # onnxruntime missing
        print(f"onnxruntime row skipped: {exc}")
    macs = sum(l.in_channels * l.out_channels * 9 * l.input_size ** 2 for l in chip.layers)
    print(f"GNetDet-{args.size} x{args.width if not args.checkpoint else 'ckpt'}, chip {chip.chip}, "
          f"{len(chip.layers)} sublayers, {macs / 1e6:.0f} M MAC/image; batch {args.batch} ({what}), "
          f"threads {args.threads}, median of {args.repeat}; torch {torch.__version__}, "
          f"int8 GEMM exact: {int8_gemm_exact()}; {cpu_name()} ({os.cpu_count()} cores), "
          f"load {os.getloadavg()[0]:.1f}")
    rows = [(name, fn) for name, fn in rows if name not in skip]
    ips = time_rows(rows, images, args.repeat)
    base = ips.get("pytorch float32")
    print("| backend | images/s | ms/image | vs pytorch float32 |")
    print("|---|---:|---:|---:|")
    for name, _ in rows:
        rel = f"{ips[name] / base:.2f}x" if base else "-"
        print(f"| {name} | {ips[name]:.1f} | {1000 / ips[name]:.1f} | {rel} |")
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
