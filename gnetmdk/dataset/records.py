"""Where a split's images and boxes come from, for every model family: the meta files of
tools/xml_2_txt.py, or COCO-json annotation files (``train_json`` / ``val_json``, e.g.
PaddleDetection's ``voc2012_train.json``; tools/xml_2_json.py writes them from a VOC folder).

Both give the same records: ``(image_name, boxes float32 (K, 4) xyxy pixels, labels int64 (K,))``,
image names relative to ``<dataset_dir>/<image_dir>``.
"""
from __future__ import annotations

import os
from typing import List, Tuple

import numpy as np

from .voc import MetaFormatError, read_meta

Record = Tuple[str, np.ndarray, np.ndarray]


def split_source(cfg, split: str) -> str:
    """The annotation file of ``split`` ("train" or "valid"): the COCO json when the config names one,
    else the meta file."""
    json_path = cfg.train_json if split == "train" else cfg.val_json
    return json_path or (cfg.train_meta if split == "train" else cfg.valid_meta)


def load_records(cfg, split: str) -> List[Record]:
    """The records of ``split`` ("train" or "valid"), at most ``max_train_images`` / ``max_val_images``.

    Raises:
        FileNotFoundError: the annotation file does not exist (the message says what writes it).
        MetaFormatError: a malformed meta file, or an empty split.
        CocoFormatError: a malformed COCO json, or categories that differ from VOC_CLASSES.
    """
    path = split_source(cfg, split)
    if not os.path.isfile(path):
        maker = ("tools/xml_2_json.py" if path.endswith(".json") else "tools/xml_2_txt.py")
        raise FileNotFoundError(f"annotation file '{path}' does not exist: run {maker} for this dataset first")
    if path.endswith(".json"):
        from .coco import read_coco_json
        records = list(read_coco_json(path, list(cfg.VOC_CLASSES)).records)
    else:
        records = read_meta(path, cfg.num_classes)
    limit = cfg.max_train_images if split == "train" else cfg.max_val_images
    if limit and limit > 0:
        records = records[:limit]
    if not records:
        raise MetaFormatError(f"annotation file '{path}' lists no images: run tools/xml_2_txt.py (or xml_2_json.py) "
                              "for this dataset again (it refuses to write an empty split and says why)")
    return records
