"""YOLOv3 head (Redmon & Farhadi, "YOLOv3: An Incremental Improvement", arXiv 1804.02767) with
PP-YOLO's IoU-aware branch, and the helpers that read its raw outputs (shared by the loss and
the decoder).

Raw output layout of one level (PaddleDetection ``YOLOv3Head``, ``ppdet/modeling/heads/yolo_head.py``),
``na`` anchors, ``C`` classes, channels of a ``(N, ch, H, W)`` tensor:

* without IoU-aware: ``ch = na * (5 + C)``, anchor a owns channels ``a*(5+C) .. (a+1)*(5+C)-1`` =
  ``[t_x, t_y, t_w, t_h, objectness logit, C class logits]``;
* with IoU-aware: ``ch = na * (6 + C)``: channels ``0 .. na-1`` are the IoU logits of anchors
  ``0 .. na-1``, then the ``na * (5 + C)`` channels above.

Box decoding ("grid sensitive", PP-YOLO paper section 3.3; PaddleDetection ``decode_yolo`` in
``bbox_utils.py`` and the ``yolo_box`` op), for the cell (row j, column i) of an ``H x W`` grid at
stride s over an ``H*s x W*s`` image, anchor (a_w, a_h) in input pixels:

    x = scale_x_y * sigmoid(t_x) - (scale_x_y - 1) / 2       (cell units, in [-0.025, 1.025] at 1.05)
    cx = (i + x) / W,   cy = (j + y) / H                      (relative to the image)
    w = exp(t_w) * a_w / (W * s),   h = exp(t_h) * a_h / (H * s)  (relative)
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence

import torch
from torch import nn

from .common import init_conv_

__all__ = ["YOLOv3Head", "split_level", "grid_offsets", "decode_level_boxes"]


class YOLOv3Head(nn.Module):
    """One 1x1 output conv per level.

    Args:
        in_channels: input channels per level, deepest first (the neck's ``out_channels``).
        num_anchors: anchors per level, deepest first (``len(mask)`` for each anchor mask).
        num_classes: C >= 1.
        iou_aware: add one IoU logit channel per anchor (PP-YOLO), layout in the module docstring.
        obj_prior: initial objectness probability p; the objectness biases start at
            ``log(p / (1 - p))`` (0.01 -> -4.595). ``None`` keeps PaddleDetection's zero bias.
            Weights use Paddle's default Normal(0, sqrt(2 / fan_in)); all other biases start at 0.

    Forward: list of ``(N, in_channels[l], H_l, W_l)`` -> list of ``(N, na_l * (5 + C [+ 1]), H_l, W_l)``
    raw outputs (logits and t values, see module docstring).

    Raises:
        ValueError: ``in_channels`` / ``num_anchors`` of different lengths, ``num_classes < 1``,
            ``obj_prior`` outside (0, 1).
    """

    def __init__(self, in_channels: Sequence[int], num_anchors: Sequence[int], num_classes: int,
                 iou_aware: bool = False, obj_prior: Optional[float] = 0.01):
        super().__init__()
        if len(in_channels) != len(num_anchors):
            raise ValueError(f"in_channels ({len(in_channels)} levels) and num_anchors ({len(num_anchors)} "
                             f"levels) must have one entry per level")
        if num_classes < 1:
            raise ValueError(f"num_classes must be >= 1, got {num_classes}")
        if obj_prior is not None and not 0.0 < obj_prior < 1.0:
            raise ValueError(f"obj_prior must be in (0, 1) or None, got {obj_prior}")
        self.num_classes, self.iou_aware = int(num_classes), bool(iou_aware)
        self.num_anchors = [int(a) for a in num_anchors]
        per_anchor = 5 + self.num_classes + (1 if self.iou_aware else 0)
        self.outputs = nn.ModuleList()
        for cin, na in zip(in_channels, self.num_anchors):
            conv = nn.Conv2d(cin, na * per_anchor, 1, bias=True)
            init_conv_(conv)
            if obj_prior is not None:
                first = na if self.iou_aware else 0
                with torch.no_grad():
                    for a in range(na):
                        conv.bias[first + a * (5 + self.num_classes) + 4] = math.log(obj_prior / (1.0 - obj_prior))
            self.outputs.append(conv)

    def forward(self, feats: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """One 1x1 output conv per level: the raw outputs, in the order of ``feats``.

        Raises:
            ValueError: not one feature map per level.
        """
        if len(feats) != len(self.outputs):
            raise ValueError(f"YOLOv3Head has {len(self.outputs)} levels, got {len(feats)} feature maps")
        return [conv(f) for conv, f in zip(self.outputs, feats)]


def split_level(out: torch.Tensor, num_anchors: int, num_classes: int, iou_aware: bool) -> Dict[str, torch.Tensor]:
    """Split one level's raw output into named parts, anchor-major.

    Args:
        out: ``(N, na * (5 + C [+ 1]), H, W)`` raw head output (layout in the module docstring).

    Returns:
        dict of views/tensors: ``tx, ty, tw, th, obj`` each ``(N, na, H, W)`` (t values, objectness
        logit), ``cls`` ``(N, na, H, W, C)`` class logits, and ``iou`` ``(N, na, H, W)`` IoU logits
        or ``None``.

    Raises:
        ValueError: if the channel count does not match ``num_anchors`` / ``num_classes`` / ``iou_aware``.
    """
    n, ch, h, w = out.shape
    per = 5 + num_classes
    expect = num_anchors * (per + (1 if iou_aware else 0))
    if ch != expect:
        raise ValueError(f"a level with {num_anchors} anchors, {num_classes} classes and iou_aware={iou_aware} "
                         f"needs {expect} channels, got {ch}")
    iou = None
    if iou_aware:
        iou, out = out[:, :num_anchors], out[:, num_anchors:]
    p = out.reshape(n, num_anchors, per, h, w)
    return {"tx": p[:, :, 0], "ty": p[:, :, 1], "tw": p[:, :, 2], "th": p[:, :, 3], "obj": p[:, :, 4],
            "cls": p[:, :, 5:].permute(0, 1, 3, 4, 2), "iou": iou}


def grid_offsets(tx: torch.Tensor, scale_x_y: float) -> torch.Tensor:
    """Grid-sensitive offset inside the cell: ``scale_x_y * sigmoid(t) - (scale_x_y - 1) / 2``
    (cell units; PP-YOLO paper section 3.3, PaddleDetection ``YOLOv3Loss.yolov3_loss``)."""
    return scale_x_y * torch.sigmoid(tx) - 0.5 * (scale_x_y - 1.0)


def decode_level_boxes(parts: Dict[str, torch.Tensor], anchors: Sequence[Sequence[float]], stride: int,
                       scale_x_y: float) -> torch.Tensor:
    """Decode every box of one level into relative xyxy (formulas in the module docstring).

    Args:
        parts: output of :func:`split_level` (``tx, ty, tw, th`` of shape ``(N, na, H, W)``).
        anchors: ``na`` (w, h) pairs in input pixels, this level's anchors in mask order.
        stride: the level's stride in input pixels (image size = grid size x stride).
        scale_x_y: grid-sensitive factor (1.05 in PP-YOLO, 1 for plain YOLOv3).

    Returns:
        ``(N, na, H, W, 4)`` boxes ``(x1, y1, x2, y2)`` relative to the image, not clipped; same
        dtype/device as the inputs; differentiable.
    """
    tx = parts["tx"]
    n, na, h, w = tx.shape
    dev, dt = tx.device, tx.dtype
    gx = torch.arange(w, device=dev, dtype=dt).view(1, 1, 1, w)
    gy = torch.arange(h, device=dev, dtype=dt).view(1, 1, h, 1)
    cx = (gx + grid_offsets(tx, scale_x_y)) / w
    cy = (gy + grid_offsets(parts["ty"], scale_x_y)) / h
    an = torch.as_tensor(anchors, dtype=dt, device=dev).view(1, na, 1, 1, 2)
    bw = torch.exp(parts["tw"]) * an[..., 0] / (w * stride)
    bh = torch.exp(parts["th"]) * an[..., 1] / (h * stride)
    return torch.stack([cx - 0.5 * bw, cy - 0.5 * bh, cx + 0.5 * bw, cy + 0.5 * bh], dim=-1)
