"""COCO detection metrics (mAP@[.5:.95], AP50, AP75, per class) through pycocotools.

Same inputs as :func:`gnetmdk.evaluation.voc.evaluate_detections`; the ground truth and the
detections are turned into pycocotools ``COCO`` objects in memory (no file is written) and scored by
``COCOeval`` with ``iouType="bbox"`` and its default parameters: IoU thresholds ``0.50:0.05:0.95``,
101 recall points ``0:0.01:1``, ``maxDets`` ``[1, 10, 100]``, area ranges all/small/medium/large.
What pycocotools prints is captured, not shown.

Protocol (pycocotools ``cocoeval.py``; Lin et al., "Microsoft COCO: Common Objects in Context",
ECCV 2014, and the COCO detection evaluation page):

* Box convention: boxes arrive as pixel ``x1 y1 x2 y2`` and are passed as ``[x1, y1, x2 - x1,
  y2 - y1]``. pycocotools computes IoU on these ``xywh`` boxes as continuous coordinates, without
  the "+1 pixel" of the VOC devkit, which is also the convention of this project's VOC evaluation
  (:mod:`gnetmdk.evaluation.voc`), so both see the same IoU for the same pair of boxes.
* Matching (per image and class): detections sorted by score (stable), each takes the unmatched
  ground truth with the highest IoU ``>= t``. Unlike VOC, a detection whose best ground truth is
  already taken may still match another one above the threshold.
* At most 100 detections per image *and class* are used (``maxDets[-1]``, applied per image and
  category by ``COCOeval.evaluateImg``); the rest are ignored.
* AP per IoU threshold is the mean over the 101 recall points ``r`` of the precision envelope
  (maximum precision at any recall ``>= r``), 0 where the recall is never reached.
* A class without ground truth has no AP (``-1`` inside pycocotools, ``nan`` here) and is left out
  of the means, so its detections cost nothing anywhere; ``evaluate_detections`` does the same.
* ``difficult`` ground truths (optional, as in the VOC evaluation) are passed as ``iscrowd = 1``,
  pycocotools' only way to ignore a ground truth: they are not counted as positives and a detection
  matched to one is neither TP nor FP. Note that pycocotools measures the overlap with a crowd box as
  intersection / detection area (not IoU), a little more lenient than VOC's rule.
* ``area`` of a ground truth (for the small/medium/large ranges) is ``w * h`` of its box in pixels.
"""

from __future__ import annotations

import contextlib
import io
import math
from typing import Any, Mapping, Sequence

import numpy as np

from .voc import _boxes, _get, _labels, _vector

__all__ = ["evaluate_coco"]

_STAT_NAMES = ("map", "ap50", "ap75", "ap_small", "ap_medium", "ap_large",
               "ar1", "ar10", "ar100", "ar_small", "ar_medium", "ar_large")


def _nan_if_negative(v: float) -> float:
    v = float(v)
    return float("nan") if v < 0 else v


def evaluate_coco(
    detections: Sequence[Mapping[str, Any]],
    ground_truths: Sequence[Mapping[str, Any]],
    num_classes: int,
    sizes: Sequence[Sequence[int]],
) -> dict:
    """COCO box metrics over a dataset with pycocotools (see the module docstring for the rules).

    Args:
        detections: one dict per image with ``"boxes"`` float ``(K, 4)`` pixel xyxy, ``"scores"``
            float ``(K,)``, ``"labels"`` int ``(K,)`` in ``[0, num_classes)`` (numpy arrays, torch
            tensors on any device, or lists), exactly as for ``evaluate_detections``.
        ground_truths: one dict per image, same order, with ``"boxes"`` float ``(G, 4)`` pixel xyxy,
            ``"labels"`` int ``(G,)`` and optional bool ``"difficult"`` ``(G,)``.
        num_classes: number of classes ``C``.
        sizes: ``(width, height)`` in pixels per image, same order (the pycocotools image
            records; the metrics themselves do not depend on them).

    Returns:
        dict of plain Python floats (``nan`` where pycocotools has no value, e.g. no ground truth at
        all or none in an area range):
            ``"map"``: AP@[.50:.95] (COCO's primary metric), ``"ap50"``, ``"ap75"``,
            ``"ap_small"``, ``"ap_medium"``, ``"ap_large"``, ``"ar1"``, ``"ar10"``, ``"ar100"``,
            ``"ar_small"``, ``"ar_medium"``, ``"ar_large"`` (the 12 numbers of
            ``COCOeval.summarize``, in its order);
            ``"ap_per_class"``: list of ``C`` AP@[.50:.95], ``"ap50_per_class"``: list of ``C``
            AP@0.5 (``nan`` for a class without ground truth);
            ``"num_gt"``: list of ``C`` ints, non-difficult ground truths per class;
            ``"num_det"``: list of ``C`` ints, detections per class (before the 100 cap).

    Raises:
        ValueError: the three lists differ in length, ``num_classes < 1``, a dict lacks a key,
            boxes are not ``(K, 4)``, a per-box array does not match its boxes, a label is outside
            ``[0, num_classes)``, a score or coordinate is not finite, or a size is not two positive
            numbers.
        ImportError: pycocotools is not installed (``pip install pycocotools``).
    """
    if len(detections) != len(ground_truths) or len(sizes) != len(ground_truths):
        raise ValueError(
            f"detections, ground_truths and sizes must have one entry per image, got "
            f"{len(detections)}, {len(ground_truths)} and {len(sizes)}")
    if int(num_classes) != num_classes or num_classes < 1:
        raise ValueError(f"num_classes must be a positive integer, got {num_classes!r}")
    num_classes = int(num_classes)
    try:
        from pycocotools.coco import COCO
        from pycocotools.cocoeval import COCOeval
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(f"evaluate_coco needs pycocotools ({exc}); pip install pycocotools") from None

    images, gt_anns, dt_anns = [], [], []
    num_gt = [0] * num_classes
    num_det = [0] * num_classes
    for i, (det, gt, size) in enumerate(zip(detections, ground_truths, sizes)):
        image_id = i + 1
        try:
            w, h = (float(s) for s in size)
        except (TypeError, ValueError):
            w = h = float("nan")
        if not (math.isfinite(w) and math.isfinite(h) and w > 0 and h > 0):
            raise ValueError(f"sizes[{i}] is {size!r}; expected (width, height) in pixels, both > 0")
        images.append({"id": image_id, "width": w, "height": h, "file_name": str(image_id)})

        where = f"ground_truths[{i}]"
        gb = _boxes(_get(gt, "boxes", where), where)
        gl = _labels(_get(gt, "labels", where), len(gb), num_classes, where)
        diff = gt.get("difficult") if isinstance(gt, Mapping) else None
        gd = (np.zeros(len(gb), bool) if diff is None
              else _vector(diff, len(gb), where + " difficult", bool))
        if not np.all(np.isfinite(gb)):
            raise ValueError(f"{where}: non-finite box coordinate")
        for box, label, d in zip(gb, gl, gd):
            bw, bh = float(box[2] - box[0]), float(box[3] - box[1])
            gt_anns.append({"id": len(gt_anns) + 1, "image_id": image_id,
                            "category_id": int(label) + 1,
                            "bbox": [float(box[0]), float(box[1]), bw, bh],
                            "area": max(bw, 0.0) * max(bh, 0.0), "iscrowd": int(bool(d))})
            if not d:
                num_gt[int(label)] += 1

        where = f"detections[{i}]"
        db = _boxes(_get(det, "boxes", where), where)
        ds = _vector(_get(det, "scores", where), len(db), where + " scores", np.float64)
        dl = _labels(_get(det, "labels", where), len(db), num_classes, where)
        if not (np.all(np.isfinite(db)) and np.all(np.isfinite(ds))):
            raise ValueError(f"{where}: non-finite box coordinate or score")
        for box, score, label in zip(db, ds, dl):
            bw, bh = float(box[2] - box[0]), float(box[3] - box[1])
            dt_anns.append({"id": len(dt_anns) + 1, "image_id": image_id,
                            "category_id": int(label) + 1,
                            "bbox": [float(box[0]), float(box[1]), bw, bh],
                            "area": max(bw, 0.0) * max(bh, 0.0), "iscrowd": 0,
                            "score": float(score)})
            num_det[int(label)] += 1

    categories = [{"id": c + 1, "name": str(c)} for c in range(num_classes)]
    nan = float("nan")
    with contextlib.redirect_stdout(io.StringIO()):
        coco_gt = COCO()
        coco_gt.dataset = {"images": images, "annotations": gt_anns, "categories": categories}
        coco_gt.createIndex()
        coco_dt = COCO()
        # built like COCO.loadRes does, which cannot take an empty list
        coco_dt.dataset = {"images": images, "annotations": dt_anns, "categories": categories}
        coco_dt.createIndex()
        ev = COCOeval(coco_gt, coco_dt, iouType="bbox")
        ev.params.imgIds = [im["id"] for im in images]
        ev.params.catIds = [c["id"] for c in categories]
        if images:
            ev.evaluate()
            ev.accumulate()
            ev.summarize()
            stats = [_nan_if_negative(v) for v in ev.stats]
            # precision: [T iou thresholds, R recall points, K classes, A areas, M maxDets]
            prec = ev.eval["precision"][:, :, :, 0, -1]
        else:
            stats = [nan] * len(_STAT_NAMES)
            prec = -np.ones((10, 101, num_classes))

    ap_cls, ap50_cls = [], []
    t50 = int(np.argmin(np.abs(ev.params.iouThrs - 0.5)))
    for k in range(num_classes):
        p = prec[:, :, k]
        valid = p[p > -1]
        ap_cls.append(float(np.mean(valid)) if valid.size else nan)
        p50 = p[t50]
        ap50_cls.append(float(np.mean(p50[p50 > -1])) if np.any(p50 > -1) else nan)

    result = {name: float(v) for name, v in zip(_STAT_NAMES, stats)}
    result.update({"ap_per_class": ap_cls, "ap50_per_class": ap50_cls,
                   "num_gt": num_gt, "num_det": num_det})
    return result
