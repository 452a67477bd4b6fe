#!/usr/bin/env python3
"""Draw the learning-rate curve of every schedule (docs/training.md) as PNGs with opencv.

    python3 tools/plot_lr_schedules.py [--out docs/img]

Needs only what gnetmdk needs (torch, numpy, opencv-python). The curves are the real schedules:
gnetmdk.engine.schedule.build_scheduler stepped once per optimizer step, 30 epochs of 100 steps,
learning_rate 1e-3, warmup_epochs 2, warmup_factor 0.1, min_lr_ratio 0.01 (the BaseConfig defaults
where they exist), step: lr_step_size 10; multistep: milestones 20, 25; cosine_restarts: 10 epochs.
"""
import os
import sys

import cv2
import numpy as np
import torch

from gnetmdk.config import BaseConfig, build_config
from gnetmdk.config.cli import Parser
from gnetmdk.engine.cli import tool_main
from gnetmdk.engine.schedule import build_optimizer, build_scheduler

IPE, EPOCHS = 100, 30
KINDS = ["cosine", "cosine_restarts", "step", "multistep", "constant"]


def curve(kind):
    cfg = build_config(BaseConfig, ["learning_rate", "1e-3", "num_epochs", str(EPOCHS), "lr_scheduler", kind,
                                    "warmup_epochs", "2", "warmup_factor", "0.1", "min_lr_ratio", "0.01",
                                    "lr_step_size", "10", "lr_milestones", "20,25", "lr_restart_epochs", "10"])
    opt = build_optimizer(torch.nn.Linear(1, 1), cfg)
    sched = build_scheduler(opt, cfg, IPE)
    out = []
    for _ in range(EPOCHS * IPE):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return np.array(out)


def draw(lrs, title, path, w=640, h=300, m=50):
    img = np.full((h, w, 3), 255, np.uint8)
    x0, y0, x1, y1 = m, h - m + 10, w - 20, 30
    cv2.rectangle(img, (x0, y1), (x1, y0), (0, 0, 0), 1)
    top = 1.05 * lrs.max()
    for e in range(0, EPOCHS + 1, 5):
        x = int(x0 + (x1 - x0) * e / EPOCHS)
        cv2.line(img, (x, y0), (x, y0 + 4), (0, 0, 0), 1)
        cv2.putText(img, str(e), (x - 6, y0 + 18), cv2.FONT_HERSHEY_SIMPLEX, 0.4, (0, 0, 0), 1, cv2.LINE_AA)
    for frac in (0.0, 0.5, 1.0):
        y = int(y0 - (y0 - y1) * frac * lrs.max() / top)
        cv2.putText(img, f"{frac * lrs.max():.0e}", (2, y + 4), cv2.FONT_HERSHEY_SIMPLEX, 0.35, (0, 0, 0), 1,
                    cv2.LINE_AA)
    pts = np.stack([x0 + (x1 - x0) * np.arange(len(lrs)) / len(lrs), y0 - (y0 - y1) * lrs / top], 1)
    cv2.polylines(img, [pts.round().astype(np.int32).reshape(-1, 1, 2)], False, (200, 80, 0), 2, cv2.LINE_AA)
    cv2.putText(img, title, (x0, 20), cv2.FONT_HERSHEY_SIMPLEX, 0.5, (0, 0, 0), 1, cv2.LINE_AA)
    cv2.putText(img, "epoch", (w // 2 - 20, h - 5), cv2.FONT_HERSHEY_SIMPLEX, 0.4, (0, 0, 0), 1, cv2.LINE_AA)
    cv2.imwrite(path, img, [cv2.IMWRITE_PNG_COMPRESSION, 9])


@tool_main
def main(argv) -> int:
    """Draw every schedule's curve into --out; returns the exit status (0 ok, 2 a bad option)."""
    ap = Parser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join("docs", "img"))
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    for kind in KINDS:
        path = os.path.join(args.out, f"lr_{kind}.png")
        draw(curve(kind), f"lr_scheduler {kind} (warmup_epochs 2, lr 1e-3)", path)
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
