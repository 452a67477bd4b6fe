"""Axis-aligned box operations in plain torch (no torchvision).

All boxes are ``(x1, y1, x2, y2)`` ("xyxy") with ``x1 <= x2`` and ``y1 <= y2``. Coordinates are
continuous: pixels, or image-normalised values in ``[0, 1]`` -- the functions only need both inputs
to use the same unit. The area of a box is ``(x2 - x1) * (y2 - y1)`` with no "+1" (the PASCAL VOC
devkit adds 1 because it treats coordinates as inclusive integer pixel indices; this toolkit does
not, see :mod:`gnetmdk.evaluation.voc`).

The NMS here is the classic greedy algorithm used by detectors since the R-CNN / YOLO line of work:
take the highest-scoring remaining box, keep it, drop every remaining box that overlaps it by more
than the threshold, repeat.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["box_area", "box_iou", "paired_iou", "nms", "batched_nms"]


def _check_boxes(boxes: torch.Tensor, name: str) -> torch.Tensor:
    if not isinstance(boxes, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(boxes).__name__}")
    if boxes.dim() != 2 or boxes.shape[1] != 4:
        raise ValueError(f"{name} must have shape (N, 4) in xyxy order, got {tuple(boxes.shape)}")
    return boxes


def _check_vector(v: torch.Tensor, n: int, name: str) -> torch.Tensor:
    if not isinstance(v, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(v).__name__}")
    if v.dim() != 1 or v.shape[0] != n:
        raise ValueError(f"{name} must have shape ({n},) to match the boxes, got {tuple(v.shape)}")
    return v


def box_area(boxes: torch.Tensor) -> torch.Tensor:
    """Area of each box, ``(x2 - x1) * (y2 - y1)``, clamped at 0 for inverted boxes.

    Args:
        boxes: ``(N, 4)`` float tensor, xyxy, any unit (pixels or normalised).

    Returns:
        ``(N,)`` tensor of areas in squared input units, same dtype as ``boxes``.

    Raises:
        ValueError: if ``boxes`` is not shaped ``(N, 4)``.
    """
    _check_boxes(boxes, "boxes")
    w = (boxes[:, 2] - boxes[:, 0]).clamp(min=0)
    h = (boxes[:, 3] - boxes[:, 1]).clamp(min=0)
    return w * h


def paired_iou(a: torch.Tensor, b: torch.Tensor, min_union: float = 1e-12) -> torch.Tensor:
    """Elementwise intersection-over-union of boxes that broadcast against each other.

    The same formula as :func:`box_iou` (Jaccard index, continuous coordinates, no "+1"), for pairs
    instead of all combinations: a box of ``a`` with the box of ``b`` at the same (broadcast) index;
    usable inside losses (differentiable, nothing read back to the host).

    Args:
        a, b: ``(..., 4)`` float tensors, xyxy, broadcastable shapes, the same unit.
        min_union: the union is clamped below at this value, so two degenerate boxes give 0.
    Returns:
        ``(...)`` tensor of IoUs in ``[0, 1]``.
    """
    lt = torch.maximum(a[..., :2], b[..., :2])
    rb = torch.minimum(a[..., 2:], b[..., 2:])
    wh = (rb - lt).clamp(min=0)
    inter = wh[..., 0] * wh[..., 1]
    area_a = (a[..., 2] - a[..., 0]).clamp(min=0) * (a[..., 3] - a[..., 1]).clamp(min=0)
    area_b = (b[..., 2] - b[..., 0]).clamp(min=0) * (b[..., 3] - b[..., 1]).clamp(min=0)
    return inter / (area_a + area_b - inter).clamp(min=min_union)


def box_iou(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Pairwise intersection-over-union of two sets of boxes.

    ``IoU(p, q) = area(p & q) / (area(p) + area(q) - area(p & q))`` (Jaccard index, as used by the
    PASCAL VOC criterion, Everingham et al., IJCV 2010), computed on continuous coordinates
    without the VOC devkit's "+1" pixel convention.

    Args:
        a: ``(N, 4)`` float tensor, xyxy, pixels or normalised coordinates.
        b: ``(M, 4)`` float tensor, xyxy, same unit as ``a``.

    Returns:
        ``(N, M)`` tensor (floating dtype of the promoted inputs) with values in ``[0, 1]``.
        A pair whose union has zero area (two degenerate boxes) gets IoU 0.

    Raises:
        TypeError: if an input is not a tensor.
        ValueError: if ``a`` or ``b`` is not shaped ``(K, 4)``.
    """
    _check_boxes(a, "a")
    _check_boxes(b, "b")
    dtype = torch.promote_types(a.dtype, b.dtype)
    if not dtype.is_floating_point:
        dtype = torch.get_default_dtype()
    a = a.to(dtype)
    b = b.to(dtype=dtype, device=a.device)

    area_a = box_area(a)  # (N,)
    area_b = box_area(b)  # (M,)
    top_left = torch.maximum(a[:, None, :2], b[None, :, :2])  # (N, M, 2)
    bottom_right = torch.minimum(a[:, None, 2:], b[None, :, 2:])  # (N, M, 2)
    wh = (bottom_right - top_left).clamp(min=0)
    inter = wh[..., 0] * wh[..., 1]  # (N, M)
    union = area_a[:, None] + area_b[None, :] - inter
    safe_union = torch.where(union > 0, union, torch.ones_like(union))
    return torch.where(union > 0, inter / safe_union, torch.zeros_like(inter))


def nms(boxes: torch.Tensor, scores: torch.Tensor, iou_thresh: float) -> torch.Tensor:
    """Greedy non-maximum suppression.

    Boxes are visited in order of descending score (equal scores: lower index first, i.e. a
    stable sort). A visited box that has not been suppressed is kept, and every later box whose
    IoU with it is strictly greater than ``iou_thresh`` is suppressed. A suppressed box
    suppresses nothing, so in a chain A > B > C where A overlaps B and B overlaps C but A does
    not overlap C, both A and C survive.

    Args:
        boxes: ``(N, 4)`` float tensor, xyxy, pixels or normalised coordinates.
        scores: ``(N,)`` float tensor of confidences (higher is better).
        iou_thresh: suppression threshold in ``[0, 1]``; overlap ``> iou_thresh`` suppresses.

    Returns:
        ``torch.long`` tensor of shape ``(K,)`` with the indices (into ``boxes``) of the kept
        boxes, sorted by descending score, ties by ascending index. Empty input gives an empty
        long tensor.

    Raises:
        TypeError: if ``boxes`` or ``scores`` is not a tensor.
        ValueError: if ``boxes`` is not ``(N, 4)`` or ``scores`` is not ``(N,)``.
    """
    _check_boxes(boxes, "boxes")
    _check_vector(scores, boxes.shape[0], "scores")
    n = boxes.shape[0]
    if n == 0:
        return torch.empty(0, dtype=torch.long, device=boxes.device)

    order = torch.sort(scores, descending=True, stable=True).indices
    iou = box_iou(boxes[order], boxes[order])  # (N, N) in visiting order
    return order[greedy_keep(iou > iou_thresh).to(order.device)]


def greedy_keep(suppresses: torch.Tensor) -> torch.Tensor:
    """The greedy pass of NMS over boxes already sorted by descending score.

    Args:
        suppresses: ``(N, N)`` bool; ``suppresses[i, j]`` is whether box ``i``, when kept, drops box ``j``
            (only ``j > i`` is read in effect: earlier boxes are decided before ``i``).

    Returns:
        ``torch.long`` ``(K,)`` positions of the kept boxes, ascending (on the CPU). A dropped box drops
        nothing (see :func:`nms`).
    """
    # The loop runs over numpy's bool arrays rather than torch's: the same pass, 3-13 times faster for
    # 50-1000 boxes (a torch element read and an in-place or cost microseconds each), which made NMS most
    # of an evaluation's decoding time (benchmarks/bench_nms.py)
    overlaps = suppresses.cpu().numpy()
    suppressed = np.zeros(overlaps.shape[0], dtype=bool)
    keep = []
    for i in range(overlaps.shape[0]):
        if suppressed[i]:
            continue
        keep.append(i)
        np.logical_or(suppressed, overlaps[i], out=suppressed)
    return torch.tensor(keep, dtype=torch.long)


def batched_nms(
    boxes: torch.Tensor, scores: torch.Tensor, labels: torch.Tensor, iou_thresh: float
) -> torch.Tensor:
    """Per-class greedy NMS: boxes only suppress boxes that carry the same label.

    Implemented with the coordinate-offset trick: each box is shifted by ``label * span`` where
    ``span`` exceeds the extent of all boxes, so boxes of different classes can never overlap,
    and a single :func:`nms` pass then acts independently per class.

    Args:
        boxes: ``(N, 4)`` float tensor, xyxy, pixels or normalised coordinates.
        scores: ``(N,)`` float tensor of confidences.
        labels: ``(N,)`` integer tensor of class indices (any non-negative or negative ints).
        iou_thresh: suppression threshold; overlap ``> iou_thresh`` suppresses.

    Returns:
        ``torch.long`` tensor ``(K,)`` of kept indices into ``boxes``, sorted by descending score
        over all classes (ties: lower index first). Empty input gives an empty long tensor.

    Raises:
        TypeError: if an input is not a tensor.
        ValueError: if ``boxes`` is not ``(N, 4)`` or ``scores``/``labels`` are not ``(N,)``.
    """
    _check_boxes(boxes, "boxes")
    n = boxes.shape[0]
    _check_vector(scores, n, "scores")
    _check_vector(labels, n, "labels")
    if n == 0:
        return torch.empty(0, dtype=torch.long, device=boxes.device)
    work = boxes if boxes.dtype == torch.float64 else boxes.to(torch.float64)
    span = (work.max() - work.min()) + 1.0
    labels_f = labels.to(device=work.device, dtype=torch.float64)
    labels_f = labels_f - labels_f.min()  # keep offsets small and non-negative
    shifted = work + (labels_f * span)[:, None]
    return nms(shifted, scores, iou_thresh)
