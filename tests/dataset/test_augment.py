"""Training augmentation moves the boxes with the pixels (flip, quarter turns, scale, shift, mosaic), clips and drops
them by the documented rule, and is a function of (seed, epoch, index)."""
from __future__ import annotations

import os

import cv2
import numpy as np
import pytest

from gnetmdk.dataset.dataset import GNetDetDataset

SIZE = 224
OBJ = 56                      # object side in pixels (images are SIZE x SIZE: no downscale)
# one class per image, a pure colour per class (BGR); background grey
COLOURS = [(0, 0, 255), (0, 255, 0), (255, 0, 0), (0, 255, 255), (255, 0, 255), (255, 255, 0)]
BACKGROUND = (90, 90, 90)


@pytest.fixture(scope="module")
def colour_set(tmp_path_factory):
    """Six images, one coloured square each (class i = colour i), at different places."""
    root = tmp_path_factory.mktemp("aug")
    lines = []
    for i, colour in enumerate(COLOURS):
        img = np.full((SIZE, SIZE, 3), BACKGROUND, np.uint8)
        x1, y1 = 10 + 27 * i, 150 - 25 * i
        img[y1:y1 + OBJ, x1:x1 + OBJ] = colour
        cv2.imwrite(str(root / f"im{i}.png"), img)
        lines.append(f"im{i}.png {x1} {y1} {x1 + OBJ} {y1 + OBJ} {i}\n")
    meta = root / "train.txt"
    meta.write_text("".join(lines))
    return str(meta), str(root)


def _dataset(colour_set, **kw):
    meta, images = colour_set
    args = dict(hsv_gain=(0, 0, 0), blur_prob=0.0, scale_range=(0.75, 1.25), shift_fraction=0.25)
    args.update(kw)
    return GNetDetDataset(meta, images, len(COLOURS), SIZE, 14, train=True, cache=True, **args)


def _mask(img, colour):
    return (np.abs(img.astype(np.int16) - np.array(colour, np.int16)).max(-1) <= 20)


def _check_sample(img, boxes, labels):
    """Every box covers its class's colour; every well-visible colour has a box of its class."""
    assert img.shape == (SIZE, SIZE, 3) and img.dtype == np.uint8
    assert boxes.dtype == np.float32 and boxes.shape == (len(labels), 4)
    assert np.all(boxes >= 0) and np.all(boxes <= 1) and np.all(boxes[:, 2] > boxes[:, 0])
    px = boxes * SIZE
    for (x1, y1, x2, y2), lab in zip(px, labels):
        inner = img[int(np.ceil(y1)) + 2:int(y2) - 2, int(np.ceil(x1)) + 2:int(x2) - 2]
        if inner.size:
            assert _mask(inner, COLOURS[lab]).mean() > 0.95, (lab, (x1, y1, x2, y2))
        # the box is tight: the colour does not extend beyond it by more than interpolation blur
        m = _mask(img, COLOURS[lab])
        ys, xs = np.nonzero(m)
        if len(xs):
            near = (xs >= x1 - 3) & (xs <= x2 + 3) & (ys >= y1 - 3) & (ys <= y2 + 3)
            assert near.any()
    smallest = (0.75 * OBJ) ** 2
    for c, colour in enumerate(COLOURS):
        visible = _mask(img, colour).sum()
        # more visible pixels than two dropped objects could show (each < 30% of at most 1.25^2 OBJ^2)
        if visible > 2 * 0.3 * (1.25 * OBJ) ** 2 + 50:
            assert c in set(labels.tolist()), (c, visible)
        if c in set(labels.tolist()):
            assert visible > 0.3 * smallest * 0.5


@pytest.mark.parametrize("mosaic_prob", [0.0, 1.0])
def test_boxes_follow_the_pixels(colour_set, mosaic_prob):
    ds = _dataset(colour_set, mosaic_prob=mosaic_prob)
    flipped = clipped = multi = 0
    for epoch in range(6):
        ds.set_epoch(epoch)
        for i in range(len(ds)):
            rng = ds.rng_for(i)
            if mosaic_prob:
                assert rng.random() < mosaic_prob           # __getitem__'s draw
                img, boxes, labels = ds.prepare_mosaic(i, rng)
            else:
                img, boxes, labels = ds.prepare(i, rng)
            _check_sample(img, boxes, labels)
            clipped += int(np.any((boxes == 0) | (boxes == 1)))
            multi += int(len(labels) > 1)
            if not mosaic_prob and len(labels):
                # the original square's left edge is at 10 + 27 i: after a flip its centre is on the other side
                _, _, lab = ds.records[i]
                cx = (boxes[0, 0] + boxes[0, 2]) / 2
                orig_cx = (10 + 27 * i + OBJ / 2) / SIZE
                flipped += int((cx - 0.5) * (orig_cx - 0.5) < 0)
    assert clipped > 0                      # some boxes were cut by the image border and kept
    if mosaic_prob:
        assert multi > 0                    # mosaics can hold objects of several images
    else:
        assert flipped > 0


def test_mosaic_is_a_function_of_seed_epoch_index(colour_set):
    ds = _dataset(colour_set, mosaic_prob=0.5)
    ds.set_epoch(3)
    a = [ds[i] for i in range(len(ds))]
    b = [ds[i] for i in range(len(ds))]
    for (ia, ta, _, _), (ib, tb, _, _) in zip(a, b):
        assert np.array_equal(ia.numpy(), ib.numpy()) and np.array_equal(ta.numpy(), tb.numpy())
    ds.set_epoch(4)
    c = [ds[i] for i in range(len(ds))]
    assert any(not np.array_equal(x[0].numpy(), y[0].numpy()) for x, y in zip(a, c))
    # mosaic_prob 0.5: some samples of an epoch are mosaics (more than one object), some are not
    counts = [int((t[..., 4] > 0).sum()) for _, t, _, _ in a + c]
    assert max(counts) > 1 and min(counts) <= 1


def test_mosaic_off_keeps_the_single_image_samples(colour_set):
    """mosaic_prob 0 takes no extra random draw: every sample is prepare()'s, from the generator of
    (seed, epoch, index)."""
    from gnetmdk.gti.quantize import image_to_codes
    ds = _dataset(colour_set, mosaic_prob=0.0)
    ds.set_epoch(2)
    for i in range(len(ds)):
        img, _, _ = ds.prepare(i, ds.rng_for(i))
        assert np.array_equal(ds[i][0].numpy(), image_to_codes(img).transpose(2, 0, 1).astype(np.float32))


def test_mosaic_window_drops_boxes_by_their_original_area(colour_set):
    """A box cut by the window keeps its place only with more than 30% of its (augmented, unclipped)
    area inside the window and its own tile: counted once, not per clip."""
    ds = _dataset(colour_set, mosaic_prob=1.0, scale_range=(1.0, 1.0), shift_fraction=0.25)
    for epoch in range(20):
        ds.set_epoch(epoch)
        for i in range(len(ds)):
            img, boxes, labels = ds.prepare_mosaic(i, ds.rng_for(i))
            for (x1, y1, x2, y2), lab in zip(boxes * SIZE, labels):
                # scale 1: the whole square is OBJ x OBJ pixels (shifts cut it at tile edges); what is
                # left must exceed 30% of that
                assert (x2 - x1) * (y2 - y1) > 0.3 * OBJ * OBJ - 1e-3, (epoch, i, lab)


class _FixedDraws:
    """A stand-in generator for prepare_mosaic: its integer draws are given in advance."""

    def __init__(self, *draws):
        self.draws = list(draws)

    def integers(self, low, high, size):
        return np.asarray(self.draws.pop(0))


def test_mosaic_clips_each_box_once_to_its_tile_and_the_window(colour_set, monkeypatch):
    """Every tile holds a box hanging half over its tile's left edge (tile-relative x -0.5..0.5) and
    the window starts a quarter tile in: 25% of each box is visible in its own tile and the window,
    so none is kept, although 50% of the part inside its tile is (a rule applied per clip would keep it)."""
    ds = _dataset(colour_set, mosaic_prob=1.0)
    tile = np.full((SIZE, SIZE, 3), 90, np.uint8)
    calls = []

    def fake_prepare(index, rng=None, clip=True):
        calls.append(clip)
        return tile, np.array([[-0.5, 0.2, 0.5, 0.6]]), np.array([1])

    monkeypatch.setattr(ds, "prepare", fake_prepare)
    _, boxes, labels = ds.prepare_mosaic(0, _FixedDraws([1, 2, 3], [SIZE // 4, 0]))
    assert calls == [False] * 4
    assert len(boxes) == 0 and len(labels) == 0
    # a window starting at the tile's left edge shows 50% of the top-left box: kept, clipped at x = 0
    _, boxes, labels = ds.prepare_mosaic(0, _FixedDraws([1, 2, 3], [0, 0]))
    assert labels.tolist() == [1]
    assert boxes[0].tolist() == pytest.approx([0.0, 0.2, 0.5, 0.6])


def test_clip_rule_drops_boxes_with_less_than_30_percent_left():
    from gnetmdk.dataset.dataset import _clip_boxes
    nb = np.array([[-0.2, 0.1, 0.2, 0.3],      # half inside: kept, clipped to x1 = 0
                   [-0.35, 0.1, 0.05, 0.3],    # 12.5% inside: dropped
                   [0.5, 0.5, 0.505, 0.7],     # 1.1 px wide at 224: dropped
                   [0.9, 0.9, 1.1, 1.1]])      # 25% inside: dropped
    boxes, keep = _clip_boxes(nb, SIZE)
    assert keep.tolist() == [True, False, False, False]
    assert boxes[0].tolist() == pytest.approx([0.0, 0.1, 0.2, 0.3])


@pytest.mark.parametrize("name", ["mosaic_prob", "rotate_prob"])
@pytest.mark.parametrize("bad", [-0.1, 1.5])
def test_probability_out_of_range_is_refused(colour_set, name, bad):
    with pytest.raises(ValueError, match=name):
        _dataset(colour_set, **{name: bad})


def test_rotate_quarter_moves_boxes_with_the_pixels():
    """A 60 x 40 image with a 20 x 10 white block: after k counter-clockwise quarter turns the block's
    pixel extent is the turned box, exactly (the turned image is 40 x 60 for odd k)."""
    from gnetmdk.dataset.dataset import rotate_quarter
    img = np.zeros((40, 60, 3), np.uint8)
    img[5:15, 10:30] = 255
    rel = np.array([[10 / 60, 5 / 40, 30 / 60, 15 / 40]])
    expected = {0: (10, 5, 30, 15), 1: (5, 30, 15, 50), 2: (30, 25, 50, 35), 3: (25, 10, 35, 30), 5: (5, 30, 15, 50)}
    for turns, box in expected.items():
        out, boxes = rotate_quarter(img, rel, turns)
        h, w = out.shape[:2]
        assert (h, w) == ((60, 40) if turns % 2 else (40, 60))
        ys, xs = np.nonzero(out[..., 0])
        assert (xs.min(), ys.min(), xs.max() + 1, ys.max() + 1) == box
        assert (boxes[0] * [w, h, w, h]).tolist() == pytest.approx(list(box))


@pytest.fixture(scope="module")
def wide_set(tmp_path_factory):
    """Three 336 x 224 images (wider than high, so a quarter turn changes the aspect), one square each."""
    root = tmp_path_factory.mktemp("wide")
    lines = []
    for i in range(3):
        img = np.full((SIZE, 336, 3), BACKGROUND, np.uint8)
        x1, y1 = 20 + 100 * i, 30 + 60 * i
        img[y1:y1 + OBJ, x1:x1 + OBJ] = COLOURS[i]
        cv2.imwrite(str(root / f"w{i}.png"), img)
        lines.append(f"w{i}.png {x1} {y1} {x1 + OBJ} {y1 + OBJ} {i}\n")
    meta = root / "train.txt"
    meta.write_text("".join(lines))
    return str(meta), str(root)


def test_quarter_turns_keep_boxes_on_their_objects(wide_set):
    """rotate_prob 1 with flips, scale and shift on non-square images: every sample's box covers its
    square, and the samples of the epochs show the turned aspect (the square, OBJ x OBJ pixels in a
    336 x 224 image, is squeezed along x before a turn and along y after one)."""
    ds = _dataset(wide_set, rotate_prob=1.0, scale_range=(1.0, 1.0), shift_fraction=0.0)
    aspects = set()
    for epoch in range(8):
        ds.set_epoch(epoch)
        for i in range(len(ds)):
            img, boxes, labels = ds.prepare(i, ds.rng_for(i))
            _check_sample(img, boxes, labels)
            w, h = (boxes[0, 2:] - boxes[0, :2]) * SIZE
            aspects.add(round(float(w / h), 1))
    # unturned (180 degrees): w/h = (224/336) / 1 = 0.67; turned by 90 / 270: 1.5
    assert aspects == {0.7, 1.5}
    # rotate_prob 0 turns nothing: every sample keeps the unturned aspect
    ds = _dataset(wide_set, rotate_prob=0.0, scale_range=(1.0, 1.0), shift_fraction=0.0)
    for epoch in range(8):
        ds.set_epoch(epoch)
        for i in range(len(ds)):
            _, boxes, _ = ds.prepare(i, ds.rng_for(i))
            w, h = (boxes[0, 2:] - boxes[0, :2]) * SIZE
            assert round(float(w / h), 1) == 0.7


def test_cached_val_samples_are_made_once_and_equal_the_uncached_ones_device_cpu(colour_set, monkeypatch):
    """With ``cache`` and no augmentation each sample is made on the first call only (prepare is not
    called again), and it equals, bit for bit, what a dataset without the cache makes; a training set
    with augmentation keeps drawing its epoch's augmentation."""
    import torch
    meta, images = colour_set
    cached = GNetDetDataset(meta, images, len(COLOURS), SIZE, 14, train=False, cache=True)
    plain = GNetDetDataset(meta, images, len(COLOURS), SIZE, 14, train=False, cache=False)
    first = [cached[i] for i in range(len(cached))]
    calls = []
    real_prepare = GNetDetDataset.prepare
    monkeypatch.setattr(GNetDetDataset, "prepare", lambda self, *a, **k: calls.append(a) or real_prepare(self, *a, **k))
    for i in range(len(cached)):
        again, fresh = cached[i], plain[i]
        assert again[0] is first[i][0] and again[1] is first[i][1]
        assert torch.equal(again[0], fresh[0]) and torch.equal(again[1], fresh[1])
        assert again[2:] == fresh[2:]
    assert len(calls) == len(cached)                 # the uncached dataset's calls only
    train = _dataset(colour_set)
    train.set_epoch(0)
    a = train[2][0]
    train.set_epoch(1)
    assert not torch.equal(a, train[2][0])
