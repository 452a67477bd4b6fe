"""PP-YOLO model family: ResNet-vd, neck parts, head, PPYOLO assembly, presets, meta; device cpu."""
import json
import math
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gnetmdk.models.ppyolo import (PPYOLO, PPYOLO_R50VD, SPP, CoordConv, DeformConv2d, DropBlock,
                                   PPYOLOFPN, ResNetVd, YOLOv3Head, coord_channels, ppyolo_r18vd, ppyolo_r50vd,
                                   split_level, decode_level_boxes)
from gnetmdk.models.ppyolo.common import ConvBNLayer

torch.set_num_threads(1)
CPU = torch.device("cpu")


def _grab(store, key, which="in"):
    """A forward hook that records the module's first input (or its output) and returns None."""
    def hook(mod, inp, out):
        store[key] = inp[0] if which == "in" else out
    return hook


def _count(m):
    return sum(p.numel() for p in m.parameters())


def _conv_bn(cin, cout, k):
    """parameters of conv (no bias) + BN (gamma, beta)"""
    return cin * cout * k * k + 2 * cout


def _tiny(**kw):
    """A width-reduced 3-level PP-YOLO with every r50vd trick, for fast cpu tests."""
    args = dict(PPYOLO_R50VD, depth=18, num_classes=3, neck_channels=[16, 8, 4], route_channels=[8, 4])
    args.update(kw)
    return PPYOLO(**args)


# ---------------------------------------------------------------- backbone
@pytest.mark.parametrize("depth,widths", [(18, [64, 128, 256, 512]), (34, [64, 128, 256, 512]),
                                          (50, [256, 512, 1024, 2048])])
def test_resnet_vd_shapes_and_strides_device_cpu(depth, widths):
    m = ResNetVd(depth, return_idx=[0, 1, 2, 3])
    outs = m(torch.randn(1, 3, 64, 96, device=CPU))
    assert [tuple(o.shape) for o in outs] == [(1, c, 64 // s, 96 // s) for c, s in zip(widths, [4, 8, 16, 32])]
    assert m.out_channels == widths and m.out_strides == [4, 8, 16, 32]


def test_resnet_vd_parameter_counts_device_cpu():
    """torchvision's ResNet-18/34/50 minus the fc layer have 11,176,512 / 21,284,672 / 23,508,032
    parameters. The vd stem (3x3 convs 3-32-32-64 + BN: 28,768) replaces the 7x7 conv + BN (9,536):
    +19,232. Basic-block nets also get PaddleDetection's 1x1 projection on stage 0's first block
    (64*64 + 128 = 4,224); the bottleneck net already has one there. The avg-pool adds nothing.
    DCNv2 in stage 3 of r50 adds 3 offset convs 512 -> 27, 3x3, with bias: 3 * (512*27*9 + 27)."""
    assert _count(ResNetVd(18)) == 11_176_512 + 19_232 + 4_224
    assert _count(ResNetVd(34)) == 21_284_672 + 19_232 + 4_224
    assert _count(ResNetVd(50)) == 23_508_032 + 19_232
    assert _count(ResNetVd(50, dcn_v2_stages=[3])) == 23_508_032 + 19_232 + 3 * (512 * 27 * 9 + 27)


def test_resnet_vd_structure_device_cpu():
    """Deep stem 32, 32, 64 (first strided); strided blocks: AvgPool 2x2 then a stride-1 1x1 conv in
    the shortcut; r50 puts the stride on the 3x3 conv; DCN only in the named stages."""
    m = ResNetVd(50, return_idx=[1, 2, 3], dcn_v2_stages=[3])
    stem = [(u.conv.in_channels, u.conv.out_channels, u.conv.kernel_size, u.conv.stride) for u in m.stem]
    assert stem == [(3, 32, (3, 3), (2, 2)), (32, 32, (3, 3), (1, 1)), (32, 64, (3, 3), (1, 1))]
    first = m.stages[1][0]
    assert isinstance(first.short[0], nn.AvgPool2d) and first.short[0].kernel_size == 2
    assert first.short[1].conv.stride == (1, 1) and first.short[1].conv.kernel_size == (1, 1)
    assert first.branch2a.conv.stride == (1, 1) and first.branch2b.conv.stride == (2, 2)
    assert isinstance(m.stages[0][0].short, ConvBNLayer)          # stage 0: stride 1, plain projection
    assert m.stages[0][1].short is None
    for s, stage in enumerate(m.stages):
        for blk in stage:
            assert isinstance(blk.branch2b.conv, DeformConv2d) == (s == 3)
    r18 = ResNetVd(18, dcn_v2_stages=[2])
    assert isinstance(r18.stages[2][1].branch2b.conv, DeformConv2d)       # BasicBlock: second 3x3
    assert isinstance(r18.stages[2][1].branch2a.conv, nn.Conv2d)


def test_resnet_vd_avgpool_shortcut_values_device_cpu():
    """The strided shortcut equals BN(conv1x1(avg_pool_2x2(x))): checked on a stage-1 block."""
    torch.manual_seed(0)
    m = ResNetVd(18, return_idx=[1]).eval()
    blk = m.stages[1][0]
    x = torch.randn(2, 64, 8, 8)
    conv, bn = blk.short[1].conv, blk.short[1].bn
    want = bn(F.conv2d(F.avg_pool2d(x, 2, 2), conv.weight))
    torch.testing.assert_close(blk.short(x), want, rtol=0, atol=1e-6)


def test_freeze_at_and_freeze_norm_device_cpu():
    m = ResNetVd(18, return_idx=[1, 2, 3], freeze_at=1)
    assert not any(p.requires_grad for p in m.stem.parameters())
    assert not any(p.requires_grad for s in m.stages[:2] for p in s.parameters())
    assert all(p.requires_grad for s in m.stages[2:] for p in s.parameters())
    assert all(p.requires_grad for p in ResNetVd(18, freeze_at=-1).parameters())

    m = ResNetVd(18, return_idx=[3], freeze_norm=True)
    m.train()
    bns = [b for b in m.modules() if isinstance(b, nn.BatchNorm2d)]
    assert bns and all(not b.training for b in bns)
    assert all(not b.weight.requires_grad and not b.bias.requires_grad for b in bns)
    before = [b.running_mean.clone() for b in bns]
    m(torch.randn(2, 3, 64, 64) * 5 + 3)
    assert all(torch.equal(b0, b.running_mean) for b0, b in zip(before, bns))
    # without freeze_norm the statistics move
    m2 = ResNetVd(18, return_idx=[3]).train()
    m2(torch.randn(2, 3, 64, 64) * 5 + 3)
    assert not torch.equal(m2.stem[0].bn.running_mean, torch.zeros(32))


@pytest.mark.parametrize("kwargs,needle", [
    (dict(depth=101), "depth 101"), (dict(depth=50, return_idx=[4]), "outside 0..3"),
    (dict(depth=50, return_idx=[2, 1]), "strictly increasing"), (dict(depth=50, freeze_at=4), "freeze_at"),
    (dict(depth=50, dcn_v2_stages=[5]), "dcn_v2_stages"),
])
def test_resnet_vd_bad_arguments_device_cpu(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        ResNetVd(**kwargs)


# ---------------------------------------------------------------- neck parts
def test_coord_channels_values_device_cpu():
    gx, gy = coord_channels(2, 3, 5)
    assert gx.shape == gy.shape == (2, 1, 3, 5)
    assert gx[1, 0, 2].tolist() == [-1.0, -0.5, 0.0, 0.5, 1.0]            # columns, left to right
    assert gy[0, 0, :, 4].tolist() == [-1.0, 0.0, 1.0]                      # rows, top to bottom
    assert torch.equal(gx[0, 0, 0], gx[0, 0, 2]) and torch.equal(gy[0, 0, :, 0], gy[0, 0, :, 3])
    gx1, _ = coord_channels(1, 2, 1)
    assert gx1.flatten().tolist() == [-1.0, -1.0]


def test_coord_channels_paddle_range_device_cpu():
    """coord_range "paddle": PaddleDetection's add_coord since 2021, j / (2 (w - 1)) - 1 (to [-1, -0.5])."""
    gx, gy = coord_channels(1, 3, 5, coord_range="paddle")
    assert gx[0, 0, 1].tolist() == [j / 8 - 1 for j in range(5)] == [-1.0, -0.875, -0.75, -0.625, -0.5]
    assert gy[0, 0, :, 0].tolist() == [-1.0, -0.75, -0.5]
    with pytest.raises(ValueError, match="coord_range"):
        coord_channels(1, 3, 5, coord_range="half")
    torch.manual_seed(0)
    full, paddle = CoordConv(4, 6, 1).eval(), CoordConv(4, 6, 1, coord_range="paddle").eval()
    paddle.load_state_dict(full.state_dict())
    x = torch.randn(1, 4, 3, 5)
    assert not torch.equal(full(x), paddle(x))        # same weights, another function


def test_coordconv_concatenates_after_input_device_cpu():
    torch.manual_seed(0)
    cc = CoordConv(4, 6, 1).eval()
    assert cc.conv.conv.in_channels == 6
    x = torch.randn(2, 4, 3, 5)
    gx, gy = coord_channels(2, 3, 5)
    torch.testing.assert_close(cc(x), cc.conv(torch.cat([x, gx, gy], 1)), rtol=0, atol=0)


def test_spp_pools_5_9_13_device_cpu():
    """A single hot pixel becomes squares of side 5, 9, 13 (clipped) in the pooled copies."""
    spp = SPP(1, 2).eval()
    seen = {}
    spp.conv.conv.register_forward_hook(_grab(seen, "x"))
    x = torch.zeros(1, 1, 15, 15)
    x[0, 0, 7, 3] = 1.0
    spp(x)
    cat = seen["x"][0]
    assert cat.shape == (4, 15, 15) and torch.equal(cat[0], x[0, 0])
    for ch, k in zip((1, 2, 3), (5, 9, 13)):
        want = torch.zeros(15, 15)
        r = k // 2
        want[max(7 - r, 0):7 + r + 1, max(3 - r, 0):3 + r + 1] = 1.0
        assert torch.equal(cat[ch], want), k


def test_dropblock_training_behaviour_device_cpu():
    torch.manual_seed(0)
    db = DropBlock(3, 0.9).train()
    x = torch.ones(4, 16, 64, 64)
    y = db(x)
    zero = y == 0
    frac = zero.float().mean().item()
    # gamma = 0.1 / 9 * (64 / 62)^2 = 0.01184 seeds per pixel; an interior pixel is dropped with
    # prob 1 - (1 - gamma)^9 = 0.1016, border pixels less: expected ~0.0996. The drop count is a
    # sum of ~3100 seeds x <= 9 pixels: std ~ 9 * sqrt(3100) / 262144 = 0.002, so 0.01 is 5 sigma.
    assert abs(frac - 0.1) < 0.01
    # kept values are rescaled by numel / kept over the whole tensor: the sum is preserved
    kept = (~zero).sum().item()
    assert torch.allclose(y[~zero], torch.full((kept,), x.numel() / kept))
    assert abs(y.sum().item() - x.numel()) <= x.numel() * 1e-5
    # dropped pixels come in 3x3 squares: the morphological opening of the drop mask is the mask
    m = zero.float()
    eroded = -F.max_pool2d(-m, 3, 1, 1)
    opened = F.max_pool2d(eroded, 3, 1, 1)
    assert torch.equal(opened, m)
    # an elementwise (Bernoulli) dropout of the same rate would fail that check
    bern = (torch.rand(4, 16, 64, 64) < 0.1).float()
    assert not torch.equal(F.max_pool2d(-F.max_pool2d(-bern, 3, 1, 1), 3, 1, 1), bern)


def test_dropblock_identity_cases_device_cpu():
    db = DropBlock(3, 0.9)
    x = torch.randn(2, 3, 8, 8)
    assert db.eval()(x) is x
    db.train()
    db.enabled = False
    assert db(x) is x
    assert DropBlock(3, 1.0).train()(x) is x
    with pytest.raises(ValueError, match="odd"):
        DropBlock(4, 0.9)
    # a map smaller than the block gets a finite rate (no division by zero)
    assert math.isfinite(DropBlock(3, 0.9).gamma(2, 2))


def test_neck_layout_r50vd_style_device_cpu():
    neck = PPYOLOFPN([8, 16, 32], coord_conv=True, spp=True, drop_block=True, conv_block_num=2,
                     channels=[16, 8, 4], route_channels=[8, 4])
    names = [[n for n, _ in b.body.named_children()] for b in neck.blocks]
    assert names[0] == ["conv0", "conv1", "conv2", "spp", "conv3", "dropblock", "route"]
    assert names[1] == names[2] == ["conv0", "conv1", "dropblock", "conv2", "conv3", "route"]
    b0 = neck.blocks[0].body
    assert isinstance(b0.conv0, CoordConv) and isinstance(b0.conv2, CoordConv) and isinstance(b0.route, CoordConv)
    assert isinstance(b0.conv1, ConvBNLayer) and isinstance(neck.blocks[0].tip, CoordConv)
    assert b0.conv0.conv.conv.in_channels == 32 + 2 and b0.spp.conv.conv.in_channels == 4 * 16
    assert neck.blocks[1].body.conv0.conv.conv.in_channels == 16 + 8 + 2     # C4 + route + coords
    assert neck.out_channels == [32, 16, 8]
    default = PPYOLOFPN([512, 1024, 2048])
    assert default.channels == [512, 256, 128] and default.route_channels == [256, 128]
    r18 = PPYOLOFPN([256, 512], drop_block=True, conv_block_num=0)
    assert r18.channels == [256, 128] and r18.route_channels == [256]
    assert [n for n, _ in r18.blocks[0].body.named_children()] == ["dropblock", "route"]


def test_neck_routes_upsample_and_concatenate_device_cpu():
    """Block i > 0 sees cat([nearest_2x(transition(route_{i-1})), C_i]); the activations are
    leaky ReLU 0.1 (negative outputs exist and equal 0.1 x the BN output)."""
    torch.manual_seed(0)
    neck = PPYOLOFPN([4, 8, 16], coord_conv=False, spp=False, drop_block=False, channels=[8, 4, 2],
                     route_channels=[4, 2]).eval()
    feats = [torch.randn(1, 4, 8, 8), torch.randn(1, 8, 4, 4), torch.randn(1, 16, 2, 2)]
    seen = {}
    neck.blocks[1].register_forward_hook(_grab(seen, "in1"))
    tips = neck(feats)
    assert [tuple(t.shape) for t in tips] == [(1, 16, 2, 2), (1, 8, 4, 4), (1, 4, 8, 8)]
    route0, _ = neck.blocks[0](feats[2])
    up = neck.transitions[0](route0).repeat_interleave(2, 2).repeat_interleave(2, 3)
    torch.testing.assert_close(seen["in1"], torch.cat([up, feats[1]], 1), rtol=0, atol=0)
    unit = neck.blocks[0].body.route
    pre = unit.bn(unit.conv(feats[2]))
    torch.testing.assert_close(unit(feats[2]), torch.where(pre > 0, pre, 0.1 * pre))
    assert (pre < 0).any()


# ---------------------------------------------------------------- head
def test_head_channels_and_objectness_prior_device_cpu():
    head = YOLOv3Head([32, 16], [3, 3], num_classes=80, iou_aware=True, obj_prior=0.01)
    assert [c.out_channels for c in head.outputs] == [3 * 86, 3 * 86]
    bias = head.outputs[0].bias
    obj_idx = [3 + a * 85 + 4 for a in range(3)]
    assert torch.allclose(bias[obj_idx], torch.full((3,), math.log(0.01 / 0.99)))
    assert torch.count_nonzero(bias) == 3
    plain = YOLOv3Head([32], [3], num_classes=20, iou_aware=False, obj_prior=None)
    assert plain.outputs[0].out_channels == 3 * 25 and torch.count_nonzero(plain.outputs[0].bias) == 0


def test_split_level_layout_device_cpu():
    """IoU logits first (one per anchor), then per anchor [tx, ty, tw, th, obj, classes]."""
    na, c = 2, 3
    out = torch.arange(na * (6 + c), dtype=torch.float32).view(1, -1, 1, 1).expand(1, -1, 2, 2)
    p = split_level(out, na, c, iou_aware=True)
    assert p["iou"][0, :, 0, 0].tolist() == [0.0, 1.0]
    assert p["tx"][0, :, 1, 1].tolist() == [2.0, 10.0] and p["obj"][0, :, 0, 1].tolist() == [6.0, 14.0]
    assert p["cls"][0, 1, 0, 0].tolist() == [15.0, 16.0, 17.0]
    with pytest.raises(ValueError, match="needs 18 channels"):
        split_level(out[:, :17], na, c, iou_aware=True)


def test_decode_level_boxes_hand_computed_device_cpu():
    """Cell (row 1, col 0) of a 2x2 grid at stride 32 (64 px image), anchor 16 x 24 px, scale 1.05."""
    out = torch.zeros(1, 5 + 1, 2, 2, dtype=torch.float64)
    tx, ty, tw, th = 0.3, -1.2, 0.5, -0.25
    out[0, :4, 1, 0] = torch.tensor([tx, ty, tw, th], dtype=torch.float64)
    box = decode_level_boxes(split_level(out, 1, 1, False), [[16, 24]], 32, 1.05)[0, 0, 1, 0]
    sig = lambda v: 1 / (1 + math.exp(-v))
    cx = (0 + 1.05 * sig(tx) - 0.025) / 2
    cy = (1 + 1.05 * sig(ty) - 0.025) / 2
    w, h = math.exp(tw) * 16 / 64, math.exp(th) * 24 / 64
    torch.testing.assert_close(box, torch.tensor([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2],
                                                 dtype=torch.float64), rtol=0, atol=1e-15)


# ---------------------------------------------------------------- model
def test_r50vd_preset_structure_and_parameter_count_device_cpu():
    """The paper's PP-YOLO with 80 classes. Expected count from PaddleDetection's layer table:
    backbone as in test_resnet_vd_parameter_counts; neck levels (c = 512, 256, 128; coord convs get
    2 extra inputs) and transitions; head 1x1 convs with bias to 3 * (6 + 80) channels."""
    m = ppyolo_r50vd()
    backbone = 23_508_032 + 19_232 + 3 * (512 * 27 * 9 + 27)
    neck = 0
    for i, (cin, c) in enumerate(zip([2048, 1024 + 256, 512 + 128], [512, 256, 128])):
        neck += (_conv_bn(cin + 2, c, 1) + _conv_bn(c, 2 * c, 3) + _conv_bn(2 * c + 2, c, 1)
                 + _conv_bn(c, 2 * c, 3) + _conv_bn(2 * c + 2, c, 1) + _conv_bn(c + 2, 2 * c, 3))
    neck += _conv_bn(4 * 512, 512, 1)                                   # SPP conv
    neck += _conv_bn(512, 256, 1) + _conv_bn(256, 128, 1)               # transitions
    head = sum(cin * 258 + 258 for cin in (1024, 512, 256))
    assert (_count(m.backbone), _count(m.neck), _count(m.head)) == (backbone, neck, head)
    assert _count(m) == 47_045_559 == backbone + neck + head
    assert m.strides == [32, 16, 8]
    outs = m.eval()(torch.full((1, 3, 64, 64), 128.0))
    assert [tuple(o.shape) for o in outs] == [(1, 258, 2, 2), (1, 258, 4, 4), (1, 258, 8, 8)]


def test_model_normalises_pixels_inside_device_cpu():
    """A constant image at 255 * ImageNet mean reaches the backbone as exact zeros."""
    m = _tiny().eval()
    seen = {}
    m.backbone.register_forward_hook(_grab(seen, "x"))
    x = (torch.tensor([0.485, 0.456, 0.406]) * 255).view(1, 3, 1, 1).expand(2, 3, 64, 32).contiguous()
    m(x)
    assert seen["x"].abs().max().item() < 1e-6
    seen.clear()
    m(torch.full((1, 3, 32, 32), 255.0))
    want = (1.0 - torch.tensor([0.485, 0.456, 0.406])) / torch.tensor([0.229, 0.224, 0.225])
    torch.testing.assert_close(seen["x"][0, :, 5, 7], want, rtol=1e-6, atol=0)
    assert "pixel_mean" not in m.state_dict()                          # non-persistent buffers


def test_model_input_checks_device_cpu():
    m = _tiny()
    with pytest.raises(ValueError, match="not a multiple of the deepest stride 32"):
        m(torch.zeros(1, 3, 80, 64))
    with pytest.raises(ValueError, match=r"\(N, 3, H, W\)"):
        m(torch.zeros(1, 1, 64, 64))


@pytest.mark.parametrize("kwargs,needle", [
    (dict(depth=42), "depth 42"),
    (dict(anchor_masks=[[0, 1, 2], [3, 4, 5]]), "2 masks but the model has 3 output levels"),
    (dict(anchor_masks=[[6, 7, 9], [3, 4, 5], [0, 1, 2]]), r"index anchors \[9\]"),
    (dict(anchor_masks=[[6, 7, 8], [3, 4, 5], [0, 1, 1]]), "twice"),
    (dict(neck_channels=[16, 8]), "channels must give 3"),
    (dict(num_classes=0), "num_classes"),
])
def test_model_bad_arguments_device_cpu(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        _tiny(**kwargs)


def test_meta_rebuilds_same_architecture_and_seed_fixes_weights_device_cpu():
    torch.manual_seed(7)
    m = _tiny(freeze_at=0, iou_thresh=0.5)
    meta = m.meta()
    assert meta["name"] == "ppyolo"
    json.dumps(meta)                                                   # plain Python values only
    torch.manual_seed(7)
    m2 = PPYOLO(**{k: v for k, v in meta.items() if k != "name"})
    assert m2.meta() == meta
    sd1, sd2 = m.state_dict(), m2.state_dict()
    assert sd1.keys() == sd2.keys()
    assert all(torch.equal(sd1[k], sd2[k]) for k in sd1)
    torch.manual_seed(8)
    m3 = PPYOLO(**{k: v for k, v in meta.items() if k != "name"})
    assert not torch.equal(m3.backbone.stem[0].conv.weight, sd1["backbone.stem.0.conv.weight"])
    r18 = ppyolo_r18vd()
    rebuilt = PPYOLO(**{k: v for k, v in r18.meta().items() if k != "name"})
    assert rebuilt.meta() == r18.meta() and rebuilt.strides == [32, 16]
    assert [len(m) for m in rebuilt.anchor_masks] == [3, 3] and rebuilt.meta()["conv_block_num"] == 0


def test_drop_block_switch_device_cpu():
    """In training mode, with DropBlock switched off two forwards are identical (BN in train
    mode is deterministic); switched on they differ; drop_block=False builds no DropBlock."""
    torch.manual_seed(0)
    m = _tiny(keep_prob=0.5).train()
    x = torch.rand(2, 3, 64, 64) * 255
    assert len(m.drop_blocks()) == 3
    m.set_drop_block(False)
    a, b = m(x), m(x)
    assert all(torch.equal(p, q) for p, q in zip(a, b))
    m.set_drop_block(True)
    torch.manual_seed(1)
    c = m(x)
    assert not all(torch.equal(p, q) for p, q in zip(a, c))
    assert _tiny(drop_block=False).drop_blocks() == []


def test_r18vd_preset_full_train_step_device_cpu():
    """The full r18vd preset (80 classes, 2 levels) runs forward + backward on (2, 3, 320, 320):
    10x10 and 20x20 grids, finite loss, a gradient on every trainable parameter."""
    torch.manual_seed(0)
    m = ppyolo_r18vd().train()
    x = torch.rand(2, 3, 320, 320) * 255
    targets = torch.tensor([[[0, .1, .1, .5, .6], [3, .5, .5, .9, .9]], [[1, .2, .3, .4, .5], [-1, 0, 0, 0, 0]]])
    t0 = time.perf_counter()
    outs = m(x)
    loss = m.loss(outs, targets)
    loss["total"].backward()
    elapsed = time.perf_counter() - t0
    assert [tuple(o.shape) for o in outs] == [(2, 255, 10, 10), (2, 255, 20, 20)]
    assert torch.isfinite(loss["total"]) and loss["total"].item() > 0 and loss["iou_aware"].item() == 0.0
    missing = [n for n, p in m.named_parameters() if p.requires_grad and p.grad is None]
    assert missing == []
    assert elapsed < 60.0, f"one r18vd training step took {elapsed:.1f} s"
