"""PP-YOLO loss (gnetmdk.models.ppyolo.loss): assignment, every term by hand, ignore threshold,
padding, batch split; device cpu."""
import math

import pytest
import torch

from gnetmdk.models.ppyolo.loss import LOSS_KEYS, YOLOv3Loss

torch.set_num_threads(1)
CPU = torch.device("cpu")
COCO_ANCHORS = [[10, 13], [16, 30], [33, 23], [30, 61], [62, 45], [59, 119], [116, 90], [156, 198], [373, 326]]
COCO_MASKS = [[6, 7, 8], [3, 4, 5], [0, 1, 2]]


# ---------------------------------------------------------------- plain-Python helpers (float64)
def sig(z):
    return 1.0 / (1.0 + math.exp(-z))


def bce(z, t):
    """binary cross-entropy of sigmoid(z) against target t"""
    return -(t * math.log(sig(z)) + (1.0 - t) * math.log(1.0 - sig(z)))


def iou(p, q):
    iw = max(0.0, min(p[2], q[2]) - max(p[0], q[0]))
    ih = max(0.0, min(p[3], q[3]) - max(p[1], q[1]))
    inter = iw * ih
    return inter / ((p[2] - p[0]) * (p[3] - p[1]) + (q[2] - q[0]) * (q[3] - q[1]) - inter)


def logit(p):
    return math.log(p / (1.0 - p))


def _box(xc, yc, w, h):
    return [xc - w / 2, yc - h / 2, xc + w / 2, yc + h / 2]


# ---------------------------------------------------------------- assignment
def test_best_anchor_over_all_levels_and_cell_device_cpu():
    """A 62 x 45 px box matches anchor 4 exactly: level 1 (mask [3, 4, 5]) anchor 1, at the
    stride-16 cell holding its centre (300, 200) px of a 608 x 608 image; works for W != H."""
    loss = YOLOv3Loss(COCO_ANCHORS, COCO_MASKS, [32, 16, 8], num_classes=3)
    t = torch.tensor([[[2.0] + _box(300 / 608, 200 / 608, 62 / 608, 45 / 608)]])
    pos = loss.assign(t, [(19, 19), (38, 38), (76, 76)], (608, 608))
    assert [p["b"].numel() for p in pos] == [0, 1, 0]
    assert (pos[1]["a"].item(), pos[1]["gj"].item(), pos[1]["gi"].item()) == (1, 200 // 16, 300 // 16)
    # a 320 x 640 (H x W) image: relative sizes differ per axis, the pixel shape still matches anchor 4
    t = torch.tensor([[[2.0] + _box(300 / 640, 200 / 320, 62 / 640, 45 / 320)]])
    pos = loss.assign(t, [(10, 20), (20, 40), (40, 80)], (320, 640))
    assert [p["b"].numel() for p in pos] == [0, 1, 0]
    assert (pos[1]["a"].item(), pos[1]["gj"].item(), pos[1]["gi"].item()) == (1, 12, 18)


def test_iou_thresh_adds_anchors_of_any_level_device_cpu():
    """A 30 x 61 px box: best anchor 3; shape IoUs 1350/3270 = 0.413 with anchor 4 (62x45),
    690/1899 = 0.363 with anchor 2 (33x23), 0.262 / 0.261 with anchors 1 and 5. With
    iou_thresh 0.3 anchors 4 (level 1) and 2 (level 2) join; the default 1.0 adds none."""
    t = torch.tensor([[[0.0] + _box(0.5, 0.5, 30 / 608, 61 / 608)]])
    grids, img = [(19, 19), (38, 38), (76, 76)], (608, 608)
    off = YOLOv3Loss(COCO_ANCHORS, COCO_MASKS, [32, 16, 8], 1).assign(t, grids, img)
    assert [p["a"].tolist() for p in off] == [[], [0], []]
    on = YOLOv3Loss(COCO_ANCHORS, COCO_MASKS, [32, 16, 8], 1, iou_thresh=0.3).assign(t, grids, img)
    assert [sorted(p["a"].tolist()) for p in on] == [[], [0, 1], [2]]
    assert on[2]["gi"].item() == 38 and on[1]["gi"].tolist() == [19, 19]


def test_slot_conflicts_follow_paddle_write_order_device_cpu():
    """Same slot: among best-anchor rows the last wins; an extra assignment never replaces a
    best-anchor one; among extras the first wins (Gt2YoloTarget's sequential writes). Shape IoUs
    at iou_thresh 0.3 (same centre, so same cells): the 62x45 box is best on anchor 4 and extra on
    3 (0.413) and 5 (0.371); the 30x61 box is best on anchor 3 and extra on 4 (0.413) and on
    anchor 2 of level 2 (0.363). Level-1 slots are keyed by anchor-in-mask 0, 1, 2 = anchors 3, 4, 5."""
    grids, img = [(19, 19), (38, 38), (76, 76)], (608, 608)
    a4 = _box(0.5, 0.5, 62 / 608, 45 / 608)
    a3 = _box(0.5, 0.5, 30 / 608, 61 / 608)
    loss = YOLOv3Loss(COCO_ANCHORS, COCO_MASKS, [32, 16, 8], 3, iou_thresh=0.3)

    def owners(rows):
        pos = loss.assign(torch.tensor([rows]), grids, img)
        return [dict(zip(p["a"].tolist(), p["m"].tolist())) for p in pos]

    assert owners([[0.0] + a4, [1.0] + a4]) == [{}, {1: 1, 0: 0, 2: 0}, {}]      # best: last; extras: first
    assert owners([[0.0] + a4, [1.0] + a3]) == [{}, {1: 0, 0: 1, 2: 0}, {2: 1}]  # best beats an earlier extra
    assert owners([[0.0] + a3, [1.0] + a4]) == [{}, {0: 0, 1: 1, 2: 1}, {2: 0}]  # extra never beats a best
    assert owners([[1.0] + a3, [2.0] + a3]) == [{}, {0: 1, 1: 0}, {2: 0}]


def test_padding_degenerate_and_edge_rows_device_cpu():
    """class -1 rows and zero-width boxes are skipped; a centre at x = 1 uses the last column."""
    loss = YOLOv3Loss(COCO_ANCHORS, COCO_MASKS, [32, 16, 8], 3)
    t = torch.tensor([[[-1.0] + _box(0.5, 0.5, 0.1, 0.1), [1.0, 0.3, 0.3, 0.3, 0.5],
                       [0.0, 0.9, 0.4, 1.1, 0.6]]])
    pos = loss.assign(t, [(2, 2), (4, 4), (8, 8)], (64, 64))
    # row 2 is 12.8 x 12.8 px: best anchor 0 (10 x 13, shape IoU 128 / 165.84 = 0.77) on level 2 (8 x 8)
    assert [p["b"].numel() for p in pos] == [0, 0, 1]
    assert (pos[2]["m"].item(), pos[2]["a"].item(), pos[2]["gj"].item(), pos[2]["gi"].item()) == (2, 0, 4, 7)


# ---------------------------------------------------------------- terms by hand
ANCHORS = [[16, 16], [40, 24]]          # one level, stride 32, 64 x 64 image: a 2 x 2 grid
GT = [0.55, 0.1, 0.85, 0.5]             # class 1, w 0.3, h 0.4, centre (0.7, 0.3) -> cell row 0, col 1
# shape IoU with anchor 0 (0.25 x 0.25): 0.0625 / 0.12 = 0.521; anchor 1 (0.625 x 0.375):
# 0.1125 / 0.241875 = 0.465 -> anchor 0 is the positive.


def _hand_case(seed=0):
    g = torch.Generator().manual_seed(seed)
    out = torch.randn(1, 2 * (6 + 2), 2, 2, generator=g, dtype=torch.float64) * 0.7
    # slot (anchor 1, row 0, col 1) predicts the gt box exactly: a negative above ignore_thresh
    out[0, 9:13, 0, 1] = torch.tensor([logit(0.425 / 1.05), logit(0.625 / 1.05), math.log(0.3 * 64 / 40),
                                       math.log(0.4 * 64 / 24)], dtype=torch.float64)
    targets = torch.tensor([[[1.0] + GT, [-1.0, 0.0, 0.0, 0.0, 0.0]]], dtype=torch.float64)
    return out, targets


def _read(out, a, ch, j, i):
    """channel ch (0 tx .. 4 obj, 5.. classes) of anchor a; IoU-aware logits sit in channels 0, 1"""
    return float(out[0, 2 + 7 * a + ch, j, i])


def _decode(out, a, j, i, scale=1.05):
    x = scale * sig(_read(out, a, 0, j, i)) - 0.5 * (scale - 1)
    y = scale * sig(_read(out, a, 1, j, i)) - 0.5 * (scale - 1)
    w = math.exp(_read(out, a, 2, j, i)) * ANCHORS[a][0] / 64
    h = math.exp(_read(out, a, 3, j, i)) * ANCHORS[a][1] / 64
    return _box((i + x) / 2, (j + y) / 2, w, h), x, y


def _hand_obj(out, ignore_thresh, pos=(0, 0, 1)):
    total, ignored = 0.0, 0
    for a in range(2):
        for j in range(2):
            for i in range(2):
                o = _read(out, a, 4, j, i)
                if (a, j, i) == pos:
                    total += bce(o, 1.0)
                elif iou(_decode(out, a, j, i)[0], GT) <= ignore_thresh:
                    total += bce(o, 0.0)
                else:
                    ignored += 1
    return total, ignored


def test_every_term_by_hand_device_cpu():
    out, targets = _hand_case()
    loss = YOLOv3Loss(ANCHORS, [[0, 1]], [32], num_classes=2, ignore_thresh=0.7, scale_x_y=1.05,
                      iou_aware=True, iou_loss_weight=2.5, iou_aware_loss_weight=1.0)
    got = loss([out], targets)
    w_s = 2.0 - 0.3 * 0.4
    pbox, x, y = _decode(out, 0, 0, 1)
    tw, th = _read(out, 0, 2, 0, 1), _read(out, 0, 3, 0, 1)
    i_pg = iou(pbox, GT)
    obj, ignored = _hand_obj(out, 0.7)
    assert ignored == 1                                  # the planted exact prediction
    want = {
        "xy": w_s * (abs(x - 0.4) + abs(y - 0.6)),       # L1 on the grid-sensitive offsets
        "wh": w_s * (abs(tw - math.log(0.3 * 64 / 16)) + abs(th - math.log(0.4 * 64 / 16))),
        "obj": obj,
        "cls": bce(_read(out, 0, 5, 0, 1), 0.0) + bce(_read(out, 0, 6, 0, 1), 1.0),
        "iou": 2.5 * w_s * (1.0 - i_pg ** 2),
        "iou_aware": 1.0 * bce(float(out[0, 0, 0, 1]), i_pg),
    }
    want["total"] = sum(want.values())
    assert set(got) == set(LOSS_KEYS)
    for k in LOSS_KEYS:
        assert got[k].dim() == 0 and got[k].dtype == torch.float64
        # float64 throughout on both sides: a few dozen operations, 1e-12 relative is ~4500 ulps
        assert got[k].item() == pytest.approx(want[k], rel=1e-12, abs=1e-15), k
    assert 0.0 < i_pg < 1.0


def test_scale_one_uses_bce_on_xy_device_cpu():
    out, targets = _hand_case(seed=1)
    loss = YOLOv3Loss(ANCHORS, [[0, 1]], [32], num_classes=2, scale_x_y=1.0, iou_aware=True)
    got = loss([out], targets)["xy"].item()
    want = (2.0 - 0.12) * (bce(_read(out, 0, 0, 0, 1), 0.4) + bce(_read(out, 0, 1, 0, 1), 0.6))
    assert got == pytest.approx(want, rel=1e-12)


def test_ignore_threshold_device_cpu():
    """The planted negative (IoU 1 with the gt) is ignored at 0.7, counted at 1.0; moved to an
    IoU of about 0.6 it counts at 0.7 too. The positive is never ignored, even at IoU 1."""
    out, targets = _hand_case(seed=2)
    mk = lambda thr: YOLOv3Loss(ANCHORS, [[0, 1]], [32], num_classes=2, ignore_thresh=thr, iou_aware=True)
    o_neg = _read(out, 1, 4, 0, 1)
    lo, hi = mk(0.7)([out], targets)["obj"].item(), mk(1.0)([out], targets)["obj"].item()
    assert hi - lo == pytest.approx(bce(o_neg, 0.0), rel=1e-12)
    assert lo == pytest.approx(_hand_obj(out, 0.7)[0], rel=1e-12)
    shrunk = out.clone()
    shrunk[0, 11, 0, 1] += math.log(0.6)                  # width x 0.6: IoU 0.6 with the gt
    assert iou(_decode(shrunk, 1, 0, 1)[0], GT) == pytest.approx(0.6, rel=1e-9)
    assert mk(0.7)([shrunk], targets)["obj"].item() == pytest.approx(mk(1.0)([shrunk], targets)["obj"].item(),
                                                                     rel=1e-12)
    exact = out.clone()                                   # the positive also predicts the gt exactly
    exact[0, 2:6, 0, 1] = torch.tensor([logit(0.425 / 1.05), logit(0.625 / 1.05), math.log(0.3 * 64 / 16),
                                        math.log(0.4 * 64 / 16)], dtype=torch.float64)
    res = mk(0.7)([exact], targets)
    assert res["obj"].item() == pytest.approx(_hand_obj(exact, 0.7)[0], rel=1e-12)
    assert res["iou"].item() == pytest.approx(0.0, abs=1e-12)


def test_padding_rows_change_nothing_device_cpu():
    """Padding rows (class -1) with arbitrary coordinates, even overlapping predictions, are
    invisible: the loss is bit-identical (same elements summed in the same order)."""
    out, targets = _hand_case(seed=3)
    loss = YOLOv3Loss(ANCHORS, [[0, 1]], [32], num_classes=2, iou_aware=True)
    base = loss([out], targets[:, :1])
    padded = torch.cat([targets[:, :1], torch.tensor([[[-1.0] + GT, [-1.0, 0.2, 0.2, 0.9, 0.9],
                                                        [-1.0, 0, 0, 0, 0]]], dtype=torch.float64)], 1)
    again = loss([out], padded)
    assert all(torch.equal(base[k], again[k]) for k in LOSS_KEYS)
    # and a real class in the same row does change it
    real = padded.clone()
    real[0, 2, 0] = 0.0
    assert not torch.equal(loss([out], real)["total"], base["total"])


def test_gradient_paths_device_cpu():
    """IoU-aware term: gradient only on the IoU logit (the IoU target is detached). IoU term:
    gradient on the positive's box channels only. Objectness: only objectness channels (the
    ignore IoU is not differentiated)."""
    out, targets = _hand_case(seed=4)
    loss = YOLOv3Loss(ANCHORS, [[0, 1]], [32], num_classes=2, iou_aware=True)
    for key, allowed in [("iou_aware", {(0, 0, 1)}), ("iou", {(c, 0, 1) for c in range(2, 6)}),
                         ("obj", {(c, j, i) for c in (6, 13) for j in range(2) for i in range(2)})]:
        x = out.clone().requires_grad_(True)
        loss([x], targets)[key].backward()
        nz = {tuple(ix) for ix in x.grad[0].nonzero().tolist()}
        assert nz and nz <= allowed, key


# ---------------------------------------------------------------- batch composition
def _random_batch(seed):
    g = torch.Generator().manual_seed(seed)
    outs = [torch.randn(4, 3 * 9, s, s, generator=g) for s in (4, 8, 16)]           # 128 px, C = 3
    rows = []
    for n_gt in (1, 3, 0, 2):                             # different counts: per-positive normalising fails
        img = []
        for _ in range(n_gt):
            c = torch.rand(2, generator=g) * 0.6 + 0.2
            wh = torch.rand(2, generator=g) * 0.5 + 0.05
            img.append([float(torch.randint(0, 3, (1,), generator=g))] + _box(c[0].item(), c[1].item(),
                                                                             wh[0].item(), wh[1].item()))
        img += [[-1.0, 0.0, 0.0, 0.0, 0.0]] * (4 - n_gt)
        rows.append(img)
    return outs, torch.tensor(rows)


def test_batch_split_equals_mean_of_halves_device_cpu():
    """loss(batch of 4) == mean(loss(images 0-1), loss(images 2-3)), per term, float32.

    Tolerance: every term is a sum of non-negative float32 elements (per-element values can
    differ by ~2 ulps between batch shapes, vectorised vs scalar tails), and the largest (obj) sums
    n = 4 images x 3 anchors x (16 + 64 + 256) cells = 4032 of them; the recursive-summation bound is
    n * 2^-24 relative to the sum, plus a few roundings for the per-level mean and the halves' mean."""
    outs, targets = _random_batch(0)
    loss = YOLOv3Loss(COCO_ANCHORS, COCO_MASKS, [32, 16, 8], num_classes=3, iou_aware=True)
    full = loss(outs, targets)
    a = loss([o[:2] for o in outs], targets[:2])
    b = loss([o[2:] for o in outs], targets[2:])
    rtol = (4032 + 16) * 2.0 ** -24
    for k in LOSS_KEYS:
        want = 0.5 * (a[k] + b[k])
        assert abs(full[k].item() - want.item()) <= rtol * abs(want.item()) + 1e-30, k
    assert full["xy"].item() > 0 and full["iou_aware"].item() > 0
    # per-image sums averaged over the batch: two copies of one image give that image's loss
    one = loss([o[1:2] for o in outs], targets[1:2])
    two = loss([o[1:2].repeat(2, 1, 1, 1) for o in outs], targets[1:2].repeat(2, 1, 1))
    for k in LOSS_KEYS:
        assert two[k].item() == pytest.approx(one[k].item(), rel=(2 * 1008 + 16) * 2.0 ** -24)


def test_loss_input_errors_device_cpu():
    out, targets = _hand_case()
    loss = YOLOv3Loss(ANCHORS, [[0, 1]], [32], num_classes=2, iou_aware=True)
    with pytest.raises(ValueError, match="targets must have shape"):
        loss([out], targets[0])
    with pytest.raises(ValueError, match="needs 16 channels"):
        loss([out[:, :15]], targets)
    with pytest.raises(ValueError, match="2 masks but the model has 1"):
        YOLOv3Loss(ANCHORS, [[0], [1]], [32], num_classes=2)
    three = YOLOv3Loss(COCO_ANCHORS, COCO_MASKS, [32, 16, 8], num_classes=2)
    with pytest.raises(ValueError, match="different image sizes"):
        three([torch.zeros(1, 21, 2, 2), torch.zeros(1, 21, 2, 2), torch.zeros(1, 21, 8, 8)],
              torch.zeros(1, 1, 5))


def test_score_column_weights_positive_terms_device_cpu():
    """An optional sixth target column is the gt score (Mixup; PaddleDetection's gt_score = tobj):
    score 1 equals the 5-column loss; score 0.5 halves every positive term (xy, wh, cls, iou,
    iou_aware and the positive's objectness BCE) and leaves the negatives' objectness; score 0
    drops the row like padding."""
    out, targets = _hand_case(seed=5)
    loss = YOLOv3Loss(ANCHORS, [[0, 1]], [32], num_classes=2, iou_aware=True)
    base = loss([out], targets)
    with_score = lambda v: torch.cat([targets, torch.full((1, 2, 1), v, dtype=torch.float64)], -1)
    one = loss([out], with_score(1.0))
    assert all(torch.equal(base[k], one[k]) for k in LOSS_KEYS)
    half = loss([out], with_score(0.5))
    for k in ("xy", "wh", "cls", "iou", "iou_aware"):
        assert half[k].item() == pytest.approx(0.5 * base[k].item(), rel=1e-12), k
    pos_obj = bce(_read(out, 0, 4, 0, 1), 1.0)
    assert half["obj"].item() == pytest.approx(base["obj"].item() - 0.5 * pos_obj, rel=1e-12)
    zero = loss([out], with_score(0.0))
    assert zero["xy"].item() == 0.0 and zero["cls"].item() == 0.0
    assert zero["obj"].item() == pytest.approx(loss([out], targets[:, 1:])["obj"].item(), rel=1e-12)
