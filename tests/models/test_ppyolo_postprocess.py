"""PP-YOLO decoding and Matrix NMS (gnetmdk.models.ppyolo.postprocess) against hand numbers and a
plain Python reference loop; device cpu."""
import math

import pytest
import torch

from gnetmdk.models.ppyolo import PPYOLO, PPYOLO_R50VD
from gnetmdk.models.ppyolo.postprocess import decode_outputs, matrix_nms

torch.set_num_threads(1)
CPU = torch.device("cpu")


def _iou(p, q):
    iw = max(0.0, min(p[2], q[2]) - max(p[0], q[0]))
    ih = max(0.0, min(p[3], q[3]) - max(p[1], q[1]))
    inter = iw * ih
    union = (p[2] - p[0]) * (p[3] - p[1]) + (q[2] - q[0]) * (q[3] - q[1]) - inter
    return inter / union if union > 0 else 0.0


def _reference_matrix_nms(boxes, scores, score_thr, post_thr, nms_top_k, keep_top_k, gaussian, sigma):
    """Paddle's matrix_nms kernel as plain loops over Python floats: (score, label, box index) list."""
    n_box, n_cls = len(boxes), len(scores[0])
    dets = []
    for c in range(n_cls):
        cand = [i for i in range(n_box) if scores[i][c] > score_thr]
        cand.sort(key=lambda i: -scores[i][c])                       # stable: ties keep index order
        if nms_top_k > -1:
            cand = cand[:nms_top_k]
        iou_max = []
        for i in range(len(cand)):
            iou_max.append(max([_iou(boxes[cand[i]], boxes[cand[j]]) for j in range(i)], default=0.0))
        for i in range(len(cand)):
            min_decay = 1.0
            for j in range(i):
                iou = _iou(boxes[cand[i]], boxes[cand[j]])
                if gaussian:
                    decay = math.exp((iou_max[j] ** 2 - iou ** 2) * sigma)
                else:
                    if 1.0 - iou_max[j] <= 0.0:
                        continue
                    decay = (1.0 - iou) / (1.0 - iou_max[j])
                min_decay = min(min_decay, decay)
            ds = scores[cand[i]][c] * min_decay
            if ds > post_thr:
                dets.append((ds, c, cand[i]))
    dets.sort(key=lambda d: -d[0])
    return dets[:keep_top_k] if keep_top_k > -1 else dets


def _clustered_boxes(seed, n=60, n_cls=4, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    centres = torch.rand(5, 2, generator=g, dtype=dtype) * 0.6 + 0.2
    pick = torch.randint(0, 5, (n,), generator=g)
    c = centres[pick] + (torch.rand(n, 2, generator=g, dtype=dtype) - 0.5) * 0.08
    wh = torch.rand(n, 2, generator=g, dtype=dtype) * 0.2 + 0.1
    boxes = torch.cat([c - wh / 2, c + wh / 2], 1)
    boxes[7] = boxes[3]                                             # an exact duplicate (cmax = 1)
    scores = torch.rand(n, n_cls, generator=g, dtype=dtype)
    scores = scores * (torch.rand(n, n_cls, generator=g, dtype=dtype) < 0.6)   # sparse, many zeros
    return boxes, scores


@pytest.mark.parametrize("gaussian", [False, True])
@pytest.mark.parametrize("top_k,keep", [(-1, 100), (12, 25)])
def test_matrix_nms_matches_reference_loop_device_cpu(gaussian, top_k, keep):
    for seed in range(3):
        boxes, scores = _clustered_boxes(seed)
        b, s, lab = matrix_nms(boxes, scores, 0.05, 0.05, top_k, keep, gaussian, 2.0)
        ref = _reference_matrix_nms(boxes.tolist(), scores.tolist(), 0.05, 0.05, top_k, keep, gaussian, 2.0)
        assert len(ref) > 10 and s.shape[0] == len(ref)
        assert lab.tolist() == [d[1] for d in ref]
        assert torch.equal(b, boxes[[d[2] for d in ref]])
        assert (s - torch.tensor([d[0] for d in ref], dtype=torch.float64)).abs().max().item() <= 1e-6
        # decay really happened: some survivors score below their raw score
        raw = scores[[d[2] for d in ref], [d[1] for d in ref]]
        assert (s < raw - 1e-3).any() and (s <= raw + 1e-12).all()


def test_matrix_nms_float32_matches_reference_device_cpu():
    """float32 inputs: same detections as the float64 reference on the same (rounded) values;
    scores within 1e-6 (float32 rounding of values <= 1 is ~6e-8 per operation)."""
    boxes, scores = _clustered_boxes(5, dtype=torch.float32)
    b, s, lab = matrix_nms(boxes, scores, 0.01, 0.01, -1, 100, False, 2.0)
    ref = _reference_matrix_nms(boxes.double().tolist(), scores.double().tolist(), 0.01, 0.01, -1, 100, False, 2.0)
    assert lab.tolist() == [d[1] for d in ref] and s.dtype == torch.float32
    assert (s.double() - torch.tensor([d[0] for d in ref], dtype=torch.float64)).abs().max().item() <= 1e-6


def test_matrix_nms_hand_example_device_cpu():
    """A (0.9), B (0.8, IoU 1/3 with A), C (0.5, duplicate of A), D (0.3, far away), one class.
    Linear: B x (1 - 1/3) / (1 - 0); C x (1 - 1) = 0, dropped; D keeps 0.3 (B's factor 1.5 is
    capped at 1; C has cmax 1 and is skipped). Gaussian (sigma 2): B x exp(-2/9), C x exp(-2)."""
    boxes = torch.tensor([[0, 0, 1, 1], [0, 0.5, 1, 1.5], [0, 0, 1, 1], [5, 5, 6, 6]], dtype=torch.float64)
    scores = torch.tensor([[0.9], [0.8], [0.5], [0.3]], dtype=torch.float64)
    b, s, lab = matrix_nms(boxes, scores, 0.01, 0.01, -1, 100, False)
    assert s.tolist() == pytest.approx([0.9, 0.8 * 2 / 3, 0.3], rel=1e-12)
    assert torch.equal(b, boxes[[0, 1, 3]]) and lab.tolist() == [0, 0, 0]
    b, s, lab = matrix_nms(boxes, scores, 0.01, 0.01, -1, 100, True, 2.0)
    assert s.tolist() == pytest.approx([0.9, 0.8 * math.exp(-2 / 9), 0.3, 0.5 * math.exp(-2)], rel=1e-12)
    assert torch.equal(b, boxes[[0, 1, 3, 2]])                       # sorted by decayed score
    # thresholds and keep_top_k: D is not a candidate above 0.3; only 2 kept
    _, s, _ = matrix_nms(boxes, scores, 0.3, 0.01, -1, 2, False)
    assert s.tolist() == pytest.approx([0.9, 0.8 * 2 / 3], rel=1e-12)
    # post threshold 0.55 removes decayed B (0.533) although its raw score is 0.8
    _, s, _ = matrix_nms(boxes, scores, 0.01, 0.55, -1, 100, False)
    assert s.tolist() == pytest.approx([0.9], rel=1e-12)
    # classes do not decay each other
    two = torch.tensor([[0.9, 0.0], [0.0, 0.8]], dtype=torch.float64)
    _, s, lab = matrix_nms(boxes[:2].clone().fill_(0.0) + torch.tensor([0, 0, 1, 1.0]), two, 0.01, 0.01)
    assert s.tolist() == pytest.approx([0.9, 0.8]) and lab.tolist() == [0, 1]


def test_decode_outputs_hand_computed_device_cpu():
    """One level (2x2 grid, stride 32, 64 px image), one anchor 20 x 30 px, two classes, IoU-aware.
    Cell (0, 1): box from the grid-sensitive formulas, too wide -> clipped at x = 1; scores
    obj^0.6 * iou^0.4 * sigmoid(cls). Cell (1, 0): objectness 0.005 < 0.01 -> scores 0."""
    sig = lambda v: 1 / (1 + math.exp(-v))
    out = torch.zeros(1, 1 + 5 + 2, 2, 2, dtype=torch.float64)
    q, tx, ty, tw, th, o, c0, c1 = 0.7, 0.2, -0.4, 1.5, 0.1, 1.3, -0.5, 2.0
    out[0, :, 0, 1] = torch.tensor([q, tx, ty, tw, th, o, c0, c1], dtype=torch.float64)
    out[0, 5, 1, 0] = math.log(0.005 / 0.995)
    out[0, 0, 1, 0] = math.log(0.005 / 0.995)
    boxes, scores = decode_outputs([out], [[20, 30]], [[0]], [32], 2, 1.05, True, 0.4, 0.01)
    assert boxes.shape == (1, 4, 4) and scores.shape == (1, 4, 2)
    cx, cy = (1 + 1.05 * sig(tx) - 0.025) / 2, (0 + 1.05 * sig(ty) - 0.025) / 2
    w, h = math.exp(tw) * 20 / 64, math.exp(th) * 30 / 64
    want = [max(cx - w / 2, 0.0), max(cy - h / 2, 0.0), min(cx + w / 2, 1.0), min(cy + h / 2, 1.0)]
    assert cx + w / 2 > 1.0 and boxes[0, 1].tolist() == pytest.approx(want, rel=1e-12)
    obj = sig(o) ** 0.6 * sig(q) ** 0.4
    assert scores[0, 1].tolist() == pytest.approx([obj * sig(c0), obj * sig(c1)], rel=1e-12)
    assert scores[0, 2].tolist() == [0.0, 0.0]                       # slot order: row 1, col 0
    plain = decode_outputs([out[:, 1:]], [[20, 30]], [[0]], [32], 2, 1.05, False, 0.4, 0.01)[1]
    assert plain[0, 1].tolist() == pytest.approx([sig(o) * sig(c0), sig(o) * sig(c1)], rel=1e-12)


def test_model_decode_contract_device_cpu():
    """list of N dicts on cpu: boxes (K, 4) float32 in [0, 1], scores (K,) float32 descending,
    labels (K,) int64 < C, K <= max_detections; conf_thresh is Matrix NMS's score threshold."""
    torch.manual_seed(0)
    m = PPYOLO(**dict(PPYOLO_R50VD, depth=18, num_classes=3, neck_channels=[16, 8, 4],
                      route_channels=[8, 4])).eval()
    with torch.no_grad():
        outs = m(torch.rand(2, 3, 64, 96) * 255)
    dets = m.decode(outs, conf_thresh=0.01, nms_thresh=0.5, max_detections=7)
    assert len(dets) == 2
    for d in dets:
        assert set(d) == {"boxes", "scores", "labels"}
        k = d["scores"].shape[0]
        assert 0 < k <= 7 and d["boxes"].shape == (k, 4)
        assert d["boxes"].dtype == torch.float32 and d["scores"].dtype == torch.float32
        assert d["labels"].dtype == torch.int64 and d["boxes"].device == CPU
        assert d["boxes"].min() >= 0 and d["boxes"].max() <= 1 and d["labels"].max() < 3
        assert torch.all(d["scores"][:-1] >= d["scores"][1:])
    boxes, scores = decode_outputs(outs, m.anchors, m.anchor_masks, m.strides, 3, 1.05, True, 0.4, 0.01)
    b, s, lab = matrix_nms(boxes[1], scores[1], 0.3, 0.01, -1, 50)
    again = m.decode(outs, conf_thresh=0.3, nms_thresh=None, max_detections=50)[1]
    assert torch.equal(again["scores"], s.float()) and torch.equal(again["labels"], lab)
