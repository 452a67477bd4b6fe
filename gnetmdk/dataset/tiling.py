"""Cut a VOC dataset into tiles, and the manifest that maps detections on tiles back onto the images.

GNetDet's output grid has a fixed number of cells (14 x 14) whatever the input size, so objects much
smaller than a cell cannot be helped by a larger ``image_size``; cropping each image into ``n x n``
tiles, each resized to ``image_size``, enlarges every object ``n``-fold relative to the grid
(tools/xml_2_txt.py names the ``n`` a dataset needs). This module writes such a tiled copy of a VOC
dataset (tools/tile_voc.py) and a manifest, ``tiles.json``, from which
gnetmdk.evaluation.stitch evaluates a model on the whole images: every tile is run, its detections
are shifted back, and NMS across the tile seams merges them (as SAHI does, Akyon et al. 2022,
"Slicing Aided Hyper Inference").

Tile geometry: ``n`` tiles per row and column of equal size, the first at the image's left (top)
edge, the last at its right (bottom) edge, neighbours overlapping by at least ``overlap`` pixels. A box
is labelled in a tile when at least ``min_visible`` of its area lies inside it (clipped to the tile);
with ``overlap`` at least the largest box side, every box lies whole in some tile.

The manifest is plain JSON (no pickled objects)::

    {"format": "gnetmdk-tiles/1", "tiles": n, "overlap": px, "min_visible": f,
     "image_dir": "JPEGImages", "classes": [...],
     "images": {source_id: {"split": "train" | "val", "width": W, "height": H,
                            "objects": [[name, x1, y1, x2, y2, difficult], ...],
                            "tiles": {tile_id: [x0, y0, x1, y1], ...}}, ...}}
"""
from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from .voc import VOCFormatError, _find_image, _split_ids, parse_voc_xml, write_voc_xml

__all__ = ["MANIFEST", "MANIFEST_FORMAT", "tile_rects", "crop_boxes", "tile_voc_dataset", "load_manifest"]

#: the manifest's file name in the tiled dataset's root
MANIFEST = "tiles.json"
MANIFEST_FORMAT = "gnetmdk-tiles/1"


def tile_rects(width: int, height: int, n: int, overlap: int = 0) -> List[Tuple[int, int, int, int]]:
    """The ``n x n`` tiles of a ``width x height`` image, row by row.

    Args:
        width, height: image size in pixels.
        n: tiles per row and per column (1 gives the whole image).
        overlap: the least overlap of neighbouring tiles in pixels.

    Returns:
        ``[(x0, y0, x1, y1), ...]`` integer pixels (x1, y1 exclusive), ``n * n`` of them; all tiles have
        one size, ``ceil((side + (n - 1) overlap) / n)`` per axis, and evenly spread origins.

    Raises:
        ValueError: ``n < 1``, ``overlap < 0``, or a tile that would not be larger than the overlap or
            would be under 2 pixels (the message names the sizes).
    """
    n, overlap = int(n), int(overlap)
    if n < 1:
        raise ValueError(f"tiles per side must be at least 1, got {n}")
    if overlap < 0:
        raise ValueError(f"overlap must be >= 0 pixels, got {overlap}")
    starts = []
    sizes = []
    for side in (int(width), int(height)):
        t = min(side, math.ceil((side + (n - 1) * overlap) / n))
        if n > 1 and (t <= overlap or t < 2):
            raise ValueError(f"{n} tiles per side with overlap {overlap} px do not fit a side of {side} px: "
                             "use fewer tiles or less overlap")
        sizes.append(t)
        starts.append([0] if n == 1 else [round(i * (side - t) / (n - 1)) for i in range(n)])
    (tw, th), (xs, ys) = sizes, starts
    return [(x, y, x + tw, y + th) for y in ys for x in xs]


def crop_boxes(boxes: np.ndarray, rect: Sequence[int], min_visible: float = 0.5) -> Tuple[np.ndarray, np.ndarray]:
    """The boxes labelled in one tile.

    Args:
        boxes: (K, 4) xyxy pixels of the image (any float or int dtype).
        rect: the tile ``(x0, y0, x1, y1)`` in image pixels.
        min_visible: the least share of a box's area inside the tile for it to be labelled there.

    Returns:
        (cropped (M, 4) float64 xyxy in tile pixels, clipped to the tile; index (M,) int64 of each in
        ``boxes``).
    """
    b = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
    x0, y0, x1, y1 = (float(v) for v in rect)
    c = np.stack([np.clip(b[:, 0], x0, x1), np.clip(b[:, 1], y0, y1),
                  np.clip(b[:, 2], x0, x1), np.clip(b[:, 3], y0, y1)], axis=1)
    inside = np.clip(c[:, 2] - c[:, 0], 0, None) * np.clip(c[:, 3] - c[:, 1], 0, None)
    area = np.clip(b[:, 2] - b[:, 0], 0, None) * np.clip(b[:, 3] - b[:, 1], 0, None)
    keep = (inside > 0) & (inside >= min_visible * area)
    idx = np.nonzero(keep)[0].astype(np.int64)
    return c[idx] - np.array([x0, y0, x0, y0]), idx


def _whole_in(boxes: np.ndarray, rect: Sequence[int]) -> np.ndarray:
    b = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
    return (b[:, 0] >= rect[0]) & (b[:, 1] >= rect[1]) & (b[:, 2] <= rect[2]) & (b[:, 3] <= rect[3])


def tile_voc_dataset(src: str, dst: str, class_names: Sequence[str], tiles: int, overlap: int = 0,
                     min_visible: float = 0.5, val_fraction: float = 0.2, seed: int = 0,
                     image_dir: str = "JPEGImages", ann_dir: str = "Annotations",
                     fold: Optional[Tuple[int, int]] = None) -> dict:
    """Write the ``tiles x tiles`` tiled copy of the VOC dataset ``src`` to ``dst``.

    ``dst`` gets ``JPEGImages/<id>_r<row>c<col>.png`` (lossless crops of the decoded image),
    ``Annotations/`` with each tile's boxes (:func:`crop_boxes`, rounded to integer pixels, the
    ``difficult`` flags kept), ``ImageSets/Main/{train,val}.txt`` listing the tiles of each source
    image in that image's split (``src``'s lists, or the seeded random split tools/xml_2_txt.py would
    make: the tiles of one image never straddle the splits), and :data:`MANIFEST`.

    Everything is written under a temporary folder beside ``dst`` that is renamed into place at the
    end: a failed run leaves nothing.

    Args:
        src: VOC root with ``image_dir`` and ``ann_dir``.
        dst: the new dataset's root; must not exist.
        class_names: the classes (objects of other classes are an error, as in tools/xml_2_txt.py).
        tiles: n (n x n tiles per image); overlap, min_visible: see :func:`tile_rects`, :func:`crop_boxes`.
        val_fraction, seed: the random split used when ``src`` has no ImageSets lists.
        fold: ``(I, K)``: that split's I-th of K disjoint val folds instead (gnetmdk.dataset.voc._split_ids).

    Returns:
        {"dst", "images", "tiles", "boxes" (source boxes), "tile_boxes" (labels written), "not_whole"
        (source boxes whole in no tile), "max_side" (the largest box side, pixels), "split_source"}.

    Raises:
        VOCFormatError: a bad annotation or image of ``src`` (the message names the file), or a
            missing ``src`` folder. FileExistsError: ``dst`` exists. ValueError: bad tiling values, or a bad ``fold``.
    """
    if not 0.0 <= float(min_visible) <= 1.0:
        raise ValueError(f"min_visible must be in [0, 1], got {min_visible}")
    src_ann, src_img = os.path.join(src, ann_dir), os.path.join(src, image_dir)
    for folder in (src_ann, src_img):
        if not os.path.isdir(folder):
            raise VOCFormatError(f"{folder}: no such folder; tile a VOC dataset root (with {image_dir}/ and "
                                 f"{ann_dir}/)", folder)
    if os.path.exists(dst):
        raise FileExistsError(f"{dst} exists: remove it or name a new folder for the tiled dataset")
    from .image_io import ImageReadError, decode_image
    import cv2
    train_ids, val_ids, split_source = _split_ids(src, src_ann, val_fraction, seed, fold)
    parent = os.path.dirname(os.path.abspath(dst))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tiling-", dir=parent)
    report = {"dst": dst, "images": 0, "tiles": 0, "boxes": 0, "tile_boxes": 0, "not_whole": 0, "max_side": 0.0,
              "split_source": split_source}
    manifest = {"format": MANIFEST_FORMAT, "tiles": int(tiles), "overlap": int(overlap),
                "min_visible": float(min_visible), "image_dir": image_dir, "classes": list(class_names),
                "images": {}}
    try:
        for sub in (image_dir, ann_dir, os.path.join("ImageSets", "Main")):
            os.makedirs(os.path.join(tmp, sub))
        lists: Dict[str, List[str]] = {"train": [], "val": []}
        for split, ids in (("train", train_ids), ("val", val_ids)):
            for stem in ids:
                xml_path = os.path.join(src_ann, stem + ".xml")
                if not os.path.isfile(xml_path):
                    raise VOCFormatError(f"{xml_path}: listed in the {split} split but missing; fix "
                                         "ImageSets/Main or add the annotation", xml_path)
                ann = parse_voc_xml(xml_path, class_names, keep_difficult=True)
                name = _find_image(src_img, ann["filename"], stem)
                if name is None:
                    raise VOCFormatError(f"{xml_path}: no image for it in {src_img}", xml_path)
                try:
                    img = decode_image(os.path.join(src_img, name), fix="replace the image or drop the annotation")
                except ImageReadError as exc:
                    raise VOCFormatError(f"{xml_path}: {exc}", xml_path) from None
                h, w = img.shape[:2]
                if (w, h) != (ann["width"], ann["height"]):
                    raise VOCFormatError(f"{xml_path}: <size> says {ann['width']}x{ann['height']} but the image "
                                         f"decodes to {w}x{h}: re-annotate or restore the annotated image", xml_path)
                boxes = np.asarray(ann["boxes"], dtype=np.float64).reshape(-1, 4)
                labels, difficult = ann["labels"], ann["difficult"]
                rects = tile_rects(w, h, tiles, overlap)
                whole = np.zeros(len(boxes), dtype=bool)
                entry = {"split": split, "width": w, "height": h,
                         "objects": [[class_names[c], *map(int, b), bool(d)]
                                     for b, c, d in zip(boxes, labels, difficult)],
                         "tiles": {}}
                for k, rect in enumerate(rects):
                    tid = f"{stem}_r{k // tiles}c{k % tiles}"
                    crop = img[rect[1]:rect[3], rect[0]:rect[2]]
                    if not cv2.imwrite(os.path.join(tmp, image_dir, tid + ".png"), crop):
                        raise OSError(f"cannot write the tile {tid}.png under {tmp}")
                    cb, idx = crop_boxes(boxes, rect, min_visible)
                    whole |= _whole_in(boxes, rect)
                    objs = []
                    for b, i in zip(np.rint(cb).astype(int), idx):
                        if b[2] > b[0] and b[3] > b[1]:         # rounding can close a sliver
                            objs.append((class_names[labels[i]], *map(int, b), difficult[i]))
                    write_voc_xml(os.path.join(tmp, ann_dir, tid + ".xml"), tid + ".png",
                                  rect[2] - rect[0], rect[3] - rect[1], objs, depth=crop.shape[2])
                    entry["tiles"][tid] = list(map(int, rect))
                    lists[split].append(tid)
                    report["tiles"] += 1
                    report["tile_boxes"] += len(objs)
                manifest["images"][stem] = entry
                report["images"] += 1
                report["boxes"] += len(boxes)
                report["not_whole"] += int((~whole).sum())
                if len(boxes):
                    report["max_side"] = max(report["max_side"], float(np.max(boxes[:, 2:] - boxes[:, :2])))
        for split, ids in lists.items():
            with open(os.path.join(tmp, "ImageSets", "Main", f"{split}.txt"), "w", encoding="utf-8") as fh:
                fh.write("".join(t + "\n" for t in ids))
        with open(os.path.join(tmp, MANIFEST), "w", encoding="utf-8") as fh:
            json.dump(manifest, fh, indent=1)
        os.rename(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return report


def load_manifest(dataset_dir: str) -> dict:
    """The tiling manifest of a dataset written by :func:`tile_voc_dataset` (plain JSON).

    Raises:
        FileNotFoundError: ``dataset_dir`` holds no manifest (it is not a tiled dataset; the message
            names tools/tile_voc.py). VOCFormatError: a manifest that is not JSON or not in this format.
    """
    path = os.path.join(dataset_dir, MANIFEST)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} does not exist: {dataset_dir} is not a tiled dataset (tools/tile_voc.py "
                                "writes one with its manifest)")
    try:
        with open(path, "r", encoding="utf-8") as fh:
            m = json.load(fh)
    except (OSError, ValueError) as exc:
        raise VOCFormatError(f"{path}: unreadable manifest ({exc}); tile the dataset again", path) from None
    if not isinstance(m, dict) or m.get("format") != MANIFEST_FORMAT or not isinstance(m.get("images"), dict):
        raise VOCFormatError(f"{path}: not a {MANIFEST_FORMAT} manifest; tile the dataset again with tools/tile_voc.py",
                             path)
    return m
