"""GNetDet's output head: how the output layer's values become boxes and scores, the checks of its
settings, and the limit it puts on the output layer's calibrated cap (docs/pipeline.md, "Loss";
docs/quantization.md, "Activations").

Each cell of the (N, S, S, 10 + C) output holds two boxes [x, y, w, h, conf] and C class outputs. x, y
are the box centre's offset inside its cell (cell units, 0..1); w, h give the box size as a fraction of
the image side through the size head ("linear", GTI's: the outputs are the sizes; "log": size_min **
(1 - output)); conf and the class outputs give scores through the score head ("linear", GTI's: the
outputs are the scores; "logit": sigmoid(score_scale (output - score_offset))). The model, the loss,
the decoder, the calibration and the chip tools all read the head from here.
"""
from __future__ import annotations

import math
from typing import Dict

import torch

from gnetmdk.config.base import ConfigError

__all__ = ["OUTPUT_CAP_FACTOR", "SIZE_HEADS", "SIZE_MIN", "cell_boxes_to_xyxy", "check_score_head", "check_size_head",
           "output_boxes", "output_cap_limit", "output_head", "output_scores", "output_sizes", "size_codes"]


def cell_boxes_to_xyxy(boxes: torch.Tensor, grid: int) -> torch.Tensor:
    """Convert (..., S, S, 4) [x, y, w, h] cell-encoded boxes to image-relative [x1, y1, x2, y2].

    Args:
        boxes: (N, S, S, 4) or (N, S, S, K, 4) float; x, y in cell units, w, h relative to the image.
        grid: S.
    Returns:
        same shape, corners relative to the image (0..1 for boxes inside it).
    """
    s = grid
    rows = torch.arange(s, device=boxes.device, dtype=boxes.dtype).view(1, s, 1)
    cols = torch.arange(s, device=boxes.device, dtype=boxes.dtype).view(1, 1, s)
    extra = boxes.dim() - 4
    for _ in range(extra):
        rows, cols = rows.unsqueeze(-1), cols.unsqueeze(-1)
    cx = (cols + boxes[..., 0]) / s
    cy = (rows + boxes[..., 1]) / s
    hw, hh = boxes[..., 2] / 2, boxes[..., 3] / 2
    return torch.stack([cx - hw, cy - hh, cx + hw, cy + hh], dim=-1)


SIZE_HEADS = ("linear", "log")
"""How the w, h outputs give box sizes: "linear" (GTI: the outputs are the sizes) or "log" (output_sizes)."""

SIZE_MIN = 1.0 / 64
"""Default smallest box size of the "log" size head, as a fraction of the image side (3.5 px at 224)."""


def output_sizes(y: torch.Tensor, size_head: str = "linear", size_min: float = SIZE_MIN) -> torch.Tensor:
    """Box sizes (fraction of the image side) from the w or h outputs ``y`` (elementwise, any float shape).

    "linear" (GTI): the outputs are the sizes. "log": ``size = size_min ** (1 - y)``, so an output of
    0 is a box of ``size_min`` and 1 a box as large as the image, and one output step multiplies the
    size by the same factor at every size. The output layer's 5-bit codes step by cap / 31
    (docs/quantization.md, "Activations"); with the linear head that is cap / 31 of the image side
    whatever the box (8.8 px at 224 px for a cap of 1.22, more than half of a 16-px box), with the log
    head a relative step of
    ``size_min ** (-cap / 31)`` (1.18 for 1/64 and cap 1.22, so a rounding error of at most 9% of the
    box). The same idea as YOLOv2's ``exp(t)`` sizes (Redmon and Farhadi 2017), written for an output
    that a capped ReLU keeps in [0, cap]. Sizes are capped at 2 (twice the image side) so that untrained
    outputs stay finite.

    Raises:
        ConfigError (a ValueError): size_head or size_min out of range (check_size_head).
    """
    if size_head == "linear":
        return y
    check_size_head(size_head, size_min)
    log_min = math.log(size_min)
    return torch.exp(((1.0 - y) * log_min).clamp(max=math.log(2.0)))


def size_codes(size: torch.Tensor, size_head: str = "linear", size_min: float = SIZE_MIN) -> torch.Tensor:
    """The outputs that give the box sizes ``size`` (fraction of the image side): the inverse of
    output_sizes, ``1 - ln(size) / ln(size_min)`` for the log head, clamped to [0, 1] (a box smaller
    than size_min is trained to output 0, size_min itself). Elementwise, any float shape."""
    if size_head == "linear":
        return size
    check_size_head(size_head, size_min)
    return (1.0 - torch.log(size.clamp(min=size_min)) / math.log(size_min)).clamp(0.0, 1.0)


def check_size_head(size_head: str, size_min: float) -> None:
    """Refuse a size head other than "linear" / "log" or a size_min outside (0, 1).

    Raises:
        ConfigError (a ValueError), naming the value and the allowed ones.
    """
    if size_head not in SIZE_HEADS:
        raise ConfigError(f"size_head must be 'linear' (GTI: the w, h outputs are the sizes) or 'log' "
                          f"(size = size_min ** (1 - output)), not {size_head!r}")
    try:
        ok = 0.0 < float(size_min) < 1.0
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ConfigError(f"size_min must be a fraction of the image side in (0, 1) (the log size head's "
                          f"smallest box, e.g. {SIZE_MIN:g}), not {size_min!r}")


def output_boxes(boxes: torch.Tensor, size_head: str = "linear", size_min: float = SIZE_MIN) -> torch.Tensor:
    """(..., 4) [x, y, w, h] outputs -> (..., 4) [x, y, w, h] with w, h as sizes (output_sizes)."""
    if size_head == "linear":
        return boxes
    return torch.cat([boxes[..., :2], output_sizes(boxes[..., 2:4], size_head, size_min)], dim=-1)


def check_score_head(score_head: str, score_scale: float, box_slots: int) -> None:
    """The score head, its scale and the trained box slots: the one check the config, the model and the
    loss share.

    Raises:
        ConfigError: naming the value and the allowed ones.
    """
    if score_head not in ("linear", "logit"):
        raise ConfigError(f"score_head must be 'linear' or 'logit' (GTI: the scores are the outputs), not {score_head!r}")
    if not (math.isfinite(float(score_scale)) and float(score_scale) > 0):
        raise ConfigError(f"score_scale must be a positive number (the logit head's sigmoid(score_scale * "
                          f"(output - score_offset))), not {score_scale!r}")
    if box_slots not in (1, 2):
        raise ConfigError(f"box_slots must be 1 (slot 1 always responsible) or 2 (YOLOv1: the slot with the "
                          f"better IoU), not {box_slots!r}")


#: the output cap rule's headroom over the top of the trained output range, per size head (output_cap_limit)
OUTPUT_CAP_FACTOR = {"linear": 2.0, "log": 1.25}


def output_cap_limit(g, model=None) -> float:
    """The upper limit on the output layer's calibrated cap that ``g.output_cap_max`` asks for, in output
    units (0 = no limit).

    ``output_cap_max`` >= 0 is returned as it is. ``-1`` (the default) is the rule: the top of the range
    the loss trains the outputs to, times :data:`OUTPUT_CAP_FACTOR` of the size head. Boxes are trained in
    [0, 1] (sizes with the linear head, log-space codes with the log head); the linear head's scores are
    the outputs, trained in [0, 1]; the logit head's score ``sigmoid(score_scale (output - score_offset))``
    reaches 0.99 at ``score_offset + ln(99) / score_scale``, and outputs beyond change no score by more
    than 0.01. So the top is ``max(1, score_offset + ln(99) / score_scale)`` for the logit head and 1 for
    the linear one. The factor leaves the MSE search room inside the limit. 2 (linear size head) is the
    value measured on the shapes demo, where a measured cap of 5.7 cost 15 points of mAP on its own and
    the limit 2 brought the model back to within 2 points of its float model. 1.25 (log size head): there
    one code step multiplies a box size by ``size_min ** (-cap / 31)``, so every unit of cap above the
    trained range coarsens all box sizes; on the shapes demo trained with the log head (seed 1) limits of 1.77 (as measured), 1.5
    and 1.25 ended step 4 at 2.5 and 1.0 points below step 1 and 1.6 above it (docs/results.md).

    Args:
        g: the ``gnetdet`` section (fields output_cap_max, score_head, score_offset, score_scale, size_head).
        model: the GNetDet being calibrated, or None; its heads (score_head, score_offset, score_scale,
            size_head), which a checkpoint keeps whatever the config says, take the place of the section's.
    Returns:
        float >= 0.
    """
    if g.output_cap_max != -1:
        return float(g.output_cap_max)

    def head(name):
        return getattr(model, name, getattr(g, name)) if model is not None else getattr(g, name)

    top = 1.0
    if head("score_head") == "logit":
        top = max(top, float(head("score_offset")) + math.log(99.0) / float(head("score_scale")))
    return OUTPUT_CAP_FACTOR.get(str(head("size_head")), 2.0) * top


def output_head(obj) -> Dict[str, object]:
    """The decode settings of a model, chip model or predictor ``obj``: its score head and size head
    (attributes score_head, score_offset, score_scale, size_head, size_min; GTI's linear heads where
    one is missing, as in files written before the option), as keyword arguments of decode_gnetdet."""
    return {"score_head": str(getattr(obj, "score_head", "linear")),
            "score_offset": float(getattr(obj, "score_offset", 4.0)),
            "score_scale": float(getattr(obj, "score_scale", 1.0)),
            "size_head": str(getattr(obj, "size_head", "linear")),
            "size_min": float(getattr(obj, "size_min", SIZE_MIN))}


def output_scores(conf: torch.Tensor, cls: torch.Tensor, score_head: str = "linear", score_offset: float = 4.0,
                  score_scale: float = 1.0):
    """(confidence, class scores) from the raw outputs: themselves ("linear", GTI) or
    sigmoid(score_scale * (output - score_offset)) ("logit" head). Shapes are kept."""
    if score_head == "logit":
        return (torch.sigmoid(score_scale * (conf - score_offset)),
                torch.sigmoid(score_scale * (cls - score_offset)))
    check_score_head(score_head, score_scale, 1)          # anything but the two heads is refused here
    return conf, cls
