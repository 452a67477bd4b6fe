"""Where a split's images and boxes come from, for every model family: the meta files of
tools/xml_2_txt.py, or COCO-json annotation files (``train_json`` / ``val_json``, e.g.
PaddleDetection's ``voc2012_train.json``; tools/xml_2_json.py writes them from a VOC folder).

Both give the same records: ``(image_name, boxes float32 (K, 4) xyxy pixels, labels int64 (K,))``,
image names relative to ``<dataset_dir>/<image_dir>``.
"""
from __future__ import annotations

import os
from typing import List, Optional, Tuple

import numpy as np

from .voc import MetaFormatError, read_meta

Record = Tuple[str, np.ndarray, np.ndarray]


def split_source(cfg, split: str) -> str:
    """The annotation file of ``split`` ("train" or "valid"): the COCO json when the config names one,
    else the meta file."""
    json_path = cfg.train_json if split == "train" else cfg.val_json
    return json_path or (cfg.train_meta if split == "train" else cfg.valid_meta)


def load_records(cfg, split: str) -> List[Record]:
    """The records of ``split`` ("train" or "valid"), at most ``max_train_images`` / ``max_val_images``
    (:func:`load_split` without the sizes)."""
    return load_split(cfg, split)[0]


def load_split(cfg, split: str) -> Tuple[List[Record], Optional["ExpectedSizes"]]:
    """The records of ``split`` ("train" or "valid"), at most ``max_train_images`` / ``max_val_images``,
    and the image sizes their boxes were written for (the COCO json's ``width``/``height``; for a meta
    file, the record tools/xml_2_txt.py keeps beside it: gnetmdk.dataset.voc.read_sizes), which the
    datasets compare with every image they decode; None for a meta file written without that record.

    Raises:
        FileNotFoundError: the annotation file does not exist (the message says what writes it).
        MetaFormatError: a malformed meta file or size record, or an empty split.
        CocoFormatError: a malformed COCO json, or categories that differ from VOC_CLASSES.
    """
    path = split_source(cfg, split)
    if not os.path.isfile(path):
        maker = ("tools/xml_2_json.py" if path.endswith(".json") else "tools/xml_2_txt.py")
        raise FileNotFoundError(f"annotation file '{path}' does not exist: run {maker} for this dataset first")
    if path.endswith(".json"):
        from .coco import read_coco_json
        data = read_coco_json(path, list(cfg.VOC_CLASSES))
        records, sizes = list(data.records), ExpectedSizes([tuple(s) for s in data.sizes], path,
                                                           "fix its width and height, or write it again with "
                                                           "tools/xml_2_json.py")
    else:
        from .voc import read_sizes, sizes_path
        records = read_meta(path, cfg.num_classes)
        known = read_sizes(path)
        sizes = None if known is None else ExpectedSizes([known.get(r[0]) for r in records], sizes_path(path),
                                                         "run tools/xml_2_txt.py again")
    limit = cfg.max_train_images if split == "train" else cfg.max_val_images
    if limit and limit > 0:
        records = records[:limit]
        if sizes is not None:
            sizes.sizes = sizes.sizes[:limit]
    if not records:
        raise MetaFormatError(f"annotation file '{path}' lists no images: run tools/xml_2_txt.py (or xml_2_json.py) "
                              "for this dataset again (it refuses to write an empty split and says why)")
    return records, sizes


class ExpectedSizes:
    """The (width, height) each record's boxes were written for, and how to say that an image differs.

    Args:
        sizes: per record, (width, height) or None (not recorded).
        source: the file that recorded them.
        fix: what to do when an image differs.
    """

    def __init__(self, sizes: List[Optional[Tuple[int, int]]], source: str, fix: str):
        self.sizes, self.source, self.fix = list(sizes), source, fix

    def check(self, index: int, path: str, width: int, height: int) -> None:
        """Refuse an image whose decoded size is not the recorded one.

        Raises:
            gnetmdk.dataset.image_io.ImageReadError: naming the image, both sizes, the record and the fix.
        """
        want = self.sizes[index] if index < len(self.sizes) else None
        if want is not None and (int(want[0]), int(want[1])) != (width, height):
            from .image_io import ImageReadError
            raise ImageReadError(
                f"image '{path}' is {width}x{height} pixels, but '{self.source}' says {want[0]}x{want[1]}: the image "
                f"changed after its boxes were written, which would put them elsewhere; {self.fix}")
