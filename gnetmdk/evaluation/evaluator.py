"""Run a model over a loader, decode, and compute VOC mAP in original-image pixels."""
from __future__ import annotations

from typing import Dict, List

import torch

from gnetmdk.config.base import BaseConfig
from gnetmdk.dist.comm import all_gather_object, is_main_process
from .voc import evaluate_detections


def eval_batch(cfg) -> int:
    """Images per evaluation forward on every rank (the ``pad_to`` of :func:`predict_loader`):
    ``eval_batch_size``, or ``batch_size`` when it is 0. The trainer and tools/eval_voc.py both use it,
    so a tool reports the mAP training recorded."""
    return int(cfg.eval_batch_size) or int(cfg.batch_size)


def _first_rows(pred, k: int):
    """A model's output (a tensor, or a list / tuple / dict of tensors with the batch first) cut to the
    first ``k`` images."""
    if isinstance(pred, torch.Tensor):
        return pred[:k]
    if isinstance(pred, dict):
        return {key: _first_rows(v, k) for key, v in pred.items()}
    return type(pred)(_first_rows(p, k) for p in pred)


@torch.no_grad()
def predict_loader(model, loader, device, conf_thresh: float, nms_thresh: float, max_detections: int = 100,
                   with_loss: bool = True, pad_to: int = 0):
    """Detections in original-image pixels for every image of ``loader`` (this rank's share).

    ``pad_to`` > 0: every batch shorter than ``pad_to`` images is filled up with blank images (codes
    0) before the forward, and their outputs are dropped. A convolution library picks its algorithm
    and blocking by the batch size (oneDNN on a CPU gave other float32 sums at batch 1 and 3 than at
    2, 4, 8 and 16), while an image's outputs do not depend on the other images of its batch; so with
    every forward of one size an image gets the same outputs in any batch, on any rank, whatever the
    number of processes the validation set is split over (docs/distributed.md, "How the batch is split").

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
            real = images.shape[0]
            if real < pad_to:       # blank images up to pad_to: every forward of one size
                images = torch.cat([images, images.new_zeros((pad_to - real,) + tuple(images.shape[1:]))])
            pred = model(images)
            if real < pad_to:
                pred = _first_rows(pred, real)
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
                   max_detections: int = 100, coco: bool = False, keep_detections: bool = False,
                   pad_to: int = 0) -> Dict[str, object]:
    """VOC mAP@0.5 of ``model`` on ``dataset`` (every image exactly once over all ranks), and with
    ``coco`` the COCO metrics too (pycocotools: gnetmdk.evaluation.coco.evaluate_coco).

    Returns (on every rank): {"map", "ap" (per class), "num_gt", "num_det", "loss" (dict of mean terms),
    "num_images"} and with ``coco`` "coco": {"map" (mAP@[.5:.95]), "ap50", "ap75", ...}. With
    ``keep_detections`` also what the numbers come from, for plots (gnetmdk.evaluation.plots):
    "detections" and "truths" (lists in dataset order, original-image pixels), "curves" (per class
    the recall / precision arrays of its AP) and "ranked" (the ranked TP / FP flags per class, for
    gnetmdk.evaluation.voc.bootstrap_map). ``pad_to``: every forward of that many images
    (:func:`predict_loader`).
    """
    dets, sums, n = predict_loader(model, loader, device, conf_thresh, nms_thresh, max_detections, pad_to=pad_to)
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
    result = evaluate_detections(detections, truths, dataset.num_classes, return_curves=keep_detections,
                                 return_ranked=keep_detections)
    if coco:
        from .coco import evaluate_coco
        result["coco"] = evaluate_coco(detections, truths, dataset.num_classes,
                                       [tuple(dataset.original_size(i)) for i in order])
    result["loss"] = {k: v / max(count, 1) for k, v in total.items()}
    result["num_images"] = count
    if keep_detections:
        result["detections"], result["truths"] = detections, truths
    return result
