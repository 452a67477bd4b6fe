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

How far a mAP measured on N images can move with the images drawn: :func:`bootstrap_map` resamples
the images with replacement and scores each resample (the percentile interval of Efron and
Tibshirani, "An Introduction to the Bootstrap", 1993, ch. 13), one model alone or two models paired
on the same draws, which is how a difference between two models on one val set is judged
(docs/pipeline.md, "How far a mAP can move with the val images").
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np

__all__ = ["voc_ap", "evaluate_detections", "resampled_map", "bootstrap_map", "format_ap_table"]


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


def _iou_rows(sel: np.ndarray, det_img: np.ndarray, det_boxes: np.ndarray, cls_gt: list) -> dict:
    """{detection index: float64 ``(G,)`` IoU with its image's ground truths of the class} for the
    detections ``sel`` whose image has any: one :func:`box_iou` per image. box_iou is elementwise
    (no reduction), so every row equals :func:`_iou_one_to_many` of that detection bit for bit; one call
    per image instead of one per detection takes the matching of a 960-image split from about 1.7 s to
    a tenth of that."""
    import torch
    from .boxes import box_iou
    rows: dict = {}
    if len(sel) == 0:
        return rows
    order = sel[np.argsort(det_img[sel], kind="stable")]
    images, starts = np.unique(det_img[order], return_index=True)
    for i, a, b in zip(images, starts, list(starts[1:]) + [len(order)]):
        gts = cls_gt[int(i)][0]
        if len(gts) == 0:
            continue
        js = order[a:b]
        m = box_iou(torch.from_numpy(np.asarray(det_boxes[js], np.float64).reshape(-1, 4)),
                    torch.from_numpy(np.asarray(gts, np.float64))).numpy()
        rows.update(zip(js.tolist(), m))
    return rows


def evaluate_detections(
    detections: Sequence[Mapping[str, Any]],
    ground_truths: Sequence[Mapping[str, Any]],
    num_classes: int,
    iou_thresh: float = 0.5,
    return_curves: bool = False,
    return_ranked: bool = False,
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
        return_ranked: also return the ranked TP / FP flags per class (for :func:`bootstrap_map`).
            Nothing else changes.

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
            ground truth, whose AP is ``nan``, have no entry,
            with ``return_ranked`` also
            ``"ranked"``: per class a dict of what its AP is computed from, the detections that
            were not ignored in ranking order: ``"image"`` int64 ``(D,)`` (index into the lists),
            ``"score"`` float64 ``(D,)``, ``"tp"`` / ``"fp"`` float64 ``(D,)`` (1.0 or 0.0, one of
            the two set), and ``"gt_per_image"`` int64 ``(N,)``, the image's non-difficult ground
            truths of the class; and ``"num_images"``, ``N``. A detection's TP / FP flag depends on
            its own image only, which is what lets :func:`resampled_map` score a resample of the
            images without matching again.

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
    ranked: list[dict] = []
    for c in range(num_classes):
        # ground truths of class c, per image
        cls_gt = []
        gt_count = np.zeros(len(gt_boxes), dtype=np.int64)
        for i, (b, lab, diff) in enumerate(zip(gt_boxes, gt_labels, gt_difficult)):
            m = lab == c
            d = diff[m]
            cls_gt.append((b[m], d, np.zeros(int(m.sum()), dtype=bool)))
            gt_count[i] = int((~d).sum())
        npos = int(gt_count.sum())

        sel = np.nonzero(all_labels == c)[0]
        # stable sort on -score: ties keep image order, then order inside the image
        sel = sel[np.argsort(-all_scores[sel], kind="stable")]
        tp = np.zeros(len(sel))
        fp = np.zeros(len(sel))
        ignored = np.zeros(len(sel), dtype=bool)
        iou_rows = _iou_rows(sel, all_img, all_boxes, cls_gt)
        for k, j in enumerate(sel):
            boxes_g, diff_g, matched = cls_gt[all_img[j]]
            if len(boxes_g) == 0:
                fp[k] = 1.0
                continue
            ious = iou_rows[j]
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
        keep = ~ignored
        if return_ranked:
            ranked.append({"image": all_img[sel][keep], "score": all_scores[sel][keep],
                           "tp": tp[keep], "fp": fp[keep], "gt_per_image": gt_count})
        if npos == 0:
            aps.append(float("nan"))
            continue
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
    if return_ranked:
        result["ranked"] = ranked
        result["num_images"] = len(ground_truths)
    return result


def _resample_order(image: np.ndarray, score: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """Indices into one class's ranked detections, in the ranking of the resampled image list.

    The resample lists image ``i`` ``weight[i]`` times in a row, in image order; ranking it as
    :func:`evaluate_detections` does (score descending, ties in list order) repeats each detection
    ``weight`` times in place, except where detections of one image tie in score: there the first
    copy of the image's tied detections comes before the second copy of any of them.
    """
    d = len(image)
    rep = np.repeat(np.arange(d), weight)
    if d < 2:
        return rep
    new_group = (score[1:] != score[:-1]) | (image[1:] != image[:-1])
    if bool(new_group.all()):
        return rep                                  # no tie inside an image: copies stay together
    group = np.concatenate(([0], np.cumsum(new_group)))
    starts = np.cumsum(weight) - weight
    copy = np.arange(len(rep)) - np.repeat(starts, weight)
    return rep[np.lexsort((rep, copy, group[rep]))]


def resampled_map(ranked: Mapping[str, Any], counts: Any) -> tuple:
    """VOC mAP of a resample of the images, from :func:`evaluate_detections`' ranked flags.

    Args:
        ranked: the result of ``evaluate_detections(..., return_ranked=True)`` on ``N`` images.
        counts: int ``(N,)``, how many times each image is drawn (0 = left out).

    Returns:
        ``(map, ap)``: the float mAP (``nan`` when no class has ground truth in the resample) and the
        per-class APs, exactly (bit for bit) what :func:`evaluate_detections` returns for the list
        holding image ``i`` ``counts[i]`` times, in image order: a detection's TP / FP flag depends
        on its own image only, so no matching is repeated.

    Raises:
        ValueError: ``ranked`` lacks the ranked flags, or ``counts`` is not ``N`` whole numbers >= 0.
    """
    if "ranked" not in ranked or "num_images" not in ranked:
        raise ValueError("ranked must be the result of evaluate_detections(..., return_ranked=True)")
    n = int(ranked["num_images"])
    c = np.asarray(counts)
    if c.shape != (n,) or (c.size and (c.min() < 0 or np.any(c != np.round(c)))):
        raise ValueError(f"counts must be {n} whole numbers >= 0 (one per image), got shape {c.shape}")
    c = c.astype(np.int64)
    aps = []
    for r in ranked["ranked"]:
        npos = int((c * r["gt_per_image"]).sum())
        if npos == 0:
            aps.append(float("nan"))
            continue
        order = _resample_order(r["image"], r["score"], c[r["image"]])
        ctp = np.cumsum(r["tp"][order])
        cfp = np.cumsum(r["fp"][order])
        recall = ctp / npos
        precision = ctp / np.maximum(ctp + cfp, np.finfo(np.float64).eps)
        aps.append(voc_ap(recall, precision))
    valid = [a for a in aps if not math.isnan(a)]
    return (float(np.mean(valid)) if valid else float("nan")), aps


def bootstrap_map(ranked_a: Mapping[str, Any], ranked_b: Mapping[str, Any] | None = None,
                  resamples: int = 1000, seed: int = 0, level: float = 0.95) -> dict:
    """Bootstrap interval of a mAP, or of the difference of two models' mAPs on the same images.

    Each resample draws ``N`` of the ``N`` images with replacement (numpy ``default_rng(seed)``) and
    scores it with :func:`resampled_map`; with ``ranked_b`` both models are scored on the same draws
    (a paired bootstrap), so what the two share (which images are hard) cancels in the difference.
    The interval is the percentile interval (Efron and Tibshirani 1993, ch. 13): the
    ``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles of the resampled values (numpy's linear
    interpolation). It measures how the number moves with the images drawn, not with training: a
    second seed moves it further.

    Args:
        ranked_a: ``evaluate_detections(..., return_ranked=True)`` of model A.
        ranked_b: the same for model B on the same images and ground truths, or None.
        resamples: how many resamples (>= 1); seed: the generator's seed; level: in (0, 1).

    Returns:
        dict with ``"map_a"`` (float, all images), ``"samples_a"`` (float64 ``(resamples,)``),
        ``"interval_a"`` (``(low, high)``), ``"resamples"``, ``"seed"``, ``"level"``, ``"num_images"``,
        and with ``ranked_b`` also ``"map_b"``, ``"samples_b"``, ``"interval_b"``, ``"diff"`` (map_a -
        map_b), ``"samples_diff"``, ``"interval_diff"`` and ``"share_below"``: the fraction of resamples
        where A scores below B. Resamples without any ground truth (mAP ``nan``) are left out of the
        quantiles and the share.

    Raises:
        ValueError: bad ``resamples`` / ``level``, missing ranked flags, or two results whose images or
            ground-truth counts differ.
    """
    if int(resamples) != resamples or resamples < 1:
        raise ValueError(f"resamples must be a whole number >= 1, got {resamples!r}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must lie in (0, 1), got {level!r}")
    models = [ranked_a] + ([ranked_b] if ranked_b is not None else [])
    for r in models:
        if "ranked" not in r or "num_images" not in r:
            raise ValueError("bootstrap_map needs evaluate_detections(..., return_ranked=True) results")
    n = int(ranked_a["num_images"])
    if ranked_b is not None:
        same = (int(ranked_b["num_images"]) == n and len(ranked_b["ranked"]) == len(ranked_a["ranked"])
                and all(np.array_equal(x["gt_per_image"], y["gt_per_image"])
                        for x, y in zip(ranked_a["ranked"], ranked_b["ranked"])))
        if not same:
            raise ValueError("the two results are not of the same images: their image or ground-truth counts "
                             "differ (evaluate both models on the same split)")
    rng = np.random.default_rng(seed)
    samples = np.empty((len(models), int(resamples)))
    for k in range(int(resamples)):
        counts = np.bincount(rng.integers(0, n, size=n), minlength=n) if n else np.zeros(0, np.int64)
        for m, r in enumerate(models):
            samples[m, k] = resampled_map(r, counts)[0]
    q = [(1.0 - level) / 2.0, (1.0 + level) / 2.0]

    def interval(v: np.ndarray) -> tuple:
        v = v[~np.isnan(v)]
        return tuple(float(x) for x in np.quantile(v, q)) if v.size else (float("nan"), float("nan"))

    ones = np.ones(n, dtype=np.int64)
    out = {"map_a": resampled_map(ranked_a, ones)[0], "samples_a": samples[0], "interval_a": interval(samples[0]),
           "resamples": int(resamples), "seed": int(seed), "level": float(level), "num_images": n}
    if ranked_b is not None:
        diff = samples[0] - samples[1]
        ok = ~np.isnan(diff)
        out.update({"map_b": resampled_map(ranked_b, ones)[0], "samples_b": samples[1],
                    "interval_b": interval(samples[1]), "samples_diff": diff, "interval_diff": interval(diff),
                    "share_below": float(np.mean(diff[ok] < 0)) if ok.any() else float("nan")})
        out["diff"] = out["map_a"] - out["map_b"]
    return out


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
