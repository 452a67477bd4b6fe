"""Tests for gnetmdk.dataset.coco (COCO json records) and gnetmdk.evaluation.coco (COCO mAP).

Every expected number is worked out by hand in a comment or computed independently in the test.
"""

import copy
import glob
import json
import math
import os

import numpy as np
import pytest
import torch

from gnetmdk.dataset.coco import CocoFormatError, read_coco_json, write_coco_json
from gnetmdk.evaluation.coco import evaluate_coco
from gnetmdk.evaluation.voc import evaluate_detections
from repo_paths import REPO

torch.set_num_threads(1)

#: the project's real VOC sets sit in ../shared/data beside the repository
CARDS = os.path.join(os.path.dirname(REPO), "shared", "data",
                     "cards")
CARD_CLASSES = ["nine", "ten", "jack", "queen", "king", "ace"]


# ----------------------------------------------------------------------------------------------
# dataset: reading and writing
# ----------------------------------------------------------------------------------------------

def _entries():
    """Three images, fractional and whole coordinates, two classes."""
    return [
        ("a.jpg", np.array([[10, 20, 110, 220], [0.5, 1.25, 30.75, 40]], np.float32),
         np.array([0, 1], np.int64)),
        ("sub/b.png", np.array([[5, 5, 6, 7]], np.float32), np.array([1], np.int64)),
        ("c.jpg", np.array([[100, 50, 640, 480], [1, 2, 3, 4], [7, 7, 9.5, 9]], np.float32),
         np.array([0, 0, 1], np.int64)),
    ]


SIZES = [(200, 300), (8, 8), (640, 480)]
NAMES = ["cat", "dog"]


def _assert_records_equal(got, want):
    assert len(got) == len(want)
    for (gn, gb, gl), (wn, wb, wl) in zip(got, want):
        assert gn == wn
        assert gb.dtype == np.float32 and gb.shape == wb.shape
        assert np.array_equal(gb, wb), (gn, gb, wb)
        assert gl.dtype == np.int64 and np.array_equal(gl, wl)


def test_round_trip_records_json_records(tmp_path):
    path = tmp_path / "train.json"
    entries = _entries()
    write_coco_json(path, entries, NAMES, SIZES)
    records, names, sizes, stats = read_coco_json(path, NAMES)
    _assert_records_equal(records, entries)
    assert names == NAMES
    assert sizes == SIZES
    assert stats["images"] == 3 and stats["annotations"] == 6
    assert stats["no_objects"] == [] and stats["crowd_dropped"] == 0 and stats["clipped"] == 0

    doc = json.loads(path.read_text())
    assert [im["id"] for im in doc["images"]] == [1, 2, 3]
    assert [a["id"] for a in doc["annotations"]] == [1, 2, 3, 4, 5, 6]
    assert doc["categories"] == [{"id": 1, "name": "cat", "supercategory": "none"},
                                 {"id": 2, "name": "dog", "supercategory": "none"}]
    # second box of a.jpg: x=0.5, y=1.25, w=30.75-0.5=30.25, h=40-1.25=38.75, area=30.25*38.75
    a2 = doc["annotations"][1]
    assert a2["bbox"] == [0.5, 1.25, 30.25, 38.75]
    assert a2["area"] == pytest.approx(30.25 * 38.75, abs=0)
    assert a2["category_id"] == 2 and a2["iscrowd"] == 0 and a2["image_id"] == 1


def test_write_is_deterministic_bytes(tmp_path):
    p1, p2 = tmp_path / "1.json", tmp_path / "2.json"
    write_coco_json(p1, _entries(), NAMES, SIZES)
    write_coco_json(p2, copy.deepcopy(_entries()), list(NAMES), list(SIZES))
    assert p1.read_bytes() == p2.read_bytes()
    # reading back and writing again reproduces the bytes too
    records, names, sizes, _ = read_coco_json(p1)
    p3 = tmp_path / "3.json"
    write_coco_json(p3, records, names, sizes)
    assert p3.read_bytes() == p1.read_bytes()


def test_empty_image_left_out_and_counted(tmp_path):
    path = tmp_path / "t.json"
    entries = _entries()
    entries.insert(1, ("empty.jpg", np.zeros((0, 4), np.float32), np.zeros(0, np.int64)))
    write_coco_json(path, entries, NAMES, SIZES[:1] + [(10, 10)] + SIZES[1:])
    records, _, sizes, stats = read_coco_json(path)
    _assert_records_equal(records, _entries())
    assert sizes == SIZES
    assert stats["images"] == 4 and stats["no_objects"] == ["empty.jpg"]


def test_write_refuses_bad_input_and_writes_nothing(tmp_path):
    path = tmp_path / "t.json"
    path.write_text("old\n")
    bad = _entries()
    bad[2] = ("c.jpg", bad[2][1], np.array([0, 0, 2]))  # label 2 with 2 classes
    with pytest.raises(ValueError, match=r"entries\[2\].*\[0, 2\)"):
        write_coco_json(path, bad, NAMES, SIZES)
    with pytest.raises(ValueError, match="sizes has 2"):
        write_coco_json(path, _entries(), NAMES, SIZES[:2])
    with pytest.raises(ValueError, match="whitespace"):
        write_coco_json(path, [("a b.jpg",) + _entries()[0][1:]], NAMES, SIZES[:1])
    assert path.read_text() == "old\n"
    assert os.listdir(tmp_path) == ["t.json"]  # no temporary file left behind


def _doc():
    """A valid hand-written json: non-contiguous category ids, a crowd box, a box to clip."""
    return {
        "info": {"description": "test"},
        "images": [
            {"id": 10, "file_name": "x.jpg", "width": 100, "height": 50},
            {"id": 4, "file_name": "y.jpg", "width": 40, "height": 40},
            {"id": 7, "file_name": "z.jpg", "width": 30, "height": 30},
        ],
        "categories": [
            {"id": 11, "name": "car"},
            {"id": 3, "name": "person"},
            {"id": 7, "name": "bike"},
        ],
        "annotations": [
            {"id": 1, "image_id": 10, "category_id": 11, "bbox": [10, 5, 20, 10], "iscrowd": 0},
            {"id": 2, "image_id": 10, "category_id": 3, "bbox": [-5, 40, 25, 20]},  # clipped
            {"id": 3, "image_id": 4, "category_id": 7, "bbox": [1.5, 2, 3, 4.5], "iscrowd": 0},
            {"id": 4, "image_id": 4, "category_id": 3, "bbox": [0, 0, 40, 40], "iscrowd": 1},
            {"id": 5, "image_id": 7, "category_id": 3, "bbox": [0, 0, 5, 5], "iscrowd": 1},
        ],
    }


def _write(tmp_path, doc, name="ann.json"):
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return str(path)


def test_non_contiguous_category_ids_crowd_and_clipping(tmp_path):
    path = _write(tmp_path, _doc())
    records, names, sizes, stats = read_coco_json(path)
    # categories sorted by id: 3 person, 7 bike, 11 car -> labels 0, 1, 2
    assert names == ["person", "bike", "car"]
    assert stats["category_ids"] == [3, 7, 11]
    # image 10: car [10,5,30,15] -> label 2; person [-5,40,20,60] clipped to [0,40,20,50] -> label 0
    # image 4: bike [1.5,2,4.5,6.5] -> label 1 (its crowd person box is dropped)
    # image 7: only a crowd box -> left out, counted
    want = [
        ("x.jpg", np.array([[10, 5, 30, 15], [0, 40, 20, 50]], np.float32), np.array([2, 0])),
        ("y.jpg", np.array([[1.5, 2, 4.5, 6.5]], np.float32), np.array([1])),
    ]
    _assert_records_equal(records, want)
    assert sizes == [(100, 50), (40, 40)]
    assert stats["crowd_dropped"] == 2 and stats["clipped"] == 1
    assert stats["no_objects"] == ["z.jpg"]
    # the expected class list is accepted when it matches, refused (both lists named) otherwise
    assert read_coco_json(path, ["person", "bike", "car"]).class_names == names
    with pytest.raises(CocoFormatError) as exc:
        read_coco_json(path, ["car", "person", "bike"])
    msg = str(exc.value)
    assert path in msg and "['person', 'bike', 'car']" in msg and "['car', 'person', 'bike']" in msg


def _mutate(fn):
    doc = _doc()
    fn(doc)
    return doc


# (mutation, strings the message must contain: the offending id and the field)
REFUSALS = {
    "missing_key": (lambda d: d.pop("annotations"), ["'annotations'"]),
    "unknown_image_id": (lambda d: d["annotations"][2].update(image_id=99),
                         ["annotation id 3", "'image_id'", "99"]),
    "unknown_category_id": (lambda d: d["annotations"][0].update(category_id=5),
                            ["annotation id 1", "'category_id'", "5", "[3, 7, 11]"]),
    "bbox_three_numbers": (lambda d: d["annotations"][1].update(bbox=[1, 2, 3]),
                           ["annotation id 2", "'bbox'", "4 finite numbers"]),
    "bbox_nan": (lambda d: d["annotations"][1].update(bbox=[1, float("nan"), 3, 4]),
                 ["annotation id 2", "'bbox'"]),
    "bbox_string": (lambda d: d["annotations"][1].update(bbox=[1, "2", 3, 4]),
                    ["annotation id 2", "'bbox'"]),
    "bbox_zero_width": (lambda d: d["annotations"][2].update(bbox=[1, 2, 0, 4]),
                        ["annotation id 3", "'bbox'", "w=0"]),
    "bbox_negative_height": (lambda d: d["annotations"][0].update(bbox=[1, 2, 3, -4]),
                             ["annotation id 1", "'bbox'", "h=-4"]),
    "box_outside_image": (lambda d: d["annotations"][0].update(bbox=[100, 5, 20, 10]),
                          ["annotation id 1", "image id 10", "outside the 100x50 image"]),
    "duplicate_image_id": (lambda d: d["images"][2].update(id=4),
                           ["image id 4", "used twice"]),
    "file_name_whitespace": (lambda d: d["images"][1].update(file_name="my photo.jpg"),
                             ["image id 4", "'file_name'", "whitespace"]),
    "crowd_box_outside_is_checked_too": (lambda d: d["annotations"][4].update(bbox=[31, 0, 5, 5]),
                                         ["annotation id 5", "outside"]),
    "duplicate_annotation_id": (lambda d: d["annotations"][3].update(id=1),
                                ["annotation id 1", "used twice"]),
    "image_without_width": (lambda d: d["images"][0].pop("width"), ["image id 10", "'width'"]),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_refusals_name_file_id_and_field(tmp_path, case):
    mutate, needles = REFUSALS[case]
    path = _write(tmp_path, _mutate(mutate))
    with pytest.raises(CocoFormatError) as exc:
        read_coco_json(path)
    msg = str(exc.value)
    assert msg.startswith(path + ":"), msg
    assert exc.value.path == path
    for needle in needles:
        assert needle in msg, (needle, msg)


def test_refuses_non_json_with_line_and_column(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{\n  "images": [\n    {"id": 1,}\n  ]\n}\n')  # trailing comma, line 3
    with pytest.raises(CocoFormatError) as exc:
        read_coco_json(path)
    msg = str(exc.value)
    assert str(path) in msg and "line 3, column" in msg and "not valid JSON" in msg
    with pytest.raises(FileNotFoundError, match="nope.json"):
        read_coco_json(tmp_path / "nope.json")
    top = _write(tmp_path, [1, 2], "list.json")
    with pytest.raises(CocoFormatError, match="top level is a JSON list"):
        read_coco_json(top)


@pytest.mark.skipif(not os.path.isdir(CARDS), reason="real VOC data not present")
def test_real_voc_annotations_round_trip(tmp_path):
    from gnetmdk.dataset.voc import parse_voc_xml

    entries, sizes = [], []
    for xml in sorted(glob.glob(os.path.join(CARDS, "Annotations", "*.xml")))[:40]:
        ann = parse_voc_xml(xml, CARD_CLASSES)
        entries.append((ann["filename"], np.asarray(ann["boxes"], np.float32).reshape(-1, 4),
                        np.asarray(ann["labels"], np.int64)))
        sizes.append((ann["width"], ann["height"]))
    entries_kept = [e for e in entries if len(e[1])]
    path = tmp_path / "cards.json"
    write_coco_json(path, entries, CARD_CLASSES, sizes)
    records, names, got_sizes, stats = read_coco_json(path, CARD_CLASSES)
    _assert_records_equal(records, entries_kept)
    assert stats["annotations"] == sum(len(e[1]) for e in entries) >= 40
    assert len(records) == len(entries_kept) > 30


# ----------------------------------------------------------------------------------------------
# evaluation: COCO mAP through pycocotools
# ----------------------------------------------------------------------------------------------

def _gt(boxes, labels, difficult=None):
    d = {"boxes": np.asarray(boxes, np.float64).reshape(-1, 4), "labels": np.asarray(labels, np.int64)}
    if difficult is not None:
        d["difficult"] = np.asarray(difficult, bool)
    return d


def _det(boxes, scores, labels):
    return {"boxes": np.asarray(boxes, np.float64).reshape(-1, 4),
            "scores": np.asarray(scores, np.float64), "labels": np.asarray(labels, np.int64)}


def test_perfect_detections_score_one_in_both_and_print_nothing(capsys):
    gts = [_gt([[10, 10, 50, 60], [70, 20, 90, 90]], [0, 1]), _gt([[0, 0, 30, 30]], [0])]
    dets = [_det(g["boxes"], [0.9] * len(g["labels"]), g["labels"]) for g in gts]
    r = evaluate_coco(dets, gts, 2, [(100, 100), (40, 40)])
    # pycocotools divides by tp + fp + 2.2e-16, so "1" arrives as 1 - 1e-16: compare to 1e-12
    one = pytest.approx(1.0, abs=1e-12)
    assert (r["map"], r["ap50"], r["ap75"]) == (one, one, one)
    assert r["ap_per_class"] == [one, one] and r["ap50_per_class"] == [one, one]
    assert r["num_gt"] == [2, 1] and r["num_det"] == [2, 1]
    assert all(isinstance(v, float) for k, v in r.items() if not isinstance(v, list))
    assert evaluate_detections(dets, gts, 2)["map"] == 1.0
    assert capsys.readouterr().out == ""


def test_one_false_positive_ranked_first_by_hand():
    # one image, class 0, two ground truths; FP (0.9, nowhere near), TP (0.8), TP (0.7)
    # precision 0, 1/2, 2/3 at recall 0, 1/2, 1 -> envelope 2/3 everywhere on [0, 1]
    # VOC all-point: 1/2 * 2/3 + 1/2 * 2/3 = 2/3
    # COCO 101-point: every recall point r in 0..1 reaches precision envelope 2/3 -> 2/3
    # the TPs are exact, IoU 1 >= every threshold, so AP@[.5:.95] is 2/3 as well
    g = [[10, 10, 40, 40], [60, 60, 90, 90]]
    gts = [_gt(g, [0, 0])]
    dets = [_det([[200, 200, 230, 230]] + g, [0.9, 0.8, 0.7], [0, 0, 0])]
    r = evaluate_coco(dets, gts, 1, [(300, 300)])
    assert r["ap50"] == pytest.approx(2 / 3, abs=1e-12)
    assert r["map"] == pytest.approx(2 / 3, abs=1e-12)
    assert evaluate_detections(dets, gts, 1)["map"] == pytest.approx(2 / 3, abs=1e-12)


def test_interpolations_differ_by_hand():
    # three ground truths; ranked TP, FP, TP, FP, TP
    # precision 1, 1/2, 2/3, 1/2, 3/5 at recall 1/3, 1/3, 2/3, 2/3, 1
    # envelope at recall 1/3: 1, at 2/3: 2/3, at 1: 3/5
    # VOC all-point: 1/3 * 1 + 1/3 * 2/3 + 1/3 * 3/5 = 34/45
    # COCO 101-point: r = 0.00..0.33 (34 points) -> 1; 0.34..0.66 (33) -> 2/3; 0.67..1.00 (34) -> 3/5
    #   (34 + 33 * 2/3 + 34 * 3/5) / 101 = 76.4 / 101
    g = [[0, 0, 10, 10], [20, 0, 30, 10], [40, 0, 50, 10]]
    fp = [[0, 50, 10, 60], [20, 50, 30, 60]]
    dets = [_det([g[0], fp[0], g[1], fp[1], g[2]], [0.9, 0.8, 0.7, 0.6, 0.5], [0] * 5)]
    gts = [_gt(g, [0, 0, 0])]
    coco = evaluate_coco(dets, gts, 1, [(60, 60)])["ap50"]
    voc = evaluate_detections(dets, gts, 1)["map"]
    assert voc == pytest.approx(34 / 45, abs=1e-12)
    assert coco == pytest.approx(76.4 / 101, abs=1e-12)
    assert abs(coco - voc) < 0.01


def _coco_ap50_reference(dets, gts, cls):
    """Independent COCO AP at IoU 0.5 for one class: greedy matching by score (stable on ties,
    image order then in-image order), each detection taking the unmatched ground truth of its image
    with the highest IoU >= 0.5; precision envelope read at the 101 recall points 0, 0.01, ..., 1
    (0 where the recall is not reached). Assumes at most 100 detections per image and class."""
    entries = []
    for i, d in enumerate(dets):
        for b, s, l in zip(d["boxes"], d["scores"], d["labels"]):
            if l == cls:
                entries.append((i, b, s))
    order = sorted(range(len(entries)), key=lambda k: -entries[k][2])  # sorted() is stable
    gt_boxes = [g["boxes"][g["labels"] == cls] for g in gts]
    taken = [np.zeros(len(b), bool) for b in gt_boxes]
    npos = sum(len(b) for b in gt_boxes)
    tp = []
    for k in order:
        i, b, _ = entries[k]
        best, best_iou = -1, 0.5
        for j, g in enumerate(gt_boxes[i]):
            iw = max(0.0, min(b[2], g[2]) - max(b[0], g[0]))
            ih = max(0.0, min(b[3], g[3]) - max(b[1], g[1]))
            inter = iw * ih
            iou = inter / ((b[2] - b[0]) * (b[3] - b[1]) + (g[2] - g[0]) * (g[3] - g[1]) - inter)
            if not taken[i][j] and iou >= best_iou:
                best, best_iou = j, iou
        if best >= 0:
            taken[i][best] = True
        tp.append(best >= 0)
    tp = np.array(tp, float)
    ctp = np.cumsum(tp)
    recall = ctp / npos
    precision = ctp / np.arange(1, len(tp) + 1)
    envelope = np.maximum.accumulate(precision[::-1])[::-1]
    points = np.linspace(0.0, 1.0, 101)
    total = 0.0
    for r in points:
        reached = np.nonzero(recall >= r)[0]
        total += envelope[reached[0]] if len(reached) else 0.0
    return total / 101


def _random_case(rng, n_images=6, num_classes=3):
    """Ground truths on a grid (no two overlap, so VOC's and COCO's matching rules agree),
    detections = jittered copies of some ground truths plus scattered false positives,
    distinct random scores."""
    gts, dets = [], []
    for _ in range(n_images):
        cells = rng.choice(16, size=rng.integers(1, 7), replace=False)
        boxes = np.array([[(c % 4) * 50 + 5, (c // 4) * 50 + 5, (c % 4) * 50 + 45, (c // 4) * 50 + 45]
                          for c in cells], float)
        labels = rng.integers(0, num_classes, len(boxes))
        gts.append(_gt(boxes, labels))
        hit = rng.random(len(boxes)) < 0.7
        db = boxes[hit] + rng.uniform(-6, 6, (int(hit.sum()), 4))
        dl = labels[hit].copy()
        dl[rng.random(len(dl)) < 0.1] = rng.integers(0, num_classes)  # some wrong classes
        n_fp = int(rng.integers(0, 4))
        fpb = rng.uniform(0, 160, (n_fp, 2))
        fpb = np.concatenate([fpb, fpb + rng.uniform(5, 40, (n_fp, 2))], 1)
        db = np.concatenate([db, fpb]).reshape(-1, 4)
        dl = np.concatenate([dl, rng.integers(0, num_classes, n_fp)]).astype(np.int64)
        dets.append(_det(db, rng.random(len(db)), dl))
    return dets, gts


def test_cross_check_ap50_against_reference_and_voc():
    # Bound between the two interpolations, for the same ranked matches: let f(r) be the precision
    # envelope at the first rank reaching recall >= r (0 past the final recall); f is
    # non-increasing with values in [0, 1]. VOC all-point AP is the integral of f over [0, 1],
    # COCO's is S / 101 with S = sum of f(k / 100), k = 0..100. On each [k/100, (k+1)/100] the
    # integral lies between f((k+1)/100) / 100 and f(k/100) / 100, so
    #   (S - f(0)) / 100 <= VOC <= (S - f(1)) / 100
    #   COCO - VOC in [f(1)/100 - S/10100, f(0)/100 - S/10100], within [-0.01, 0.01] as S <= 101.
    # VOC and COCO rank and match identically here: no two ground truths overlap (one candidate
    # per detection) and ties in score have probability 0.
    rng = np.random.default_rng(1234)
    for _ in range(8):
        dets, gts = _random_case(rng)
        sizes = [(200, 200)] * len(gts)
        r = evaluate_coco(dets, gts, 3, sizes)
        voc = evaluate_detections(dets, gts, 3)
        for c in range(3):
            if voc["num_gt"][c] == 0:
                assert math.isnan(r["ap50_per_class"][c]) and math.isnan(voc["ap"][c])
                continue
            ref = _coco_ap50_reference(dets, gts, c)
            assert r["ap50_per_class"][c] == pytest.approx(ref, abs=1e-9)
            assert abs(r["ap50_per_class"][c] - voc["ap"][c]) <= 0.01 + 1e-12
        assert abs(r["ap50"] - voc["map"]) <= 0.01 + 1e-12


def test_ap75_and_map_over_thresholds():
    # ground truth [0,0,100,100]; detection [0,0,100,62]: IoU = 6200 / 10000 = 0.62
    # a match at IoU thresholds 0.50, 0.55, 0.60 (3 of 10) -> AP50 1, AP75 0, AP@[.5:.95] 0.3
    r = evaluate_coco([_det([[0, 0, 100, 62]], [0.5], [0])], [_gt([[0, 0, 100, 100]], [0])], 1,
                      [(100, 100)])
    assert (r["ap50"], r["ap75"]) == (pytest.approx(1.0, abs=1e-12), 0.0)
    assert r["map"] == pytest.approx(0.3, abs=1e-12)


def test_empty_detections_and_class_without_ground_truth():
    gts = [_gt([[10, 10, 50, 50]], [0]), _gt([[5, 5, 25, 25], [30, 30, 60, 60]], [1, 0])]
    empty = [_det(np.zeros((0, 4)), [], []) for _ in gts]
    r = evaluate_coco(empty, gts, 3, [(64, 64)] * 2)
    # no detections: recall is never reached, precision 0 at every point -> AP 0 for classes 0, 1
    assert r["map"] == 0.0 and r["ap50"] == 0.0
    assert r["ap_per_class"][:2] == [0.0, 0.0]
    # class 2 has no ground truth: pycocotools leaves it out (precision -1) -> nan, not in the mean
    assert math.isnan(r["ap_per_class"][2]) and math.isnan(r["ap50_per_class"][2])
    assert evaluate_detections(empty, gts, 3)["map"] == 0.0

    perfect = [_det(g["boxes"], [0.9] * len(g["labels"]), g["labels"]) for g in gts]
    with_fp = [_det(np.concatenate([d["boxes"], [[0, 0, 20, 20]]]),
                    np.concatenate([d["scores"], [0.99]]),
                    np.concatenate([d["labels"], [2]])) for d in perfect]
    r2 = evaluate_coco(with_fp, gts, 3, [(64, 64)] * 2)
    # false positives of a class without ground truth cost nothing: mean of classes 0 and 1 only
    assert r2["map"] == pytest.approx(1.0, abs=1e-12) and r2["num_det"] == [2, 1, 2]
    assert math.isnan(r2["ap_per_class"][2])

    none = evaluate_coco([_det(np.zeros((0, 4)), [], [])], [_gt(np.zeros((0, 4)), [])], 2,
                         [(10, 10)])
    assert math.isnan(none["map"]) and none["num_gt"] == [0, 0]


def test_difficult_ground_truth_is_ignored_like_voc():
    # ground truths: one normal, two difficult; detections on the normal one and on one difficult
    # one (ranked first). Ignored: the detection on the difficult box is neither TP nor FP and the
    # undetected difficult box is no miss -> AP 1 in both evaluations. (Counted as normal boxes it
    # would be 2/3 (recall 2/3 at precision 1); dropped, the first detection is a FP -> 1/2.)
    gts = [_gt([[0, 0, 20, 20], [50, 50, 80, 80], [0, 50, 20, 80]], [0, 0, 0],
               difficult=[False, True, True])]
    dets = [_det([[50, 50, 80, 80], [0, 0, 20, 20]], [0.9, 0.8], [0, 0])]
    r = evaluate_coco(dets, gts, 1, [(100, 100)])
    assert r["ap50"] == pytest.approx(1.0, abs=1e-12) and r["num_gt"] == [1]
    assert evaluate_detections(dets, gts, 1)["map"] == 1.0


def test_evaluate_coco_refuses_bad_input():
    gts = [_gt([[0, 0, 10, 10]], [0])]
    dets = [_det([[0, 0, 10, 10]], [0.5], [0])]
    with pytest.raises(ValueError, match="one entry per image"):
        evaluate_coco(dets, gts, 1, [])
    with pytest.raises(ValueError, match=r"sizes\[0\]"):
        evaluate_coco(dets, gts, 1, [(0, 10)])
    with pytest.raises(ValueError, match=r"detections\[0\]: labels must be integers in \[0, 1\)"):
        evaluate_coco([_det([[0, 0, 10, 10]], [0.5], [1])], gts, 1, [(10, 10)])
    with pytest.raises(ValueError, match="num_classes"):
        evaluate_coco(dets, gts, 0, [(10, 10)])
