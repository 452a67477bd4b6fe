"""PASCAL VOC detection evaluation: AP at IoU 0.5 with all-point interpolation.

This follows the protocol of the PASCAL VOC challenge (Everingham et al., "The PASCAL Visual
Object Classes (VOC) Challenge", IJCV 88(2), 2010, and the VOC2010+ devkit ``VOCevaldet`` /
``VOCap``), with two deliberate, documented differences from the devkit code:

* Overlap is computed on continuous coordinates, ``(x2 - x1) * (y2 - y1)``, without the devkit's
  "+1" (the devkit treats box corners as inclusive integer pixel indices). For large boxes the
  difference is negligible; for boxes a few pixels wide it is not, so numbers here can differ
  slightly from the official devkit.
* A detection matches when its best IoU is ``>= iou_thresh``; the devkit tests ``ovmax > 0.5``.
  The two only differ for an IoU of exactly the threshold.

Matching, per class: all detections of the class over the whole dataset are sorted by score,
descending (ties: image order, then order within the image). Each detection takes the ground
truth (same image, same class) with the highest IoU. If that IoU reaches the threshold and the
ground truth is "difficult", the detection is ignored (neither TP nor FP). Otherwise, if the
ground truth is not yet matched the detection is a TP and the ground truth becomes matched; if it
was already matched (a duplicate) or the IoU is below the threshold, it is a FP. Difficult ground
truths do not count toward the number of positives.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np

__all__ = ["voc_ap", "evaluate_detections", "format_ap_table"]


def voc_ap(recall: np.ndarray, precision: np.ndarray) -> float:
    """All-point interpolated average precision (VOC2010+ ``VOCap``).

    Sentinels are added (recall ``0`` ... ``1``, precision ``0`` ... ``0``), precision is replaced
    by its running maximum taken from the right (so it never increases with recall), and the area
    is the sum of ``(r[i+1] - r[i]) * p[i+1]`` over the points where recall changes.
    Source: PASCAL VOC devkit, Everingham et al. 2010.

    Args:
        recall: 1-D float array, non-decreasing, values in ``[0, 1]``; one entry per ranked
            detection (cumulative TP / number of positives).
        precision: 1-D float array, same length (cumulative TP / (TP + FP)).

    Returns:
        The AP as a Python float in ``[0, 1]``. Empty inputs give 0.0.

    Raises:
        ValueError: if the inputs are not 1-D or their lengths differ.
    """
    rec = np.asarray(recall, dtype=np.float64)
    prec = np.asarray(precision, dtype=np.float64)
    if rec.ndim != 1 or prec.ndim != 1:
        raise ValueError(
            f"recall and precision must be 1-D, got shapes {rec.shape} and {prec.shape}"
        )
    if rec.shape != prec.shape:
        raise ValueError(
            f"recall and precision must have the same length, got {rec.size} and {prec.size}"
        )
    mrec = np.concatenate(([0.0], rec, [1.0]))
    mpre = np.concatenate(([0.0], prec, [0.0]))
    # precision envelope: p[i] = max(p[i:])
    mpre = np.maximum.accumulate(mpre[::-1])[::-1]
    changes = np.nonzero(mrec[1:] != mrec[:-1])[0]
    return float(np.sum((mrec[changes + 1] - mrec[changes]) * mpre[changes + 1]))


def _to_numpy(x: Any) -> np.ndarray:
    """Tensor or array-like -> numpy array (detached, on CPU)."""
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # torch.Tensor without importing torch
        x = x.detach().cpu().numpy()
    return np.asarray(x)


def _boxes(x: Any, where: str) -> np.ndarray:
    b = _to_numpy(x).astype(np.float64, copy=False)
    if b.size == 0:
        return b.reshape(0, 4)
    if b.ndim != 2 or b.shape[1] != 4:
        raise ValueError(f"{where}: boxes must have shape (K, 4) in xyxy pixels, got {b.shape}")
    return b


def _vector(x: Any, n: int, where: str, dtype) -> np.ndarray:
    v = _to_numpy(x)
    if v.size == 0 and n == 0:
        return v.reshape(0).astype(dtype)
    v = v.reshape(-1) if v.ndim == 0 else v
    if v.ndim != 1 or v.shape[0] != n:
        raise ValueError(f"{where}: expected shape ({n},) to match the boxes, got {v.shape}")
    return v.astype(dtype, copy=False)


def _labels(x: Any, n: int, num_classes: int, where: str) -> np.ndarray:
    lab = _vector(x, n, where + " labels", np.float64)
    if n and (np.any(lab != np.round(lab)) or lab.min() < 0 or lab.max() >= num_classes):
        raise ValueError(
            f"{where}: labels must be integers in [0, {num_classes}), got {lab.tolist()}"
        )
    return lab.astype(np.int64)


def _get(d: Mapping, key: str, where: str):
    try:
        return d[key]
    except (KeyError, TypeError):
        raise ValueError(f"{where}: missing required key {key!r}") from None


def _iou_one_to_many(box: np.ndarray, gts: np.ndarray) -> np.ndarray:
    """IoU of one xyxy box with ``(G, 4)`` boxes (gnetmdk.evaluation.boxes.box_iou, in float64)."""
    import torch
    from .boxes import box_iou
    return box_iou(torch.from_numpy(np.asarray(box, np.float64).reshape(1, 4)),
                   torch.from_numpy(np.asarray(gts, np.float64))).numpy()[0]


def evaluate_detections(
    detections: Sequence[Mapping[str, Any]],
    ground_truths: Sequence[Mapping[str, Any]],
    num_classes: int,
    iou_thresh: float = 0.5,
    return_curves: bool = False,
) -> dict:
    """PASCAL VOC mAP over a dataset (IoU 0.5, all-point interpolated AP, VOC2010+).

    Protocol of the PASCAL VOC devkit (Everingham et al. 2010); see the module docstring for the
    matching rules and the two documented differences (no "+1" in areas, ``IoU >= thresh``).

    Args:
        detections: one dict per image with
            ``"boxes"``: float ``(K, 4)`` xyxy in pixels,
            ``"scores"``: float ``(K,)``,
            ``"labels"``: int ``(K,)`` in ``[0, num_classes)``.
            Values may be numpy arrays, torch tensors (any device) or lists.
        ground_truths: one dict per image, same order as ``detections``, with
            ``"boxes"``: float ``(G, 4)`` xyxy in pixels (same image coordinates as detections),
            ``"labels"``: int ``(G,)`` in ``[0, num_classes)``,
            ``"difficult"``: optional bool ``(G,)`` (absent = all False).
        num_classes: number of classes ``C``.
        iou_thresh: minimum IoU for a match (inclusive).
        return_curves: also return the precision/recall arrays each AP was computed from
            (for plots: gnetmdk.evaluation.plots.plot_pr_curves). Nothing else changes.

    Returns:
        dict with
            ``"ap"``: list of ``C`` floats, per-class AP; ``nan`` for a class with no
            (non-difficult) ground truth,
            ``"map"``: float, mean AP over the classes that have ground truth (``nan`` if none),
            ``"num_gt"``: list of ``C`` ints, non-difficult ground truths per class,
            ``"num_det"``: list of ``C`` ints, detections per class,
            with ``return_curves`` also
            ``"curves"``: ``{class index: (recall, precision)}``, 1-D float64 arrays of equal length
            (one entry per ranked detection of the class that was not ignored, highest score first),
            exactly the arrays passed to :func:`voc_ap` for that class, so
            ``voc_ap(*result["curves"][c]) == result["ap"][c]``; classes without (non-difficult)
            ground truth, whose AP is ``nan``, have no entry.

    Raises:
        ValueError: if the two lists differ in length, a dict lacks a required key, boxes are not
            shaped ``(K, 4)``, a per-box array does not match its boxes, a label is outside
            ``[0, num_classes)``, or ``num_classes < 1``.
    """
    if len(detections) != len(ground_truths):
        raise ValueError(
            f"detections and ground_truths must have one entry per image and the same length, "
            f"got {len(detections)} and {len(ground_truths)}"
        )
    if int(num_classes) != num_classes or num_classes < 1:
        raise ValueError(f"num_classes must be a positive integer, got {num_classes!r}")
    num_classes = int(num_classes)

    # --- normalise inputs -------------------------------------------------------------------
    gt_boxes, gt_labels, gt_difficult = [], [], []
    for i, gt in enumerate(ground_truths):
        where = f"ground_truths[{i}]"
        b = _boxes(_get(gt, "boxes", where), where)
        gt_boxes.append(b)
        gt_labels.append(_labels(_get(gt, "labels", where), len(b), num_classes, where))
        diff = gt.get("difficult") if isinstance(gt, Mapping) else None
        if diff is None:
            gt_difficult.append(np.zeros(len(b), dtype=bool))
        else:
            gt_difficult.append(_vector(diff, len(b), where + " difficult", bool))

    det_img, det_boxes, det_scores, det_labels = [], [], [], []
    for i, det in enumerate(detections):
        where = f"detections[{i}]"
        b = _boxes(_get(det, "boxes", where), where)
        s = _vector(_get(det, "scores", where), len(b), where + " scores", np.float64)
        lab = _labels(_get(det, "labels", where), len(b), num_classes, where)
        det_img.append(np.full(len(b), i, dtype=np.int64))
        det_boxes.append(b)
        det_scores.append(s)
        det_labels.append(lab)
    if detections:
        all_img = np.concatenate(det_img)
        all_boxes = np.concatenate(det_boxes).reshape(-1, 4)
        all_scores = np.concatenate(det_scores)
        all_labels = np.concatenate(det_labels)
    else:
        all_img = np.zeros(0, np.int64)
        all_boxes = np.zeros((0, 4))
        all_scores = np.zeros(0)
        all_labels = np.zeros(0, np.int64)

    # --- per-class matching -----------------------------------------------------------------
    aps: list[float] = []
    curves: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    num_gt: list[int] = []
    num_det: list[int] = []
    for c in range(num_classes):
        # ground truths of class c, per image
        cls_gt = []
        npos = 0
        for b, lab, diff in zip(gt_boxes, gt_labels, gt_difficult):
            m = lab == c
            d = diff[m]
            cls_gt.append((b[m], d, np.zeros(int(m.sum()), dtype=bool)))
            npos += int((~d).sum())

        sel = np.nonzero(all_labels == c)[0]
        # stable sort on -score: ties keep image order, then order inside the image
        sel = sel[np.argsort(-all_scores[sel], kind="stable")]
        tp = np.zeros(len(sel))
        fp = np.zeros(len(sel))
        ignored = np.zeros(len(sel), dtype=bool)
        for k, j in enumerate(sel):
            boxes_g, diff_g, matched = cls_gt[all_img[j]]
            if len(boxes_g) == 0:
                fp[k] = 1.0
                continue
            ious = _iou_one_to_many(all_boxes[j], boxes_g)
            best = int(np.argmax(ious))
            if ious[best] >= iou_thresh:
                if diff_g[best]:
                    ignored[k] = True  # matched a difficult object: neither TP nor FP
                elif not matched[best]:
                    tp[k] = 1.0
                    matched[best] = True
                else:
                    fp[k] = 1.0  # duplicate detection of an already-found object
            else:
                fp[k] = 1.0

        num_gt.append(npos)
        num_det.append(int(len(sel)))
        if npos == 0:
            aps.append(float("nan"))
            continue
        keep = ~ignored
        ctp = np.cumsum(tp[keep])
        cfp = np.cumsum(fp[keep])
        recall = ctp / npos
        precision = ctp / np.maximum(ctp + cfp, np.finfo(np.float64).eps)
        aps.append(voc_ap(recall, precision))
        if return_curves:
            curves[c] = (recall, precision)

    valid = [a for a in aps if not math.isnan(a)]
    mean_ap = float(np.mean(valid)) if valid else float("nan")
    result = {"ap": aps, "map": mean_ap, "num_gt": num_gt, "num_det": num_det}
    if return_curves:
        result["curves"] = curves
    return result


def format_ap_table(result: Mapping[str, Any], class_names: Sequence[str]) -> str:
    """Render the output of :func:`evaluate_detections` as a plain-text table.

    One row per class with AP (``n/a`` when the class has no ground truth), ground-truth count and
    detection count, followed by a ``mAP`` line (mean over classes with ground truth).

    Args:
        result: dict returned by :func:`evaluate_detections`.
        class_names: ``C`` class names, in label order.

    Returns:
        The table as a multi-line string (no trailing newline).

    Raises:
        ValueError: if ``len(class_names)`` differs from the number of classes in ``result`` or a
            required key is missing.
    """
    for key in ("ap", "map", "num_gt", "num_det"):
        if key not in result:
            raise ValueError(f"result is missing key {key!r}; pass evaluate_detections output")
    aps = list(result["ap"])
    if len(class_names) != len(aps):
        raise ValueError(
            f"class_names has {len(class_names)} entries but the result has {len(aps)} classes"
        )

    def fmt_ap(v: float) -> str:
        return "n/a" if v is None or math.isnan(v) else f"{v:.4f}"

    width = max([len("class"), len("mAP")] + [len(str(n)) for n in class_names])
    header = f"{'class':<{width}}  {'AP':>7}  {'GT':>6}  {'Det':>7}"
    rule = "-" * len(header)
    lines = [header, rule]
    for name, ap, ngt, ndet in zip(class_names, aps, result["num_gt"], result["num_det"]):
        lines.append(f"{str(name):<{width}}  {fmt_ap(ap):>7}  {int(ngt):>6}  {int(ndet):>7}")
    lines.append(rule)
    lines.append(
        f"{'mAP':<{width}}  {fmt_ap(result['map']):>7}  "
        f"{sum(int(n) for n in result['num_gt']):>6}  {sum(int(n) for n in result['num_det']):>7}"
    )
    return "\n".join(lines)
