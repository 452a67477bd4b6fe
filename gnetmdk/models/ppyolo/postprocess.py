"""PP-YOLO inference post-processing: box decoding, scores, Matrix NMS.

Decoding follows PaddleDetection's ``YOLOBox`` (``ppdet/modeling/layers.py``, the ``yolo_box`` op)
after ``YOLOv3Head``'s IoU-aware rescoring (``ppdet/modeling/heads/yolo_head.py``):

* boxes: grid-sensitive decoding (:func:`~.head.decode_level_boxes`), clipped to the image;
  relative coordinates (0..1) instead of PaddleDetection's pixels;
* objectness ``o = sigmoid(obj)``; with the IoU-aware branch ``o = o**(1 - f) * sigmoid(iou)**f``
  (f = ``iou_aware_factor``, 0.4);
* a box whose ``o`` is below ``obj_thresh`` (``YOLOBox.conf_thresh``, 0.01) scores 0 for every class;
  otherwise ``score_c = o * sigmoid(cls_c)``.

Matrix NMS: Wang, Zhang, Kong, Li, Shen, "SOLOv2: Dynamic and Fast Instance Segmentation",
NeurIPS 2020, arXiv 2003.10152, section 3.3.3 (box form, as Paddle's ``matrix_nms`` op). Per class:
the candidates scoring above ``score_threshold`` are sorted by score (descending, ties by index),
the best ``nms_top_k`` kept (-1: all); for candidate i,

    decay_i = min(1, min_{j ranked before i} f(iou_ji, cmax_j)),  cmax_j = max_{k ranked before j} iou_kj

with ``f = (1 - iou) / (1 - cmax)`` (linear) or ``exp((cmax^2 - iou^2) * sigma)`` (gaussian);
pairs with ``cmax_j = 1`` are skipped in the linear form (a zero denominator; Paddle's kernel lets
the resulting inf/NaN fall out of its ``std::min``). The decayed score ``score_i * decay_i`` must
exceed ``post_threshold``. Survivors of all classes are sorted by decayed score and the best
``keep_top_k`` kept. IoUs: :func:`gnetmdk.evaluation.boxes.box_iou` on relative coordinates
(PaddleDetection's PP-YOLO config runs the op with ``normalized=False``, i.e. the "+1" pixel
convention on pixel boxes; it does not apply to relative boxes).
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch

from gnetmdk.evaluation.boxes import box_iou
from .head import decode_level_boxes, split_level

__all__ = ["decode_outputs", "matrix_nms", "matrix_nms_decay", "postprocess"]


def decode_outputs(outputs: Sequence[torch.Tensor], anchors: Sequence[Sequence[float]],
                   anchor_masks: Sequence[Sequence[int]], strides: Sequence[int], num_classes: int,
                   scale_x_y: float = 1.05, iou_aware: bool = False, iou_aware_factor: float = 0.4,
                   obj_thresh: float = 0.01) -> Tuple[torch.Tensor, torch.Tensor]:
    """Boxes and per-class scores of every anchor slot of every level.

    Args:
        outputs: raw head outputs, deepest first, ``(N, na_l * (5 + C [+ 1]), H_l, W_l)``.
        anchors, anchor_masks, strides: as :class:`~.loss.YOLOv3Loss` (pixels, deepest first).
        num_classes: C.
        scale_x_y: grid-sensitive factor (1.05).
        iou_aware, iou_aware_factor: IoU-aware rescoring (module docstring).
        obj_thresh: objectness threshold below which a box scores 0.

    Returns:
        ``boxes`` ``(N, P, 4)`` xyxy relative, clipped to [0, 1], and ``scores`` ``(N, P, C)`` in
        [0, 1], with ``P = sum_l na_l H_l W_l`` ordered by level, anchor, row, column; dtype of
        the outputs (float32 at least), no gradient.
    """
    all_boxes, all_scores = [], []
    with torch.no_grad():
        for out, mask, stride in zip(outputs, anchor_masks, strides):
            out = out.to(torch.promote_types(out.dtype, torch.float32))
            n = out.shape[0]
            parts = split_level(out, len(mask), num_classes, iou_aware)
            boxes = decode_level_boxes(parts, [anchors[i] for i in mask], stride, scale_x_y).clamp(0.0, 1.0)
            obj = torch.sigmoid(parts["obj"])
            if iou_aware:
                obj = obj.pow(1.0 - iou_aware_factor) * torch.sigmoid(parts["iou"]).pow(iou_aware_factor)
            scores = obj.unsqueeze(-1) * torch.sigmoid(parts["cls"])
            scores = scores * (obj >= obj_thresh).unsqueeze(-1).to(scores.dtype)
            all_boxes.append(boxes.reshape(n, -1, 4))
            all_scores.append(scores.reshape(n, -1, num_classes))
    return torch.cat(all_boxes, dim=1), torch.cat(all_scores, dim=1)


def matrix_nms_decay(boxes: torch.Tensor, scores: torch.Tensor, use_gaussian: bool = False,
                     gaussian_sigma: float = 2.0) -> torch.Tensor:
    """Matrix NMS decayed scores of one class's candidates, vectorised (formula in the module docstring).

    Args:
        boxes: ``(n, 4)`` xyxy, sorted by descending score.
        scores: ``(n,)`` scores in that order.
        use_gaussian, gaussian_sigma: decay function (linear by default).

    Returns:
        ``(n,)`` decayed scores ``scores * decay`` (decay in [0, 1]).
    """
    n = scores.shape[0]
    if n == 0:
        return scores.clone()
    iou = box_iou(boxes, boxes)                                                  # [j, i]
    before = torch.ones(n, n, dtype=torch.bool, device=boxes.device).triu(diagonal=1)   # j ranked before i
    iou = torch.where(before, iou, torch.zeros_like(iou))
    cmax = iou.max(dim=0).values[:, None]                                        # cmax_j, one per row j
    if use_gaussian:
        decay = torch.exp((cmax * cmax - iou * iou) * gaussian_sigma)
        usable = before
    else:
        den = 1.0 - cmax
        usable = before & (den > 0)
        decay = (1.0 - iou) / torch.where(den > 0, den, torch.ones_like(den))
    decay = torch.where(usable, decay, torch.ones_like(decay))
    return scores * decay.min(dim=0).values.clamp(max=1.0)


def matrix_nms(boxes: torch.Tensor, scores: torch.Tensor, score_threshold: float = 0.01,
               post_threshold: float = 0.01, nms_top_k: int = -1, keep_top_k: int = 100,
               use_gaussian: bool = False, gaussian_sigma: float = 2.0,
               background_label: int = -1) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-class Matrix NMS for one image (module docstring; PP-YOLO settings are the defaults).

    Args:
        boxes: ``(P, 4)`` xyxy (any unit, relative here).
        scores: ``(P, C)`` per-class scores.
        score_threshold: candidates need ``score > score_threshold``.
        post_threshold: survivors need ``decayed score > post_threshold``.
        nms_top_k: at most this many candidates per class (-1: all).
        keep_top_k: at most this many detections over all classes (-1: all).
        use_gaussian, gaussian_sigma: decay function.
        background_label: class index skipped (-1: none, PP-YOLO).

    Returns:
        ``(boxes (K, 4), scores (K,), labels (K,) int64)`` sorted by decayed score, descending (ties
        by class, then by rank within the class); same device and float dtype as the inputs.

    Raises:
        ValueError: ``boxes`` not ``(P, 4)`` or ``scores`` not ``(P, C)``.
    """
    if boxes.dim() != 2 or boxes.shape[1] != 4 or scores.dim() != 2 or scores.shape[0] != boxes.shape[0]:
        raise ValueError(f"boxes must be (P, 4) and scores (P, C), got {tuple(boxes.shape)} and {tuple(scores.shape)}")
    out_b, out_s, out_l = [], [], []
    present = (scores > score_threshold).any(dim=0).nonzero().flatten().tolist()
    for c in present:
        if c == background_label:
            continue
        sc = scores[:, c]
        idx = (sc > score_threshold).nonzero().flatten()
        order = torch.sort(sc[idx], descending=True, stable=True).indices
        if nms_top_k > -1:
            order = order[:nms_top_k]
        idx = idx[order]
        decayed = matrix_nms_decay(boxes[idx], sc[idx], use_gaussian, gaussian_sigma)
        keep = decayed > post_threshold
        out_b.append(boxes[idx][keep])
        out_s.append(decayed[keep])
        out_l.append(torch.full((int(keep.sum()),), c, dtype=torch.long, device=boxes.device))
    if not out_b:
        return boxes.new_zeros(0, 4), scores.new_zeros(0), torch.zeros(0, dtype=torch.long, device=boxes.device)
    b, s, lab = torch.cat(out_b), torch.cat(out_s), torch.cat(out_l)
    order = torch.sort(s, descending=True, stable=True).indices
    if keep_top_k > -1:
        order = order[:keep_top_k]
    return b[order], s[order], lab[order]


def postprocess(outputs: Sequence[torch.Tensor], anchors: Sequence[Sequence[float]],
                anchor_masks: Sequence[Sequence[int]], strides: Sequence[int], num_classes: int,
                scale_x_y: float = 1.05, iou_aware: bool = False, iou_aware_factor: float = 0.4,
                obj_thresh: float = 0.01, score_threshold: float = 0.01, post_threshold: float = 0.01,
                nms_top_k: int = -1, keep_top_k: int = 100, use_gaussian: bool = False,
                gaussian_sigma: float = 2.0) -> List[Dict[str, torch.Tensor]]:
    """Raw outputs -> per-image detections (:func:`decode_outputs`, then :func:`matrix_nms`).

    Returns:
        a list of N dicts on the CPU: ``boxes`` ``(K, 4)`` float32 xyxy relative to the image (0..1),
        ``scores`` ``(K,)`` float32 (decayed), ``labels`` ``(K,)`` int64 -- the contract of
        :func:`gnetmdk.models.gnetdet.decode.decode_gnetdet`.
    """
    boxes, scores = decode_outputs(outputs, anchors, anchor_masks, strides, num_classes, scale_x_y,
                                   iou_aware, iou_aware_factor, obj_thresh)
    result = []
    for i in range(boxes.shape[0]):
        b, s, lab = matrix_nms(boxes[i], scores[i], score_threshold, post_threshold, nms_top_k, keep_top_k,
                               use_gaussian, gaussian_sigma)
        result.append({"boxes": b.float().cpu(), "scores": s.float().cpu(), "labels": lab.long().cpu()})
    return result
