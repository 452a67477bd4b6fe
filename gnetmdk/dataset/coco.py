"""COCO detection json <-> the meta-file record list used by the VOC reader.

:func:`read_coco_json` reads a COCO *detection* annotation file (such as PaddleDetection's
``voc2012_train.json``) into the same records :func:`gnetmdk.dataset.voc.read_meta` returns,
``(image_name, boxes float32 (K, 4) pixel xyxy, labels int64 (K,))``, so a COCO-json dataset and a
meta-file dataset feed the same code. :func:`write_coco_json` writes such records back.

Conventions
-----------
* Boxes: COCO stores ``bbox = [x, y, w, h]`` in pixels, ``(x, y)`` the top-left corner. A box reads
  as ``x1 = x, y1 = y, x2 = x + w, y2 = y + h`` on continuous coordinates (no "+1"/"-1" pixel
  shift; PaddleDetection's older ``COCODataSet`` subtracted 1 from ``w`` and ``h``, we do not, like
  the rest of this project's evaluation). Values are kept as written (fractions stay fractions,
  float32 in the records); they are not rounded as the meta files are.
* Clipping: like :mod:`gnetmdk.dataset.voc`, a box is clipped to the image extent
  ``[0, width] x [0, height]`` taken from the json's ``images`` entry; the number of clipped boxes is
  reported in ``stats["clipped"]``. A box lying entirely outside its image is refused.
* Classes: label ``i`` is the ``i``-th category when ``categories`` is sorted by ``id``. Category ids
  need not be contiguous nor start at 1 (``[3, 7, 11]`` give labels 0, 1, 2).
* ``iscrowd``: crowd annotations (``iscrowd`` 1; absent counts as 0) are checked like any other
  annotation and then left out, as COCO detector training does (PaddleDetection's ``COCODataSet``
  asks pycocotools for ``iscrowd=False`` annotations only). They are counted in
  ``stats["crowd_dropped"]``.
* Images with no boxes left (none annotated, or only crowd ones) are left out of the records and
  listed in ``stats["no_objects"]``, as ``tools/xml_2_txt.py`` does for VOC (see
  :func:`gnetmdk.dataset.voc.convert_voc_to_meta`).
* Order: records follow the order of the json's ``images`` list; boxes within an image follow the
  order of the ``annotations`` list.

Everything in the file is checked before anything is returned: one bad annotation raises
:class:`CocoFormatError` naming the file, the image or annotation id, the field and the fix.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, NamedTuple, Sequence

import numpy as np

from gnetmdk.utils.atomic import atomic_write_text

__all__ = ["CocoFormatError", "CocoData", "read_coco_json", "write_coco_json", "coco_json_text"]

_TOP_KEYS = ("images", "annotations", "categories")


class CocoFormatError(ValueError):
    """A malformed COCO json. The message names the file, the image/annotation id, the field and the fix."""

    def __init__(self, message: str, path: str | None = None):
        super().__init__(message)
        self.path = path


class CocoData(NamedTuple):
    """What :func:`read_coco_json` returns (unpack as ``records, names, sizes, stats = ...``).

    Attributes:
        records: list of ``(image_name, boxes, labels)``: ``image_name`` the json's ``file_name``,
            ``boxes`` float32 ``(K, 4)`` pixel xyxy (clipped to the image), ``labels`` int64 ``(K,)``
            0-based indices into ``class_names``; ``K >= 1``.
        class_names: category names, in label order (categories sorted by id).
        sizes: ``(width, height)`` in pixels per record, same order as ``records``.
        stats: ``{"images": images in the json, "annotations": annotations in the json,
            "no_objects": [file_name, ...] images left out for having no (non-crowd) box,
            "crowd_dropped": crowd boxes left out, "clipped": boxes clipped to their image,
            "category_ids": the json's category ids in label order}``.
    """

    records: list
    class_names: list
    sizes: list
    stats: dict


# ----------------------------------------------------------------------------------------------
# reading
# ----------------------------------------------------------------------------------------------

def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _err(path: str, message: str) -> CocoFormatError:
    return CocoFormatError(f"{path}: {message}", path)


def read_coco_json(path: str, class_names: Sequence[str] | None = None) -> CocoData:
    """Read a COCO detection json into meta-style records (see the module docstring).

    Args:
        path: the ``.json`` file.
        class_names: optional expected class list. When given, the json's category names, sorted by
            category id, must equal it exactly (same names, same order).

    Returns:
        :class:`CocoData` ``(records, class_names, sizes, stats)``: records as
        :func:`gnetmdk.dataset.voc.read_meta` returns them (boxes float32 ``(K, 4)`` xyxy pixels,
        labels int64 ``(K,)``), the class names, ``(width, height)`` per record and counts.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        CocoFormatError: (naming ``path``) the file is not UTF-8 JSON (with line and column) or not
            a JSON object; ``images``, ``annotations`` or ``categories`` is missing or not a list;
            an image without an integer ``id``, a ``file_name`` string without whitespace, or
            positive integer ``width``/``height``; duplicate image ids; a category without an
            integer ``id`` or a non-empty ``name``, duplicate category ids or names; no
            categories; ``class_names`` differing from the categories (both lists are named); an
            annotation without an integer ``id`` or with a duplicate one, naming an unknown
            ``image_id`` or ``category_id``, whose ``bbox`` is not 4 finite numbers or has
            ``w <= 0`` or ``h <= 0``, whose ``iscrowd`` is not 0/1, or whose box lies entirely
            outside its image.
    """
    path = str(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"COCO annotation file {path} does not exist")
    try:
        with open(path, "r", encoding="utf-8") as fh:
            text = fh.read()
    except UnicodeDecodeError as exc:
        raise _err(path, f"not UTF-8 text ({exc.reason} at byte {exc.start}); save the json as "
                         f"UTF-8") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _err(path, f"not valid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}. "
                         f"Fix the file or regenerate it (e.g. with write_coco_json).") from None
    if not isinstance(data, dict):
        raise _err(path, f"top level is a JSON {type(data).__name__}, expected an object with keys "
                         f"{list(_TOP_KEYS)}; not a COCO detection file")
    for key in _TOP_KEYS:
        if key not in data:
            raise _err(path, f"missing top-level key {key!r} (a COCO detection file needs "
                             f"{list(_TOP_KEYS)}). Add it (a list, possibly empty for "
                             f"'annotations') or use the right file.")
        if not isinstance(data[key], list):
            raise _err(path, f"top-level {key!r} is a {type(data[key]).__name__}, expected a list")

    # --- categories ------------------------------------------------------------------------
    cats: dict[int, str] = {}
    for index, cat in enumerate(data["categories"]):
        where = f"categories[{index}]"
        if not isinstance(cat, dict) or not _is_int(cat.get("id")):
            raise _err(path, f"{where} has no integer 'id' (got {cat!r:.80}); give every category "
                             f"an integer id")
        cid = cat["id"]
        name = cat.get("name")
        if not isinstance(name, str) or not name.strip():
            raise _err(path, f"category id {cid} ({where}) has no non-empty 'name' string; name it")
        if cid in cats:
            raise _err(path, f"category id {cid} appears twice ({cats[cid]!r} and {name!r}); give "
                             f"each category its own id")
        cats[cid] = name
    if not cats:
        raise _err(path, "'categories' is empty; list the classes as {\"id\": int, \"name\": str}")
    cat_ids = sorted(cats)
    names = [cats[c] for c in cat_ids]
    seen_names: dict[str, int] = {}
    for cid in cat_ids:
        if cats[cid] in seen_names:
            raise _err(path, f"category name {cats[cid]!r} is used by ids {seen_names[cats[cid]]} "
                             f"and {cid}; merge them or rename one")
        seen_names[cats[cid]] = cid
    if class_names is not None and list(class_names) != names:
        raise _err(path, f"categories sorted by id are {names} (ids {cat_ids}) but the expected "
                         f"class list is {list(class_names)}; names and order must match. Fix the "
                         f"class list (config VOC_CLASSES / --classes) or the json's categories.")
    label_of = {cid: i for i, cid in enumerate(cat_ids)}

    # --- images ----------------------------------------------------------------------------
    images: dict[int, dict] = {}
    order: list[int] = []
    for index, img in enumerate(data["images"]):
        where = f"images[{index}]"
        if not isinstance(img, dict) or not _is_int(img.get("id")):
            raise _err(path, f"{where} has no integer 'id'; give every image an integer id")
        iid = img["id"]
        if iid in images:
            raise _err(path, f"image id {iid} is used twice ({images[iid]['file_name']!r} and "
                             f"{img.get('file_name')!r}, {where}); image ids must be unique")
        name = img.get("file_name")
        if not isinstance(name, str) or not name:
            raise _err(path, f"image id {iid} has no 'file_name' string; add the image's file name")
        if any(ch.isspace() for ch in name):
            raise _err(path, f"image id {iid} field 'file_name' {name!r} contains whitespace, which "
                             f"the space-separated meta format cannot hold. Rename the image file "
                             f"and the json entry.")
        for field in ("width", "height"):
            v = img.get(field)
            ok = _is_number(v) and v > 0 and float(v).is_integer()
            if not ok:
                raise _err(path, f"image id {iid} ({name!r}) field {field!r} is {v!r}; it must be a "
                                 f"positive whole number of pixels. Fix the images entry.")
        images[iid] = {"file_name": name, "width": int(img["width"]), "height": int(img["height"]),
                       "boxes": [], "labels": []}
        order.append(iid)

    # --- annotations -----------------------------------------------------------------------
    ann_ids: set[int] = set()
    crowd = clipped = 0
    for index, ann in enumerate(data["annotations"]):
        where = f"annotations[{index}]"
        if not isinstance(ann, dict) or not _is_int(ann.get("id")):
            raise _err(path, f"{where} has no integer 'id'; give every annotation an integer id")
        aid = ann["id"]
        if aid in ann_ids:
            raise _err(path, f"annotation id {aid} is used twice ({where}); annotation ids must be "
                             f"unique")
        ann_ids.add(aid)
        iid = ann.get("image_id")
        if not _is_int(iid) or iid not in images:
            raise _err(path, f"annotation id {aid} field 'image_id' is {iid!r}, which names no "
                             f"image in 'images'. Add the image or fix/remove the annotation.")
        cid = ann.get("category_id")
        if not _is_int(cid) or cid not in label_of:
            raise _err(path, f"annotation id {aid} (image id {iid}) field 'category_id' is {cid!r}; "
                             f"known category ids are {cat_ids}. Add the category or fix the "
                             f"annotation.")
        is_crowd = ann.get("iscrowd", 0)
        if not _is_number(is_crowd) and not isinstance(is_crowd, bool) or is_crowd not in (0, 1):
            raise _err(path, f"annotation id {aid} (image id {iid}) field 'iscrowd' is "
                             f"{is_crowd!r}; use 0 or 1")
        bbox = ann.get("bbox")
        if (not isinstance(bbox, list) or len(bbox) != 4
                or not all(_is_number(v) for v in bbox)):
            raise _err(path, f"annotation id {aid} (image id {iid}) field 'bbox' is {bbox!r:.80}; "
                             f"expected 4 finite numbers [x, y, w, h] in pixels. Fix or delete "
                             f"the annotation.")
        x, y, w, h = (float(v) for v in bbox)
        if w <= 0 or h <= 0:
            raise _err(path, f"annotation id {aid} (image id {iid}) field 'bbox' {bbox} has "
                             f"w={w:g}, h={h:g}; both must be > 0. Fix or delete the annotation.")
        im = images[iid]
        W, H = im["width"], im["height"]
        x1, y1, x2, y2 = x, y, x + w, y + h
        if x2 <= 0 or y2 <= 0 or x1 >= W or y1 >= H:
            raise _err(path, f"annotation id {aid} (image id {iid}, {im['file_name']!r}) field "
                             f"'bbox' {bbox} (xyxy {x1:g},{y1:g},{x2:g},{y2:g}) lies entirely "
                             f"outside the {W}x{H} image. Fix or delete the annotation.")
        c = [max(0.0, x1), max(0.0, y1), min(float(W), x2), min(float(H), y2)]
        if is_crowd:
            crowd += 1
            continue
        if c != [x1, y1, x2, y2]:
            clipped += 1
        im["boxes"].append(c)
        im["labels"].append(label_of[cid])

    records, sizes, no_objects = [], [], []
    for iid in order:
        im = images[iid]
        if not im["boxes"]:
            no_objects.append(im["file_name"])
            continue
        records.append((im["file_name"], np.asarray(im["boxes"], dtype=np.float32).reshape(-1, 4),
                        np.asarray(im["labels"], dtype=np.int64)))
        sizes.append((im["width"], im["height"]))
    stats = {"images": len(order), "annotations": len(data["annotations"]),
             "no_objects": no_objects, "crowd_dropped": crowd, "clipped": clipped,
             "category_ids": cat_ids}
    return CocoData(records, names, sizes, stats)


# ----------------------------------------------------------------------------------------------
# writing
# ----------------------------------------------------------------------------------------------

def _num(v: float):
    """A float as JSON wants it: whole values as ints (``12`` not ``12.0``), others exactly (repr)."""
    v = float(v)
    return int(v) if v.is_integer() else v


def coco_json_text(entries, class_names: Sequence[str], sizes) -> str:
    """The text :func:`write_coco_json` writes (same arguments, same checks), without writing it."""
    class_names = [str(c) for c in class_names]
    if not class_names:
        raise ValueError("class_names is empty; give the class list (label = index)")
    if len(set(class_names)) != len(class_names):
        raise ValueError(f"class_names has duplicates: {class_names}")
    entries = list(entries)
    sizes = list(sizes)
    if len(sizes) != len(entries):
        raise ValueError(f"sizes has {len(sizes)} (width, height) pairs but there are "
                         f"{len(entries)} entries; give one size per entry, in the same order")
    C = len(class_names)
    images, annotations, seen = [], [], {}
    for i, (entry, size) in enumerate(zip(entries, sizes)):
        if len(entry) != 3:
            raise ValueError(f"entries[{i}] has {len(entry)} fields; expected (image_name, boxes, "
                             f"labels)")
        name, boxes, labels = entry
        where = f"entries[{i}] ({name!r})"
        if not isinstance(name, str) or not name or any(ch.isspace() for ch in name):
            raise ValueError(f"{where}: image name must be a non-empty string without whitespace")
        if name in seen:
            raise ValueError(f"{where}: image name also used by entries[{seen[name]}]; each image "
                             f"once (merge the boxes)")
        seen[name] = i
        try:
            W, H = (int(s) for s in size)
            ok = W > 0 and H > 0 and all(float(s) == int(s) for s in size)
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise ValueError(f"{where}: size {size!r} is not a (width, height) pair of positive "
                             f"whole pixels")
        b = np.asarray(boxes, dtype=np.float64)
        if b.size == 0:
            b = b.reshape(0, 4)
        lab = np.asarray(labels).reshape(-1)
        if b.ndim != 2 or b.shape[1] != 4 or len(lab) != len(b):
            raise ValueError(f"{where}: boxes {b.shape} and labels {lab.shape} must be (K, 4) and "
                             f"(K,)")
        if not np.all(np.isfinite(b)):
            raise ValueError(f"{where}: non-finite box coordinate")
        if np.any(b[:, 2] <= b[:, 0]) or np.any(b[:, 3] <= b[:, 1]):
            k = int(np.nonzero((b[:, 2] <= b[:, 0]) | (b[:, 3] <= b[:, 1]))[0][0])
            raise ValueError(f"{where}: box {k} {b[k].tolist()} needs x2 > x1 and y2 > y1")
        outside = (b[:, 2] <= 0) | (b[:, 3] <= 0) | (b[:, 0] >= W) | (b[:, 1] >= H)
        if np.any(outside):
            k = int(np.nonzero(outside)[0][0])
            raise ValueError(f"{where}: box {k} {b[k].tolist()} lies entirely outside the {W}x{H} "
                             f"image")
        if len(lab) and (np.any(lab != np.round(lab)) or lab.min() < 0 or lab.max() >= C):
            raise ValueError(f"{where}: labels {lab.tolist()} must be integers in [0, {C})")
        image_id = i + 1
        images.append({"id": image_id, "file_name": name, "width": W, "height": H})
        for box, label in zip(b, lab):
            x1, y1, x2, y2 = (float(v) for v in box)
            w, h = x2 - x1, y2 - y1
            annotations.append({
                "id": len(annotations) + 1, "image_id": image_id, "category_id": int(label) + 1,
                "bbox": [_num(x1), _num(y1), _num(w), _num(h)], "area": _num(w * h),
                "iscrowd": 0,
            })
    categories = [{"id": i + 1, "name": n, "supercategory": "none"} for i, n in enumerate(class_names)]
    doc = {"images": images, "annotations": annotations, "categories": categories}
    return json.dumps(doc, ensure_ascii=False, separators=(",", ":")) + "\n"


def write_coco_json(path: str, entries, class_names: Sequence[str], sizes) -> None:
    """Write records as a COCO detection json, atomically.

    Output: ``{"images", "annotations", "categories"}``; image ids ``1..N`` in entry order,
    annotation ids ``1..`` in entry then box order, category ids ``1..C`` (label + 1, named from
    ``class_names``, ``"supercategory": "none"``), ``bbox = [x1, y1, x2 - x1, y2 - y1]`` pixels,
    ``area = w * h``, ``iscrowd = 0``; no ``segmentation``. Numbers are written exactly (whole values
    as integers), compact separators, UTF-8, one trailing newline: the bytes depend only on the
    arguments. An entry with no boxes becomes an image without annotations (which
    :func:`read_coco_json` then leaves out and counts). A box partly outside its image is written
    as given (reading clips it). Reading the file back gives the same records (float32 boxes
    compare equal) for entries whose boxes lie inside their images.

    The file is written through :func:`gnetmdk.checkpoint.io.atomic_write_text` (temporary file,
    fsync, rename): a failure leaves the old file or none, never a partial one.

    Args:
        path: output file (parent folders are created).
        entries: ``(image_name, boxes (K, 4) pixel xyxy, labels (K,) 0-based)``, e.g. from
            :func:`gnetmdk.dataset.voc.read_meta` or :func:`read_coco_json`.
        class_names: ``C`` class names (label = index).
        sizes: ``(width, height)`` in pixels per entry, same order.

    Raises:
        ValueError: (nothing written) empty or duplicate ``class_names``; ``sizes`` and ``entries``
            of different lengths; an image name empty, with whitespace or repeated; a size that is
            not two positive whole numbers; boxes not ``(K, 4)`` finite with ``x2 > x1`` and
            ``y2 > y1``, or entirely outside their image; labels outside ``[0, C)``.
    """
    text = coco_json_text(entries, class_names, sizes)
    atomic_write_text(str(path), text)
