"""A small synthetic VOC-format detection dataset of filled shapes (circle, square, triangle).

Meant for fast end-to-end checks: a small detector should reach a high mAP on it in minutes on a CPU.
The colour of a shape is random and independent of its class, so only the shape tells the class.
Output is deterministic: the same arguments give byte-identical annotations and identical decoded
pixels (the JPEGs are written by OpenCV with a fixed quality).
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict
from typing import Sequence

import cv2
import numpy as np

from .voc import write_voc_xml

__all__ = ["SHAPE_CLASSES", "make_shapes_dataset"]

SHAPE_CLASSES = ("circle", "square", "triangle")

_SPLIT_CODE = {"train": 0, "val": 1}


def _pick_colour(rng: np.random.Generator, background: np.ndarray) -> np.ndarray:
    """A saturated colour that stands out from the background (BGR, uint8 range)."""
    for _ in range(100):
        hue = int(rng.integers(0, 180))
        sat = int(rng.integers(150, 256))
        val = int(rng.integers(150, 256))
        bgr = cv2.cvtColor(np.uint8([[[hue, sat, val]]]), cv2.COLOR_HSV2BGR)[0, 0].astype(np.int32)
        if np.abs(bgr - background).sum() >= 180:
            return bgr
    return 255 - background  # the complement always contrasts


def _overlap_ok(box, placed, max_cover: float = 0.25) -> bool:
    """Centres in distinct places and only mild overlap with every already placed box."""
    x1, y1, x2, y2 = box
    cx, cy, side = (x1 + x2) / 2, (y1 + y2) / 2, max(x2 - x1, y2 - y1)
    area = (x2 - x1) * (y2 - y1)
    for px1, py1, px2, py2 in placed:
        pcx, pcy = (px1 + px2) / 2, (py1 + py2) / 2
        if math.hypot(cx - pcx, cy - pcy) < 0.5 * max(side, px2 - px1, py2 - py1):
            return False
        iw = min(x2, px2) - max(x1, px1)
        ih = min(y2, py2) - max(y1, py1)
        if iw > 0 and ih > 0:
            if iw * ih > max_cover * min(area, (px2 - px1) * (py2 - py1)):
                return False
    return True


def _draw(image: np.ndarray, kind: str, x: int, y: int, side: int, colour, flip: bool):
    """Draw one filled shape in the square [x, x+side) x [y, y+side); return its tight box."""
    c = tuple(int(v) for v in colour)
    if kind == "circle":
        r = side // 2
        cx, cy = x + r, y + r
        cv2.circle(image, (cx, cy), r, c, thickness=-1, lineType=cv2.LINE_AA)
        return [cx - r, cy - r, cx + r + 1, cy + r + 1]
    if kind == "square":
        cv2.rectangle(image, (x, y), (x + side - 1, y + side - 1), c, thickness=-1)
        return [x, y, x + side, y + side]
    if kind == "triangle":
        h = max(2, int(round(side * math.sqrt(3) / 2)))
        top = y + (side - h) // 2
        base_y, apex_y = (top + h - 1, top) if not flip else (top, top + h - 1)
        pts = np.array([[x, base_y], [x + side - 1, base_y], [x + (side - 1) // 2, apex_y]], np.int32)
        cv2.fillPoly(image, [pts], c, lineType=cv2.LINE_AA)
        return [x, top, x + side, top + h]
    raise ValueError(f"unknown shape {kind!r}; choose from {SHAPE_CLASSES}")


def _make_image(rng: np.random.Generator, size_range, classes, max_objects: int, min_objects: int = 1,
                side_px=None, upright: bool = False):
    lo, hi = size_range
    width, height = int(rng.integers(lo, hi + 1)), int(rng.integers(lo, hi + 1))

    background = rng.integers(0, 256, size=3).astype(np.int32)
    # a gentle linear gradient so the background is not perfectly flat
    gx, gy = rng.uniform(-30, 30, size=2)
    ramp = (np.linspace(-0.5, 0.5, width)[None, :, None] * gx
            + np.linspace(-0.5, 0.5, height)[:, None, None] * gy)
    image = np.clip(background[None, None, :] + ramp, 0, 255).astype(np.uint8)
    image = np.ascontiguousarray(image)

    short = min(width, height)
    placed, objects = [], []
    for _ in range(int(rng.integers(min_objects, max_objects + 1))):
        kind = classes[int(rng.integers(0, len(classes)))]
        colour = _pick_colour(rng, background)
        flip = bool(rng.integers(0, 2)) and not upright     # drawn either way: the same stream of draws
        for _try in range(30):
            if side_px is None:
                side = int(round(rng.uniform(0.15, 0.45) * short))
            else:
                side = int(rng.integers(side_px[0], side_px[1] + 1))
            x = int(rng.integers(2, width - side - 2))
            y = int(rng.integers(2, height - side - 2))
            probe = [x, y, x + side, y + side]
            if _overlap_ok(probe, placed):
                break
        else:
            continue
        box = _draw(image, kind, x, y, side, colour, flip)
        placed.append(probe)
        objects.append((kind, *box, False))

    if not objects:  # cannot happen for the first object, kept as a guard
        raise RuntimeError("no shape could be placed")
    noise = rng.normal(0.0, 6.0, size=image.shape)
    image = np.clip(image.astype(np.float64) + noise, 0, 255).astype(np.uint8)
    return image, objects


def make_shapes_dataset(
    out_dir: str,
    num_train: int = 240,
    num_val: int = 60,
    image_size: int | tuple[int, int] = (256, 320),
    seed: int = 0,
    classes: Sequence[str] = SHAPE_CLASSES,
    max_objects: int = 3,
    jpeg_quality: int = 95,
    min_objects: int = 1,
    side_px: tuple[int, int] | None = None,
    upright: bool = False,
) -> dict:
    """Write a synthetic VOC dataset of filled circles, squares and triangles.

    Layout under ``out_dir``: ``JPEGImages/<id>.jpg``, ``Annotations/<id>.xml``,
    ``ImageSets/Main/train.txt`` and ``val.txt``; ids are ``train_00000`` ... and ``val_00000`` ...
    Existing files with the same names are overwritten; other files are left alone.

    Each image: width and height drawn independently from ``image_size`` (``(lo, hi)`` pixels,
    inclusive, or one int for fixed squares), a random background colour with a gentle gradient and
    Gaussian noise (sigma 6), ``min_objects`` to ``max_objects`` shapes (fewer when one finds no
    place in 30 tries) with sides of 15-45 % of the shorter image side, or ``side_px`` = (lo, hi)
    pixels when given, random saturated colours, centres apart and only mild overlap. Boxes are tight
    integer pixel boxes ``x1 y1 x2 y2`` (x2/y2 one past the last covered pixel). A triangle points up
    or down at random, or always up with ``upright`` (its box, and every other pixel and box of the
    dataset, the same either way: the random draws are the same).

    The dense small-object case (``tools/make_shapes.py --dense``): 448 px squares, 30-80 shapes of
    4-16 px: several objects share a 32-px grid cell at times, and the smallest are a few pixels
    wide once the image is resized.

    Deterministic: image ``i`` of a split depends only on ``(seed, split, i)`` and the size range.

    Returns:
        ``{"out_dir", "classes", "splits": {"train"|"val": {"images", "boxes", "per_class"}}}``.

    Raises:
        ValueError: unknown class name, bad counts or sizes.
    """
    classes = tuple(classes)
    unknown = [c for c in classes if c not in SHAPE_CLASSES]
    if unknown or not classes:
        raise ValueError(f"classes must be a non-empty subset of {SHAPE_CLASSES}, got {classes}")
    if isinstance(image_size, int):
        image_size = (image_size, image_size)
    lo, hi = int(image_size[0]), int(image_size[1])
    if lo < 32 or hi < lo:
        raise ValueError(f"image_size range must satisfy 32 <= lo <= hi, got {image_size}")
    if num_train < 0 or num_val < 0 or not 1 <= min_objects <= max_objects:
        raise ValueError("num_train/num_val must be >= 0 and 1 <= min_objects <= max_objects")
    if side_px is not None and not (2 <= int(side_px[0]) <= int(side_px[1]) <= lo - 8):
        raise ValueError(f"side_px must satisfy 2 <= lo <= hi <= smallest image side - 8, got {side_px}")

    out_dir = str(out_dir)
    img_dir = os.path.join(out_dir, "JPEGImages")
    ann_dir = os.path.join(out_dir, "Annotations")
    set_dir = os.path.join(out_dir, "ImageSets", "Main")
    for d in (img_dir, ann_dir, set_dir):
        os.makedirs(d, exist_ok=True)

    params = [int(cv2.IMWRITE_JPEG_QUALITY), int(jpeg_quality)]
    report = {"out_dir": out_dir, "classes": list(classes), "splits": OrderedDict()}
    for split, count in (("train", num_train), ("val", num_val)):
        ids = []
        stats = {"images": 0, "boxes": 0, "per_class": OrderedDict((c, 0) for c in classes)}
        for i in range(count):
            rng = np.random.default_rng([int(seed), _SPLIT_CODE[split], i])
            image, objects = _make_image(rng, (lo, hi), classes, max_objects, min_objects, side_px, upright)
            stem = f"{split}_{i:05d}"
            if not cv2.imwrite(os.path.join(img_dir, stem + ".jpg"), image, params):
                raise OSError(f"could not write {os.path.join(img_dir, stem + '.jpg')}")
            h, w = image.shape[:2]
            write_voc_xml(os.path.join(ann_dir, stem + ".xml"), stem + ".jpg", w, h, objects)
            ids.append(stem)
            stats["images"] += 1
            stats["boxes"] += len(objects)
            for obj in objects:
                stats["per_class"][obj[0]] += 1
        with open(os.path.join(set_dir, f"{split}.txt"), "w", encoding="utf-8", newline="\n") as fh:
            fh.write("".join(s + "\n" for s in ids))
        report["splits"][split] = stats
    return report
