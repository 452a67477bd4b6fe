"""Tests for gnetmdk.evaluation: every expected number below is worked out by hand in comments."""

import math

import numpy as np
import pytest
import torch

from gnetmdk.evaluation import (
    batched_nms,
    bootstrap_map,
    box_iou,
    evaluate_detections,
    format_ap_table,
    nms,
    resampled_map,
    voc_ap,
)


def T(x, dtype=torch.float32):
    return torch.tensor(x, dtype=dtype)


# ----------------------------------------------------------------------------------------------
# box_iou
# ----------------------------------------------------------------------------------------------


def test_box_iou_known_values():
    a = T([[0, 0, 10, 10]])
    b = T(
        [
            [5, 5, 15, 15],  # inter 5*5 = 25, union 100 + 100 - 25 = 175 -> 25/175 = 1/7
            [0, 0, 10, 10],  # identical -> 1
            [20, 20, 30, 30],  # disjoint -> 0
            [0, 0, 5, 10],  # contained: inter 50, union 100 + 50 - 50 = 100 -> 0.5
            [10, 0, 20, 10],  # touching edge: inter width 0 -> 0
        ]
    )
    iou = box_iou(a, b)
    assert iou.shape == (1, 5)
    expected = T([[25 / 175, 1.0, 0.0, 0.5, 0.0]])
    torch.testing.assert_close(iou, expected)


def test_box_iou_shape_symmetry_and_normalised_coords():
    a = T([[0, 0, 10, 10], [5, 5, 15, 15]])
    b = T([[0, 0, 10, 10], [5, 5, 15, 15], [0, 0, 5, 10]])
    iou = box_iou(a, b)
    assert iou.shape == (2, 3)
    torch.testing.assert_close(box_iou(b, a), iou.T)
    # normalised coordinates (divide by 100) give the same ratios
    torch.testing.assert_close(box_iou(a / 100, b / 100), iou)
    # [5,5,15,15] vs [0,0,5,10]: inter width min(15,5)-max(5,0) = 0 -> 0
    assert iou[1, 2].item() == 0.0


def test_box_iou_empty_and_bad_shapes():
    assert box_iou(torch.zeros(0, 4), T([[0, 0, 1, 1]])).shape == (0, 1)
    with pytest.raises(ValueError, match=r"\(N, 4\)"):
        box_iou(torch.zeros(3, 5), torch.zeros(2, 4))
    with pytest.raises(ValueError):
        box_iou(torch.zeros(4), torch.zeros(2, 4))


# ----------------------------------------------------------------------------------------------
# nms / batched_nms
# ----------------------------------------------------------------------------------------------

# Chain: A=[0,0,10,10], B=[5,0,15,10], C=[10,0,20,10] (all 10 wide, 10 high).
#   IoU(A,B): inter 5*10 = 50, union 100+100-50 = 150 -> 1/3
#   IoU(B,C): same geometry -> 1/3
#   IoU(A,C): they only touch at x = 10 -> 0
A, B, C = [0, 0, 10, 10], [5, 0, 15, 10], [10, 0, 20, 10]


def test_nms_chain_suppressed_box_does_not_suppress():
    # stored as [C, A, B] with scores [0.7, 0.9, 0.8] -> visiting order A(1), B(2), C(0)
    boxes = T([C, A, B])
    scores = T([0.7, 0.9, 0.8])
    # thresh 0.3: A keeps, B suppressed by A (1/3 > 0.3), C is not compared with the suppressed B
    # and IoU(A,C) = 0, so C survives.
    keep = nms(boxes, scores, 0.3)
    assert keep.dtype == torch.long
    assert keep.tolist() == [1, 0]
    # thresh 0.5: nothing overlaps by more than 1/3 -> all kept, in descending score order
    assert nms(boxes, scores, 0.5).tolist() == [1, 2, 0]


def test_nms_threshold_is_strict_and_ties_prefer_lower_index():
    # IoU([0,0,10,10], [0,0,5,10]) = 50/100 = 0.5 exactly; "> 0.5" does not suppress
    boxes = T([[0, 0, 10, 10], [0, 0, 5, 10]])
    scores = T([0.9, 0.8])
    assert nms(boxes, scores, 0.5).tolist() == [0, 1]
    assert nms(boxes, scores, 0.49).tolist() == [0]
    # identical boxes with equal scores: the lower index is visited first and kept
    same = T([[0, 0, 10, 10]] * 3)
    assert nms(same, T([0.5, 0.5, 0.5]), 0.5).tolist() == [0]
    # equal scores, non-overlapping: order is ascending index
    apart = T([[0, 0, 1, 1], [5, 5, 6, 6], [9, 9, 10, 10]])
    assert nms(apart, T([0.5, 0.7, 0.5]), 0.5).tolist() == [1, 0, 2]


def test_nms_empty_and_errors():
    keep = nms(torch.zeros(0, 4), torch.zeros(0), 0.5)
    assert keep.dtype == torch.long and keep.numel() == 0
    keep = batched_nms(torch.zeros(0, 4), torch.zeros(0), torch.zeros(0, dtype=torch.long), 0.5)
    assert keep.dtype == torch.long and keep.numel() == 0
    with pytest.raises(ValueError):
        nms(torch.zeros(3, 4), torch.zeros(2), 0.5)
    with pytest.raises(ValueError):
        nms(torch.zeros(3, 3), torch.zeros(3), 0.5)
    with pytest.raises(ValueError):
        batched_nms(torch.zeros(3, 4), torch.zeros(3), torch.zeros(2, dtype=torch.long), 0.5)


def test_batched_nms_keeps_overlapping_boxes_of_different_classes():
    # box 0 and 1 identical but classes 0 and 1 -> both kept;
    # box 2 = [0,0,10,9] class 0: IoU with box 0 = 90/100 = 0.9 -> suppressed by box 0;
    # box 3 identical to box 1 (class 1) but lower score -> suppressed.
    boxes = T([[0, 0, 10, 10], [0, 0, 10, 10], [0, 0, 10, 9], [0, 0, 10, 10]])
    scores = T([0.8, 0.9, 0.7, 0.6])
    labels = torch.tensor([0, 1, 0, 1])
    assert batched_nms(boxes, scores, labels, 0.5).tolist() == [1, 0]
    # plain nms would merge across classes: only the best box survives
    assert nms(boxes, scores, 0.5).tolist() == [1]


def test_batched_nms_matches_per_class_loop():
    g = torch.Generator().manual_seed(0)
    xy = torch.rand(60, 2, generator=g) * 0.8
    wh = torch.rand(60, 2, generator=g) * 0.3 + 0.05
    boxes = torch.cat([xy, xy + wh], 1)  # normalised coordinates
    scores = torch.rand(60, generator=g)
    labels = torch.randint(0, 4, (60,), generator=g) + 7  # labels need not start at 0
    keep = batched_nms(boxes, scores, labels, 0.45)
    ref = []
    for c in labels.unique():
        idx = torch.nonzero(labels == c).flatten()
        ref += idx[nms(boxes[idx], scores[idx], 0.45)].tolist()
    ref.sort(key=lambda i: -scores[i].item())
    assert keep.tolist() == ref


def _greedy_keep_by_definition(suppresses):
    """The greedy pass written from its definition: visit boxes in order, keep one no kept box dropped."""
    kept = []
    for j in range(suppresses.shape[0]):
        if not any(bool(suppresses[i, j]) for i in kept):
            kept.append(j)
    return kept


@pytest.mark.parametrize("n", [0, 1, 7, 300])
def test_greedy_keep_equals_its_definition_on_random_matrices_device_cpu(n):
    """greedy_keep (the numpy loop) keeps exactly the boxes its definition keeps, on matrices that are
    neither symmetric nor zero on the diagonal, at several densities; a dropped box drops nothing."""
    from gnetmdk.evaluation.boxes import greedy_keep
    g = torch.Generator().manual_seed(n)
    for density in (0.0, 0.02, 0.3, 1.0):
        sup = torch.rand(n, n, generator=g) < density
        keep = greedy_keep(sup)
        assert keep.dtype == torch.long and keep.device.type == "cpu"
        assert keep.tolist() == _greedy_keep_by_definition(sup)
    chain = torch.tensor([[0, 1, 0], [0, 0, 1], [0, 0, 0]], dtype=torch.bool)   # 0 drops 1; 1 would drop 2
    assert greedy_keep(chain).tolist() == [0, 2]


# ----------------------------------------------------------------------------------------------
# voc_ap
# ----------------------------------------------------------------------------------------------


def test_voc_ap_hand_example_with_envelope():
    # recall    0.25  0.25  0.5    0.75
    # precision 1.0   0.5   2/3    0.75
    # with sentinels: r = [0, .25, .25, .5, .75, 1], p = [0, 1, .5, 2/3, .75, 0]
    # right-to-left running max: p = [1, 1, .75, .75, .75, 0]   (2/3 is lifted to .75)
    # recall changes: 0->.25 (p=1): .25; .25->.5 (p=.75): .1875; .5->.75 (p=.75): .1875;
    #                 .75->1 (p=0): 0            total = 0.625
    ap = voc_ap(np.array([0.25, 0.25, 0.5, 0.75]), np.array([1.0, 0.5, 2 / 3, 0.75]))
    assert ap == pytest.approx(0.625)


def test_voc_ap_simple_cases():
    # recall [.5, .5, 1], precision [1, .5, 2/3]: 0.5*1 + 0.5*(2/3) = 0.8333...
    assert voc_ap(np.array([0.5, 0.5, 1.0]), np.array([1.0, 0.5, 2 / 3])) == pytest.approx(5 / 6)
    assert voc_ap(np.array([1.0]), np.array([1.0])) == pytest.approx(1.0)
    assert voc_ap(np.array([]), np.array([])) == 0.0
    with pytest.raises(ValueError):
        voc_ap(np.array([0.5, 1.0]), np.array([1.0]))


# ----------------------------------------------------------------------------------------------
# evaluate_detections
# ----------------------------------------------------------------------------------------------

G1, G2 = [0, 0, 10, 10], [20, 20, 30, 30]
FAR = [50, 50, 60, 60]


def det(boxes, scores, labels):
    return {
        "boxes": np.array(boxes, dtype=np.float64).reshape(-1, 4),
        "scores": np.array(scores, dtype=np.float64),
        "labels": np.array(labels, dtype=np.int64),
    }


def gt(boxes, labels, difficult=None):
    d = {"boxes": np.array(boxes, dtype=np.float64).reshape(-1, 4), "labels": np.array(labels)}
    if difficult is not None:
        d["difficult"] = np.array(difficult, dtype=bool)
    return d


def test_perfect_detections_give_ap_one():
    gts = [gt([G1, G2], [0, 1]), gt([G2], [1])]
    dets = [det([G1, G2], [0.9, 0.8], [0, 1]), det([G2], [0.7], [1])]
    r = evaluate_detections(dets, gts, num_classes=2)
    assert r["ap"] == [pytest.approx(1.0), pytest.approx(1.0)]
    assert r["map"] == pytest.approx(1.0)
    assert r["num_gt"] == [1, 2] and r["num_det"] == [1, 2]


def test_tp_fp_tp_hand_computed():
    # 2 GT; ranked detections: TP(0.9), FP(0.8), TP(0.7)
    # cum TP = [1, 1, 2], cum FP = [0, 1, 1]
    # recall    = [1/2, 1/2, 2/2] = [.5, .5, 1]
    # precision = [1/1, 1/2, 2/3]
    # envelope  = [1, 2/3, 2/3] -> AP = 0.5*1 + 0.5*(2/3) = 0.8333
    gts = [gt([G1, G2], [0, 0])]
    dets = [det([G1, FAR, G2], [0.9, 0.8, 0.7], [0, 0, 0])]
    r = evaluate_detections(dets, gts, num_classes=1)
    assert r["ap"][0] == pytest.approx(0.5 * 1 + 0.5 * (2 / 3))
    assert r["map"] == pytest.approx(0.8333333333)


def test_ranking_is_global_over_images():
    # Same as above but spread over two images, with the FP in image 1 placed on a box that is
    # a GT only in image 0 (matching never crosses images): ranking 0.9 TP, 0.8 FP, 0.7 TP.
    gts = [gt([G1], [0]), gt([G2], [0])]
    dets = [det([G1], [0.9], [0]), det([G1, G2], [0.8, 0.7], [0, 0])]
    r = evaluate_detections(dets, gts, num_classes=1)
    assert r["ap"][0] == pytest.approx(5 / 6)


def test_duplicate_detection_is_fp():
    # G1 detected twice (0.9 and 0.8; second box [0,0,10,9] has IoU 90/100 = 0.9 with G1),
    # then G2 at 0.7. The duplicate is a FP: TP, FP, TP -> AP = 0.8333 (not 1.0).
    gts = [gt([G1, G2], [0, 0])]
    dets = [det([G1, [0, 0, 10, 9], G2], [0.9, 0.8, 0.7], [0, 0, 0])]
    r = evaluate_detections(dets, gts, num_classes=1)
    assert r["ap"][0] == pytest.approx(5 / 6)


def test_class_without_gt_is_nan_and_excluded_from_map():
    # class 0: perfect -> 1.0; class 1: TP, FP, TP -> 5/6; class 2: detections but no GT -> nan
    # mAP = (1 + 5/6) / 2 = 11/12
    gts = [gt([G1, G1, G2], [0, 1, 1])]
    dets = [det([G1, G1, FAR, G2, FAR], [0.9, 0.9, 0.8, 0.7, 0.95], [0, 1, 1, 1, 2])]
    r = evaluate_detections(dets, gts, num_classes=3)
    assert r["ap"][0] == pytest.approx(1.0)
    assert r["ap"][1] == pytest.approx(5 / 6)
    assert math.isnan(r["ap"][2])
    assert r["map"] == pytest.approx(11 / 12)
    assert r["num_gt"] == [1, 2, 0] and r["num_det"] == [1, 3, 1]


def test_difficult_gt_is_ignored():
    # G2 is difficult. Detection on G2 (0.95) is neither TP nor FP; detection on G1 (0.9) is TP.
    # npos = 1 -> recall [1], precision [1] -> AP 1.0.
    # (Counting G2 as a normal GT would give npos 2; counting its detection as FP would give
    #  precision [0, 1/2] at recall [0, 1] -> AP 0.5.)
    gts = [gt([G1, G2], [0, 0], difficult=[False, True])]
    r = evaluate_detections([det([G2, G1], [0.95, 0.9], [0, 0])], gts, num_classes=1)
    assert r["ap"][0] == pytest.approx(1.0)
    assert r["num_gt"] == [1]
    # an undetected difficult GT does not lower recall: only G1 detected -> AP 1.0 (not 0.5)
    r = evaluate_detections([det([G1], [0.9], [0])], gts, num_classes=1)
    assert r["ap"][0] == pytest.approx(1.0)
    # a class whose only GT is difficult has no positives -> nan
    r = evaluate_detections([det([], [], [])], [gt([G1], [0], [True])], num_classes=1)
    assert math.isnan(r["ap"][0]) and math.isnan(r["map"])


def test_empty_detections_give_ap_zero():
    gts = [gt([G1], [0]), gt([G2], [1])]
    dets = [det([], [], []), det([], [], [])]
    r = evaluate_detections(dets, gts, num_classes=2)
    assert r["ap"] == [0.0, 0.0] and r["map"] == 0.0
    assert r["num_det"] == [0, 0] and r["num_gt"] == [1, 1]


def test_iou_threshold_inclusive_and_no_plus_one():
    # IoU([0,0,10,10], GT [0,0,5,10]) = 50/100 = 0.5 exactly -> TP with ">= 0.5" -> AP 1
    r = evaluate_detections([det([G1], [0.9], [0])], [gt([[0, 0, 5, 10]], [0])], 1)
    assert r["ap"][0] == pytest.approx(1.0)
    # det [0,0,2,2] vs GT [1,0,3,2]: continuous IoU = (1*2)/(4+4-2) = 1/3 -> FP at thresh 0.4.
    # (The VOC "+1" convention would give (2*3)/(9+9-6) = 0.5 and a match.)
    r = evaluate_detections([det([[0, 0, 2, 2]], [0.9], [0])], [gt([[1, 0, 3, 2]], [0])], 1, 0.4)
    assert r["ap"][0] == 0.0


def test_torch_and_numpy_inputs_agree():
    gts_np = [gt([G1, G2], [0, 1], [False, False]), gt([G2, G1], [0, 0], [False, True])]
    dets_np = [
        det([G1, FAR, G2, [1, 1, 11, 11]], [0.9, 0.88, 0.8, 0.5], [0, 0, 1, 0]),
        det([G2, G1, FAR], [0.85, 0.7, 0.65], [0, 0, 1]),
    ]

    def to_torch(d):
        return {k: torch.as_tensor(v) for k, v in d.items()}

    r_np = evaluate_detections(dets_np, gts_np, num_classes=2)
    r_t = evaluate_detections([to_torch(d) for d in dets_np], [to_torch(g) for g in gts_np], 2)
    # mixed: float32 tensors for detections, numpy ground truth
    dets_f32 = [{k: torch.as_tensor(v).float() if k != "labels" else torch.as_tensor(v)
                 for k, v in d.items()} for d in dets_np]
    r_mix = evaluate_detections(dets_f32, gts_np, 2)
    for r in (r_t, r_mix):
        np.testing.assert_allclose(r["ap"], r_np["ap"])
        assert r["map"] == pytest.approx(r_np["map"])
        assert r["num_gt"] == r_np["num_gt"] and r["num_det"] == r_np["num_det"]
    # sanity on the values themselves:
    # class 0: npos = 2 (G1 img0, G2 img1; G1 img1 difficult). Ranked:
    #   0.9 G1 img0 TP | 0.88 FAR img0 FP | 0.85 G2 img1 TP | 0.7 G1 img1 -> difficult, ignored |
    #   0.5 [1,1,11,11] img0: IoU with G1 = 81/119 >= .5 but G1 already matched -> FP
    #   kept ranks: cum TP [1,1,2,2], cum FP [0,1,1,2]
    #   recall [.5, .5, 1, 1], precision [1, 1/2, 2/3, 1/2] -> AP = .5*1 + .5*(2/3) = 5/6
    # class 1: npos = 1 (G2 img0). 0.8 G2 img0 TP | 0.65 FAR img1 FP -> AP 1.0
    # mAP = (5/6 + 1) / 2 = 11/12; detections per class: 5 (incl. the ignored one) and 2
    assert r_np["ap"] == [pytest.approx(5 / 6), pytest.approx(1.0)]
    assert r_np["map"] == pytest.approx(11 / 12)
    assert r_np["num_gt"] == [2, 1] and r_np["num_det"] == [5, 2]


def test_iou_of_a_whole_image_equals_one_detection_at_a_time_bit_for_bit_device_cpu():
    """The matching computes one IoU matrix per image and class; box_iou is elementwise, so every row is
    the IoU of that detection alone, bit for bit, in any order of images and detections."""
    from gnetmdk.evaluation.voc import _iou_one_to_many, _iou_rows
    rng = np.random.default_rng(3)
    img = rng.integers(0, 7, 300)
    xy = rng.uniform(0, 200, (300, 2))
    boxes = np.concatenate([xy, xy + rng.uniform(1, 60, (300, 2))], 1)
    cls_gt = []
    for i in range(7):
        g = rng.integers(0, 5) if i != 4 else 0                  # image 4 has no ground truth of the class
        gxy = rng.uniform(0, 200, (g, 2))
        cls_gt.append((np.concatenate([gxy, gxy + rng.uniform(1, 60, (g, 2))], 1), None, None))
    sel = rng.permutation(300)[:250]
    rows = _iou_rows(sel, img, boxes, cls_gt)
    assert set(rows) == {int(j) for j in sel if len(cls_gt[img[j]][0])}
    for j in sel:
        if len(cls_gt[img[j]][0]):
            want = _iou_one_to_many(boxes[j], cls_gt[img[j]][0])
            assert rows[j].dtype == np.float64 and np.array_equal(rows[j], want), j
    assert _iou_rows(np.zeros(0, np.int64), img, boxes, cls_gt) == {}


def test_input_validation():
    with pytest.raises(ValueError, match="same length"):
        evaluate_detections([det([], [], [])], [], num_classes=1)
    with pytest.raises(ValueError, match=r"\(K, 4\)"):
        evaluate_detections([{"boxes": np.zeros((2, 5)), "scores": np.zeros(2),
                              "labels": np.zeros(2)}], [gt([G1], [0])], 1)
    with pytest.raises(ValueError, match="labels"):
        evaluate_detections([det([G1], [0.9], [3])], [gt([G1], [0])], num_classes=2)
    with pytest.raises(ValueError):
        evaluate_detections([det([G1, G2], [0.9], [0, 0])], [gt([G1], [0])], 1)
    with pytest.raises(ValueError, match="scores"):
        evaluate_detections([{"boxes": np.zeros((1, 4)), "labels": [0]}], [gt([G1], [0])], 1)


def test_format_ap_table():
    gts = [gt([G1, G1, G2], [0, 1, 1])]
    dets = [det([G1, G1, FAR, G2], [0.9, 0.9, 0.8, 0.7], [0, 1, 1, 1])]
    r = evaluate_detections(dets, gts, num_classes=3)
    table = format_ap_table(r, ["car", "person", "bicycle"])
    lines = table.splitlines()
    assert any(l.startswith("car") and "1.0000" in l for l in lines)
    assert any(l.startswith("person") and "0.8333" in l and " 2 " in l and " 3" in l for l in lines)
    assert any(l.startswith("bicycle") and "n/a" in l for l in lines)
    # mean over car and person: (1 + 5/6) / 2 = 0.91667
    assert lines[-1].startswith("mAP") and "0.9167" in lines[-1]
    with pytest.raises(ValueError):
        format_ap_table(r, ["car"])


def test_padded_evaluation_gives_each_image_the_same_outputs_on_any_split_device_cpu():
    """predict_loader with pad_to: the detections of every image equal bit for bit whether the 20
    images are evaluated in one process (batches 16 + 4, padded to 16) or split over 2 or 3 ranks
    (ShardSampler: rank r takes r, r + W, ...), in loader batches of 16, 3 or 1 images padded to 16;
    the mean loss terms are those of the real images. Every cell is kept as a detection (threshold 0,
    no suppression), so any difference in the outputs shows; unpadded, batches of 1 and 3 differ here."""
    from gnetmdk.dist.sampler import ShardSampler
    from gnetmdk.engine.stages import STAGES, apply_stage
    from gnetmdk.evaluation.evaluator import predict_loader
    from gnetmdk.models.gnetdet.model import GNetDet
    torch.set_num_threads(2)
    torch.manual_seed(0)
    model = GNetDet(3, 224, 0.125, use_bn=False)
    apply_stage(model, STAGES["step1"])
    images = torch.randint(0, 32, (20, 3, 224, 224), dtype=torch.uint8)
    targets = torch.zeros(20, 14, 14, 13)

    def loader(world, rank, batch=16):
        idx = list(ShardSampler(20, rank, world))
        for i in range(0, len(idx), batch):
            part = torch.tensor(idx[i:i + batch])
            yield images[part], targets[part], part, torch.tensor([[640, 480]] * len(part))

    ref, sums, n = predict_loader(model, [(images[:16], targets[:16], torch.arange(16), torch.tensor([[640, 480]] * 16))]
                                  + list(loader(1, 0))[1:], "cpu", 0.0, 1.0, 1000, pad_to=16)
    assert n == 20 and sorted(ref) == list(range(20))
    for world, batch in ((2, 16), (3, 3), (1, 1)):     # oneDNN sums otherwise at batch 1 and 3 here
        got = {}
        for rank in range(world):
            d, _, k = predict_loader(model, loader(world, rank, batch), "cpu", 0.0, 1.0, 1000, pad_to=16)
            got.update(d)
        assert sorted(got) == list(range(20))
        for i in range(20):
            for key in ("boxes", "scores", "labels"):
                assert torch.equal(got[i][key], ref[i][key]), (world, i, key)
    # the loss terms are those of the 4 real images of the padded batch, not of the blanks
    _, s4, n4 = predict_loader(model, [(images[16:], targets[16:], torch.arange(16, 20),
                                        torch.tensor([[640, 480]] * 4))], "cpu", 0.0, 1.0, 1000, pad_to=16)
    model.eval()
    with torch.no_grad():
        padded = torch.cat([images[16:], torch.zeros(12, 3, 224, 224, dtype=torch.uint8)]).float()
        plain = model.loss(model(padded)[:4], targets[16:])
    assert n4 == 4 and s4 == {k: float(v) * 4 for k, v in plain.items()}


# ----------------------------------------------------------------------------------------------
# resampled_map / bootstrap_map
# ----------------------------------------------------------------------------------------------


def _random_set(seed, n=40, num_classes=3):
    """A random detection set with difficult objects, near-hits and scores on a 0.1 grid (ties, also
    inside one image)."""
    rng = np.random.default_rng(seed)
    gts, dets = [], []
    for _ in range(n):
        g = int(rng.integers(0, 4))
        xy, wh = rng.uniform(0, 200, (g, 2)), rng.uniform(5, 60, (g, 2))
        gts.append({"boxes": np.concatenate([xy, xy + wh], 1), "labels": rng.integers(0, num_classes, g),
                    "difficult": rng.uniform(size=g) < 0.1})
        k = int(rng.integers(0, 8))
        xy, wh = rng.uniform(0, 200, (k, 2)), rng.uniform(5, 60, (k, 2))
        b = np.concatenate([xy, xy + wh], 1)
        if g:
            b[:k // 2] = gts[-1]["boxes"][rng.integers(0, g, k // 2)] + rng.normal(0, 3, (k // 2, 4))
        dets.append({"boxes": b, "scores": np.round(rng.uniform(size=k), 1), "labels": rng.integers(0, num_classes, k)})
    return dets, gts


def _same(a, b):
    return a == b or (math.isnan(a) and math.isnan(b))


def test_resampled_map_is_the_map_of_the_resampled_list_bit_for_bit():
    for seed in (0, 1):
        dets, gts = _random_set(seed)
        ranked = evaluate_detections(dets, gts, 3, return_ranked=True)
        assert resampled_map(ranked, np.ones(len(gts), int))[0] == ranked["map"]
        rng = np.random.default_rng(10 + seed)
        for _ in range(60):
            idx = np.sort(rng.integers(0, len(gts), len(gts)))
            ref = evaluate_detections([dets[i] for i in idx], [gts[i] for i in idx], 3)
            got, aps = resampled_map(ranked, np.bincount(idx, minlength=len(gts)))
            assert _same(got, ref["map"]) and all(_same(a, b) for a, b in zip(aps, ref["ap"]))


def test_resampled_map_ranks_tied_detections_of_a_drawn_twice_image_as_the_list_does():
    # one image, one object; detection a hits it (TP), b misses (FP), both score 0.9. Drawn twice, the
    # list [image, image] ranks a, b, a', b': TP FP TP FP over 2 positives -> recall .5 .5 1 1,
    # precision 1 .5 .667 .5 -> AP = .5 * 1 + .5 * 2/3 = 5/6 (a, a', b, b' would give 1)
    dets = [{"boxes": [[0, 0, 10, 10], [50, 50, 60, 60]], "scores": [0.9, 0.9], "labels": [0, 0]}]
    gts = [{"boxes": [[0, 0, 10, 10]], "labels": [0]}]
    ranked = evaluate_detections(dets, gts, 1, return_ranked=True)
    assert ranked["map"] == pytest.approx(1.0)
    assert resampled_map(ranked, [2])[0] == pytest.approx(5 / 6)
    assert resampled_map(ranked, [2])[0] == evaluate_detections(dets * 2, gts * 2, 1)["map"]
    assert math.isnan(resampled_map(ranked, [0])[0])                   # no ground truth drawn
    with pytest.raises(ValueError, match="1 whole numbers"):
        resampled_map(ranked, [1, 1])
    with pytest.raises(ValueError, match="return_ranked"):
        resampled_map(evaluate_detections(dets, gts, 1), [1])


def test_bootstrap_of_a_share_of_found_objects_is_the_binomial():
    # one object per image, found alone (score 1) in the first 30 of 50 images: AP of a resample is
    # the share of drawn images among the first 30, a binomial over 50 draws / 50: mean 0.6, sd
    # sqrt(.6 * .4 / 50) = 0.0693; the 95% interval about 0.6 -/+ 1.96 sd = [0.464, 0.736]
    gts = [{"boxes": [[0, 0, 10, 10]], "labels": [0]} for _ in range(50)]
    dets = [{"boxes": [[0, 0, 10, 10]] if i < 30 else np.zeros((0, 4)), "scores": [1.0] if i < 30 else [],
             "labels": [0] if i < 30 else []} for i in range(50)]
    b = bootstrap_map(evaluate_detections(dets, gts, 1, return_ranked=True), resamples=2000, seed=3)
    assert b["map_a"] == pytest.approx(0.6)
    assert abs(b["samples_a"].mean() - 0.6) < 4 * 0.0693 / math.sqrt(2000)
    assert abs(b["samples_a"].std() - 0.0693) < 0.006
    lo, hi = b["interval_a"]
    assert 0.44 <= lo <= 0.50 and 0.70 <= hi <= 0.76


def test_paired_bootstrap_shares_the_draws_and_refuses_other_images():
    dets, gts = _random_set(0)
    a = evaluate_detections(dets, gts, 3, return_ranked=True)
    worse = [dict(d, scores=np.asarray(d["scores"])[::-1].copy()) for d in dets]   # scores shuffled per image
    b = evaluate_detections(worse, gts, 3, return_ranked=True)
    self_pair = bootstrap_map(a, a, resamples=50)
    assert self_pair["interval_diff"] == (0.0, 0.0) and self_pair["share_below"] == 0.0 and self_pair["diff"] == 0.0
    r1, r2 = bootstrap_map(a, b, resamples=200, seed=5), bootstrap_map(a, b, resamples=200, seed=5)
    assert np.array_equal(r1["samples_diff"], r2["samples_diff"])                # the seed decides the draws
    assert not np.array_equal(r1["samples_a"], bootstrap_map(a, b, resamples=200, seed=6)["samples_a"])
    assert r1["map_a"] == a["map"] and r1["map_b"] == b["map"] and r1["diff"] == a["map"] - b["map"]
    assert np.array_equal(r1["samples_diff"], r1["samples_a"] - r1["samples_b"])
    lo, hi = r1["interval_diff"]
    assert lo <= np.median(r1["samples_diff"]) <= hi
    assert r1["share_below"] == np.mean(r1["samples_diff"] < 0)
    other = evaluate_detections(dets[:-1], gts[:-1], 3, return_ranked=True)
    with pytest.raises(ValueError, match="not of the same images"):
        bootstrap_map(a, other)
    with pytest.raises(ValueError, match="resamples"):
        bootstrap_map(a, resamples=0)
    with pytest.raises(ValueError, match="level"):
        bootstrap_map(a, level=1.0)
