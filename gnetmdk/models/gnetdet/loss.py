"""GNetDet loss (docs/pipeline.md, "Loss"; the YOLOv1 family, Redmon et al. 2016, with smooth-L1 terms).

Layout of the last dimension of predictions and targets (10 + C):
    [x1, y1, w1, h1, conf1, x2, y2, w2, h2, conf2, class_0 .. class_{C-1}]
x, y: offset of the box centre inside its cell (cell units, 0..1); w, h: box size relative to the
image (0..1) in the targets, and in the predictions either the same ("linear" size head, GTI) or a
log-space code of it ("log" size head, see output_sizes). A target cell holding an object carries the box in both slots, conf 1 and the one-hot
class; every other target cell is all zero.

Alignment rule (docs/alignment.md): every term is a sum over the cells of one image, then a mean over
the images of the batch, with no normaliser that depends on how a batch is split, so N processes
with B/N images each average to exactly the loss of one process with B images.
"""
from __future__ import annotations

import math
from typing import Dict

import torch
import torch.nn.functional as F

from gnetmdk.evaluation.boxes import paired_iou
from .head import (SIZE_HEADS, SIZE_MIN, cell_boxes_to_xyxy, check_score_head, check_size_head,  # noqa: F401
                   output_boxes, output_sizes, size_codes)


class _ClampBack(torch.autograd.Function):
    """clamp(x, lo, hi) whose gradient also passes outside [lo, hi] when it points back inside."""

    @staticmethod
    def forward(ctx, x, lo, hi):
        ctx.save_for_backward(x)
        ctx.lo, ctx.hi = lo, hi
        return x.clamp(lo, hi)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        inside = (x > ctx.lo) & (x < ctx.hi)
        mask = inside | ((x <= ctx.lo) & (grad < 0)) | ((x >= ctx.hi) & (grad > 0))
        return grad * mask.to(grad.dtype), None, None


def safe_sqrt(x: torch.Tensor, tau: float = 1e-2) -> torch.Tensor:
    """sqrt(x) for x >= tau, continued below tau by its tangent at tau (elementwise, any float shape).

    The plain sqrt(x + eps) of YOLOv1's size term has slope 1 / (2 sqrt eps) at 0: with the output
    ReLU's revive gradient, a size output of 0 sends ~250x larger gradients than any other term,
    which inflates Adam's second moments and stalls learning for hundreds of steps. The tangent
    keeps the slope at most 1 / (2 sqrt tau) (5 for tau = 0.01); sizes above tau (a box at least
    1% of the image side) get the exact sqrt.
    """
    root = torch.sqrt(x.clamp(min=tau))
    return torch.where(x >= tau, root, root + (x - tau) / (2 * math.sqrt(tau)))


def score_bce(p: torch.Tensor, t: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """Binary cross-entropy of a score used directly as a probability (no sigmoid: the chip's
    output is a capped ReLU, so the score is the output value itself, clamped to [eps, 1 - eps]).

    Elementwise; p, t float tensors of one shape, t in [0, 1].
    """
    q = _ClampBack.apply(p, eps, 1.0 - eps)
    return -(t * torch.log(q) + (1 - t) * torch.log1p(-q))


LOGIT_MAX = 6.0
"""Logit above which a score gets no further upward push (sigmoid(6) = 0.9975); see logit_bce."""


def logit_bce(y: torch.Tensor, t: torch.Tensor, offset: float, scale: float = 1.0,
              logit_max: float = LOGIT_MAX) -> torch.Tensor:
    """Cross-entropy of scores p = sigmoid(z), z = scale (y - offset), against targets t (elementwise),
    minus its value at y = 0 for t = 0, so that a unit the output ReLU has switched off costs exactly 0.

        bce(z, t) = softplus(z) - t z   (binary cross-entropy with logits)

    z is clipped at ``logit_max`` with a gradient that still passes downward (_ClampBack): cross-entropy
    alone pushes a positive's output up for ever, and the output layer shares one calibrated cap
    (docs/quantization.md, "GNetDet on the chip"), so unbounded scores would coarsen the 5-bit codes
    of the box outputs too.
    """
    z = _ClampBack.apply(scale * (y - offset), float("-inf"), float(logit_max))
    return F.softplus(z) - t * z - (1 - t) * F.softplus(torch.full_like(z, -scale * offset))


def gnetdet_loss(pred: torch.Tensor, target: torch.Tensor, l_coord: float = 5.0, l_noobj: float = 0.005,
                 l_class: float = 1.0, score_loss: str = "smooth_l1", score_head: str = "linear",
                 score_offset: float = 4.0, sqrt_tau: float = 1e-2,
                 score_scale: float = 1.0, l_range: float = 0.0, box_slots: int = 2,
                 size_head: str = "linear", size_min: float = SIZE_MIN) -> Dict[str, torch.Tensor]:
    """GNetDet loss terms.

    Args:
        pred: (N, S, S, 10 + C) float predictions (>= 0: the last layer has a capped ReLU).
        target: (N, S, S, 10 + C) float targets (see the module docstring).
        l_coord: weight of the localisation of the responsible box (x, y, sqrt w, sqrt h with the linear
            size head; x, y and the w, h outputs against size_codes of the target with the log head).
        l_noobj: weight of the confidence of both boxes of cells without an object.
        l_class: weight of the class scores of cells with an object.
        score_loss: "smooth_l1" (GTI's GNetDet: every score regressed with smooth-L1) or "bce"
            (confidence and class scores by binary cross-entropy on the score itself, see
            score_bce; stronger gradients for badly wrong scores, same outputs and decoding).
            Ignored with score_head "logit".
        score_head: "linear" (GTI: the confidence and class outputs are the scores) or "logit"
            (the scores are sigmoid(score_scale * (output - score_offset)), computed on the host after the chip;
            conf and class terms become binary cross-entropy with logits, see logit_bce).
        score_offset, score_scale: offset b and scale k of the "logit" head (an output of 0 means
            p = sigmoid(-k b)).
        l_range: weight of a "range" term (0 = off): a squared hinge on the outputs no other term
            trains, which share the output layer's one calibrated cap with the trained ones
            (docs/quantization.md, "GNetDet on the chip"): the class outputs of cells without an
            object above the highest score any term asks for (b + LOGIT_MAX / k with the logit head,
            1 with the linear head), and the box outputs x, y, w, h of those cells' two slots and of
            an object cell's non-responsible slot above 1 (the largest box target). Measured:
            raccoon's empty-cell class output
            reached 4.4 and cards' free box outputs 7.6 while every trained output stayed below 1.4.
        box_slots: 2 (YOLOv1): in each object cell the slot whose box has the higher IoU with the
            target is responsible; 1: slot 1 is always responsible and slot 2's confidence is trained
            to 0 in every cell (its box by the range term only), so the two slots never trade the
            target. The output layout keeps both slots either way (the chip model does not change).
            Measured on cards (docs/results.md): the step-1 runs whose second slot had died on its
            own ended at half the training loss of those where both slots stayed alive.
        sqrt_tau: below this size (relative to the image) the sqrt of the size term is linear
            (safe_sqrt), bounding its gradient (linear size head).
        size_head, size_min: how the w, h outputs give box sizes (output_sizes): "linear" (GTI) or "log".
    Returns:
        dict of 0-d tensors: ``loc``, ``conf`` (responsible box toward its IoU with the target),
        ``noresp`` (the other box of an object cell toward 0), ``noobj``, ``cls``, ``range`` (only
        when l_range > 0) and ``total`` (their sum). Each is a per-image sum averaged over the batch.
    Raises:
        ValueError: shapes differ, the last dimension is < 11; ConfigError (a ValueError): score_head,
            score_scale or box_slots out of range (gnetmdk.models.gnetdet.head.check_score_head), size_head
            or size_min out of range (check_size_head).
    """
    check_score_head(score_head, score_scale, box_slots)
    check_size_head(size_head, size_min)
    if pred.shape != target.shape or pred.dim() != 4 or pred.shape[-1] < 11:
        raise ValueError(f"pred {tuple(pred.shape)} and target {tuple(target.shape)} must both be (N, S, S, 10 + C)")
    n, s = pred.shape[0], pred.shape[1]
    pred = pred.float()
    target = target.float()
    obj = target[..., 4] > 0                                   # (N, S, S)
    objf = obj.float()
    pboxes = torch.stack([pred[..., 0:5], pred[..., 5:10]], dim=3)    # (N, S, S, 2, 5)
    tbox = target[..., 0:4]                                           # (N, S, S, 4)

    with torch.no_grad():
        pxy = cell_boxes_to_xyxy(output_boxes(pboxes[..., :4], size_head, size_min), s)   # (N, S, S, 2, 4)
        txy = cell_boxes_to_xyxy(tbox, s).unsqueeze(3)                # (N, S, S, 1, 4)
        ious = paired_iou(pxy, txy)                                   # (N, S, S, 2)
        resp = (ious[..., 1] > ious[..., 0]).long()                   # responsible slot, ties -> 0
        if box_slots == 1:
            resp = torch.zeros_like(resp)
        resp_iou = ious.gather(3, resp.unsqueeze(-1)).squeeze(-1)
    # one-hot of the responsible slot (F.one_hot would check the index range on the host)
    rmask = torch.stack([1 - resp, resp], dim=-1).float()             # (N, S, S, 2)
    rbox = (pboxes * rmask.unsqueeze(-1)).sum(3)                      # (N, S, S, 5)
    obox = (pboxes * (1 - rmask).unsqueeze(-1)).sum(3)

    def sl1(a, b):
        return F.smooth_l1_loss(a, b, reduction="none", beta=1.0)

    loc = sl1(rbox[..., 0], tbox[..., 0]) + sl1(rbox[..., 1], tbox[..., 1])
    if size_head == "log":
        # the outputs are already log-space codes: compare them with the targets' codes
        twh = size_codes(tbox[..., 2:4], size_head, size_min)
        loc = loc + sl1(rbox[..., 2], twh[..., 0]) + sl1(rbox[..., 3], twh[..., 1])
    else:
        loc = (loc + sl1(safe_sqrt(rbox[..., 2], sqrt_tau), safe_sqrt(tbox[..., 2], sqrt_tau))
               + sl1(safe_sqrt(rbox[..., 3], sqrt_tau), safe_sqrt(tbox[..., 3], sqrt_tau)))
    if score_head == "logit":
        def score(a, b):
            return logit_bce(a, b, score_offset, score_scale)
    elif score_loss == "bce":
        score = score_bce
    elif score_loss == "smooth_l1":
        score = sl1
    else:
        raise ValueError(f"score_loss must be 'smooth_l1' or 'bce', not {score_loss!r}")
    conf = score(rbox[..., 4], resp_iou)
    noresp = score(obox[..., 4], torch.zeros_like(obox[..., 4]))
    noobj = score(pred[..., 4], torch.zeros_like(pred[..., 4])) + score(pred[..., 9], torch.zeros_like(pred[..., 9]))
    cls = score(pred[..., 10:], target[..., 10:]).sum(-1)

    def per_image(cell_term, mask):
        return (cell_term * mask).reshape(n, -1).sum(1).mean()

    terms = {
        "loc": l_coord * per_image(loc, objf),
        "conf": per_image(conf, objf),
        "noresp": per_image(noresp, objf),
        "noobj": l_noobj * per_image(noobj, 1.0 - objf),
        "cls": l_class * per_image(cls, objf),
    }
    if l_range > 0:
        # outputs no other term trains: the class outputs of empty cells (above the highest score any
        # term asks for), and the boxes of empty cells and of the non-responsible slot (above 1, the
        # largest box target)
        y_max = score_offset + LOGIT_MAX / score_scale if score_head == "logit" else 1.0

        def over(x, lim):
            return F.relu(x - lim).pow(2).sum(-1)

        free_cells = over(pred[..., 10:], y_max) + over(pred[..., 0:4], 1.0) + over(pred[..., 5:9], 1.0)
        free_slot = over(obox[..., 0:4], 1.0)
        terms["range"] = l_range * (per_image(free_cells, 1.0 - objf) + per_image(free_slot, objf))
    terms["total"] = sum(terms.values())
    return terms
