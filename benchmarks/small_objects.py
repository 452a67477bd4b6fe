#!/usr/bin/env python3
"""How fast GNetDet's float model learns to tell small objects apart: class accuracy over training
iterations, per band of object sizes. Prints a table; asserts nothing.

    python3 benchmarks/small_objects.py [--bands 4-16:8-20,8-32:2-5,30-95:1-3] [--iters 300]
        [--out runs/small_objects] [--seed 0] [overrides, e.g. gnetdet.width_mult 0.5 learning_rate 1e-3]

Each band ``LO-HI:NMIN-NMAX`` is a synthetic shapes set (gnetmdk.dataset.shapes, 224 px squares,
960 train and 240 val images, seed ``--seed``) with NMIN-NMAX shapes of LO-HI px each. The default
bands: a 224-px tile of the dense set (``make_shapes.py --dense``: the same sizes and density), shapes
twice that size, and the shapes demo's sizes. For each band the GNetDet of ``examples/shapes.py``
(224 px, width 0.25; overrides apply) trains from scratch on the float stage's loss with the
configured optimizer at a constant learning rate, augmentation off, batch 16, ``--iters`` steps.

Reported per band, every 50 iterations (every multiple of 50 that gives about 12 columns for longer
runs): the class accuracy on the training batches' object cells
(argmax of the class outputs against the target class; chance is 1/3), and at the end on the val
set: the class accuracy, and the mean |x error| of the box centre in object cells next to that of
always guessing the cell centre (cell units). A band whose accuracy stays near 1/3 has learned no
shape from the pixels: the class outputs depend on the cell, not on the image.

Measured (docs/results/accuracy-matrix.md, "The dense set"): the demo's band reaches 0.98 within 600 steps; the
dense set's band stays at chance for about 1500 steps, then reaches 0.99 (val 0.91) by 3000. About
7 minutes per band and 600 steps on 2 cores; never part of the tests.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from typing import List, Tuple

from gnetmdk.config.cli import Parser
from gnetmdk.engine.cli import tool_main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
Band = Tuple[int, int, int, int]


def parse_bands(text: str) -> List[Band]:
    """'4-16:8-20,30-95:1-3' -> [(4, 16, 8, 20), (30, 95, 1, 3)] (side px lo-hi : objects lo-hi).

    Raises:
        ValueError: a band that is not LO-HI:NMIN-NMAX with 1 <= LO <= HI and 1 <= NMIN <= NMAX.
    """
    bands = []
    for item in text.split(","):
        try:
            sides, counts = item.split(":")
            lo, hi = (int(v) for v in sides.split("-"))
            nlo, nhi = (int(v) for v in counts.split("-"))
        except ValueError:
            raise ValueError(f"--bands: '{item}' is not LO-HI:NMIN-NMAX (e.g. 4-16:8-20)") from None
        if not (1 <= lo <= hi and 1 <= nlo <= nhi):
            raise ValueError(f"--bands: '{item}' needs 1 <= LO <= HI and 1 <= NMIN <= NMAX")
        bands.append((lo, hi, nlo, nhi))
    return bands


def report_every(iters: int) -> int:
    """Steps per reported accuracy: 50, or a multiple of 50 that keeps the table to about 12 columns."""
    return 50 * max(1, round(iters / 600))


def run_band(band: Band, args, overrides: List[str]) -> dict:
    """Make (or reuse) one band's set under ``args.out``, train GNetDet on it for ``args.iters`` steps
    and measure it.

    Returns:
        {"band": label, "curve": [(step, mean train class accuracy over the last steps)], "val_acc",
        "dx" and "dx_centre" (mean |x error| of the model and of the cell-centre guess, cell units),
        "seconds" (training and validation wall time)}.
    Raises:
        ConfigError: an override the config refuses; OSError: the output folder cannot be written.
    """
    import torch
    from torch.utils.data import DataLoader
    from gnetmdk.config import build_config, load_config_class
    from gnetmdk.dataset.dataset import build_dataset, collate
    from gnetmdk.dataset.shapes import make_shapes_dataset
    from gnetmdk.engine.schedule import build_optimizer
    from gnetmdk.models import get_family

    lo, hi, nlo, nhi = band
    name = f"sides{lo}-{hi}_n{nlo}-{nhi}_seed{args.seed}"
    data_dir = os.path.join(args.out, name)
    meta_dir = os.path.join(args.out, "meta")
    cfg = build_config(load_config_class(os.path.join(ROOT, "examples", "shapes.py")),
                       ["DS_NAME", name, "dataset_path", data_dir, "meta_root", meta_dir,
                        "augment", "false", "seed", str(args.seed), *overrides])
    if not os.path.isdir(os.path.join(data_dir, "Annotations")):
        make_shapes_dataset(data_dir, num_train=960, num_val=240, image_size=224, seed=args.seed,
                            min_objects=nlo, max_objects=nhi, side_px=(lo, hi))
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "xml_2_txt.py"), "--name", name,
                    "--dataset-dir", data_dir, "--classes", ",".join(cfg.VOC_CLASSES), "--out-dir", meta_dir],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    torch.manual_seed(args.seed)
    torch.set_num_threads(cfg.threads)
    model = get_family("gnetdet").build(cfg)
    opt = build_optimizer(model, cfg)
    gen = torch.Generator().manual_seed(args.seed)
    train = DataLoader(build_dataset(cfg, "train"), batch_size=16, shuffle=True, drop_last=True,
                       collate_fn=collate, generator=gen)
    every = report_every(args.iters)
    curve, window, step, t0 = [], [], 0, time.time()
    model.train()
    while step < args.iters:
        for batch in train:
            x, t = batch[0], batch[1]
            pred = model(x)
            loss = model.loss(pred, t)["total"]
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            obj = t[..., 4] > 0
            hit = (pred[..., 10:].argmax(-1) == t[..., 10:].argmax(-1))[obj]
            window.append(hit.float().mean().item())
            step += 1
            if step % every == 0:
                curve.append((step, sum(window) / len(window)))
                window = []
            if step >= args.iters:
                break
    model.eval()
    hits, dx, dx0, cells = 0.0, 0.0, 0.0, 0
    with torch.no_grad():
        for batch in DataLoader(build_dataset(cfg, "valid"), batch_size=16, collate_fn=collate):
            x, t = batch[0], batch[1]
            pred = model(x)
            obj = t[..., 4] > 0
            hits += (pred[..., 10:].argmax(-1) == t[..., 10:].argmax(-1))[obj].float().sum().item()
            dx += (pred[..., 0] - t[..., 0]).abs()[obj].sum().item()
            dx0 += (0.5 - t[..., 0]).abs()[obj].sum().item()
            cells += int(obj.sum())
    return {"band": f"{lo}-{hi} px, {nlo}-{nhi} per image", "curve": curve, "val_acc": hits / max(cells, 1),
            "dx": dx / max(cells, 1), "dx_centre": dx0 / max(cells, 1), "seconds": time.time() - t0}


def parse_args(argv):
    """The command line (module docstring): options first, then config overrides (KEY VALUE / KEY=VALUE).

    Returns:
        (argparse.Namespace, [override words]).
    """
    p = Parser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bands", default="4-16:8-20,8-32:2-5,30-95:1-3",
                   help="comma-separated LO-HI:NMIN-NMAX (shape side in px : shapes per 224-px image)")
    p.add_argument("--iters", type=int, default=300, help="training steps per band (default 300)")
    p.add_argument("--seed", type=int, default=0, help="data and weight seed (default 0)")
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "small_objects"),
                   help="folder for the generated sets (reused when present)")
    return p.parse_with_overrides(argv)


@tool_main
def main(argv) -> int:
    """Train and measure every band (module docstring); returns the exit status (0, or 2 for bad input)."""
    args, overrides = parse_args(argv)
    try:
        bands = parse_bands(args.bands)
    except ValueError as exc:
        print(f"small_objects: error: {exc}", file=sys.stderr)
        return 2
    if args.iters < 50:
        print("small_objects: error: --iters must be at least 50 (accuracy is reported per 50 steps)",
              file=sys.stderr)
        return 2
    try:
        rows = [run_band(b, args, overrides) for b in bands]
    except (ValueError, OSError) as exc:          # ConfigError is a ValueError: a refused override
        print(f"small_objects: error: {exc}", file=sys.stderr)
        return 2
    marks = [s for s, _ in rows[0]["curve"]]
    print("class accuracy on object cells (chance 0.33); dx: mean |box-centre x error| in cell units")
    print("| objects | " + " | ".join(f"train acc @{s}" for s in marks) + " | val acc | val dx (centre guess) | s |")
    print("|---" * (len(marks) + 4) + "|")
    for r in rows:
        accs = " | ".join(f"{a:.2f}" for _, a in r["curve"])
        print(f"| {r['band']} | {accs} | {r['val_acc']:.2f} | {r['dx']:.3f} ({r['dx_centre']:.3f}) | {r['seconds']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
