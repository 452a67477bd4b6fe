"""PASCAL VOC annotations -> GNetDet meta files.

The meta format (docs/pipeline.md, "Data") is a plain text file with one line per image::

    image_name x1 y1 x2 y2 cls [x1 y1 x2 y2 cls ...]

``image_name`` is relative to the dataset's image folder, the coordinates are integer pixels of the
original image and ``cls`` is a 0-based index into the class list.

Coordinate convention used here: box corners are kept as the annotation writes them (VOC counts
pixels from 1, we do not shift), fractional values are rounded to the nearest integer, and the box is
clipped to the image extent ``[0, width] x [0, height]`` (an ``xmax`` equal to the width is common in
VOC files and is kept as is). A box with ``x2 <= x1`` or ``y2 <= y1``, or one lying entirely outside
the image, is an annotation error and is refused.

Conversion is all-or-nothing: every annotation and image is checked first, and only then are the two
meta files written (each to a temporary file that is renamed into place), so a failed run never leaves
a partial or stale-but-new-looking file behind.
"""

from __future__ import annotations

import math
import os
import random
from collections import OrderedDict
from typing import Iterable, Optional, Sequence, Tuple

import numpy as np
from lxml import etree

__all__ = [
    "VOCFormatError",
    "MetaFormatError",
    "IMAGE_EXTENSIONS",
    "parse_voc_xml",
    "convert_voc_to_meta",
    "convert_voc_to_coco",
    "read_meta",
    "write_meta",
    "format_meta_line",
    "write_voc_xml",
    "sizes_path",
    "read_sizes",
]

#: extensions tried, in order, when the XML's <filename> does not name an existing image
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".JPG", ".JPEG", ".PNG")

_BOX_FIELDS = ("xmin", "ymin", "xmax", "ymax")


class VOCFormatError(ValueError):
    """A VOC annotation or dataset layout problem. The message names the file and the fix."""

    def __init__(self, message: str, path: str | None = None):
        super().__init__(message)
        self.path = path


class MetaFormatError(ValueError):
    """A malformed line in a meta file. The message names the file and the 1-based line number."""


# ----------------------------------------------------------------------------------------------
# single annotation
# ----------------------------------------------------------------------------------------------

def _round_half_up(value: float) -> int:
    return int(math.floor(value + 0.5))


def _number(node, field: str, xml_path: str, where: str) -> float:
    """Text of child ``field`` of ``node`` as a finite float, or VOCFormatError naming the field."""
    child = node.find(field)
    if child is None or child.text is None or not child.text.strip():
        raise VOCFormatError(
            f"{xml_path}: {where} is missing <{field}> (absent or empty). Add the value to the "
            f"annotation (re-save it in the labelling tool) or drop the file.",
            xml_path,
        )
    text = child.text.strip()
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not math.isfinite(value):
        raise VOCFormatError(
            f"{xml_path}: {where} <{field}> is {text!r}, not a number. Fix the value in the annotation.",
            xml_path,
        )
    return value


def parse_voc_xml(xml_path: str, class_names: Sequence[str], keep_difficult: bool = False) -> dict:
    """Read one PASCAL VOC annotation file.

    Args:
        xml_path: path of the ``.xml`` file.
        class_names: the class list; labels are 0-based indices into it.
        keep_difficult: keep objects marked ``<difficult>1</difficult>`` (dropped by default).

    Returns:
        ``{"filename": str, "width": int, "height": int, "boxes": [[x1, y1, x2, y2], ...],
        "labels": [int, ...], "difficult": [bool, ...], "dropped_difficult": int}``.
        Boxes are integer pixels of the original image (rounded, clipped to ``[0, width] x
        [0, height]``; see the module docstring). ``filename`` is ``""`` when the file has no
        ``<filename>``. ``dropped_difficult`` counts difficult objects left out.

    Raises:
        VOCFormatError: unreadable or malformed XML (with the line number), a missing or
            non-numeric ``<size>``/``<bndbox>`` field, an object without ``<name>`` or with a class
            not in ``class_names``, a degenerate box (``x2 <= x1`` or ``y2 <= y1``) or a box
            entirely outside the image. The message names ``xml_path``.
    """
    xml_path = str(xml_path)
    try:
        root = etree.parse(xml_path).getroot()
    except etree.XMLSyntaxError as exc:
        line = getattr(exc, "lineno", None)
        raise VOCFormatError(
            f"{xml_path}: malformed XML at line {line}: {exc.msg}. Fix or regenerate the annotation.",
            xml_path,
        ) from None
    except OSError as exc:
        raise VOCFormatError(f"{xml_path}: cannot read the annotation ({exc}).", xml_path) from None

    if root.tag != "annotation":
        raise VOCFormatError(
            f"{xml_path}: root element is <{root.tag}>, expected <annotation>; not a VOC annotation.",
            xml_path,
        )

    filename = (root.findtext("filename") or "").strip()

    size = root.find("size")
    if size is None:
        raise VOCFormatError(
            f"{xml_path}: missing <size> (needs <width> and <height> in pixels). Add it to the "
            f"annotation.",
            xml_path,
        )
    width = _number(size, "width", xml_path, "<size>")
    height = _number(size, "height", xml_path, "<size>")
    if width <= 0 or height <= 0 or width != int(width) or height != int(height):
        raise VOCFormatError(
            f"{xml_path}: <size> is {width:g}x{height:g}; width and height must be positive "
            f"whole numbers of pixels. Fix the <size> element.",
            xml_path,
        )
    width, height = int(width), int(height)

    known = {name: i for i, name in enumerate(class_names)}
    boxes, labels, difficult, dropped = [], [], [], 0
    for index, obj in enumerate(root.findall("object")):
        where = f"object #{index}"
        name = (obj.findtext("name") or "").strip()
        if not name:
            raise VOCFormatError(
                f"{xml_path}: {where} has no <name>. Give every object a class name.", xml_path
            )
        if name not in known:
            raise VOCFormatError(
                f"{xml_path}: {where} has unknown class {name!r}; known classes are "
                f"{list(class_names)}. Add {name!r} to VOC_CLASSES in configs.py (or pass it with "
                f"--classes), or fix the label.",
                xml_path,
            )
        is_difficult = False
        if obj.find("difficult") is not None and (obj.findtext("difficult") or "").strip():
            is_difficult = _number(obj, "difficult", xml_path, where) != 0

        bndbox = obj.find("bndbox")
        if bndbox is None:
            raise VOCFormatError(
                f"{xml_path}: {where} ({name!r}) has no <bndbox>. Add the box or remove the object.",
                xml_path,
            )
        raw = [_number(bndbox, f, xml_path, f"{where} <bndbox>") for f in _BOX_FIELDS]
        x1, y1, x2, y2 = (_round_half_up(v) for v in raw)
        coords = "({:g}, {:g}, {:g}, {:g})".format(*raw)
        if x2 <= x1 or y2 <= y1:
            raise VOCFormatError(
                f"{xml_path}: {where} ({name!r}) has a degenerate box {coords} (xmin, ymin, xmax, "
                f"ymax): needs xmax > xmin and ymax > ymin. Fix or delete the box.",
                xml_path,
            )
        if x2 <= 0 or y2 <= 0 or x1 >= width or y1 >= height:
            raise VOCFormatError(
                f"{xml_path}: {where} ({name!r}) box {coords} lies entirely outside the "
                f"{width}x{height} image. Fix or delete the box.",
                xml_path,
            )
        x1, x2 = max(0, x1), min(width, x2)
        y1, y2 = max(0, y1), min(height, y2)

        if is_difficult and not keep_difficult:
            dropped += 1
            continue
        boxes.append([x1, y1, x2, y2])
        labels.append(known[name])
        difficult.append(is_difficult)

    return {
        "filename": filename,
        "width": width,
        "height": height,
        "boxes": boxes,
        "labels": labels,
        "difficult": difficult,
        "dropped_difficult": dropped,
    }


# ----------------------------------------------------------------------------------------------
# whole dataset
# ----------------------------------------------------------------------------------------------

def _read_id_list(path: str) -> list[str]:
    ids = []
    with open(path, "r", encoding="utf-8") as fh:
        for line in fh:
            parts = line.split()
            if parts:  # VOC per-class lists carry a second column ("id  1"); keep the id only
                ids.append(parts[0])
    return ids


def _find_image(image_dir: str, filename: str, stem: str) -> str | None:
    """Name (relative to image_dir) of the image for one annotation, or None."""
    candidates = []
    if filename:
        candidates.append(os.path.basename(filename.replace("\\", "/")))
    candidates += [stem + ext for ext in IMAGE_EXTENSIONS]
    for name in candidates:
        if os.path.isfile(os.path.join(image_dir, name)):
            return name
    return None


def _check_image(path: str, ann: dict, xml_path: str) -> None:
    """Decode the image of an annotation and compare its size with ``<size>``.

    Raises:
        VOCFormatError: naming the XML and the image: truncated or undecodable (see
            gnetmdk.dataset.image_io.decode_image), or a decoded size other than the annotation's
            (the image was resized, or is turned by its EXIF orientation, after it was annotated:
            the boxes would point elsewhere).
    """
    from .image_io import ImageReadError, decode_image
    try:
        img = decode_image(path, fix="replace the image or drop the annotation")
    except ImageReadError as exc:
        raise VOCFormatError(f"{xml_path}: {exc}", xml_path) from None
    h, w = img.shape[:2]
    if (w, h) != (ann["width"], ann["height"]):
        raise VOCFormatError(
            f"{xml_path}: <size> says {ann['width']}x{ann['height']} but {path} decodes to {w}x{h} pixels (resized, "
            f"or turned by its EXIF orientation, after it was annotated): the boxes would be wrong. Re-annotate the "
            f"image, or restore the annotated one.",
            xml_path,
        )


def parse_fold(text: str) -> Tuple[int, int]:
    """``"I/K"`` -> ``(I, K)``: the val fold of a K-fold split (tools/xml_2_txt.py ``--fold``).

    Raises:
        ValueError: not two integers ``I/K`` with ``K >= 2`` and ``0 <= I < K``.
    """
    try:
        i, k = (int(v) for v in str(text).split("/"))
    except ValueError:
        raise ValueError(f"fold {text!r} is not I/K (e.g. 1/5: the second of five disjoint val folds)") from None
    if k < 2 or not 0 <= i < k:
        raise ValueError(f"fold {text!r}: needs K >= 2 and 0 <= I < K (folds are numbered 0 to K - 1)")
    return i, k


def _split_ids(dataset_dir: str, ann_dir: str, val_fraction: float, seed: int,
               fold: Optional[Tuple[int, int]] = None):
    """(train ids, val ids, a line naming the split): ``ImageSets/Main`` lists when both exist, else a
    random split of the annotation stems shuffled with ``seed``.

    The random split's val ids are the first ``round(n * val_fraction)`` of the shuffled stems, or with
    ``fold = (I, K)`` the shuffled stems ``round(n I / K)`` to ``round(n (I + 1) / K)``: the K folds of
    one seed are disjoint and together cover every image once (K-fold cross-validation), and fold
    ``0/K`` is the split of ``val_fraction = 1 / K``. Raises VOCFormatError (an id in both lists) or
    ValueError (a bad ``val_fraction`` or ``fold``, or a ``fold`` where lists decide the split).
    """
    sets = os.path.join(dataset_dir, "ImageSets", "Main")
    train_list, val_list = os.path.join(sets, "train.txt"), os.path.join(sets, "val.txt")
    if os.path.isfile(train_list) and os.path.isfile(val_list):
        if fold is not None:
            raise ValueError(f"{sets}/{{train,val}}.txt decide the split, so a fold ({fold[0]}/{fold[1]}) cannot "
                             f"choose one: drop the fold, or move the two lists away for a random split")
        train_ids, val_ids = _read_id_list(train_list), _read_id_list(val_list)
        both = sorted(set(train_ids) & set(val_ids))
        if both:
            shown = ", ".join(both[:5]) + (" ..." if len(both) > 5 else "")
            raise VOCFormatError(
                f"{sets}: {len(both)} id(s) are in both train.txt and val.txt ({shown}). "
                f"Make the two lists disjoint.",
                sets,
            )
        return train_ids, val_ids, f"{os.path.relpath(sets, dataset_dir)}/{{train,val}}.txt"

    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    stems = sorted(f[:-4] for f in os.listdir(ann_dir) if f.endswith(".xml"))
    order = list(stems)
    random.Random(seed).shuffle(order)
    if fold is not None:
        i, k = parse_fold(f"{fold[0]}/{fold[1]}")
        val = set(order[int(round(len(order) * i / k)):int(round(len(order) * (i + 1) / k))])
        source = f"random split (seed={seed}, val fold {i}/{k})"
    else:
        val = set(order[:int(round(len(order) * val_fraction))])
        source = f"random split (seed={seed}, val_fraction={val_fraction:g})"
    train_ids = [s for s in stems if s not in val]
    val_ids = [s for s in stems if s in val]
    return train_ids, val_ids, source


SIZES_FORMAT = "gnetmdk-image-sizes"


def sizes_path(meta_path: str) -> str:
    """The image-size file beside a meta file: ``<name>.sizes.json`` for ``<name>.txt``."""
    meta_path = str(meta_path)
    return (meta_path[:-4] if meta_path.endswith(".txt") else meta_path) + ".sizes.json"


def sizes_text(entries) -> str:
    """JSON of {image name: [width, height]} for ``(image_name, boxes, labels, (width, height))`` entries."""
    import json
    return json.dumps({"format": SIZES_FORMAT, "sizes": {n: [int(wh[0]), int(wh[1])] for n, _, _, wh in entries}},
                      separators=(",", ":")) + "\n"


def read_sizes(meta_path: str) -> dict | None:
    """{image name: (width, height)} that tools/xml_2_txt.py recorded beside a meta file (the sizes the
    boxes were converted for), or None when there is no such file (meta files written before it).

    Raises:
        MetaFormatError: the file exists but is not such a record.
    """
    import json
    path = sizes_path(meta_path)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as fh:
            rec = json.load(fh)
        sizes = rec["sizes"] if isinstance(rec, dict) and rec.get("format") == SIZES_FORMAT else None
        out = {str(k): (int(v[0]), int(v[1])) for k, v in sizes.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError):
        raise MetaFormatError(f"'{path}' is not the image-size record tools/xml_2_txt.py writes: run "
                              "tools/xml_2_txt.py again") from None
    return out


def format_meta_line(image_name: str, boxes: Iterable[Sequence[int]], labels: Iterable[int]) -> str:
    """One meta line ``image_name x1 y1 x2 y2 cls ...`` (no newline)."""
    parts = [image_name]
    for box, label in zip(boxes, labels):
        parts.extend(str(int(v)) for v in box)
        parts.append(str(int(label)))
    return " ".join(parts)


def _atomic_write_many(contents: dict[str, str]) -> None:
    """Write every {path: text} as one set (gnetmdk.checkpoint.io.atomic_write_set): nothing replaced
    unless all are written."""
    from gnetmdk.utils.atomic import atomic_write_set, text_writer
    atomic_write_set({str(p): text_writer(t) for p, t in contents.items()})


def write_meta(path: str, entries: Iterable[tuple[str, Sequence[Sequence[int]], Sequence[int]]]) -> None:
    """Write ``(image_name, boxes, labels)`` entries as a meta file (atomically)."""
    text = "".join(format_meta_line(n, b, l) + "\n" for n, b, l in entries)
    _atomic_write_many({str(path): text})


def convert_voc_to_meta(
    dataset_dir: str,
    class_names: Sequence[str],
    out_train: str,
    out_valid: str,
    keep_difficult: bool = False,
    skip_bad: bool = False,
    val_fraction: float = 0.2,
    seed: int = 0,
    image_dir: str = "JPEGImages",
    ann_dir: str = "Annotations",
    check_images: bool = True,
    writer=None,
    keep_empty: bool = False,
    fold: Optional[Tuple[int, int]] = None,
) -> dict:
    """Convert a VOC-layout dataset into the two meta files.

    Split: ``ImageSets/Main/train.txt`` and ``val.txt`` when both exist, otherwise a random split
    of all ``<ann_dir>/*.xml`` stems, deterministic for a given ``seed`` (``round(n *
    val_fraction)`` ids go to valid, or with ``fold = (I, K)`` the I-th of K disjoint val folds of the
    same shuffle: :func:`_split_ids`). Images whose objects are all dropped (none, or only difficult
    ones) are left out and counted, or with ``keep_empty`` written as background images (a line with
    the image name alone): training then learns "no object" from them, and evaluation counts the
    detections on them as false positives. Image names in the output are relative to ``image_dir``; boxes
    are integer pixels (see :func:`parse_voc_xml`).

    Every file is checked before anything is written; both outputs are then written atomically.

    Args:
        dataset_dir: dataset root holding ``image_dir``, ``ann_dir`` and optionally ``ImageSets``.
        class_names: the class list (label = index).
        out_train, out_valid: meta files to write (parent folders are created).
        keep_difficult: keep objects marked difficult.
        skip_bad: skip bad annotations/images (listed in the report) instead of failing.
        val_fraction, seed: used only for the random split.
        fold: ``(I, K)``: valid is the I-th (0-based) of the K disjoint folds of that random split
            instead of its first ``val_fraction`` (cross-validation); refused where ImageSets lists exist.
        image_dir, ann_dir: sub-folders of ``dataset_dir``.
        keep_empty: write the images without (kept) objects too, as background images.
        check_images: decode every image (a truncated or undecodable file, or one whose size differs
            from the annotation's ``<size>``, is a bad file; see :func:`_check_image`).
        writer: None (meta files), or ``writer({path: [(image_name, boxes, labels, (width, height))]},
            class_names)`` writing both splits as one set in another format (:func:`convert_voc_to_coco`).

    Returns:
        ``{"dataset_dir", "split_source", "classes", "skipped": [(path, reason), ...], "warnings": [...],
        "splits": {"train"|"valid": {"file", "ids", "images", "boxes", "per_class": {name: n},
        "no_objects": [xml paths], "empty_written": n (0 without ``keep_empty``), "dropped_difficult": n, "box_sizes": [(w / image width, h / image
        height) per kept box], "box_labels": [class index per kept box], "box_centres": [(x / width,
        y / height, image number) per kept box]}}}``.

    Raises:
        FileNotFoundError: ``dataset_dir``, its image folder or its annotation folder is missing.
        VOCFormatError: (unless ``skip_bad``) the first bad file: malformed annotation (see
            :func:`parse_voc_xml`), id listed without an annotation, missing image (names the XML
            and the expected image path), image name with whitespace, an image that is truncated,
            cannot be decoded or has another size than ``<size>``. Also, regardless of
            ``skip_bad``, an id in both train.txt and val.txt, and a train split left without any
            image with objects (an empty valid split is written with a warning). Nothing is written
            when it is raised.
        ValueError: an empty or duplicated class list, a ``val_fraction`` outside [0, 1), or a bad
            ``fold`` (:func:`parse_fold`), or one given where ImageSets lists decide the split.
    """
    dataset_dir = str(dataset_dir)
    if not os.path.isdir(dataset_dir):
        raise FileNotFoundError(f"dataset folder {dataset_dir} does not exist")
    img_root = os.path.join(dataset_dir, image_dir)
    ann_root = os.path.join(dataset_dir, ann_dir)
    for folder, what in ((img_root, "image"), (ann_root, "annotation")):
        if not os.path.isdir(folder):
            raise FileNotFoundError(
                f"{what} folder {folder} does not exist (expected the VOC layout "
                f"{image_dir}/, {ann_dir}/ under {dataset_dir})"
            )
    class_names = list(class_names)
    if not class_names:
        raise ValueError("class_names is empty")
    if len(set(class_names)) != len(class_names):
        raise ValueError(f"class_names has duplicates: {class_names}")

    train_ids, val_ids, split_source = _split_ids(dataset_dir, ann_root, val_fraction, seed, fold)

    skipped: list[tuple[str, str]] = []
    splits: "OrderedDict[str, dict]" = OrderedDict()
    lines: dict[str, list[str]] = {}
    for split, ids, out in (("train", train_ids, out_train), ("valid", val_ids, out_valid)):
        stats = {
            "file": str(out), "ids": len(ids), "images": 0, "boxes": 0,
            "per_class": OrderedDict((c, 0) for c in class_names),
            "no_objects": [], "empty_written": 0, "dropped_difficult": 0, "box_sizes": [], "box_labels": [],
            "box_centres": [],
        }
        split_lines = []
        for stem in ids:
            xml_path = os.path.join(ann_root, stem + ".xml")
            try:
                if not os.path.isfile(xml_path):
                    raise VOCFormatError(
                        f"{xml_path}: id {stem!r} is listed for split {split!r} but has no "
                        f"annotation file. Add it or remove the id from ImageSets/Main.",
                        xml_path,
                    )
                ann = parse_voc_xml(xml_path, class_names, keep_difficult=keep_difficult)
                image_name = _find_image(img_root, ann["filename"], stem)
                if image_name is None:
                    expected = os.path.join(img_root, os.path.basename(ann["filename"]) or stem + ".jpg")
                    raise VOCFormatError(
                        f"{xml_path}: image not found: expected {expected} (also tried "
                        f"{stem}{{{','.join(IMAGE_EXTENSIONS)}}} in {img_root}). Add the image or "
                        f"fix <filename>.",
                        xml_path,
                    )
                if any(ch.isspace() for ch in image_name):
                    raise VOCFormatError(
                        f"{xml_path}: image name {image_name!r} contains whitespace, which the "
                        f"space-separated meta format cannot hold. Rename the image.",
                        xml_path,
                    )
                if check_images:
                    _check_image(os.path.join(img_root, image_name), ann, xml_path)
            except VOCFormatError as exc:
                if not skip_bad:
                    raise
                skipped.append((xml_path, str(exc)))
                continue

            stats["dropped_difficult"] += ann["dropped_difficult"]
            if not ann["boxes"]:
                stats["no_objects"].append(xml_path)
                if keep_empty:
                    split_lines.append((image_name, [], [], (ann["width"], ann["height"])))
                    stats["empty_written"] += 1
                continue
            split_lines.append((image_name, ann["boxes"], ann["labels"], (ann["width"], ann["height"])))
            stats["images"] += 1
            stats["boxes"] += len(ann["boxes"])
            for (x1, y1, x2, y2), label in zip(ann["boxes"], ann["labels"]):
                w_img, h_img = max(ann["width"], 1), max(ann["height"], 1)
                stats["box_sizes"].append(((x2 - x1) / w_img, (y2 - y1) / h_img))
                stats["box_labels"].append(int(label))
                stats["box_centres"].append(((x1 + x2) / 2 / w_img, (y1 + y2) / 2 / h_img, stats["images"]))
            for label in ann["labels"]:
                stats["per_class"][class_names[label]] += 1
        splits[split] = stats
        lines[split] = split_lines

    warnings = []
    for split, source in (("train", "train.txt"), ("valid", "val.txt")):
        if not splits[split]["images"]:
            why = (f"split {split!r} has no image with objects ({splits[split]['ids']} ids, "
                   f"{len(splits[split]['no_objects'])} without objects, {len(skipped)} skipped as bad)")
            if split == "train":        # an empty dataset: nothing to write
                raise VOCFormatError(f"{dataset_dir}: {why}: nothing was written. Check {ann_dir}/ and "
                                     f"ImageSets/Main/{source}, or the random split's val_fraction.", dataset_dir)
            warnings.append(f"{why}: the trainer evaluates every stage on it and will refuse an empty one; "
                            f"check ImageSets/Main/{source} or set val_fraction")
    if writer is None:
        # the meta files and the image sizes their boxes were converted for, as one set
        _atomic_write_many({
            str(out_train): "".join(format_meta_line(n, b, l) + "\n" for n, b, l, _ in lines["train"]),
            str(out_valid): "".join(format_meta_line(n, b, l) + "\n" for n, b, l, _ in lines["valid"]),
            sizes_path(out_train): sizes_text(lines["train"]),
            sizes_path(out_valid): sizes_text(lines["valid"]),
        })
    else:
        writer({str(out_train): lines["train"], str(out_valid): lines["valid"]}, class_names)
    return {
        "dataset_dir": dataset_dir,
        "split_source": split_source,
        "classes": class_names,
        "skipped": skipped,
        "splits": splits,
        "warnings": warnings,
    }


def convert_voc_to_coco(dataset_dir: str, class_names: Sequence[str], out_train: str, out_valid: str,
                        **kwargs) -> dict:
    """Convert a VOC-layout dataset into two COCO-json files (``voc2012_train.json`` style), with every
    check, the split and the report of :func:`convert_voc_to_meta` (same keyword arguments); both files
    are written as one set (gnetmdk.dataset.coco.coco_json_text: image ids 1.., category ids 1..C,
    boxes as [x, y, w, h] pixels from the integer VOC corners).

    Raises:
        what :func:`convert_voc_to_meta` raises; nothing is written then.
    """
    from gnetmdk.utils.atomic import atomic_write_set, text_writer
    from .coco import coco_json_text

    def write(splits, names):
        texts = {}
        for path, entries in splits.items():
            records = [(n, np.asarray(b, np.float32).reshape(-1, 4), np.asarray(l, np.int64)) for n, b, l, _ in entries]
            texts[path] = coco_json_text(records, list(names), [wh for *_, wh in entries])
        atomic_write_set({p: text_writer(t) for p, t in texts.items()})

    return convert_voc_to_meta(dataset_dir, class_names, out_train, out_valid, writer=write, **kwargs)


# ----------------------------------------------------------------------------------------------
# meta files
# ----------------------------------------------------------------------------------------------

def read_meta(path: str, num_classes: int | None = None) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """Read a meta file.

    Returns:
        A list of ``(image_name, boxes, labels)``: ``boxes`` float32 ``(K, 4)`` as ``x1 y1 x2 y2``
        in pixels, ``labels`` int64 ``(K,)``. Blank lines are ignored.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        MetaFormatError: naming ``path`` and the 1-based line number, for a line whose field count
            is not ``1 + 5k``, a non-numeric or non-finite coordinate, a class that is not a
            non-negative integer, or (when ``num_classes`` is given) a class ``>= num_classes``.
    """
    path = str(path)
    entries = []
    with open(path, "r", encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            fields = line.split()
            if not fields:
                continue
            where = f"{path}:{lineno}"
            if (len(fields) - 1) % 5 != 0:
                raise MetaFormatError(
                    f"{where}: {len(fields)} fields; expected 'image_name' followed by groups of 5 "
                    f"'x1 y1 x2 y2 cls' (1 + 5k fields). Regenerate the file with tools/xml_2_txt.py."
                )
            k = (len(fields) - 1) // 5
            groups = [fields[1 + 5 * i: 6 + 5 * i] for i in range(k)]
            try:
                boxes = np.array([[float(v) for v in g[:4]] for g in groups], dtype=np.float32)
            except ValueError:
                raise MetaFormatError(f"{where}: non-numeric box coordinate in {line.strip()!r}") from None
            boxes = boxes.reshape(k, 4)
            if not np.all(np.isfinite(boxes)):
                raise MetaFormatError(f"{where}: non-finite box coordinate in {line.strip()!r}")
            labels = []
            for g in groups:
                text = g[4]
                try:
                    label = int(text)
                except ValueError:
                    raise MetaFormatError(
                        f"{where}: class {text!r} is not an integer index") from None
                if label < 0:
                    raise MetaFormatError(f"{where}: negative class index {label}")
                if num_classes is not None and label >= num_classes:
                    raise MetaFormatError(
                        f"{where}: class index {label} out of range for {num_classes} classes")
                labels.append(label)
            entries.append((fields[0], boxes, np.array(labels, dtype=np.int64)))
    return entries


# ----------------------------------------------------------------------------------------------
# writing annotations
# ----------------------------------------------------------------------------------------------

def write_voc_xml(path: str, filename: str, width: int, height: int, objects, depth: int = 3) -> None:
    """Write a VOC annotation.

    Args:
        path: output ``.xml`` path (parent folder must exist).
        filename: image file name stored in ``<filename>``.
        width, height, depth: image size in pixels / channels.
        objects: iterable of ``(class_name, x1, y1, x2, y2, difficult)``; coordinates in pixels,
            written as given (ints stay ints).

    The output bytes depend only on the arguments (deterministic).
    """
    root = etree.Element("annotation")
    etree.SubElement(root, "folder").text = "JPEGImages"
    etree.SubElement(root, "filename").text = str(filename)
    size = etree.SubElement(root, "size")
    etree.SubElement(size, "width").text = str(int(width))
    etree.SubElement(size, "height").text = str(int(height))
    etree.SubElement(size, "depth").text = str(int(depth))
    etree.SubElement(root, "segmented").text = "0"
    for name, x1, y1, x2, y2, difficult in objects:
        obj = etree.SubElement(root, "object")
        etree.SubElement(obj, "name").text = str(name)
        etree.SubElement(obj, "pose").text = "Unspecified"
        etree.SubElement(obj, "truncated").text = "0"
        etree.SubElement(obj, "difficult").text = "1" if difficult else "0"
        box = etree.SubElement(obj, "bndbox")
        for field, value in zip(_BOX_FIELDS, (x1, y1, x2, y2)):
            etree.SubElement(box, field).text = str(value)
    data = etree.tostring(root, pretty_print=True, encoding="utf-8")
    with open(path, "wb") as fh:
        fh.write(data)
