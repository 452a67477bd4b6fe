"""VOC mAP on whole images of a model trained on tiles (gnetmdk.dataset.tiling, tools/tile_voc.py).

Every tile of every val image in the tiling manifest is run (tiles without a labelled object too, so
their false positives count), and its detections are shifted by the tile's origin into image pixels.
Neighbouring tiles both see an object in their overlap, one of them often only in part, so the
merge is a class-wise greedy NMS at the config's ``nms_thresh`` in which a box is also dropped when a
higher-scoring box of the same class from another tile covers more than ``nms_thresh`` of the smaller
of the two (intersection over the smaller area: a part cut by a tile edge lies inside the whole box,
at an IoU that can be as low as its visible share; SAHI's merge, Akyon et al. 2022, "Slicing Aided
Hyper Inference", uses the same measure). The kept detections, at most ``max_detections`` per image by score, are scored against
the whole image's boxes with the PASCAL VOC protocol (gnetmdk.evaluation.voc; objects marked
difficult are ignored, as the devkit does).
"""
from __future__ import annotations

import os
from typing import Dict, List, Mapping, Sequence, Tuple

import numpy as np
import torch

from gnetmdk.dataset.voc import VOCFormatError
from .boxes import box_area, box_iou, greedy_keep
from .voc import evaluate_detections

__all__ = ["merge_tiles", "stitch_detections", "whole_image_truths", "predict_tiles", "evaluate_stitched"]


def _val_images(manifest: Mapping, split: str) -> List[str]:
    return [k for k, v in manifest["images"].items() if v.get("split") == split]


def merge_tiles(boxes: torch.Tensor, scores: torch.Tensor, labels: torch.Tensor, tiles: torch.Tensor,
                thresh: float) -> torch.Tensor:
    """The merge of the module docstring: greedy, by descending score (ties: lower index first).

    Args:
        boxes: (N, 4) float xyxy in image pixels; scores: (N,) float; labels: (N,) int64 classes;
        tiles: (N,) int64, the tile each box came from; thresh: the IoU (any two boxes) and
            intersection-over-smaller (boxes of different tiles) above which the lower-scoring is dropped.

    Returns:
        int64 (K,) indices of the kept boxes, by descending score.
    """
    n = boxes.shape[0]
    if n == 0:
        return torch.zeros(0, dtype=torch.int64)
    order = torch.sort(scores, descending=True, stable=True).indices
    b = boxes[order].to(torch.float64)
    iou = box_iou(b, b)
    lt = torch.maximum(b[:, None, :2], b[None, :, :2])
    rb = torch.minimum(b[:, None, 2:], b[None, :, 2:])
    inter = (rb - lt).clamp(min=0).prod(dim=2)
    area = box_area(b)
    smaller = torch.minimum(area[:, None], area[None, :])
    ios = torch.where(smaller > 0, inter / smaller.clamp(min=1e-12), torch.zeros_like(inter))
    lab, til = labels[order], tiles[order]
    same = lab[:, None] == lab[None, :]
    other_tile = til[:, None] != til[None, :]
    return order[greedy_keep(same & ((iou > thresh) | (other_tile & (ios > thresh))))]


def stitch_detections(tile_dets: Mapping[str, Mapping[str, torch.Tensor]], manifest: Mapping, nms_thresh: float,
                      max_detections: int = 100, split: str = "val") -> Tuple[List[str], List[Dict[str, torch.Tensor]]]:
    """Merge per-tile detections into detections on the whole images of ``split``.

    Args:
        tile_dets: tile id -> {"boxes" (K, 4) float xyxy in tile pixels, "scores" (K,) float,
            "labels" (K,) int64}; a tile of the split that is missing counts as no detections.
        manifest: the tiling manifest (gnetmdk.dataset.tiling.load_manifest).
        nms_thresh: the threshold of :func:`merge_tiles` (module docstring).
        max_detections: the most detections kept per image (by score).
        split: "val" or "train".

    Returns:
        (image ids in manifest order, [{"boxes" (M, 4) float32 image pixels, "scores" (M,) float32,
        "labels" (M,) int64}] in the same order).
    """
    ids = _val_images(manifest, split)
    out = []
    for sid in ids:
        boxes, scores, labels, origin = [], [], [], []
        for k, (tid, rect) in enumerate(manifest["images"][sid]["tiles"].items()):
            d = tile_dets.get(tid)
            if d is None or len(d["scores"]) == 0:
                continue
            shift = torch.tensor([rect[0], rect[1], rect[0], rect[1]], dtype=torch.float32)
            boxes.append(torch.as_tensor(d["boxes"], dtype=torch.float32).reshape(-1, 4) + shift)
            scores.append(torch.as_tensor(d["scores"], dtype=torch.float32).reshape(-1))
            labels.append(torch.as_tensor(d["labels"], dtype=torch.int64).reshape(-1))
            origin.append(torch.full((len(scores[-1]),), k, dtype=torch.int64))
        if not boxes:
            out.append({"boxes": torch.zeros(0, 4), "scores": torch.zeros(0), "labels": torch.zeros(0, dtype=torch.int64)})
            continue
        b, s, l = torch.cat(boxes), torch.cat(scores), torch.cat(labels)
        keep = merge_tiles(b, s, l, torch.cat(origin), nms_thresh)[:max_detections]
        out.append({"boxes": b[keep], "scores": s[keep], "labels": l[keep]})
    return ids, out


def whole_image_truths(manifest: Mapping, class_names: Sequence[str], split: str = "val") -> List[Dict[str, np.ndarray]]:
    """Ground truth of the whole images of ``split``, in manifest order: {"boxes" (G, 4) float32 pixels,
    "labels" (G,) int64 indices into ``class_names``, "difficult" (G,) bool}.

    Raises:
        VOCFormatError: the manifest names a class that ``class_names`` lacks (the config and the tiled
            dataset disagree).
    """
    index = {c: i for i, c in enumerate(class_names)}
    truths = []
    for sid in _val_images(manifest, split):
        objs = manifest["images"][sid]["objects"]
        missing = sorted({o[0] for o in objs} - set(index))
        if missing:
            raise VOCFormatError(f"tiling manifest, image {sid}: class(es) {missing} are not in VOC_CLASSES "
                             f"{list(class_names)}: use the config the dataset was tiled for")
        truths.append({"boxes": np.asarray([o[1:5] for o in objs], dtype=np.float32).reshape(-1, 4),
                       "labels": np.asarray([index[o[0]] for o in objs], dtype=np.int64),
                       "difficult": np.asarray([bool(o[5]) for o in objs], dtype=bool)})
    return truths


def _split_tiles(cfg, manifest: Mapping, split: str) -> List[str]:
    """The tile ids of the ``split`` images, in manifest order (VOCFormatError when there are none)."""
    tiles = [tid for sid in _val_images(manifest, split) for tid in manifest["images"][sid]["tiles"]]
    if not tiles:
        raise VOCFormatError(f"{cfg.dataset_dir}: the tiling manifest has no {split} images")
    return tiles


def _tile_dataset(cfg, manifest: Mapping, split: str):
    """The tiles of the ``split`` images, in manifest order, as a GNetDet evaluation dataset (no labels:
    the tiles are scored through their whole images), and their ids."""
    from gnetmdk.dataset.dataset import GNetDetDataset
    tiles = _split_tiles(cfg, manifest, split)
    empty = (np.zeros((0, 4), np.float32), np.zeros(0, np.int64))
    ds = GNetDetDataset("", os.path.join(cfg.dataset_dir, manifest.get("image_dir", "JPEGImages")),
                        cfg.num_classes, cfg.image_size, cfg.grid_size, train=False,
                        records=[(tid + ".png", *empty) for tid in tiles])
    return ds, tiles


def predict_tiles(model, cfg, device, manifest: Mapping, batch_size: int = 0, split: str = "val",
                  rank: int = 0, world_size: int = 1) -> Dict[int, Dict[str, torch.Tensor]]:
    """This rank's share of the tiles of the ``split`` images (tile k of the manifest order for every
    k = rank mod world_size, as gnetmdk.dist.sampler.ShardSampler shards), run through ``model``.

    Every forward holds ``batch_size`` tiles (0: the config's evaluation batch,
    gnetmdk.evaluation.evaluator.eval_batch), the last one padded with blank images
    (evaluator.predict_loader), so a tile's detections are the same bits whatever the number of
    ranks the tiles are split over.

    Returns:
        tile index (manifest order) -> {"boxes" (K, 4) float32 tile pixels xyxy, "scores" (K,),
        "labels" (K,) int64}.
    """
    from torch.utils.data import DataLoader
    from gnetmdk.dataset.dataset import collate
    from gnetmdk.dist.sampler import ShardSampler
    from .evaluator import eval_batch, predict_loader
    ds, _ = _tile_dataset(cfg, manifest, split)
    batch = int(batch_size) or eval_batch(cfg)
    # its own generator: iterating a DataLoader without one draws from torch's global generator, which
    # training's random layers draw from (gnetmdk.engine.trainer, the validation loader)
    loader = DataLoader(ds, batch_size=batch, sampler=ShardSampler(len(ds), rank, world_size),
                        collate_fn=collate, num_workers=0, generator=torch.Generator().manual_seed(0))
    dets, _, _ = predict_loader(model, loader, device, cfg.conf_thresh, cfg.nms_thresh, cfg.max_detections,
                                with_loss=False, pad_to=batch)
    return dets


def evaluate_stitched(model, cfg, device, batch_size: int = 0, split: str = "val",
                      keep_detections: bool = False, rank: int = 0, world_size: int = 1) -> Dict[str, object]:
    """Run ``model`` on every tile of the ``split`` images of the tiled dataset ``cfg.dataset_dir`` and
    score the merged detections on the whole images (module docstring).

    Args:
        model: a GNetDet of any stage (``decode`` gives boxes relative to its input).
        cfg: the resolved config the model was trained with (dataset_dir holds tiles.json).
        device: where the model runs; batch_size: tiles per forward, the last one padded (0: the
            config's evaluation batch, ``eval_batch_size`` or else ``batch_size``, as the trainer
            evaluates; :func:`predict_tiles`).
        keep_detections: also return what the numbers come from (as evaluate_model does).
        rank, world_size: this process's share of the tiles (every process of a run calls this; the
            detections are all-gathered over the processes, gnetmdk.dist.comm.all_gather_object, and every
            process returns the same numbers, those of one process running every tile).

    Returns:
        evaluate_detections' dict ("map", "ap", ...) plus "num_images" (whole images) and "num_tiles";
        with ``keep_detections`` also "ids", "detections" (stitch_detections') and "truths"
        (whole_image_truths'), in manifest order, and "ranked" (evaluate_detections' ranked flags, for
        gnetmdk.evaluation.voc.bootstrap_map).

    Raises:
        FileNotFoundError / VOCFormatError: no or a bad manifest (gnetmdk.dataset.tiling.load_manifest),
            or classes that differ from the config's.
    """
    from gnetmdk.dataset.tiling import load_manifest
    from gnetmdk.dist.comm import all_gather_object
    manifest = load_manifest(cfg.dataset_dir)
    truths = whole_image_truths(manifest, cfg.VOC_CLASSES, split)
    tiles = _split_tiles(cfg, manifest, split)
    dets: Dict[int, Dict[str, torch.Tensor]] = {}
    for part in all_gather_object(predict_tiles(model, cfg, device, manifest, batch_size, split, rank, world_size)):
        dets.update(part)
    ids, merged = stitch_detections({tiles[i]: d for i, d in dets.items()}, manifest, cfg.nms_thresh,
                                    cfg.max_detections, split)
    result = evaluate_detections(merged, truths, cfg.num_classes, return_ranked=keep_detections)
    result["num_images"], result["num_tiles"] = len(ids), len(tiles)
    if keep_detections:
        result["ids"], result["detections"], result["truths"] = ids, merged, truths
    return result
