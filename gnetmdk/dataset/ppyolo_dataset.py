"""The PP-YOLO data pipeline (PaddleDetection's PP-YOLO reader, in this project's own code):

training: decode -> Mixup with a random other image (for the first ``mixup_epochs`` epochs) ->
colour distortion -> expand -> IoU-constrained crop -> flip -> resize to the global batch's size
(one of ``train_sizes``, drawn from (seed, epoch, batch index) alone, so every rank of an iteration and
a replay get the same size), with a random interpolation; the boxes relative to the image and padded
to ``max_boxes`` rows ``[class, x1, y1, x2, y2, score]`` (gnetmdk.dataset.ppyolo_transforms).
evaluation: decode -> resize to ``image_size`` (bicubic, aspect ratio not kept, as PaddleDetection's
evaluation reader).

Images are RGB uint8 (the model normalises them itself, gnetmdk.models.ppyolo.model.PPYOLO.forward);
every augmentation draw comes from a numpy Generator seeded by (seed, epoch, index), so a sample is
the same whatever the worker, the process count or the batch it lands in.
"""
from __future__ import annotations

import os
from typing import Dict, List, Optional, Sequence, Tuple

import cv2
import numpy as np
import torch
from torch.utils.data import Dataset

from .image_io import decode_image
from .ppyolo_transforms import (draw_batch_size, draw_interp, pad_targets, ppyolo_train_sample)
from .records import Record

cv2.setNumThreads(1)


class PPYOLODataset(Dataset):
    """Images and padded targets for PP-YOLO.

    Args:
        records: (image_name, boxes (K, 4) float32 pixels xyxy, labels (K,) int64) per image
            (gnetmdk.dataset.records.load_records).
        image_dir: folder the image names are relative to.
        num_classes: C.
        image_size: evaluation side in pixels (multiple of the model's deepest stride).
        train, augment: training samples with augmentation.
        train_sizes: the multi-scale training sides; random_interp: draw the interpolation per batch.
        mixup_epochs, mixup_alpha, mixup_beta: Mixup for the first epochs, Beta(alpha, beta) weights.
        max_boxes: padded target rows.
        cache: keep the decoded images (downscaled to at most ``cache_side`` on the long side).
        seed: augmentation seed.

    ``__getitem__(key)``: ``key`` an index, or ``(index, epoch[, batch])`` (gnetmdk.dist.sampler.EpochBatches:
    the epoch and the global batch's index travel with the index). Returns (image (3, H, W) uint8 RGB,
    targets (max_boxes, 6) float32, index, (width, height) of the original file).
    """

    def __init__(self, records: Sequence[Record], image_dir: str, num_classes: int, image_size: int,
                 train: bool = False, augment: bool = True, train_sizes: Sequence[int] = (320,),
                 random_interp: bool = True, mixup_epochs: int = 0, mixup_alpha: float = 1.5,
                 mixup_beta: float = 1.5, max_boxes: int = 50, cache: bool = True, seed: int = 0,
                 expected_sizes=None):
        self.records = list(records)
        self.expected_sizes = expected_sizes   # gnetmdk.dataset.records.ExpectedSizes, or None
        self.image_dir = image_dir
        self.num_classes = int(num_classes)
        self.image_size = int(image_size)
        self.train = bool(train)
        self.augment = bool(augment) and self.train
        self.train_sizes = [int(s) for s in train_sizes]
        self.random_interp = bool(random_interp)
        self.mixup_epochs = int(mixup_epochs)
        self.mixup_alpha, self.mixup_beta = float(mixup_alpha), float(mixup_beta)
        self.max_boxes = int(max_boxes)
        self.seed = int(seed)
        self.epoch = 0
        self.cache_side = 2 * max(self.train_sizes + [self.image_size])
        self.sizes: List[Optional[Tuple[int, int]]] = [None] * len(self.records)
        self._cache: Optional[List[np.ndarray]] = None
        if cache:
            self._cache = [self._load(i) for i in range(len(self.records))]

    def __len__(self) -> int:
        return len(self.records)

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose augmentation plain integer keys draw."""
        self.epoch = int(epoch)

    # ------------------------------------------------------------------ images and ground truth
    def image_path(self, index: int) -> str:
        """The image file of sample ``index``: its record's name joined to ``image_dir``."""
        return os.path.join(self.image_dir, self.records[index][0])

    def _load(self, index: int) -> np.ndarray:
        """RGB uint8 image of ``index``, downscaled to at most ``cache_side`` on its long side (the boxes
        stay relative to the image, so the scale does not matter for them)."""
        img = decode_image(self.image_path(index))
        h, w = img.shape[:2]
        if self.expected_sizes is not None:
            self.expected_sizes.check(index, self.image_path(index), w, h)
        self.sizes[index] = (w, h)
        if max(h, w) > self.cache_side:
            s = self.cache_side / max(h, w)
            img = cv2.resize(img, (max(1, round(w * s)), max(1, round(h * s))), interpolation=cv2.INTER_AREA)
        return np.ascontiguousarray(img[:, :, ::-1])

    def load_image(self, index: int) -> np.ndarray:
        """RGB uint8 (H, W, 3) image of ``index``, at most ``cache_side`` on its long side (from the cache when
        images are cached, else decoded now)."""
        return self._cache[index] if self._cache is not None else self._load(index)

    def original_size(self, index: int) -> Tuple[int, int]:
        """(width, height) in pixels of the image file."""
        if self.sizes[index] is None:
            self._load(index)
        return self.sizes[index]  # type: ignore[return-value]

    def ground_truth(self, index: int) -> Dict[str, np.ndarray]:
        """Original-pixel ground truth: ``boxes`` (K, 4) float32 xyxy, ``labels`` (K,) int64."""
        _, boxes, labels = self.records[index]
        return {"boxes": boxes.astype(np.float32), "labels": labels.astype(np.int64)}

    def sample(self, index: int) -> Dict[str, np.ndarray]:
        """The image of ``index`` with its boxes in that image's pixels."""
        img = self.load_image(index)
        ow, oh = self.original_size(index)
        h, w = img.shape[:2]
        _, boxes, labels = self.records[index]
        scale = np.array([w / ow, h / oh, w / ow, h / oh], np.float32)
        return {"image": img, "boxes": boxes.astype(np.float32) * scale, "labels": labels.astype(np.int64)}

    # ------------------------------------------------------------------ samples
    def __getitem__(self, key):
        if isinstance(key, tuple):
            index, epoch = int(key[0]), int(key[1])
            batch = int(key[2]) if len(key) > 2 else 0
        else:
            index, epoch, batch = int(key), self.epoch, 0
        if self.augment:
            rng = np.random.default_rng([self.seed, epoch, index])
            size = draw_batch_size(self.seed, epoch, batch, self.train_sizes)
            interp = draw_interp(self.seed, epoch, batch) if self.random_interp else cv2.INTER_LINEAR
            partner = None
            if epoch < self.mixup_epochs and len(self.records) > 1:
                other = int(rng.integers(0, len(self.records) - 1))
                partner = self.sample(other + (other >= index))
            img, rel, labels, scores = ppyolo_train_sample(self.sample(index), rng, size, partner, interp,
                                                           self.mixup_alpha, self.mixup_beta)
        else:
            img = cv2.resize(self.load_image(index), (self.image_size, self.image_size),
                             interpolation=cv2.INTER_CUBIC)
            ow, oh = self.original_size(index)
            _, boxes, labels = self.records[index]
            rel = (boxes.astype(np.float32) / np.array([ow, oh, ow, oh], np.float32)).clip(0, 1)
            scores = np.ones(len(labels), np.float32)
        image = torch.from_numpy(np.ascontiguousarray(img.transpose(2, 0, 1)))
        target = torch.from_numpy(pad_targets(rel, labels, scores, self.max_boxes))
        return image, target, index, self.original_size(index)


def build_ppyolo_dataset(cfg, split: str) -> PPYOLODataset:
    """PPYOLODataset of ``split`` ("train" or "valid") from a resolved config (records and the image sizes
    they were written for: gnetmdk.dataset.records.load_split)."""
    from .records import load_split
    p = cfg.ppyolo
    train = split == "train"
    records, sizes = load_split(cfg, split)
    return PPYOLODataset(records, os.path.join(cfg.dataset_dir, cfg.image_dir), cfg.num_classes,
                         cfg.image_size, train=train, augment=cfg.augment, train_sizes=p.train_sizes,
                         random_interp=p.random_interp, mixup_epochs=p.mixup_epochs, mixup_alpha=p.mixup_alpha,
                         mixup_beta=p.mixup_beta, max_boxes=p.max_boxes, cache=cfg.cache_images, seed=cfg.seed,
                         expected_sizes=sizes)
