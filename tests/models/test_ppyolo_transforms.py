"""Tests for gnetmdk.dataset.ppyolo_transforms (PP-YOLO training augmentations), CPU, seconds."""

import glob
import os

import cv2
import numpy as np
import pytest

from gnetmdk.dataset.ppyolo_transforms import (
    IMAGENET_MEAN_PIXELS,
    PPYOLO_INTERPS,
    PPYOLO_SIZES,
    draw_batch_size,
    draw_interp,
    mixup,
    pad_targets,
    ppyolo_train_sample,
    random_crop,
    random_distort,
    random_expand,
    random_flip,
    resize_to,
)
from repo_paths import REPO

cv2.setNumThreads(1)

#: the project's real VOC sets sit in ../shared/data beside the repository
CARDS = os.path.join(os.path.dirname(REPO), "shared", "data",
                     "cards")
RED, BLUE = (250, 20, 20), (20, 20, 250)


def scene(h=375, w=500, rects=((100, 80, 260, 200),), colors=(RED,), bg=(40, 40, 40)):
    """uint8 RGB image of filled rectangles (pixel xyxy, exclusive x2/y2) on a plain background."""
    img = np.empty((h, w, 3), np.uint8)
    img[:] = bg
    for (x1, y1, x2, y2), c in zip(rects, colors):
        img[y1:y2, x1:x2] = c
    return img, np.array(rects, np.float32).reshape(-1, 4)


def pixel_box(mask):
    """Exclusive pixel bbox [x1, y1, x2, y2] of a boolean mask, or None when empty."""
    ys, xs = np.nonzero(mask)
    if len(xs) == 0:
        return None
    return np.array([xs.min(), ys.min(), xs.max() + 1, ys.max() + 1], float)


def is_color(img, color):
    return np.all(np.abs(img.astype(int) - np.array(color)) <= 2, axis=2)


def assert_inside(boxes, img):
    h, w = img.shape[:2]
    assert np.all(boxes[:, 0] >= 0) and np.all(boxes[:, 1] >= 0)
    assert np.all(boxes[:, 2] <= w) and np.all(boxes[:, 3] <= h)
    assert np.all(boxes[:, 2] > boxes[:, 0]) and np.all(boxes[:, 3] > boxes[:, 1])


# ----------------------------------------------------------------------------------------------
# geometry: boxes stay inside and on their pixels
# ----------------------------------------------------------------------------------------------

def test_expand_keeps_boxes_on_their_pixels():
    img, boxes = scene(h=150, w=200, rects=((40, 30, 110, 90),))
    expanded = 0
    for seed in range(40):
        out, b = random_expand(img, boxes, np.random.default_rng(seed))
        assert_inside(b, out)
        assert np.array_equal(pixel_box(is_color(out, RED)), b[0])
        if out.shape != img.shape:
            expanded += 1
            h, w = out.shape[:2]
            assert 150 < h < 4 * 150 and 200 < w < 4 * 200
            # the canvas outside the image is the ImageNet mean rounded to whole levels
            fill = (124, 116, 104)
            assert tuple(np.rint(IMAGENET_MEAN_PIXELS).astype(int)) == fill
            assert tuple(out[0, 0]) == fill or tuple(out[-1, -1]) == fill
    assert 10 < expanded < 30  # prob 0.5 of 40 draws (binomial sd 3.2)
    out, b = random_expand(img, boxes, np.random.default_rng(0), prob=0.0)
    assert np.array_equal(out, img) and np.array_equal(b, boxes)


def test_crop_keeps_boxes_on_their_pixels_and_never_loses_all():
    rects = ((30, 40, 90, 120), (300, 200, 480, 360))
    img, boxes = scene(rects=rects, colors=(RED, BLUE))
    labels, scores = np.array([0, 1]), np.ones(2, np.float32)
    cropped = dropped = 0
    for seed in range(150):
        out, b, lab, sc = random_crop(img, boxes, labels, scores, np.random.default_rng(seed))
        assert len(b) >= 1 and len(lab) == len(b) == len(sc)
        assert_inside(b, out)
        cropped += out.shape != img.shape
        dropped += len(b) < 2
        for box, label in zip(b, lab):
            # a kept box is exactly the visible part of its rectangle
            assert np.array_equal(pixel_box(is_color(out, (RED, BLUE)[label])), box), seed
    assert cropped > 50 and dropped > 10  # the crop does happen, and drops boxes
    # an image without boxes is returned unchanged (PaddleDetection does the same)
    out, b, lab, sc = random_crop(img, np.zeros((0, 4)), [], [], np.random.default_rng(0))
    assert np.array_equal(out, img) and b.shape == (0, 4)


def test_crop_never_returns_no_boxes_for_small_objects():
    img, boxes = scene(h=150, w=200, rects=((10, 10, 14, 14),))  # a 4 px box in a corner
    for seed in range(150):
        out, b, lab, _ = random_crop(img, boxes, [3], [1.0], np.random.default_rng(seed))
        assert len(b) == 1 and lab[0] == 3
        assert np.array_equal(pixel_box(is_color(out, RED)), b[0])


def test_flip_twice_is_identity_and_boxes_follow_pixels():
    img, boxes = scene(rects=((0, 10, 37, 50), (420, 300, 500, 375)), colors=(RED, BLUE))
    f1, b1 = random_flip(img, boxes, np.random.default_rng(0), prob=1.0)
    assert np.array_equal(pixel_box(is_color(f1, RED)), b1[0])
    assert np.array_equal(b1[0], [500 - 37, 10, 500, 50])
    f2, b2 = random_flip(f1, b1, np.random.default_rng(1), prob=1.0)
    assert np.array_equal(f2, img) and np.array_equal(b2, boxes)
    f0, b0 = random_flip(img, boxes, np.random.default_rng(0), prob=0.0)
    assert np.array_equal(f0, img) and np.array_equal(b0, boxes)


@pytest.mark.parametrize("interp", PPYOLO_INTERPS)
@pytest.mark.parametrize("size", [608, 320, (416, 352)])
def test_resize_boxes_match_pixels_within_one_pixel(interp, size):
    img, boxes = scene(rects=((101, 83, 263, 207),), bg=(0, 0, 0), colors=((255, 255, 255),))
    out, b = resize_to(img, boxes, size, interp)
    sw, sh = (size, size) if isinstance(size, int) else size
    assert out.shape == (sh, sw, 3) and out.dtype == np.uint8
    assert_inside(b, out)
    # box scaled by (sw / 500, sh / 375); edges of the blurred rectangle at the half level
    assert np.allclose(b[0], [101 * sw / 500, 83 * sh / 375, 263 * sw / 500, 207 * sh / 375], atol=1e-4)
    assert np.abs(pixel_box(out[..., 0] >= 128) - b[0]).max() <= 1.0


# ----------------------------------------------------------------------------------------------
# colour and mixup
# ----------------------------------------------------------------------------------------------

def test_distort_numbers():
    rng = np.random.default_rng(0)
    img = rng.integers(0, 256, (20, 30, 3), dtype=np.uint8)
    off = (0, 0, 0.0)
    # contrast is a gain: x * 2, clipped
    out = random_distort(img, rng, hue=off, saturation=off, contrast=(2, 2, 1.0), brightness=off)
    assert np.array_equal(out, np.clip(img.astype(int) * 2, 0, 255))
    # brightness adds levels
    out = random_distort(img, rng, hue=off, saturation=off, contrast=off, brightness=(10, 10, 1.0))
    assert np.array_equal(out, np.clip(img.astype(int) + 10, 0, 255))
    # saturation 0 gives the luma in every channel
    out = random_distort(img, rng, hue=off, saturation=(0, 0, 1.0), contrast=off, brightness=off)
    luma = np.rint(img.astype(np.float64) @ [0.299, 0.587, 0.114])
    assert np.abs(out.astype(int) - luma[..., None]).max() <= 1
    # a full turn of hue is the identity (to rounding); half a turn is not
    out = random_distort(img, rng, hue=(360, 360, 1.0), saturation=off, contrast=off, brightness=off)
    assert np.abs(out.astype(int) - img).max() <= 1
    out = random_distort(img, rng, hue=(180, 180, 1.0), saturation=off, contrast=off, brightness=off)
    assert np.abs(out.astype(int) - img).max() > 50
    # nothing applied: the image comes back unchanged
    out = random_distort(img, rng, hue=off, saturation=off, contrast=off, brightness=off)
    assert np.array_equal(out, img)


def test_distort_keeps_grey_grey_for_any_draw():
    grey = np.repeat(np.arange(0, 250, 10, dtype=np.uint8)[None, :, None], 3, axis=2)
    for seed in range(30):
        out = random_distort(grey, np.random.default_rng(seed), hue=(-180, 180, 0.5))
        assert np.abs(out.astype(int) - out[..., :1]).max() <= 1  # hue and saturation keep grey


def test_mixup_weights_and_scores():
    a = {"image": np.full((40, 60, 3), 100, np.uint8), "boxes": [[1, 2, 10, 20], [5, 5, 9, 9]],
         "labels": [0, 3]}
    b = {"image": np.full((50, 30, 3), 200, np.uint8), "boxes": [[0, 0, 30, 50]], "labels": [1],
         "scores": [0.5]}
    out = mixup(a, b, np.random.default_rng(7))
    f = out["mixup_factor"]
    assert 0 < f < 1
    assert out["image"].shape == (50, 60, 3)
    # overlap: f * 100 + (1 - f) * 200; a only: f * 100; b only: (1 - f) * 200; neither: 0
    assert out["image"][0, 0, 0] == round(100 * f + 200 * (1 - f))
    assert out["image"][0, 45, 0] == round(100 * f)
    assert out["image"][45, 10, 0] == round(200 * (1 - f))
    assert out["image"][45, 45, 0] == 0
    assert np.array_equal(out["boxes"], np.array([[1, 2, 10, 20], [5, 5, 9, 9], [0, 0, 30, 50]], np.float32))
    assert out["labels"].tolist() == [0, 3, 1]
    # scores: a's boxes get f (their score 1 times f), b's get 0.5 * (1 - f)
    assert np.allclose(out["scores"], [f, f, 0.5 * (1 - f)], atol=1e-6)
    # fresh samples: a box of a and a box of b sum to 1
    b1 = dict(b, scores=None)
    out1 = mixup(a, b1, np.random.default_rng(7))
    assert out1["mixup_factor"] == f and out1["scores"][0] + out1["scores"][2] == pytest.approx(1.0, abs=1e-6)
    # Beta(1.5, 1.5): mean 1/2, sd 1/4 -> the mean of 2000 draws is within 0.03 of 1/2
    rng = np.random.default_rng(0)
    fs = [mixup(a, b, rng)["mixup_factor"] for _ in range(2000)]
    assert abs(np.mean(fs) - 0.5) < 0.03 and abs(np.std(fs) - 0.25) < 0.02
    with pytest.raises(ValueError, match="alpha"):
        mixup(a, b, rng, alpha=0)


# ----------------------------------------------------------------------------------------------
# per-batch draws, determinism, the chain
# ----------------------------------------------------------------------------------------------

def test_draw_batch_size_depends_only_on_its_integers():
    first = [draw_batch_size(3, 1, i) for i in range(200)]
    np.random.seed(99)
    np.random.random(10)
    np.random.default_rng(5).random(10)
    assert [draw_batch_size(3, 1, i) for i in reversed(range(200))][::-1] == first
    assert set(first) <= set(PPYOLO_SIZES)
    counts = np.bincount([PPYOLO_SIZES.index(s) for s in
                          (draw_batch_size(0, 0, i) for i in range(2000))], minlength=10)
    assert counts.min() > 140 and counts.max() < 260  # uniform: 200 each, sd 13.4
    assert [draw_batch_size(3, 2, i) for i in range(200)] != first  # another epoch, another order
    assert [draw_batch_size(4, 1, i) for i in range(200)] != first
    # pinned values: a change here breaks replays of earlier runs
    assert [draw_batch_size(0, 0, i) for i in range(6)] == PINNED_SIZES
    assert [draw_interp(0, 0, i) for i in range(6)] == PINNED_INTERPS
    assert set(draw_interp(1, 2, i) for i in range(200)) == set(PPYOLO_INTERPS)
    assert draw_batch_size(0, 0, 5, sizes=[416]) == 416
    with pytest.raises(ValueError, match="epoch"):
        draw_batch_size(0, 1.5, 0)


#: draw_batch_size(0, 0, 0..5) and draw_interp(0, 0, 0..5) as first released (blake2b based)
PINNED_SIZES = [512, 448, 416, 512, 480, 448]
PINNED_INTERPS = [cv2.INTER_NEAREST, cv2.INTER_CUBIC, cv2.INTER_NEAREST, cv2.INTER_CUBIC,
                  cv2.INTER_LINEAR, cv2.INTER_LANCZOS4]


def test_same_seed_same_output():
    img, boxes = scene(rects=((30, 40, 90, 120), (300, 200, 480, 360)), colors=(RED, BLUE))
    other, oboxes = scene(h=300, w=420, rects=((10, 10, 200, 100),))
    sample = {"image": img, "boxes": boxes, "labels": [0, 1]}
    mix = {"image": other, "boxes": oboxes, "labels": [2]}
    runs = [ppyolo_train_sample(sample, np.random.default_rng(11), 416, mixup_sample=mix)
            for _ in range(2)]
    for x, y in zip(*runs):
        assert np.array_equal(x, y)
    outs = [ppyolo_train_sample(sample, np.random.default_rng(s), 416, mixup_sample=mix)[0]
            for s in range(4)]
    assert not all(np.array_equal(outs[0], o) for o in outs[1:])
    for fn in (lambda r: random_distort(img, r), lambda r: random_expand(img, boxes, r)[0],
               lambda r: random_crop(img, boxes, [0, 1], [1, 1], r)[0],
               lambda r: random_flip(img, boxes, r)[0]):
        assert np.array_equal(fn(np.random.default_rng(5)), fn(np.random.default_rng(5)))


def test_chain_boxes_match_pixels_and_are_relative():
    # a white rectangle on black: distortion keeps black <= 2 and white >= 127, the expand fill is
    # black, so after the whole chain the rectangle is the set of bright pixels; NEAREST resize
    # moves an edge by less than one output pixel
    img, boxes = scene(rects=((120, 90, 300, 260),), bg=(0, 0, 0), colors=((255, 255, 255),))
    sample = {"image": img, "boxes": boxes, "labels": [4]}
    for seed in range(40):
        size = draw_batch_size(seed, 0, 0)
        out, rel, lab, sc = ppyolo_train_sample(sample, np.random.default_rng(seed), size,
                                                interp=cv2.INTER_NEAREST, expand_fill=(0, 0, 0))
        assert out.shape == (size, size, 3) and out.dtype == np.uint8
        assert rel.dtype == np.float32 and lab.dtype == np.int64 and sc.dtype == np.float32
        assert len(rel) == 1 and lab.tolist() == [4] and sc.tolist() == [1.0]
        assert np.all(rel >= 0) and np.all(rel <= 1)
        px = pixel_box(out.min(axis=2) >= 64)
        assert np.abs(px - rel[0] * size).max() <= 1.0, (seed, px, rel[0] * size)


def test_chain_with_mixup_scores_sum_to_one():
    a_img, a_boxes = scene(rects=((120, 90, 300, 260),))
    b_img, b_boxes = scene(h=200, w=200, rects=((20, 20, 180, 180),))
    for seed in range(10):
        _, rel, lab, sc = ppyolo_train_sample(
            {"image": a_img, "boxes": a_boxes, "labels": [0]}, np.random.default_rng(seed), 320,
            mixup_sample={"image": b_img, "boxes": b_boxes, "labels": [1]})
        if lab.tolist() == [0, 1]:
            assert sc.sum() == pytest.approx(1.0, abs=1e-6) and 0 < sc[0] < 1
        assert np.all((rel >= 0) & (rel <= 1))


def test_pad_targets_rows_padding_and_overflow():
    rel = np.array([[0.1, 0.2, 0.3, 0.4], [0.5, 0.5, 0.9, 1.0]], np.float32)
    out = pad_targets(rel, [3, 0], [1.0, 0.25], max_boxes=4)
    assert out.dtype == np.float32 and out.shape == (4, 6)
    assert np.array_equal(out, np.array([[3, 0.1, 0.2, 0.3, 0.4, 1.0],
                                         [0, 0.5, 0.5, 0.9, 1.0, 0.25],
                                         [-1, 0, 0, 0, 0, 0],
                                         [-1, 0, 0, 0, 0, 0]], np.float32))
    many = np.tile(rel[:1], (60, 1))
    out = pad_targets(many, np.arange(60), np.ones(60), max_boxes=50)
    assert out.shape == (50, 6) and out[:, 0].tolist() == list(range(50))  # the first 50 kept
    assert np.array_equal(pad_targets(np.zeros((0, 4)), [], [], 3)[:, 0], [-1, -1, -1])
    with pytest.raises(ValueError, match="labels"):
        pad_targets(rel, [0], [1, 1])


def test_bad_input_is_refused():
    img, boxes = scene()
    with pytest.raises(ValueError, match=r"uint8 RGB array \(H, W, 3\)"):
        random_flip(img.astype(np.float32), boxes, np.random.default_rng(0))
    with pytest.raises(ValueError, match=r"\(K, 4\)"):
        random_expand(img, np.zeros((2, 5)), np.random.default_rng(0))
    with pytest.raises(ValueError, match="ratio"):
        random_expand(img, boxes, np.random.default_rng(0), ratio=1.0)
    with pytest.raises(ValueError, match="interp"):
        resize_to(img, boxes, 320, interp=99)
    with pytest.raises(ValueError, match="missing key 'labels'"):
        ppyolo_train_sample({"image": img, "boxes": boxes}, np.random.default_rng(0), 320)


@pytest.mark.skipif(not os.path.isdir(CARDS), reason="real VOC data not present")
def test_real_images_through_the_chain():
    from gnetmdk.dataset.voc import parse_voc_xml

    classes = ["nine", "ten", "jack", "queen", "king", "ace"]
    samples = []
    for xml in sorted(glob.glob(os.path.join(CARDS, "Annotations", "*.xml")))[:6]:
        ann = parse_voc_xml(xml, classes)
        bgr = cv2.imread(os.path.join(CARDS, "JPEGImages", ann["filename"]))
        samples.append({"image": cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB), "boxes": ann["boxes"],
                        "labels": ann["labels"]})
    for i, s in enumerate(samples):
        rng = np.random.default_rng(i)
        size = draw_batch_size(0, 0, i)
        out, rel, lab, sc = ppyolo_train_sample(s, rng, size, mixup_sample=samples[-1 - i],
                                                interp=draw_interp(0, 0, i))
        assert out.shape == (size, size, 3)
        assert len(rel) >= 1 and np.all((rel >= 0) & (rel <= 1))
        assert np.all(rel[:, 2] > rel[:, 0]) and np.all(rel[:, 3] > rel[:, 1])
        assert set(lab.tolist()) <= set(range(6)) and np.all((sc > 0) & (sc <= 1))
