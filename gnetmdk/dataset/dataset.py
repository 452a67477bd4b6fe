"""Detection dataset: meta files -> decoded, augmented, chip-coded images and GNetDet targets.

Data flow (docs/architecture.md, "Data flow"): image file -> decode (opencv, grayscale becomes 3 channels, BGR)
-> downscale once to at most 2 x image_size (INTER_AREA; cached in memory if asked)
-> training only: HSV jitter, blur, horizontal flip, quarter-turn rotation (``rotate_prob``),
   random scale + shift (one affine warp),
   and with probability ``mosaic_prob`` a mosaic of four such images (objects keep their scale)
-> resize to image_size x image_size -> 8-bit to 5-bit chip codes -> GNetDet target.

Randomness: every augmentation draw comes from a numpy Generator seeded by (seed, epoch, index),
so a sample is the same whatever the worker, the process count or the batch it lands in.
"""
from __future__ import annotations

import os
import random
from typing import Dict, List, Optional, Sequence, Tuple

import cv2
import numpy as np
import torch
from torch.utils.data import Dataset

from gnetmdk.config.registry import get_family
from gnetmdk.gti.quantize import image_to_codes
from .image_io import ImageReadError, decode_image, image_complete  # noqa: F401 (their earlier home)
from .voc import read_meta

cv2.setNumThreads(1)


def preprocess_image(img: np.ndarray, image_size: int) -> np.ndarray:
    """The evaluation-time image path: what training's validation, the chip tools and predict.py feed.

    Downscale once to at most 2 x image_size on the long side (INTER_AREA, as the dataset's loader
    does), then resize to image_size x image_size (INTER_AREA). An image already at most 2 x image_size
    (e.g. one the dataset loaded and downscaled) skips the first step, so the result is the same
    whichever of the two paths produced the input.

    Args:
        img: (H, W, 3) uint8 BGR image (see decode_image).
        image_size: network input side in pixels.
    Returns:
        (image_size, image_size, 3) uint8 BGR; turn it into chip codes with
        gnetmdk.gti.quantize.image_to_codes.
    """
    h, w = img.shape[:2]
    limit = 2 * int(image_size)
    if max(h, w) > limit:
        scale = limit / max(h, w)
        img = cv2.resize(img, (max(1, round(w * scale)), max(1, round(h * scale))), interpolation=cv2.INTER_AREA)
    return cv2.resize(img, (int(image_size), int(image_size)), interpolation=cv2.INTER_AREA)


def encode_targets(boxes: np.ndarray, labels: np.ndarray, grid: int, num_classes: int) -> np.ndarray:
    """GNetDet targets (docs/quantization.md, "GNetDet on the chip"): (S, S, 10 + C) float32.

    Each object goes to the cell holding its centre; x, y are the centre's offset inside the cell
    (cell units), w, h relative to the image; both box slots get it, with conf 1 and the one-hot
    class. When two objects share a cell the later one wins (YOLOv1 behaviour).

    Args:
        boxes: (K, 4) float xyxy relative to the image (0..1).
        labels: (K,) int class indices.
    """
    t = np.zeros((grid, grid, 10 + num_classes), dtype=np.float32)
    for (x1, y1, x2, y2), c in zip(boxes, labels):
        w, h = x2 - x1, y2 - y1
        if w <= 0 or h <= 0:
            continue
        cx, cy = (x1 + x2) / 2, (y1 + y2) / 2
        col = min(int(cx * grid), grid - 1)
        row = min(int(cy * grid), grid - 1)
        cell = [cx * grid - col, cy * grid - row, w, h, 1.0]
        t[row, col, 0:5] = cell
        t[row, col, 5:10] = cell
        t[row, col, 10:] = 0
        t[row, col, 10 + int(c)] = 1.0
    return t


def _hsv_jitter(img: np.ndarray, gains: Sequence[float], rng: np.random.Generator) -> np.ndarray:
    r = rng.uniform(-1, 1, 3) * np.asarray(gains, dtype=np.float64) + 1
    hue, sat, val = cv2.split(cv2.cvtColor(img, cv2.COLOR_BGR2HSV))
    x = np.arange(256, dtype=np.float64)
    lut_h = ((x * r[0]) % 180).astype(np.uint8)
    lut_s = np.clip(x * r[1], 0, 255).astype(np.uint8)
    lut_v = np.clip(x * r[2], 0, 255).astype(np.uint8)
    hsv = cv2.merge((cv2.LUT(hue, lut_h), cv2.LUT(sat, lut_s), cv2.LUT(val, lut_v)))
    return cv2.cvtColor(hsv, cv2.COLOR_HSV2BGR)


def _clip_boxes(nb: np.ndarray, size: int, bounds: Optional[np.ndarray] = None) -> Tuple[np.ndarray, np.ndarray]:
    """Clip (K, 4) relative xyxy boxes to the image (or to per-box ``bounds``, (K, 4) xyxy inside it);
    keep those with more than 30% of their area left and at least 2 pixels (of ``size``) on each side.
    Returns (kept boxes float32, keep mask)."""
    if bounds is None:
        clipped = np.clip(nb, 0, 1)
    else:
        clipped = np.empty_like(nb)
        for j in range(4):
            clipped[:, j] = np.clip(nb[:, j], bounds[:, 0 if j % 2 == 0 else 1], bounds[:, 2 if j % 2 == 0 else 3])
    area = (nb[:, 2] - nb[:, 0]) * (nb[:, 3] - nb[:, 1])
    carea = (clipped[:, 2] - clipped[:, 0]) * (clipped[:, 3] - clipped[:, 1])
    keep = (carea > 0.3 * np.maximum(area, 1e-12)) & ((clipped[:, 2] - clipped[:, 0]) * size >= 2) & \
           ((clipped[:, 3] - clipped[:, 1]) * size >= 2)
    return clipped[keep].astype(np.float32), keep


def rotate_quarter(img: np.ndarray, rel: np.ndarray, turns: int) -> Tuple[np.ndarray, np.ndarray]:
    """Turn an image and its boxes counter-clockwise by ``turns`` x 90 degrees (np.rot90's sense).

    Args:
        img: (H, W, 3) uint8.
        rel: (K, 4) float xyxy boxes relative to the image side (0..1).
        turns: number of quarter turns (any integer; taken modulo 4).
    Returns:
        the turned image ((W, H, 3) for an odd number of turns), contiguous, and its (K, 4) relative
        boxes: one counter-clockwise turn maps a point (x, y) to (y, 1 - x), so a box
        (x1, y1, x2, y2) becomes (y1, 1 - x2, y2, 1 - x1).
    """
    turns %= 4
    out = rel.copy()
    for _ in range(turns):
        out = np.stack([out[:, 1], 1 - out[:, 2], out[:, 3], 1 - out[:, 0]], axis=1)
    return np.ascontiguousarray(np.rot90(img, turns)), out


class GNetDetDataset(Dataset):
    """Images and GNetDet targets from a meta file (tools/xml_2_txt.py format).

    Args:
        meta_file: data/meta/<DS_NAME>_train.txt or _valid.txt (unused when ``records`` is given).
        image_dir: folder the meta file's image names are relative to.
        num_classes: C.
        image_size: network input side in pixels (224 or 448).
        grid: output grid side S (14).
        train: apply augmentation (if ``augment``).
        cache: keep decoded (downscaled) images in memory; without augmentation (``train`` or ``augment``
            False) also each finished sample, so later calls return the same tensors (a DataLoader's
            collate copies them; do not change them in place).
        max_images: 0 = all, else the first N records.
        seed: augmentation seed.
        hsv_gain, scale_range, shift_fraction, flip_prob, blur_prob: the per-image augmentation
            (fractions of the image side for the shift; scale per axis).
        rotate_prob: probability that a training image is turned by 90, 180 or 270 degrees (equal odds),
            after the flip: with ``flip_prob`` 0.5 every one of the 8 orientations of the square occurs.
            Boxes stay exact (a quarter turn maps axis-aligned boxes to axis-aligned boxes). For data
            seen from above in any orientation (cards on a table, aerial images); 0 (the default)
            takes no random draw, so the other augmentations are drawn as without it.
        mosaic_prob: probability that a training sample is a mosaic of four augmented images
            (YOLOv4's mosaic, Bochkovskiy et al. 2020): they tile a 2 x image_size canvas and a random
            image_size window of it is the sample, so objects keep their scale; boxes cut by the window
            are clipped, those keeping less than 30% of their area (or under 2 pixels) are dropped.

    ``__getitem__`` returns (image, target, index, (width, height) of the original file; for a mosaic,
    the file of ``index``, its top-left tile): image (3, image_size, image_size) uint8 holding
    the chip's 5-bit codes 0..31 in BGR order (a quarter of float32's bytes between loader processes;
    the trainer turns them into float32 on its device), target (S, S, 10 + C) float32, index int.

    Raises:
        MetaFormatError (from read_meta), ImageReadError: when the meta file or an image is bad.
    """

    def __init__(self, meta_file: str, image_dir: str, num_classes: int, image_size: int = 448, grid: int = 14,
                 train: bool = False, augment: bool = True, cache: bool = False, max_images: int = 0,
                 seed: int = 0, hsv_gain: Sequence[float] = (0.015, 0.5, 0.3),
                 scale_range: Sequence[float] = (0.75, 1.25), shift_fraction: float = 0.15,
                 flip_prob: float = 0.5, blur_prob: float = 0.1, mosaic_prob: float = 0.0,
                 rotate_prob: float = 0.0, records=None, expected_sizes=None):
        for name, value in (("mosaic_prob", mosaic_prob), ("rotate_prob", rotate_prob)):
            if not 0.0 <= float(value) <= 1.0:
                raise ValueError(f"{name} {value} must be in [0, 1]")
        if records is not None:           # from gnetmdk.dataset.records (a meta file or a COCO json)
            self.records = list(records)
        elif not os.path.isfile(meta_file):
            raise FileNotFoundError(f"meta file '{meta_file}' does not exist: run tools/xml_2_txt.py for this "
                                    "dataset first")
        else:
            self.records = read_meta(meta_file, num_classes)
        if max_images and max_images > 0:
            self.records = self.records[:max_images]
        if not self.records:
            from .voc import MetaFormatError
            raise MetaFormatError(f"meta file '{meta_file}' lists no images: run tools/xml_2_txt.py for this dataset "
                                  "again (it refuses to write an empty split and says why)")
        self.meta_file = meta_file
        self.image_dir = image_dir
        self.num_classes = num_classes
        self.image_size = int(image_size)
        self.grid = int(grid)
        self.train = train
        self.augment = augment and train
        self.seed = int(seed)
        self.epoch = 0
        self.hsv_gain = list(hsv_gain)
        self.scale_range = list(scale_range)
        self.shift_fraction = float(shift_fraction)
        self.flip_prob = float(flip_prob)
        self.blur_prob = float(blur_prob)
        self.mosaic_prob = float(mosaic_prob)
        self.rotate_prob = float(rotate_prob)
        self.sizes: List[Optional[Tuple[int, int]]] = [None] * len(self.records)   # original (W, H)
        self.expected_sizes = expected_sizes   # gnetmdk.dataset.records.ExpectedSizes, or None
        self._cache: Optional[List[Tuple[np.ndarray, float]]] = None
        # with ``cache`` and no augmentation (a val split) the finished samples are kept too, the first
        # time each is made: at network size they take less memory than the decoded images, and an
        # evaluation of the shapes demo's 960 val images spent about a tenth of its time remaking them
        self._prepared: Optional[Dict[int, tuple]] = {} if cache and not self.augment else None
        if cache:
            self._cache = [self._load(i) for i in range(len(self.records))]

    def __len__(self) -> int:
        return len(self.records)

    def set_epoch(self, epoch: int) -> None:
        """Select the augmentation draws of ``epoch`` (call before iterating a loader)."""
        self.epoch = int(epoch)

    def image_path(self, index: int) -> str:
        """The image file of sample ``index``: its meta-file name joined to ``image_dir``."""
        return os.path.join(self.image_dir, self.records[index][0])

    def ground_truth(self, index: int) -> Dict[str, np.ndarray]:
        """Original-pixel ground truth of one image: ``boxes`` (K, 4) float32 xyxy, ``labels`` (K,) int64."""
        _, boxes, labels = self.records[index]
        return {"boxes": boxes.astype(np.float32), "labels": labels.astype(np.int64)}

    def original_size(self, index: int) -> Tuple[int, int]:
        """(width, height) in pixels of the image file."""
        if self.sizes[index] is None:
            self._load(index)
        return self.sizes[index]  # type: ignore[return-value]

    def _load(self, index: int) -> Tuple[np.ndarray, float]:
        """Decode and downscale to at most 2 x image_size on the long side; returns (image, scale)."""
        img = decode_image(self.image_path(index))
        h, w = img.shape[:2]
        if self.expected_sizes is not None:
            self.expected_sizes.check(index, self.image_path(index), w, h)
        self.sizes[index] = (w, h)
        limit = 2 * self.image_size
        scale = 1.0
        if max(h, w) > limit:
            scale = limit / max(h, w)
            img = cv2.resize(img, (max(1, round(w * scale)), max(1, round(h * scale))), interpolation=cv2.INTER_AREA)
        return img, scale

    def load_image(self, index: int) -> np.ndarray:
        """The (downscaled) uint8 BGR image of ``index``, from the cache when present."""
        if self._cache is not None:
            return self._cache[index][0]
        return self._load(index)[0]

    def prepare(self, index: int, rng: Optional[np.random.Generator] = None, clip: bool = True):
        """Image (S, S, 3) uint8 BGR at network size and boxes (K, 4) relative xyxy, labels (K,).

        With ``clip`` False (mosaic tiles) the augmented boxes are returned unclipped, all of them."""
        img = self.load_image(index)
        h, w = img.shape[:2]
        ow, oh = self.original_size(index)
        _, boxes, labels = self.records[index]
        rel = boxes.astype(np.float64) / np.array([ow, oh, ow, oh], dtype=np.float64)
        size = self.image_size
        if rng is None:
            out = preprocess_image(img, size)
            return out, rel.astype(np.float32), labels
        img = _hsv_jitter(img, self.hsv_gain, rng)
        if rng.random() < self.blur_prob:
            img = cv2.GaussianBlur(img, (3, 3), 0)
        if rng.random() < self.flip_prob:
            img = np.ascontiguousarray(img[:, ::-1])
            rel = rel[:, [2, 1, 0, 3]].copy()
            rel[:, 0], rel[:, 2] = 1 - rel[:, 0], 1 - rel[:, 2]
        if self.rotate_prob > 0 and rng.random() < self.rotate_prob:
            img, rel = rotate_quarter(img, rel, int(rng.integers(1, 4)))
            h, w = img.shape[:2]
        sx, sy = rng.uniform(self.scale_range[0], self.scale_range[1], 2)
        tx, ty = rng.uniform(-self.shift_fraction, self.shift_fraction, 2)
        # output pixel = (rel * s + (1 - s)/2 + t) * size
        m = np.array([[sx * size / w, 0, ((1 - sx) / 2 + tx) * size],
                      [0, sy * size / h, ((1 - sy) / 2 + ty) * size]], dtype=np.float64)
        out = cv2.warpAffine(img, m, (size, size), flags=cv2.INTER_LINEAR, borderMode=cv2.BORDER_CONSTANT,
                             borderValue=(114, 114, 114))
        nb = rel.copy()
        nb[:, [0, 2]] = nb[:, [0, 2]] * sx + (1 - sx) / 2 + tx
        nb[:, [1, 3]] = nb[:, [1, 3]] * sy + (1 - sy) / 2 + ty
        if not clip:
            return out, nb, labels
        boxes, keep = _clip_boxes(nb, size)
        return out, boxes, labels[keep]

    def prepare_mosaic(self, index: int, rng: np.random.Generator):
        """A mosaic sample: ``index`` and three images drawn by ``rng``, each augmented as in prepare,
        tile a (2S, 2S) canvas (index top-left); the sample is the S x S window at a random offset in
        [0, S] on each axis. Returns what prepare returns."""
        size = self.image_size
        others = rng.integers(0, len(self.records), 3)
        canvas = np.empty((2 * size, 2 * size, 3), dtype=np.uint8)
        tiles = []
        for k, i in enumerate([index, *others.tolist()]):
            img, rel, lab = self.prepare(int(i), rng, clip=False)
            r, c = divmod(k, 2)
            canvas[r * size:(r + 1) * size, c * size:(c + 1) * size] = img
            tiles.append((r, c, rel, lab))
        ox, oy = (int(v) for v in rng.integers(0, size + 1, 2))
        out = np.ascontiguousarray(canvas[oy:oy + size, ox:ox + size])
        all_boxes, all_bounds, all_labels = [], [], []
        for r, c, rel, lab in tiles:
            # tile-relative -> window-relative; a box is clipped once, to its tile inside the window
            off = np.array([c * size - ox, r * size - oy] * 2, dtype=np.float64) / size
            all_boxes.append(rel.astype(np.float64) + off)
            tile = np.clip(off + np.array([0, 0, 1, 1], dtype=np.float64), 0, 1)
            all_bounds.append(np.repeat(tile[None], len(rel), axis=0))
            all_labels.append(lab)
        boxes, keep = _clip_boxes(np.concatenate(all_boxes), size, np.concatenate(all_bounds))
        return out, boxes, np.concatenate(all_labels)[keep]

    def rng_for(self, index: int, epoch: Optional[int] = None) -> np.random.Generator:
        """The augmentation generator of (seed, epoch, index); ``epoch`` defaults to set_epoch's."""
        return np.random.default_rng([self.seed, self.epoch if epoch is None else int(epoch), int(index)])

    def __getitem__(self, key):
        """``key``: an index, or ``(index, epoch)`` (EpochBatches: the epoch travels with the index, so
        persistent loader workers, which keep their own copy of the dataset, draw that epoch's
        augmentation). Returns (image (3, S, S) uint8 codes, target, index, (width, height)); see the
        class docstring."""
        index, epoch = (int(key[0]), int(key[1])) if isinstance(key, tuple) else (int(key), None)   # (i, epoch[, batch])
        if self._prepared is not None:      # cache without augmentation: every call gives the same sample
            hit = self._prepared.get(index)
            if hit is not None:
                return hit
        rng = self.rng_for(index, epoch) if self.augment else None
        if rng is not None and self.mosaic_prob > 0 and rng.random() < self.mosaic_prob:
            img, boxes, labels = self.prepare_mosaic(index, rng)
        else:
            img, boxes, labels = self.prepare(index, rng)
        codes = image_to_codes(img)
        image = torch.from_numpy(np.ascontiguousarray(codes.transpose(2, 0, 1)))
        target = torch.from_numpy(encode_targets(boxes, labels, self.grid, self.num_classes))
        sample = image, target, index, self.original_size(index)
        if self._prepared is not None:
            self._prepared[index] = sample
        return sample


def collate(batch):
    """Stack samples: images (N, 3, S, S) uint8 (codes), targets (N, G, G, 10+C) float32, indices (N,)
    int64, original sizes (N, 2) int64 as (width, height) pixels."""
    images = torch.stack([b[0] for b in batch])
    targets = torch.stack([b[1] for b in batch])
    indices = torch.tensor([b[2] for b in batch], dtype=torch.int64)
    sizes = torch.tensor([b[3] for b in batch], dtype=torch.int64)
    return images, targets, indices, sizes


def seed_worker(worker_id: int) -> None:
    """DataLoader worker_init_fn: seed numpy/random from torch's per-worker seed (itself from the loader's generator)."""
    seed = torch.initial_seed() % 2 ** 32
    np.random.seed(seed)
    random.seed(seed)


def build_dataset(cfg, split: str):
    """The dataset of ``split`` ("train" or "valid") the config's model family reads
    (DetectorFamily.build_dataset: GNetDet's :class:`GNetDetDataset`, PP-YOLO's
    gnetmdk.dataset.ppyolo_dataset.PPYOLODataset), the family looked up in gnetmdk.config.registry."""
    return get_family(cfg.model_name).build_dataset(cfg, split)


#: the earlier name of :class:`GNetDetDataset` (scripts written against it keep working)
DetectionDataset = GNetDetDataset


def build_gnetdet_dataset(cfg, split: str) -> GNetDetDataset:
    """GNetDetDataset of ``split`` ("train" or "valid") from a resolved config (records from the meta
    file or the COCO json: gnetmdk.dataset.records)."""
    from .records import load_split
    train = split == "train"
    records, sizes = load_split(cfg, split)
    g = cfg.gnetdet                     # GNetDet's augmentation settings
    return GNetDetDataset(
        cfg.train_meta if train else cfg.valid_meta, os.path.join(cfg.dataset_dir, cfg.image_dir),
        cfg.num_classes, cfg.image_size, cfg.grid_size, train=train, augment=cfg.augment, cache=cfg.cache_images,
        max_images=cfg.max_train_images if train else cfg.max_val_images, seed=cfg.seed,
        hsv_gain=g.hsv_gain, scale_range=g.scale_range, shift_fraction=g.shift_fraction,
        flip_prob=g.flip_prob, blur_prob=g.blur_prob, mosaic_prob=g.mosaic_prob,
        rotate_prob=g.rotate_prob, records=records, expected_sizes=sizes)
