"""Drawing detections on an image (the predictor's outputs, the tensorboard images of the validation
set). A leaf: it imports nothing of gnetmdk, so the trainer's hooks and the chip tools share it.
"""
from __future__ import annotations

from typing import Dict, Sequence, Tuple

import cv2
import numpy as np
import torch

__all__ = ["draw_detections"]


def _color(label: int) -> Tuple[int, int, int]:
    rng = np.random.default_rng(label * 7919 + 17)
    return tuple(int(c) for c in rng.integers(64, 256, 3))


def draw_detections(img: np.ndarray, det: Dict[str, torch.Tensor], class_names: Sequence[str]) -> np.ndarray:
    """A copy of ``img`` with each detection's box and a label "class score" drawn in the class's colour.

    Args:
        img: (H, W, 3) uint8 BGR image.
        det: "boxes" (K, 4) float [x1, y1, x2, y2] in pixels of ``img``, "scores" (K,) float, "labels"
            (K,) int class indices into ``class_names``.
        class_names: the dataset's class names.
    Returns:
        a new (H, W, 3) uint8 array; ``img`` is not changed.
    """
    out = img.copy()
    h, w = out.shape[:2]
    thick = max(1, round(min(h, w) / 300))
    font = 0.4 + min(h, w) / 1500
    for box, score, label in zip(det["boxes"].tolist(), det["scores"].tolist(), det["labels"].tolist()):
        x1, y1, x2, y2 = (int(round(v)) for v in box)
        color = _color(int(label))
        cv2.rectangle(out, (x1, y1), (x2, y2), color, thick)
        text = f"{class_names[int(label)]} {score:.2f}"
        (tw, th), base = cv2.getTextSize(text, cv2.FONT_HERSHEY_SIMPLEX, font, 1)
        ty = max(th + base, y1)
        cv2.rectangle(out, (x1, ty - th - base), (x1 + tw, ty), color, -1)
        cv2.putText(out, text, (x1, ty - base), cv2.FONT_HERSHEY_SIMPLEX, font, (0, 0, 0), 1, cv2.LINE_AA)
    return out
