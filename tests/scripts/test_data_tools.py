"""Tests for the VOC -> meta conversion (gnetmdk.dataset.voc, tools/xml_2_txt.py) and the shapes
generator (gnetmdk.dataset.shapes, tools/make_shapes.py).

Real datasets are read in place from ../shared/data (beside the repository); every fixture is written under tmp_path.
"""

import os
import subprocess
import sys

import cv2
import numpy as np
import pytest

from gnetmdk.dataset.shapes import make_shapes_dataset
from gnetmdk.dataset.voc import (
    MetaFormatError,
    VOCFormatError,
    convert_voc_to_meta,
    parse_voc_xml,
    read_meta,
    write_voc_xml,
)
from repo_paths import REPO

DATA = os.path.join(os.path.dirname(REPO), "shared", "data")
CARDS = os.path.join(DATA, "cards")
RACCOON = os.path.join(DATA, "raccoon")
CARD_CLASSES = ["nine", "ten", "jack", "queen", "king", "ace"]
SHAPES = ["circle", "square", "triangle"]
XML_2_TXT = os.path.join(REPO, "tools", "xml_2_txt.py")
MAKE_SHAPES = os.path.join(REPO, "tools", "make_shapes.py")

needs_cards = pytest.mark.skipif(not os.path.isdir(CARDS), reason="cards dataset not present")
needs_raccoon = pytest.mark.skipif(not os.path.isdir(RACCOON), reason="raccoon dataset not present")


def run_tool(script, *args):
    return subprocess.run([sys.executable, script, *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=60)


def count(meta_path):
    entries = read_meta(meta_path)
    return len(entries), sum(len(labels) for _, _, labels in entries)


# ------------------------------------------------------------------------------------------------
# fixtures: small VOC trees
# ------------------------------------------------------------------------------------------------

def make_tree(root, n=6, classes=("cat", "dog"), imagesets=True, val_every=3):
    """A tiny valid VOC tree: image i has 1 + i % 2 objects. Returns the list of ids."""
    for sub in ("JPEGImages", "Annotations"):
        os.makedirs(os.path.join(root, sub), exist_ok=True)
    ids = []
    for i in range(n):
        stem = f"img{i:03d}"
        w, h = 64 + i, 48
        cv2.imwrite(os.path.join(root, "JPEGImages", stem + ".jpg"), np.full((h, w, 3), 40 * (i % 5), np.uint8))
        objs = [(classes[j % len(classes)], 5 + j * 20, 5, 20 + j * 20, 30, False) for j in range(1 + i % 2)]
        write_voc_xml(os.path.join(root, "Annotations", stem + ".xml"), stem + ".jpg", w, h, objs)
        ids.append(stem)
    if imagesets:
        d = os.path.join(root, "ImageSets", "Main")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "train.txt"), "w") as fh:
            fh.write("".join(s + "\n" for k, s in enumerate(ids) if k % val_every))
        with open(os.path.join(d, "val.txt"), "w") as fh:
            fh.write("".join(s + "\n" for k, s in enumerate(ids) if not k % val_every))
    return ids


def ann(root, stem):
    return os.path.join(root, "Annotations", stem + ".xml")


def break_malformed(root, stem):
    with open(ann(root, stem), "w") as fh:
        fh.write("<annotation>\n  <filename>x.jpg</filename>\n  <size><width>10</width>\n</annotation>\n")


def break_unknown_class(root, stem):
    write_voc_xml(ann(root, stem), stem + ".jpg", 64, 48, [("zebra", 1, 1, 20, 20, False)])


def break_missing_image(root, stem):
    os.remove(os.path.join(root, "JPEGImages", stem + ".jpg"))


def break_degenerate(root, stem):
    write_voc_xml(ann(root, stem), stem + ".jpg", 64, 48, [("cat", 30, 5, 30, 20, False)])


def break_outside(root, stem):
    write_voc_xml(ann(root, stem), stem + ".jpg", 64, 48, [("cat", 100, 5, 120, 20, False)])


def break_missing_field(root, stem):
    with open(ann(root, stem)) as fh:
        text = fh.read()
    with open(ann(root, stem), "w") as fh:
        fh.write(text.replace("<ymax>30</ymax>", ""))


def break_missing_size(root, stem):
    with open(ann(root, stem)) as fh:
        text = fh.read()
    start, end = text.index("<size>"), text.index("</size>") + len("</size>")
    with open(ann(root, stem), "w") as fh:
        fh.write(text[:start] + text[end:])


def break_non_numeric(root, stem):
    with open(ann(root, stem)) as fh:
        text = fh.read()
    with open(ann(root, stem), "w") as fh:
        fh.write(text.replace("<xmin>5</xmin>", "<xmin>five</xmin>", 1))


BREAKERS = {
    "malformed": (break_malformed, "line"),
    "unknown_class": (break_unknown_class, "zebra"),
    "missing_image": (break_missing_image, "img002.jpg"),
    "degenerate": (break_degenerate, "degenerate"),
    "outside": (break_outside, "outside"),
    "missing_field": (break_missing_field, "ymax"),
    "missing_size": (break_missing_size, "size"),
    "non_numeric": (break_non_numeric, "xmin"),
}


# ------------------------------------------------------------------------------------------------
# real datasets
# ------------------------------------------------------------------------------------------------

@needs_cards
def test_cards_cli_counts(tmp_path):
    res = run_tool(XML_2_TXT, "--name", "cards", "--dataset-dir", CARDS,
                   "--classes", ",".join(CARD_CLASSES), "--out-dir", tmp_path)
    assert res.returncode == 0, res.stderr
    train, valid = tmp_path / "cards_train.txt", tmp_path / "cards_valid.txt"
    assert count(train) == (296, 527)
    assert count(valid) == (67, 143)
    for path in (train, valid):
        for name, boxes, labels in read_meta(path, num_classes=len(CARD_CLASSES)):
            assert os.path.isfile(os.path.join(CARDS, "JPEGImages", name))
            assert labels.min() >= 0 and labels.max() < len(CARD_CLASSES)
            assert np.all(boxes[:, 2] > boxes[:, 0]) and np.all(boxes[:, 3] > boxes[:, 1])
    assert "527" in res.stdout and "143" in res.stdout


@needs_cards
def test_cards_per_class_and_round_trip(tmp_path):
    rep = convert_voc_to_meta(CARDS, CARD_CLASSES, tmp_path / "t.txt", tmp_path / "v.txt")
    assert rep["skipped"] == []
    assert dict(rep["splits"]["train"]["per_class"]) == {
        "nine": 89, "ten": 82, "jack": 89, "queen": 80, "king": 95, "ace": 92}
    assert dict(rep["splits"]["valid"]["per_class"]) == {
        "nine": 26, "ten": 18, "jack": 24, "queen": 26, "king": 23, "ace": 26}
    for name, boxes, labels in read_meta(tmp_path / "t.txt") + read_meta(tmp_path / "v.txt"):
        a = parse_voc_xml(os.path.join(CARDS, "Annotations", os.path.splitext(name)[0] + ".xml"),
                          CARD_CLASSES)
        assert boxes.dtype == np.float32 and boxes.shape == (len(a["boxes"]), 4)
        assert labels.dtype == np.int64
        np.testing.assert_array_equal(boxes, np.array(a["boxes"], np.float32))
        np.testing.assert_array_equal(labels, np.array(a["labels"]))


@needs_raccoon
def test_raccoon_including_grayscale(tmp_path):
    rep = convert_voc_to_meta(RACCOON, ["raccoon"], tmp_path / "t.txt", tmp_path / "v.txt")
    assert count(tmp_path / "t.txt") == (160, 173)
    assert count(tmp_path / "v.txt") == (40, 44)
    names = {n for n, _, _ in read_meta(tmp_path / "t.txt") + read_meta(tmp_path / "v.txt")}
    assert {"raccoon-150.jpg", "raccoon-152.jpg", "raccoon-161.jpg"} <= names
    assert rep["splits"]["train"]["no_objects"] == []


# ------------------------------------------------------------------------------------------------
# round trip, clipping, split
# ------------------------------------------------------------------------------------------------

def test_meta_round_trip_matches_xml(tmp_path):
    root = tmp_path / "ds"
    ids = make_tree(root, n=9)
    convert_voc_to_meta(root, ["cat", "dog"], tmp_path / "t.txt", tmp_path / "v.txt")
    got = {n: (b, l) for n, b, l in read_meta(tmp_path / "t.txt") + read_meta(tmp_path / "v.txt")}
    assert sorted(got) == sorted(s + ".jpg" for s in ids)
    for stem in ids:
        a = parse_voc_xml(ann(root, stem), ["cat", "dog"])
        boxes, labels = got[stem + ".jpg"]
        np.testing.assert_array_equal(boxes, np.array(a["boxes"], np.float32))
        np.testing.assert_array_equal(labels, a["labels"])


def test_parse_rounds_and_clips(tmp_path):
    path = tmp_path / "a.xml"
    write_voc_xml(path, "a.jpg", 100, 80, [("cat", -3, 10.6, 120, 80, False), ("dog", 1.4, 2, 50, 60.5, True)])
    a = parse_voc_xml(path, ["cat", "dog"], keep_difficult=True)
    assert (a["filename"], a["width"], a["height"]) == ("a.jpg", 100, 80)
    assert a["boxes"] == [[0, 11, 100, 80], [1, 2, 50, 61]]
    assert a["labels"] == [0, 1] and a["difficult"] == [False, True]


def test_random_split_deterministic_disjoint_complete(tmp_path):
    root = tmp_path / "ds"
    ids = make_tree(root, n=20, imagesets=False)

    def split(seed, tag):
        rep = convert_voc_to_meta(root, ["cat", "dog"], tmp_path / f"{tag}_t.txt", tmp_path / f"{tag}_v.txt",
                                  val_fraction=0.25, seed=seed)
        assert rep["split_source"].startswith("random")
        t = [n for n, _, _ in read_meta(tmp_path / f"{tag}_t.txt")]
        v = [n for n, _, _ in read_meta(tmp_path / f"{tag}_v.txt")]
        return t, v

    t1, v1 = split(7, "a")
    t2, v2 = split(7, "b")
    assert (t1, v1) == (t2, v2)
    assert (tmp_path / "a_t.txt").read_bytes() == (tmp_path / "b_t.txt").read_bytes()
    assert len(v1) == 5 and not set(t1) & set(v1)
    assert sorted(t1 + v1) == sorted(s + ".jpg" for s in ids)
    t3, v3 = split(8, "c")
    assert sorted(t3 + v3) == sorted(t1 + v1) and set(v3) != set(v1)


def test_val_folds_are_disjoint_cover_every_image_and_fold_0_is_the_default_split(tmp_path):
    """fold (I, K): the K val folds of one seed are disjoint, hold round(n (I+1)/K) - round(n I/K) images
    each and together every image once; fold 0/K equals val_fraction 1/K. xml_2_txt --fold I/K writes
    that split; a bad fold, --fold with --val-fraction, and a fold where ImageSets lists decide the
    split are one error line each, and nothing is written."""
    root = tmp_path / "ds"
    ids = make_tree(root, n=23, imagesets=False)

    def val(tag, **kw):
        rep = convert_voc_to_meta(root, ["cat", "dog"], tmp_path / f"{tag}_t.txt", tmp_path / f"{tag}_v.txt",
                                  seed=3, **kw)
        t = [n for n, _, _ in read_meta(tmp_path / f"{tag}_t.txt")]
        v = [n for n, _, _ in read_meta(tmp_path / f"{tag}_v.txt")]
        assert sorted(t + v) == sorted(i + ".jpg" for i in ids) and not set(t) & set(v)
        return v, rep["split_source"]

    folds = [val(f"f{i}", fold=(i, 5)) for i in range(5)]
    assert [len(v) for v, _ in folds] == [5, 4, 5, 4, 5]            # round(23 i / 5): 0, 5, 9, 14, 18, 23
    assert sorted(n for v, _ in folds for n in v) == sorted(i + ".jpg" for i in ids)
    assert folds[2][1] == "random split (seed=3, val fold 2/5)"
    assert folds[0][0] == val("d", val_fraction=0.2)[0]
    assert (tmp_path / "f0_v.txt").read_bytes() == (tmp_path / "d_v.txt").read_bytes()
    assert set(val("s", fold=(0, 5))[0]) == set(folds[0][0])        # deterministic
    for bad in ((5, 5), (0, 1), (-1, 3)):
        with pytest.raises(ValueError, match="0 <= I < K"):
            convert_voc_to_meta(root, ["cat", "dog"], tmp_path / "x_t.txt", tmp_path / "x_v.txt", fold=bad)
    assert not (tmp_path / "x_t.txt").exists()

    out = tmp_path / "meta"
    res = run_tool(XML_2_TXT, "--name", "d", "--dataset-dir", root, "--classes", "cat,dog", "--out-dir", out,
                   "--seed", 3, "--fold", "1/5")
    assert res.returncode == 0, res.stderr
    assert "val fold 1/5" in res.stdout
    assert [n for n, _, _ in read_meta(out / "d_valid.txt")] == folds[1][0]
    for args, msg in ((("--fold", "5/5"), "0 <= I < K"), (("--fold", "one/5"), "is not I/K"),
                      (("--fold", "1/5", "--val-fraction", "0.2"), "give one")):
        res = run_tool(XML_2_TXT, "--name", "e", "--dataset-dir", root, "--classes", "cat,dog", "--out-dir", out,
                       *args)
        assert res.returncode == 2 and msg in res.stderr and "Traceback" not in res.stderr
        assert len(res.stderr.strip().splitlines()) == 1
    assert not (out / "e_train.txt").exists()
    listed = tmp_path / "listed"
    make_tree(listed, n=6)
    res = run_tool(XML_2_TXT, "--name", "e", "--dataset-dir", listed, "--classes", "cat,dog", "--out-dir", out,
                   "--fold", "0/3")
    assert res.returncode == 2 and "decide the split" in res.stderr and not (out / "e_train.txt").exists()


def test_imagesets_split_is_used(tmp_path):
    root = tmp_path / "ds"
    ids = make_tree(root, n=9, val_every=3)
    rep = convert_voc_to_meta(root, ["cat", "dog"], tmp_path / "t.txt", tmp_path / "v.txt", seed=123)
    assert "ImageSets" in rep["split_source"]
    assert [n for n, _, _ in read_meta(tmp_path / "v.txt")] == [ids[k] + ".jpg" for k in (0, 3, 6)]


def test_image_found_by_stem_when_filename_is_wrong(tmp_path):
    root = tmp_path / "ds"
    make_tree(root, n=3)
    os.rename(root / "JPEGImages" / "img001.jpg", root / "JPEGImages" / "img001.png")
    convert_voc_to_meta(root, ["cat", "dog"], tmp_path / "t.txt", tmp_path / "v.txt")
    assert "img001.png" in [n for n, _, _ in read_meta(tmp_path / "t.txt")]


# ------------------------------------------------------------------------------------------------
# bad inputs: refused, file named, nothing written
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", sorted(BREAKERS))
def test_bad_input_refused_and_nothing_written(tmp_path, kind):
    root = tmp_path / "ds"
    make_tree(root, n=6)
    breaker, needle = BREAKERS[kind]
    breaker(root, "img002")
    out = tmp_path / "out"
    with pytest.raises(VOCFormatError) as err:
        convert_voc_to_meta(root, ["cat", "dog"], out / "t.txt", out / "v.txt")
    msg = str(err.value)
    assert "img002.xml" in msg and needle in msg, msg
    assert not out.exists() or os.listdir(out) == []


def test_error_messages_are_specific(tmp_path):
    root = tmp_path / "ds"
    make_tree(root, n=3)
    break_malformed(root, "img000")
    with pytest.raises(VOCFormatError, match=r"img000\.xml: malformed XML at line \d+"):
        parse_voc_xml(ann(root, "img000"), ["cat", "dog"])
    break_unknown_class(root, "img001")
    with pytest.raises(VOCFormatError, match=r"'zebra'.*\['cat', 'dog'\].*VOC_CLASSES"):
        parse_voc_xml(ann(root, "img001"), ["cat", "dog"])
    break_degenerate(root, "img002")
    with pytest.raises(VOCFormatError, match=r"object #0.*\(30, 5, 30, 20\)"):
        parse_voc_xml(ann(root, "img002"), ["cat", "dog"])


def test_failed_run_keeps_previous_outputs(tmp_path):
    root = tmp_path / "ds"
    make_tree(root, n=6)
    convert_voc_to_meta(root, ["cat", "dog"], tmp_path / "t.txt", tmp_path / "v.txt")
    before = (tmp_path / "t.txt").read_bytes(), (tmp_path / "v.txt").read_bytes()
    break_degenerate(root, "img005")
    with pytest.raises(VOCFormatError):
        convert_voc_to_meta(root, ["cat", "dog"], tmp_path / "t.txt", tmp_path / "v.txt")
    assert ((tmp_path / "t.txt").read_bytes(), (tmp_path / "v.txt").read_bytes()) == before
    # no temp files left (the meta files and their image-size records, as one set)
    assert sorted(os.listdir(tmp_path)) == ["ds", "t.sizes.json", "t.txt", "v.sizes.json", "v.txt"]


def test_listed_id_without_annotation(tmp_path):
    root = tmp_path / "ds"
    make_tree(root, n=4)
    with open(root / "ImageSets" / "Main" / "train.txt", "a") as fh:
        fh.write("ghost\n")
    with pytest.raises(VOCFormatError, match="ghost.xml"):
        convert_voc_to_meta(root, ["cat", "dog"], tmp_path / "t.txt", tmp_path / "v.txt")


def test_skip_bad_lists_every_skipped_file(tmp_path):
    root = tmp_path / "ds"
    ids = make_tree(root, n=8)
    bad = {"img001": break_malformed, "img003": break_unknown_class, "img004": break_missing_image,
           "img006": break_degenerate}
    for stem, breaker in bad.items():
        breaker(root, stem)
    rep = convert_voc_to_meta(root, ["cat", "dog"], tmp_path / "t.txt", tmp_path / "v.txt", skip_bad=True)
    assert sorted(os.path.basename(p) for p, _ in rep["skipped"]) == sorted(s + ".xml" for s in bad)
    written = [n for n, _, _ in read_meta(tmp_path / "t.txt") + read_meta(tmp_path / "v.txt")]
    assert sorted(written) == sorted(s + ".jpg" for s in ids if s not in bad)

    res = run_tool(XML_2_TXT, "--name", "x", "--dataset-dir", root, "--classes", "cat,dog",
                   "--out-dir", tmp_path / "cli", "--skip-bad")
    assert res.returncode == 0, res.stderr
    for stem in bad:
        assert stem + ".xml" in res.stderr
    assert count(tmp_path / "cli" / "x_train.txt")[0] + count(tmp_path / "cli" / "x_valid.txt")[0] == 4


def test_difficult_dropped_by_default(tmp_path):
    root = tmp_path / "ds"
    make_tree(root, n=3)
    write_voc_xml(ann(root, "img001"), "img001.jpg", 65, 48,
                  [("cat", 2, 2, 20, 20, True), ("dog", 30, 5, 60, 40, False)])
    write_voc_xml(ann(root, "img002"), "img002.jpg", 66, 48, [("dog", 2, 2, 20, 20, True)])

    rep = convert_voc_to_meta(root, ["cat", "dog"], tmp_path / "t.txt", tmp_path / "v.txt")
    train = {n: l.tolist() for n, _, l in read_meta(tmp_path / "t.txt")}
    assert train == {"img001.jpg": [1]}  # img002 had only a difficult object
    assert [os.path.basename(p) for p in rep["splits"]["train"]["no_objects"]] == ["img002.xml"]
    assert rep["splits"]["train"]["dropped_difficult"] == 2

    convert_voc_to_meta(root, ["cat", "dog"], tmp_path / "t.txt", tmp_path / "v.txt", keep_difficult=True)
    train = {n: l.tolist() for n, _, l in read_meta(tmp_path / "t.txt")}
    assert train == {"img001.jpg": [0, 1], "img002.jpg": [1]}


# ------------------------------------------------------------------------------------------------
# read_meta errors
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("line, needle", [
    ("a.jpg 1 2 3 4", "fields"),
    ("a.jpg 1 2 3 4 0 5", "fields"),
    ("a.jpg 1 2 x 4 0", "non-numeric"),
    ("a.jpg 1 2 3 4 -1", "negative"),
    ("a.jpg 1 2 3 4 c", "integer"),
])
def test_read_meta_errors_name_file_and_line(tmp_path, line, needle):
    path = tmp_path / "m.txt"
    path.write_text("ok.jpg 1 2 3 4 0\n\n" + line + "\n")
    with pytest.raises(MetaFormatError, match=rf"m\.txt:3: .*{needle}"):
        read_meta(path)


def test_read_meta_class_range(tmp_path):
    path = tmp_path / "m.txt"
    path.write_text("a.jpg 1 2 3 4 0 5 6 7 8 2\nb.jpg\n")
    entries = read_meta(path)
    assert entries[1][1].shape == (0, 4) and entries[1][2].shape == (0,)
    with pytest.raises(MetaFormatError, match=r"m\.txt:1: class index 2 out of range"):
        read_meta(path, num_classes=2)


# ------------------------------------------------------------------------------------------------
# CLI errors
# ------------------------------------------------------------------------------------------------

def test_cli_bad_input_exits_2_with_one_line(tmp_path):
    root = tmp_path / "ds"
    make_tree(root, n=4)
    break_unknown_class(root, "img001")
    out = tmp_path / "out"
    res = run_tool(XML_2_TXT, "--name", "X", "--dataset-dir", root, "--classes", "cat,dog", "--out-dir", out)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "img001.xml" in lines[0] and "zebra" in lines[0]
    assert "Traceback" not in res.stderr
    assert not out.exists()


def test_cli_missing_dataset_dir_exits_2(tmp_path):
    res = run_tool(XML_2_TXT, "--name", "X", "--dataset-dir", tmp_path / "nope", "--classes", "a",
                   "--out-dir", tmp_path / "out")
    assert res.returncode == 2
    assert len(res.stderr.strip().splitlines()) == 1 and "nope" in res.stderr


# ------------------------------------------------------------------------------------------------
# shapes
# ------------------------------------------------------------------------------------------------

def test_shapes_deterministic_and_convertible(tmp_path):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    rep = make_shapes_dataset(a, num_train=12, num_val=4, seed=3)
    make_shapes_dataset(b, num_train=12, num_val=4, seed=3)
    make_shapes_dataset(c, num_train=12, num_val=4, seed=4)

    files = sorted(os.path.relpath(os.path.join(d, f), a) for d, _, fs in os.walk(a) for f in fs)
    assert len(files) == 2 * 16 + 2
    assert files == sorted(os.path.relpath(os.path.join(d, f), b) for d, _, fs in os.walk(b) for f in fs)
    for rel in files:
        if rel.endswith(".jpg"):
            np.testing.assert_array_equal(cv2.imread(str(a / rel)), cv2.imread(str(b / rel)))
        else:
            assert (a / rel).read_bytes() == (b / rel).read_bytes(), rel
    assert (a / "Annotations" / "train_00000.xml").read_bytes() != (c / "Annotations" / "train_00000.xml").read_bytes()

    conv = convert_voc_to_meta(a, SHAPES, tmp_path / "t.txt", tmp_path / "v.txt")
    assert conv["skipped"] == [] and "ImageSets" in conv["split_source"]
    assert count(tmp_path / "t.txt") == (12, rep["splits"]["train"]["boxes"])
    assert count(tmp_path / "v.txt") == (4, rep["splits"]["val"]["boxes"])
    for name, boxes, labels in read_meta(tmp_path / "t.txt"):
        h, w = cv2.imread(str(a / "JPEGImages" / name)).shape[:2]
        assert 256 <= w <= 320 and 256 <= h <= 320
        assert 1 <= len(labels) <= 3
        sides = np.maximum(boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1])
        assert np.all(sides >= 0.14 * min(w, h)) and np.all(sides <= 0.46 * min(w, h))
        assert np.all(boxes[:, :2] >= 0) and np.all(boxes[:, 2] <= w) and np.all(boxes[:, 3] <= h)


def test_shapes_box_is_tight(tmp_path):
    """Every box is filled by its shape's colour well away from the background at its centre."""
    make_shapes_dataset(tmp_path, num_train=6, num_val=0, seed=0, classes=("square",), max_objects=1)
    for name, boxes, _ in read_meta_from_tree(tmp_path, ["square"]):
        img = cv2.imread(str(tmp_path / "JPEGImages" / name)).astype(np.int32)
        x1, y1, x2, y2 = boxes[0].astype(int)
        inside = img[y1 + 2:y2 - 2, x1 + 2:x2 - 2].reshape(-1, 3).mean(0)
        ring = np.concatenate([img[y1 + 2:y2 - 2, max(0, x1 - 3)], img[y1 + 2:y2 - 2, min(img.shape[1] - 1, x2 + 2)]])
        assert np.abs(inside - ring.mean(0)).sum() > 60


def test_shapes_upright_triangles_point_up_and_change_nothing_else_device_cpu(tmp_path):
    """upright (make_shapes --upright, config shapes_upright): every triangle's apex is above its base;
    the boxes are those of the default dataset and, before JPEG coding, only pixels inside triangle boxes
    differ, and their anti-aliased edges a pixel around (the random draws are the same). The CLI flag
    writes what the function writes."""
    from gnetmdk.dataset.shapes import _make_image
    widths, flipped = [], 0
    for i in range(24):
        up, up_objects = _make_image(np.random.default_rng([5, 0, i]), (256, 320), SHAPES, 3, upright=True)
        df, df_objects = _make_image(np.random.default_rng([5, 0, i]), (256, 320), SHAPES, 3)
        assert up_objects == df_objects
        outside = np.ones(up.shape[:2], bool)
        for kind, x1, y1, x2, y2, _ in up_objects:
            if kind == "triangle":
                outside[max(0, y1 - 1):y2 + 1, max(0, x1 - 1):x2 + 1] = False
        assert np.array_equal(up[outside], df[outside])
        up, df = up.astype(np.int32), df.astype(np.int32)
        for kind, x1, y1, x2, y2, _ in up_objects:
            if kind != "triangle":
                continue
            h = y2 - y1
            bg = up[max(0, y1 - 2), x1:x2].mean(0)             # the row just above the box
            def coloured(img, y):
                return int((np.abs(img[y, x1:x2] - bg).sum(1) > 60).sum())
            top, bottom = y1 + h // 5, y2 - 1 - h // 5
            widths.append((coloured(up, top), coloured(up, bottom)))
            flipped += coloured(df, top) > coloured(df, bottom)
    assert len(widths) >= 8
    assert all(t < b for t, b in widths), widths          # narrow near the top, wide near the base
    assert flipped >= 2                                   # the default set has triangles pointing down

    res = run_tool(MAKE_SHAPES, tmp_path / "u", "--num-train", 3, "--num-val", 1, "--seed", 5, "--upright")
    assert res.returncode == 0, res.stderr
    make_shapes_dataset(tmp_path / "f", num_train=3, num_val=1, seed=5, upright=True)
    for stem in ("train_00000", "train_00001", "train_00002", "val_00000"):
        assert ((tmp_path / "u" / "Annotations" / f"{stem}.xml").read_bytes()
                == (tmp_path / "f" / "Annotations" / f"{stem}.xml").read_bytes())
        np.testing.assert_array_equal(cv2.imread(str(tmp_path / "u" / "JPEGImages" / f"{stem}.jpg")),
                                      cv2.imread(str(tmp_path / "f" / "JPEGImages" / f"{stem}.jpg")))


def read_meta_from_tree(root, classes):
    convert_voc_to_meta(root, classes, root / "m_t.txt", root / "m_v.txt")
    return read_meta(root / "m_t.txt")


def test_make_shapes_cli(tmp_path):
    res = run_tool(MAKE_SHAPES, tmp_path / "s", "--num-train", 4, "--num-val", 2, "--seed", 1)
    assert res.returncode == 0, res.stderr
    res = run_tool(XML_2_TXT, "--name", "shapes", "--dataset-dir", tmp_path / "s",
                   "--classes", ",".join(SHAPES), "--out-dir", tmp_path / "meta")
    assert res.returncode == 0, res.stderr
    assert count(tmp_path / "meta" / "shapes_train.txt")[0] == 4
    assert count(tmp_path / "meta" / "shapes_valid.txt")[0] == 2


def test_xml_2_txt_reads_config_overrides_after_its_options(tmp_path):
    """Options first, then KEY VALUE overrides, as train.py reads them: the overrides move the dataset and
    the meta files; an option written after them, or a word that is no field, is one error line."""
    make_shapes_dataset(tmp_path / "data" / "s2", num_train=4, num_val=2, seed=0)
    cfg = os.path.join(REPO, "examples", "shapes.py")
    res = run_tool(XML_2_TXT, "--config", cfg, "DS_NAME", "s2", "data_root", tmp_path / "data",
                   "meta_root=" + str(tmp_path / "meta"))
    assert res.returncode == 0, res.stderr
    assert count(tmp_path / "meta" / "s2_train.txt")[0] == 4
    res = run_tool(XML_2_TXT, "--config", cfg, "data_root", tmp_path / "data", "--skip-bad")
    assert res.returncode == 2 and res.stderr.startswith("error: option --skip-bad comes after the config overrides")
    res = run_tool(XML_2_TXT, "--config", cfg, "no_such_field", "1")
    assert res.returncode == 2 and "no_such_field" in res.stderr and "Traceback" not in res.stderr


def test_make_shapes_objects_per_image(tmp_path):
    """--objects LO HI: LO to HI shapes per image (the shapes demo's 3-6); each image's annotation counted."""
    import glob
    res = run_tool(MAKE_SHAPES, tmp_path / "s", "--num-train", 12, "--num-val", 0, "--objects", 3, 6)
    assert res.returncode == 0, res.stderr
    counts = [open(f).read().count("<object>") for f in glob.glob(str(tmp_path / "s" / "Annotations" / "*.xml"))]
    assert len(counts) == 12 and max(counts) <= 6 and sum(counts) / len(counts) >= 3.5
    assert min(counts) >= 2                               # a shape with no free place in 30 tries is left out
    res = run_tool(MAKE_SHAPES, tmp_path / "t", "--num-train", 1, "--num-val", 0, "--objects", 4, 2)
    assert res.returncode == 2 and "min_objects" in res.stderr


def test_dense_shapes_small_crowded_objects(tmp_path):
    """--dense: 448 px squares with 30-80 shapes of 4-16 px (a shape that finds no free place in 30
    tries is dropped, so a few fewer at times); several box centres share a 32-px cell somewhere."""
    res = run_tool(os.path.join(REPO, "tools", "make_shapes.py"), tmp_path / "d", "--dense", "--num-train", "6",
                   "--num-val", "1")
    assert res.returncode == 0, res.stderr
    conv = convert_voc_to_meta(tmp_path / "d", SHAPES, tmp_path / "t.txt", tmp_path / "v.txt")
    crowded = 0
    for name, boxes, labels in read_meta(tmp_path / "t.txt"):
        assert cv2.imread(str(tmp_path / "d" / "JPEGImages" / name)).shape[:2] == (448, 448)
        assert 25 <= len(labels) <= 80
        sides = np.maximum(boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1])
        assert sides.min() >= 4 and sides.max() <= 17            # a circle's box is 2r + 1
        cells = ((boxes[:, 0] + boxes[:, 2]) // 64) * 14 + (boxes[:, 1] + boxes[:, 3]) // 64
        crowded = max(crowded, int(np.bincount(cells.astype(np.int64)).max()))
    assert crowded >= 2
    assert len(conv["splits"]["train"]["box_sizes"]) == conv["splits"]["train"]["boxes"]


def test_xml_2_txt_box_sizes_and_small_box_warning(tmp_path):
    """Box-size statistics at the config's image_size; the warning when more than 20% of the train
    boxes are below one grid cell, with the remedy that fits the model's grid."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("xml_2_txt", os.path.join(REPO, "tools", "xml_2_txt.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    lines, warn = tool.box_size_lines([(0.02, 0.02)] * 10, 256, 16, True)
    assert "median 5.1" in lines[0] and "100.0% of the boxes" in lines[1]
    assert "image_size 800" in warn                               # 16 px / 0.02 = 800, a multiple of 32
    lines, warn = tool.box_size_lines([(0.02, 0.02)] * 10, 448, 32, False)
    assert "crop the images into tiles" in warn and "does not help" in warn
    assert "4 x 4 tiles per image (each at most 28% of the image side)" in warn   # 0.02 * 448 / 32 = 0.28
    assert "tools/tile_voc.py SRC DST --tiles 4" in warn and "--stitch" in warn    # the tool that does it
    assert tool.box_size_lines([(0.3, 0.2)] * 10, 224, 16, False)[1] is None
    make_shapes_dataset(tmp_path / "d", num_train=3, num_val=1, image_size=448, min_objects=30, max_objects=40,
                        side_px=(4, 16))
    cfg = tmp_path / "c.py"
    cfg.write_text("from gnetmdk.config import BaseConfig\nclass Config(BaseConfig):\n    DS_NAME = 'dense'\n"
                   f"    VOC_CLASSES = {list(SHAPES)!r}\n    dataset_path = {str(tmp_path / 'd')!r}\n"
                   f"    meta_root = {str(tmp_path / 'meta')!r}\n    image_size = 448\n")
    res = run_tool(XML_2_TXT, "--config", cfg)
    assert res.returncode == 0, res.stderr
    assert "box size sqrt(w h) at image_size 448" in res.stdout
    assert "warning: 100% of the train boxes are smaller than one grid cell (32 px" in res.stderr
    # the default linear size head: the boxes span under 4 output code steps, so the log head is named
    assert "smaller than 4 steps of the chip's 5-bit output codes" in res.stderr
    assert "gnetdet.size_head log" in res.stderr
    assert "output_bits 10" not in res.stderr          # GNetDet-448 has no room for the 10-bit output's major layer
    cfg.write_text(cfg.read_text() + "    gnetdet = dict(size_head='log')\n")
    res = run_tool(XML_2_TXT, "--config", cfg)
    assert res.returncode == 0 and "output codes" not in res.stderr, res.stderr
    assert tool.size_head_warning([(0.3, 0.2)] * 10, "linear") is None          # large boxes: no warning
    assert "size_head log" in tool.size_head_warning([(0.1, 0.1)] * 10, "linear")   # 0.1 < 4 / 31
    assert tool.size_head_warning([(0.1, 0.1)] * 10, None) is None              # no config, or PP-YOLO
    # the 10-bit output (output_bits 10): steps of 1/1023 of the side, so only boxes under 4 / 1023 warn
    cfg.write_text(cfg.read_text().replace("gnetdet = dict(size_head='log')", "gnetdet = dict(output_bits=10)")
                   .replace("image_size = 448", "image_size = 224"))     # GNetDet-224: room for the 7th major layer
    res = run_tool(XML_2_TXT, "--config", cfg)
    assert res.returncode == 0 and "output codes" not in res.stderr, res.stderr
    assert tool.size_head_warning([(0.1, 0.1)] * 10, "linear", 1023) is None
    assert "10-bit output codes" in tool.size_head_warning([(0.003, 0.003)] * 10, "linear", 1023)
    # GNetDet-224 on the 5801 at 5 bits: the 10-bit output is named as the second remedy, with its 7 formats
    cfg.write_text(cfg.read_text().replace("gnetdet = dict(output_bits=10)", "gnetdet = dict(mask_bits=[8, 3, 3, 3, 3, 8])"))
    res = run_tool(XML_2_TXT, "--config", cfg)
    assert res.returncode == 0 and "gnetdet.size_head log" in res.stderr, res.stderr
    assert "gnetdet.output_bits 10 gnetdet.mask_bits 8,3,3,3,3,8,8" in res.stderr
    assert "from step 2's checkpoint on" in tool.size_head_warning([(0.1, 0.1)] * 10, "linear", 31, "X")


def test_xml_2_txt_small_minority_class_and_crowded_cells():
    """Per-class sizes: a class whose boxes are small is named even when the set's boxes are mostly
    large (7 small of 60 boxes, under the set's 20%); the share of boxes in cells holding more boxes than
    the model's box slots, counted by hand."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("xml_2_txt", os.path.join(REPO, "tools", "xml_2_txt.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    sizes = [(0.3, 0.3)] * 53 + [(0.06, 0.06)] * 7 + [(0.05, 0.05)] * 5          # 0.06 < 4 / 31 = 0.129
    labels = [0] * 50 + [1] * 3 + [1] * 7 + [2] * 5
    assert tool.size_head_warning(sizes, "linear") is None                       # 12 of 65: under the set's 20%
    lines, warn = tool.class_size_lines(sizes, labels, ["big", "mixed", "tiny"], 224, 16, "linear")
    assert "mixed (70% of its 10 boxes)" in warn and "tiny" not in warn          # 5 boxes: too few to judge
    assert "gnetdet.size_head log" in warn and "The size head" in warn
    assert any(l.split()[:2] == ["big", "50"] for l in lines)
    assert "output_bits" not in warn
    assert "(gnetdet.output_bits 10:" in tool.class_size_lines(sizes, labels, ["big", "mixed", "tiny"], 224, 16,
                                                               "linear", 31, "gnetdet.output_bits 10")[1]
    assert tool.class_size_lines(sizes, labels, ["big", "mixed", "tiny"], 224, 16, "log")[1] is None
    assert tool.class_size_lines(sizes, labels, ["big", "mixed", "tiny"], 224, 16, "linear", 1023)[1] is None
    # grid 2: image 0 has three centres in cell (0, 0) and one in (1, 1); image 1 one in (0, 0)
    centres = [(0.1, 0.1, 0), (0.2, 0.3, 0), (0.4, 0.4, 0), (0.9, 0.9, 0), (0.1, 0.1, 1)]
    line = tool.shared_cell_line(centres, 2, 1)
    assert "more than 1 box(es)" in line and ": 60.0%" in line and "at most 60.0%" in line
    assert ": 0.0%" in tool.shared_cell_line(centres, 2, 3)
    # the warning: 2 of the 5 boxes lost with one slot (40% > 5%), none with three
    warn = tool.crowded_cell_warning(centres, 2, 1, "linear")
    assert warn.startswith("40% of the train boxes") and "box_slots 2" in warn and "--tiles 2" in warn
    assert "box_slots 2" not in tool.crowded_cell_warning(centres, 2, 1, "log")     # two slots failed with log
    assert tool.crowded_cell_warning(centres, 2, 3, "linear") is None
    assert tool.crowded_cell_warning(centres[:1] * 19 + [(0.9, 0.9, 1)], 1, 18, "linear") is None  # 1 of 20 lost: 5%
    assert tool.crowded_cell_warning(centres[:1] * 20, 1, 18, "linear").startswith("10%")


def test_keep_empty_writes_background_images_that_train_and_evaluate_device_cpu(tmp_path):
    """xml_2_txt leaves images without objects out and says so in a note; with --keep-empty (convert's
    keep_empty) each is a line with the image name alone, in its split, counted in the summary. Such an
    image reads back with no boxes, gives an all-zero GNetDet target under every augmentation, mosaic
    included, and a detection on it is a false positive in the VOC mAP."""
    import torch
    from gnetmdk.dataset.dataset import GNetDetDataset
    from gnetmdk.evaluation.voc import evaluate_detections
    root = tmp_path / "ds"
    make_tree(root, n=6)                                   # train img001 img002 img004 img005, val img000 img003
    for stem in ("img002", "img003"):
        write_voc_xml(ann(root, stem), stem + ".jpg", 64 + int(stem[-1]), 48, [])
    args = ("--name", "x", "--dataset-dir", root, "--classes", "cat,dog", "--out-dir")
    res = run_tool(XML_2_TXT, *args, tmp_path / "a")
    assert res.returncode == 0, res.stderr
    assert "note: 2 image(s) without objects were left out; --keep-empty" in res.stdout
    assert "written (--keep-empty)" not in res.stdout
    assert [n for n, _, _ in read_meta(tmp_path / "a" / "x_train.txt")] == ["img001.jpg", "img004.jpg", "img005.jpg"]
    res = run_tool(XML_2_TXT, *args, tmp_path / "b", "--keep-empty")
    assert res.returncode == 0, res.stderr
    assert "note:" not in res.stdout
    assert [ln.split() for ln in res.stdout.splitlines() if "written (--keep-empty)" in ln] == \
        [["written", "(--keep-empty)", "1", "1"]]
    with open(tmp_path / "b" / "x_train.txt") as fh:
        assert "img002.jpg\n" in fh.read().splitlines(keepends=True)
    train = read_meta(tmp_path / "b" / "x_train.txt", 2)
    assert [n for n, _, _ in train] == ["img001.jpg", "img002.jpg", "img004.jpg", "img005.jpg"]
    assert train[1][1].shape == (0, 4) and train[1][2].shape == (0,)
    val = read_meta(tmp_path / "b" / "x_valid.txt", 2)
    assert [n for n, _, _ in val] == ["img000.jpg", "img003.jpg"]
    rep = convert_voc_to_meta(root, ["cat", "dog"], tmp_path / "t.txt", tmp_path / "v.txt", keep_empty=True)
    assert rep["splits"]["train"]["images"] == 3 and rep["splits"]["train"]["empty_written"] == 1

    for mosaic in (0.0, 1.0):
        ds = GNetDetDataset(str(tmp_path / "b" / "x_train.txt"), str(root / "JPEGImages"), 2, image_size=64,
                            grid=4, train=True, mosaic_prob=mosaic, rotate_prob=0.5)
        for epoch in range(3):
            ds.set_epoch(epoch)
            image, target, _, size = ds[1]
            assert image.shape == (3, 64, 64) and size == (66, 48)
            if mosaic == 0.0:
                assert torch.count_nonzero(target) == 0
        assert torch.count_nonzero(ds[0][1]) > 0
    gts = [dict(boxes=b, labels=lab) for _, b, lab in val]
    hit = dict(boxes=val[0][1], scores=np.ones(len(val[0][1])), labels=val[0][2])
    miss = dict(boxes=np.array([[1.0, 1.0, 20.0, 20.0]]), scores=np.array([2.0]), labels=np.array([0]))
    none = dict(boxes=np.zeros((0, 4)), scores=np.zeros(0), labels=np.zeros(0, dtype=np.int64))
    assert evaluate_detections([hit, none], gts, 2)["map"] == 1.0
    assert evaluate_detections([hit, miss], gts, 2)["ap"][0] < 1.0      # the top-scored box on the background image
