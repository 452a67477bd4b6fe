"""Run a model over a loader, decode, and compute VOC mAP in original-image pixels."""
from __future__ import annotations

from typing import Dict, List

import torch

from gnetmdk.config.base import BaseConfig
from gnetmdk.dist.comm import all_gather_object, is_main_process
from .voc import evaluate_detections


@torch.no_grad()
def predict_loader(model, loader, device, conf_thresh: float, nms_thresh: float, max_detections: int = 100,
                   with_loss: bool = True):
    """Detections in original-image pixels for every image of ``loader`` (this rank's share).

    Returns:
        (dets, loss_sums, n): ``dets`` maps dataset index -> {"boxes" (K,4) float32 pixels xyxy,
        "scores" (K,), "labels" (K,) int64}; ``loss_sums`` the summed per-batch loss terms x batch size;
        ``n`` the number of images.
    """
    was_training = model.training
    model.eval()
    dets: Dict[int, Dict[str, torch.Tensor]] = {}
    sums: Dict[str, float] = {}
    n = 0
    try:
        for images, targets, indices, sizes in loader:
            images = images.to(device, non_blocking=True).float()   # uint8 codes from the loader
            pred = model(images)
            if with_loss:
                terms = model.loss(pred, targets.to(device))
                for k, v in terms.items():
                    sums[k] = sums.get(k, 0.0) + float(v) * len(indices)
            n += len(indices)
            out = model.decode(pred, conf_thresh, nms_thresh, max_detections)
            for d, idx, (w, h) in zip(out, indices.tolist(), sizes.tolist()):
                scale = torch.tensor([w, h, w, h], dtype=torch.float32)
                dets[idx] = {"boxes": d["boxes"] * scale, "scores": d["scores"], "labels": d["labels"]}
    finally:
        model.train(was_training)
    return dets, sums, n


def evaluate_model(model, loader, dataset, device, conf_thresh: float = BaseConfig.conf_thresh, nms_thresh: float = 0.5,
                   max_detections: int = 100, coco: bool = False, keep_detections: bool = False) -> Dict[str, object]:
    """VOC mAP@0.5 of ``model`` on ``dataset`` (every image exactly once over all ranks), and with
    ``coco`` the COCO metrics too (pycocotools: gnetmdk.evaluation.coco.evaluate_coco).

    Returns (on every rank): {"map", "ap" (per class), "num_gt", "num_det", "loss" (dict of mean terms),
    "num_images"} and with ``coco`` "coco": {"map" (mAP@[.5:.95]), "ap50", "ap75", ...}. With
    ``keep_detections`` also what the numbers come from, for plots (gnetmdk.evaluation.plots):
    "detections" and "truths" (lists in dataset order, original-image pixels) and "curves" (per class
    the recall / precision arrays of its AP).
    """
    dets, sums, n = predict_loader(model, loader, device, conf_thresh, nms_thresh, max_detections)
    gathered = all_gather_object((dets, sums, n))
    all_dets: Dict[int, dict] = {}
    total: Dict[str, float] = {}
    count = 0
    for d, s, k in gathered:
        all_dets.update(d)
        for key, v in s.items():
            total[key] = total.get(key, 0.0) + v
        count += k
    order = sorted(all_dets)
    detections = [all_dets[i] for i in order]
    truths = [dataset.ground_truth(i) for i in order]
    result = evaluate_detections(detections, truths, dataset.num_classes, return_curves=keep_detections)
    if coco:
        from .coco import evaluate_coco
        result["coco"] = evaluate_coco(detections, truths, dataset.num_classes,
                                       [tuple(dataset.original_size(i)) for i in order])
    result["loss"] = {k: v / max(count, 1) for k, v in total.items()}
    result["num_images"] = count
    if keep_detections:
        result["detections"], result["truths"] = detections, truths
    return result
