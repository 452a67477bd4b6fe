"""Drawing detections (gnetmdk.evaluation.draw), device cpu."""
from __future__ import annotations

import cv2
import numpy as np
import torch

from gnetmdk.evaluation.draw import draw_detections


def test_draw_detections_draws_only_around_the_box_device_cpu():
    """draw_detections returns a copy; pixels change on the box outline and its label, the rest of the
    image and the input stay as they were."""
    img = np.full((120, 160, 3), 40, np.uint8)
    det = {"boxes": torch.tensor([[60.0, 50.0, 120.0, 100.0]]), "scores": torch.tensor([0.875]),
           "labels": torch.tensor([1])}
    out = draw_detections(img, det, ["a", "b"])
    assert out.shape == img.shape and out.dtype == np.uint8
    assert (img == 40).all()                                               # input untouched
    changed = (out != img).any(axis=2)
    ys, xs = np.nonzero(changed)
    assert changed.any()
    # everything drawn lies in the box's columns (label starts at x1) and rows from the label above
    assert xs.min() >= 59 and ys.max() <= 101 and ys.min() >= 50 - 30
    label_w = cv2.getTextSize("b 0.88", cv2.FONT_HERSHEY_SIMPLEX, 0.4 + 120 / 1500, 1)[0][0]
    assert xs.max() <= max(121, 60 + label_w)
    # outline pixels all have the label's colour, the box interior below the label is untouched
    edge = [tuple(out[75, 60]), tuple(out[75, 120]), tuple(out[100, 90])]
    assert edge[0] == edge[1] == edge[2] != (40, 40, 40)
    assert not changed[70:95, 65:115].any()
    # no detection: an equal copy
    empty = {"boxes": torch.zeros(0, 4), "scores": torch.zeros(0), "labels": torch.zeros(0, dtype=torch.long)}
    blank = draw_detections(img, empty, ["a", "b"])
    assert blank is not img and np.array_equal(blank, img)
