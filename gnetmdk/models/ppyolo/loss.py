"""YOLOv3 loss with PP-YOLO's additions, computed from padded ground-truth boxes.

Sources: PaddleDetection ``ppdet/modeling/losses/yolo_loss.py`` (``YOLOv3Loss``), ``iou_loss.py``
(``IouLoss``), ``iou_aware_loss.py`` (``IouAwareLoss``), and the target assignment of
``ppdet/data/transform/batch_operators.py`` (``Gt2YoloTarget``), here done on the predictions'
device inside the loss instead of in the data pipeline; PP-YOLO settings from
``configs/ppyolo/_base_/ppyolo_r50vd_dcn.yml``.

Targets: ``(N, M, 5)`` float, rows ``[class, x1, y1, x2, y2]``, coordinates relative to the image
(0..1); rows with class < 0 are padding and are ignored everywhere (so are boxes of zero width
or height, which ``Gt2YoloTarget`` skips). An optional sixth column is the ground truth's score
(PaddleDetection's ``gt_score``, < 1 after Mixup; ``gnetmdk.dataset.ppyolo_transforms.pad_targets``
writes it); without it every score is 1. Rows with score <= 0 are skipped entirely (``Gt2YoloTarget``
skips them in the assignment but PaddleDetection's ignore mask still sees their boxes). The image size is ``grid size x stride`` of the outputs.

Assignment (``Gt2YoloTarget``): each ground truth takes the anchor, over all anchors of all levels,
with the best *shape* IoU (boxes of the gt's and the anchor's width and height sharing a corner;
ties to the lowest anchor index), at the cell ``(floor(cy * H_l), floor(cx * W_l))`` holding its
centre on that anchor's level (clamped into the grid for a centre at exactly 1). With
``iou_thresh < 1`` it also takes every other anchor (of any level) whose shape IoU exceeds
``iou_thresh``, at its centre cell on that anchor's level. PP-YOLO's configs leave ``Gt2YoloTarget.iou_thresh`` at its
default 1.0, i.e. off, and so do we (default ``iou_thresh=1.0``). When several ground truths land on
the same (image, level, anchor, cell) slot, PaddleDetection's sequential writes decide: best-anchor
assignments overwrite (the last such row wins) and extra assignments only fill empty slots (the
first wins, never over a best-anchor one); we reproduce that order. Departure: the class target of
a slot is the one-hot class of its winning row (PaddleDetection also leaves the class bit of an
overwritten row set).

Terms (per level, each a sum over slots of one image, then the mean over the N images of the
batch, then summed over the levels, exactly PaddleDetection's ``sum([1, 2, 3, 4]).mean()``; the
loss of a batch is therefore the mean of per-image losses, and a batch of 8 split over 2 processes
of 4 averages to the same value). ``w_s = 2 - w * h`` (gt width and height relative to the image,
``Gt2YoloTarget``'s "scale" channel), positives are the assigned slots, and ``g`` is the
positive's ground-truth score (``tobj``; 1 without a score column). Every positive term below is
multiplied by ``g``, as PaddleDetection multiplies by ``tobj``:

* ``xy``: with ``scale_x_y != 1`` (PP-YOLO: 1.05), ``w_s * (|x - t_x*| + |y - t_y*|)`` on positives,
  x = ``scale_x_y * sigmoid(t_x) - (scale_x_y - 1) / 2`` and ``t_x* = cx * W_l - i`` the gt centre's
  offset in its cell. This is an **L1** term, as in PaddleDetection's ``yolov3_loss``: BCE is used
  only when ``scale_x_y == 1`` (then ``w_s * (BCE(sigmoid(t_x), t_x*) + BCE(sigmoid(t_y), t_y*))``),
  because the grid-sensitive x can leave [0, 1], where BCE is undefined.
* ``wh``: ``w_s * (|t_w - log(w W / a_w)| + |t_h - log(h H / a_h)|)`` on positives (W, H image pixels,
  ``a`` the anchor in pixels).
* ``obj``: ``g * BCE(sigmoid(o), 1)`` on positives plus ``BCE(sigmoid(o), 0)`` on negatives whose
  decoded predicted box has IoU <= ``ignore_thresh`` (0.7) with every ground truth of its image
  (larger overlaps are ignored; the IoU is not differentiated).
* ``cls``: ``sum_c BCE(sigmoid(p_c), onehot_c)`` on positives; with ``label_smooth`` the targets are
  ``1 - d`` / ``d``, ``d = min(1 / C, 1 / 40)``.
* ``iou``: ``iou_loss_weight * w_s * (1 - IoU^2)`` on positives (``IouLoss`` with ``loss_square=True``,
  weight 2.5, times PaddleDetection's ``tscale * tobj`` = ``w_s * g``), IoU between the decoded
  predicted box and the gt box, differentiated through the predicted box; ``1 - IoU`` with
  ``iou_loss_square=False``.
* ``iou_aware``: ``iou_aware_loss_weight * BCE(sigmoid(q), IoU.detach())`` on positives, q the IoU-aware
  logit (``IouAwareLoss``, weight 1.0, times ``tobj`` = g only -- no ``w_s``). Zero without ``iou_aware``.

The returned ``iou`` and ``iou_aware`` entries already include their weights, as PaddleDetection
logs them, and ``total`` is the sum of the six entries. IoUs come from
:func:`gnetmdk.evaluation.boxes.box_iou` (union without PaddleDetection's 1e-9 epsilon).
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch
import torch.nn.functional as F

from gnetmdk.evaluation.boxes import paired_iou
from .head import decode_level_boxes, grid_offsets, split_level

__all__ = ["YOLOv3Loss", "validate_anchors", "LOSS_KEYS"]

LOSS_KEYS = ("xy", "wh", "obj", "cls", "iou", "iou_aware", "total")


def validate_anchors(anchors: Sequence[Sequence[float]], anchor_masks: Sequence[Sequence[int]],
                     num_levels: int) -> Tuple[List[List[float]], List[List[int]]]:
    """Check anchors (w, h pixel pairs) and masks (per level, deepest first) and return plain lists.

    Raises:
        ValueError: a mask count different from ``num_levels``, an empty mask, a mask index out of
            range or repeated, or an anchor that is not two positive numbers.
    """
    anchors_l = []
    for k, an in enumerate(anchors):
        if len(an) != 2 or not all(float(v) > 0 for v in an):
            raise ValueError(f"anchor {k} must be a (width, height) pair of positive pixels, got {an!r}")
        anchors_l.append([float(an[0]), float(an[1])])
    if len(anchor_masks) != num_levels:
        raise ValueError(f"anchor_masks has {len(anchor_masks)} masks but the model has {num_levels} output levels "
                         f"(one mask per level, deepest first); make them match")
    masks_l = [[int(i) for i in m] for m in anchor_masks]
    flat = [i for m in masks_l for i in m]
    if any(len(m) == 0 for m in masks_l):
        raise ValueError(f"every anchor mask needs at least one anchor index, got {masks_l}")
    bad = [i for i in flat if not 0 <= i < len(anchors_l)]
    if bad:
        raise ValueError(f"anchor_masks {masks_l} index anchors {bad}, but there are {len(anchors_l)} anchors "
                         f"(indices 0..{len(anchors_l) - 1})")
    if len(set(flat)) != len(flat):
        raise ValueError(f"anchor_masks {masks_l} use an anchor twice; each anchor belongs to one level")
    return anchors_l, masks_l


def _bce_logits(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(logits, target, reduction="none")


class YOLOv3Loss:
    """The PP-YOLO / YOLOv3 loss (module docstring for every term and its source).

    Args:
        anchors: (w, h) pairs in input pixels.
        anchor_masks: anchor indices per level, deepest first.
        strides: stride (pixels) per level, deepest first (PaddleDetection ``downsample``: 32, 16, 8).
        num_classes: C.
        ignore_thresh: objectness-ignore IoU (0.7).
        scale_x_y: grid-sensitive factor (1.05; 1 gives YOLOv3's BCE on x, y).
        label_smooth: class label smoothing (off in PP-YOLO).
        iou_loss_weight: weight of the IoU term (2.5); 0 drops the term.
        iou_loss_square: ``1 - IoU^2`` (True, PP-YOLO) or ``1 - IoU``.
        iou_aware: the outputs carry IoU-aware channels; adds the ``iou_aware`` term.
        iou_aware_loss_weight: its weight (1.0).
        iou_thresh: extra anchors above this shape IoU become positives too; 1.0 (default) is off.

    Raises:
        ValueError: bad anchors / masks (:func:`validate_anchors`), strides not one per level.
    """

    def __init__(self, anchors: Sequence[Sequence[float]], anchor_masks: Sequence[Sequence[int]],
                 strides: Sequence[int], num_classes: int, ignore_thresh: float = 0.7, scale_x_y: float = 1.05,
                 label_smooth: bool = False, iou_loss_weight: float = 2.5, iou_loss_square: bool = True,
                 iou_aware: bool = False, iou_aware_loss_weight: float = 1.0, iou_thresh: float = 1.0):
        self.anchors, self.anchor_masks = validate_anchors(anchors, anchor_masks, len(strides))
        self.strides = [int(s) for s in strides]
        if num_classes < 1:
            raise ValueError(f"num_classes must be >= 1, got {num_classes}")
        self.num_classes = int(num_classes)
        self.ignore_thresh, self.scale_x_y = float(ignore_thresh), float(scale_x_y)
        self.label_smooth, self.iou_loss_weight = bool(label_smooth), float(iou_loss_weight)
        self.iou_loss_square, self.iou_aware = bool(iou_loss_square), bool(iou_aware)
        self.iou_aware_loss_weight, self.iou_thresh = float(iou_aware_loss_weight), float(iou_thresh)

    # ------------------------------------------------------------------ helpers
    def image_size(self, outputs: Sequence[torch.Tensor]) -> Tuple[int, int]:
        """``(H, W)`` of the input image in pixels, ``grid x stride`` of the outputs.

        Raises:
            ValueError: a wrong number of levels or levels that imply different image sizes.
        """
        if len(outputs) != len(self.strides):
            raise ValueError(f"expected {len(self.strides)} output levels (deepest first), got {len(outputs)}")
        sizes = {(o.shape[2] * s, o.shape[3] * s) for o, s in zip(outputs, self.strides)}
        if len(sizes) != 1:
            raise ValueError(f"output grids {[tuple(o.shape[2:]) for o in outputs]} at strides {self.strides} "
                             f"imply different image sizes {sorted(sizes)}; pass the levels deepest first")
        return sizes.pop()

    def assign(self, targets: torch.Tensor, grid_sizes: Sequence[Tuple[int, int]],
               image_size: Tuple[int, int]) -> List[Dict[str, torch.Tensor]]:
        """Positive slots per level (assignment rules in the module docstring).

        Args:
            targets: ``(N, M, 5)`` float ``[class, x1, y1, x2, y2]`` relative (class < 0 = padding),
                or ``(N, M, 6)`` with a score column (score <= 0 = skipped).
            grid_sizes: ``(H_l, W_l)`` per level, deepest first.
            image_size: ``(H, W)`` pixels.

        Returns:
            per level a dict of int64 ``(P_l,)`` tensors: ``b`` image, ``m`` target row, ``a`` anchor
            within the level's mask, ``gj`` row and ``gi`` column of the cell; one entry per
            positive slot, sorted by image.
        """
        n, m_rows = targets.shape[:2]
        dev, dt = targets.device, targets.dtype
        img_h, img_w = image_size
        cls, x1, y1, x2, y2 = targets.unbind(-1)[:5]
        gw, gh = x2 - x1, y2 - y1
        valid = (cls >= 0) & (gw > 0) & (gh > 0)
        if targets.shape[-1] == 6:
            valid &= targets[..., 5] > 0
        cx, cy = 0.5 * (x1 + x2), 0.5 * (y1 + y2)
        an = torch.tensor(self.anchors, dtype=dt, device=dev)
        aw, ah = an[:, 0] / img_w, an[:, 1] / img_h
        inter = torch.minimum(gw[..., None], aw) * torch.minimum(gh[..., None], ah)     # (N, M, A)
        shape_iou = inter / (gw[..., None] * gh[..., None] + aw * ah - inter)
        best = shape_iou.argmax(-1) if an.shape[0] else torch.zeros_like(cls, dtype=torch.long)
        result = []
        for mask, (hl, wl) in zip(self.anchor_masks, grid_sizes):
            na = len(mask)
            mask_t = torch.tensor(mask, dtype=torch.long, device=dev)
            is_best = valid[..., None] & (best[..., None] == mask_t)                      # (N, M, na)
            cand = is_best
            if self.iou_thresh < 1.0:
                cand = is_best | (valid[..., None] & ~is_best & (shape_iou[..., mask_t] > self.iou_thresh))
            b, m, a = cand.nonzero(as_tuple=True)
            gi = torch.floor(cx[b, m] * wl).long().clamp(0, wl - 1)
            gj = torch.floor(cy[b, m] * hl).long().clamp(0, hl - 1)
            prio = torch.where(is_best[b, m, a], m_rows + m, m_rows - 1 - m)
            slot = ((b * na + a) * hl + gj) * wl + gi
            top = torch.full((n * na * hl * wl,), -1, dtype=torch.long, device=dev)
            top = top.scatter_reduce(0, slot, prio, reduce="amax", include_self=True)
            win = prio == top[slot]
            result.append({"b": b[win], "m": m[win], "a": a[win], "gj": gj[win], "gi": gi[win]})
        return result

    # ------------------------------------------------------------------ loss
    def __call__(self, outputs: Sequence[torch.Tensor], targets: torch.Tensor) -> Dict[str, torch.Tensor]:
        """Loss terms for raw head outputs and padded targets.

        Args:
            outputs: per level, deepest first, ``(N, na_l * (5 + C [+ 1]), H_l, W_l)`` raw outputs
                (float16/32/64; computed in float32 or float64).
            targets: ``(N, M, 5)`` float ``[class, x1, y1, x2, y2]`` relative, class -1 for padding,
                or ``(N, M, 6)`` with the ground-truth score last; moved to the outputs' device.

        Returns:
            dict of 0-d tensors ``xy, wh, obj, cls, iou, iou_aware, total`` (``iou`` and ``iou_aware``
            weighted; ``total`` their sum), each the batch mean of per-image sums.

        Raises:
            ValueError: wrong target shape or batch size, wrong level count or channel count.
        """
        img_h, img_w = self.image_size(outputs)
        n = outputs[0].shape[0]
        dt = torch.promote_types(outputs[0].dtype, torch.float32)
        dev = outputs[0].device
        if targets.dim() != 3 or targets.shape[-1] not in (5, 6) or targets.shape[0] != n:
            raise ValueError(f"targets must have shape (N={n}, M, 5) with rows [class, x1, y1, x2, y2] "
                             f"(or (N, M, 6) with a score column), got {tuple(targets.shape)}")
        targets = targets.to(device=dev, dtype=dt)
        assigned = self.assign(targets, [tuple(o.shape[2:]) for o in outputs], (img_h, img_w))
        cls_t, gx1, gy1, gx2, gy2 = targets.unbind(-1)[:5]
        gw, gh = gx2 - gx1, gy2 - gy1
        gcx, gcy = 0.5 * (gx1 + gx2), 0.5 * (gy1 + gy2)
        score = targets[..., 5] if targets.shape[-1] == 6 else torch.ones_like(cls_t)
        valid = (cls_t >= 0) & (gw > 0) & (gh > 0) & (score > 0)
        zero = torch.zeros((), dtype=dt, device=dev)
        terms = {k: zero for k in LOSS_KEYS[:-1]}
        s = self.scale_x_y
        for out, mask, stride, pos in zip(outputs, self.anchor_masks, self.strides, assigned):
            out = out.to(dt)
            na, hl, wl = len(mask), out.shape[2], out.shape[3]
            parts = split_level(out, na, self.num_classes, self.iou_aware)
            anc = torch.tensor([self.anchors[i] for i in mask], dtype=dt, device=dev)    # (na, 2) pixels
            b, m, a, gj, gi = pos["b"], pos["m"], pos["a"], pos["gj"], pos["gi"]

            # ---- positives: x, y, w, h, class, IoU terms
            g = score[b, m]
            w_pos = (2.0 - gw[b, m] * gh[b, m]) * g                                 # tscale * tobj
            ptx, pty = parts["tx"][b, a, gj, gi], parts["ty"][b, a, gj, gi]
            ptw, pth = parts["tw"][b, a, gj, gi], parts["th"][b, a, gj, gi]
            tx_t, ty_t = gcx[b, m] * wl - gi.to(dt), gcy[b, m] * hl - gj.to(dt)
            tw_t = torch.log(gw[b, m] * img_w / anc[a, 0])
            th_t = torch.log(gh[b, m] * img_h / anc[a, 1])
            px, py = grid_offsets(ptx, s), grid_offsets(pty, s)
            if abs(s - 1.0) < 1e-10:
                lxy = _bce_logits(ptx, tx_t) + _bce_logits(pty, ty_t)
            else:
                lxy = (px - tx_t).abs() + (py - ty_t).abs()
            terms["xy"] = terms["xy"] + (w_pos * lxy).sum() / n
            terms["wh"] = terms["wh"] + (w_pos * ((ptw - tw_t).abs() + (pth - th_t).abs())).sum() / n

            tcls = F.one_hot(cls_t[b, m].long(), self.num_classes).to(dt)
            if self.label_smooth:
                d = min(1.0 / self.num_classes, 1.0 / 40.0)
                tcls = tcls * (1.0 - d) + (1.0 - tcls) * d
            lcls = _bce_logits(parts["cls"][b, a, gj, gi], tcls).sum(dim=-1)
            terms["cls"] = terms["cls"] + (g * lcls).sum() / n

            if self.iou_loss_weight != 0.0 or self.iou_aware:
                pcx, pcy = (gi.to(dt) + px) / wl, (gj.to(dt) + py) / hl
                pw, ph = torch.exp(ptw) * anc[a, 0] / img_w, torch.exp(pth) * anc[a, 1] / img_h
                pbox = torch.stack([pcx - 0.5 * pw, pcy - 0.5 * ph, pcx + 0.5 * pw, pcy + 0.5 * ph], dim=-1)
                iou = paired_iou(pbox, targets[b, m, 1:5])
                if self.iou_loss_weight != 0.0:
                    liou = 1.0 - iou * iou if self.iou_loss_square else 1.0 - iou
                    terms["iou"] = terms["iou"] + self.iou_loss_weight * (w_pos * liou).sum() / n
                if self.iou_aware:
                    lia = g * _bce_logits(parts["iou"][b, a, gj, gi], iou.detach())
                    terms["iou_aware"] = terms["iou_aware"] + self.iou_aware_loss_weight * lia.sum() / n

            # ---- objectness over every slot, negatives near a ground truth ignored
            tobj = torch.zeros_like(parts["obj"])
            tobj[b, a, gj, gi] = 1.0
            weight = torch.ones_like(tobj)
            weight[b, a, gj, gi] = g
            with torch.no_grad():
                boxes = decode_level_boxes(parts, [self.anchors[i] for i in mask], stride, s).reshape(n, -1, 4)
                # every predicted box against every ground truth of its image at once (padding rows -1)
                ious = paired_iou(boxes[:, :, None, :], targets[:, None, :, 1:5])          # (N, P, M)
                iou_max = ious.masked_fill(~valid[:, None, :], -1.0).amax(dim=2).clamp(min=0) \
                    if targets.shape[1] else torch.zeros(n, boxes.shape[1], dtype=dt, device=dev)
                keep = (iou_max.view_as(tobj) <= self.ignore_thresh) | (tobj > 0)
            terms["obj"] = terms["obj"] + (_bce_logits(parts["obj"], tobj) * keep.to(dt) * weight).sum() / n

        terms["total"] = sum(terms[k] for k in LOSS_KEYS[:-1])
        return terms
