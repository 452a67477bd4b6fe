"""Stage transforms and loss invariants (docs/quantization.md, "Stages" and "GNetDet on the chip"):
BN folding keeps the outputs, gain editing keeps every activation code, the loss does not depend
on how a batch is split."""

import copy
import math

import numpy as np
import pytest
import torch

from gnetmdk.dataset.dataset import encode_targets
from gnetmdk.engine.stages import STAGES, apply_stage
from gnetmdk.gti.quantize import activation_codes
from gnetmdk.gti.transforms import fold_bn, fold_requant_multipliers
from gnetmdk.models.gnetdet.model import GNetDet
from gnetmdk.models.gnetdet.loss import gnetdet_loss, safe_sqrt

TINY = dict(num_classes=2, image_size=224, width_mult=0.0625, chip="5801")


pytestmark = pytest.mark.usefixtures("one_thread_module")


def _init_weights(model, seed):
    """He-normal weights and small random biases, so activations stay alive through 16 layers."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for conv in model.convs():
            fan_in = conv.in_channels * 9
            conv.weight.copy_(torch.randn(conv.weight.shape, generator=g) * math.sqrt(2.0 / fan_in))
            conv.bias.copy_(torch.randn(conv.bias.shape, generator=g) * 0.5)
        model.layers[0].conv.weight.mul_(1 / 16.0)           # the input holds codes 0..31


def _codes_input(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 32, (n, 3, 224, 224), generator=g).float()


def _run(model, x):
    """One forward: (model output, every sublayer's output after its pool), via forward hooks."""
    feats = []
    hooks = [layer.register_forward_hook(lambda mod, inp, out: feats.append(out)) for layer in model.layers]
    try:
        with torch.no_grad():
            y = model(x)
    finally:
        for h in hooks:
            h.remove()
    assert len(feats) == len(model.layers)
    return y, feats


# ------------------------------------------------------------------ BN folding
def test_fold_bn_keeps_outputs():
    torch.manual_seed(0)
    model = GNetDet(use_bn=True, **TINY)
    _init_weights(model, 1)
    g = torch.Generator().manual_seed(2)
    n_bn = 0
    with torch.no_grad():
        for layer in model.layers:
            if layer.bn is None:
                continue
            n_bn += 1
            c = layer.bn.num_features
            layer.bn.running_mean.copy_(torch.randn(c, generator=g) * 0.5)
            layer.bn.running_var.copy_(torch.rand(c, generator=g) * 2 + 0.2)
            layer.bn.weight.copy_(torch.rand(c, generator=g) + 0.5)
            layer.bn.bias.copy_(torch.randn(c, generator=g) * 0.3 + 0.2)
    assert n_bn == len(model.layers) - 1                    # the output conv has no BN
    model.eval()
    x = _codes_input(1, 3)
    before, before_all = _run(model, x)
    assert float(before.abs().max()) > 0                    # not a dead network
    assert model.has_bn

    assert fold_bn(model) == n_bn
    assert all(layer.bn is None for layer in model.layers)
    assert not model.has_bn
    after, after_all = _run(model, x)
    rel = float((after - before).norm() / before.norm())
    assert rel < 1e-4, rel
    assert torch.allclose(after, before, rtol=1e-4, atol=1e-4 * float(before.abs().max()))
    for a, b in zip(after_all, before_all):
        assert float((a - b).norm()) <= 1e-4 * float(b.norm()) + 1e-6
    assert fold_bn(model) == 0                              # nothing left to fold


def test_fold_bn_formula_one_layer():
    model = GNetDet(use_bn=True, **TINY)
    layer = model.layers[0]
    with torch.no_grad():
        layer.conv.weight.fill_(1.0)
        layer.conv.bias.fill_(2.0)
        layer.bn.running_mean.fill_(1.0)
        layer.bn.running_var.fill_(4.0 - layer.bn.eps)       # sd = 2
        layer.bn.weight.fill_(3.0)
        layer.bn.bias.fill_(0.5)
    fold_bn(model)
    # W' = 1 * 3 / 2 = 1.5, b' = (2 - 1) * 3 / 2 + 0.5 = 2
    assert torch.allclose(layer.conv.weight, torch.full_like(layer.conv.weight, 1.5))
    assert torch.allclose(layer.conv.bias, torch.full_like(layer.conv.bias, 2.0))


# ------------------------------------------------------------------ gain editing
@pytest.fixture(scope="module")
def calibrated():
    """A BN-free tiny GNetDet with caps measured on one batch of codes (the cal pass)."""
    torch.manual_seed(0)
    model = GNetDet(use_bn=False, **TINY)
    _init_weights(model, 10)
    model.eval()
    apply_stage(model, STAGES["cal"], calibrating=True)
    for conv in model.convs():
        conv.disable_fake_quant()
    from gnetmdk.engine.calibration import measure_caps
    for relu, c in zip(model.relus(), measure_caps(model, lambda: [_codes_input(1, 20)])):
        relu.cap.fill_(c)
    caps = [float(r.cap) for r in model.relus()]
    assert all(c > 0 for c in caps), caps
    assert len(set(caps)) == len(caps)                     # distinct caps: the gain edit does something
    return model


def _step3_model(calibrated, dtype=torch.float32):
    """A copy of the calibrated model in step 3, with float (unquantized) weights."""
    model = copy.deepcopy(calibrated).to(dtype)
    caps = [float(r.cap) for r in model.relus()]
    apply_stage(model, STAGES["step3"])
    for conv in model.convs():
        conv.disable_fake_quant()                           # exact math, no weight rounding
    assert all(r.fake_quant_enabled and not r.integer and not r.observer_enabled for r in model.relus())
    return model, caps


def _to_step4(model, caps):
    """Gain-edit a step-3 model, check the edit itself, and switch it to step 4 (float weights)."""
    w_before = [conv.weight.detach().clone() for conv in model.convs()]
    b_before = [conv.bias.detach().clone() for conv in model.convs()]
    returned = fold_requant_multipliers(model)
    assert returned == caps
    assert all(float(r.cap) == 31.0 for r in model.relus())
    assert float(model.output_scale) == pytest.approx(caps[-1] / 31, rel=1e-6)
    # W_i <- W_i * cap_{i-1} / cap_i (cap_{-1} = 31), b_i <- b_i * 31 / cap_i
    prev = 31.0
    for conv, w0, b0, c in zip(model.convs(), w_before, b_before, caps):
        assert torch.allclose(conv.weight, w0 * prev / c, rtol=1e-6, atol=0)
        assert torch.allclose(conv.bias, b0 * 31.0 / c, rtol=1e-6, atol=0)
        prev = c
    apply_stage(model, STAGES["step4"])
    for conv in model.convs():
        conv.disable_fake_quant()
    model.eval()
    assert all(r.integer and r.fake_quant_enabled for r in model.relus())
    assert all(conv.exact for conv in model.convs())        # step-4 evaluation runs in float64


def _check_step3_codes(feats3, caps):
    codes3 = [activation_codes(f, c) for f, c in zip(feats3, caps)]
    # the step-3 outputs are on the code grid: y = code * cap / 31
    for f, c, k in zip(feats3, caps, codes3):
        assert torch.allclose(f.double(), k.double() * c / 31, rtol=1e-5, atol=1e-6 * c)
    # the test means something: every layer has nonzero codes, and the codes are spread out
    for k in codes3:
        assert int(k.max()) > 0
    assert len(torch.unique(torch.cat([k.reshape(-1) for k in codes3]))) > 20
    return codes3


def test_gain_edit_keeps_codes_layer_by_layer_float32(calibrated):
    """Each step-4 layer, fed the step-3 codes of the layer before, gives the step-3 codes.

    (Layer by layer, because in a float32 chain one code flipped by rounding at a .5 boundary
    changes the inputs of the next layers and the differences spread; the chained check is below,
    in float64.)"""
    model, caps = _step3_model(calibrated)
    x = _codes_input(1, 99)
    feats3 = _run(model, x)[1]
    codes3 = _check_step3_codes(feats3, caps)
    _to_step4(model, caps)
    total = same = 0
    with torch.no_grad():
        for i, layer in enumerate(model.layers):
            inp = x if i == 0 else codes3[i - 1].float()
            out = layer(inp)
            # step-4 activations are the integer codes themselves
            assert torch.equal(out, torch.round(out)) and float(out.min()) >= 0 and float(out.max()) <= 31
            k4 = out.long()
            agree = float((k4 == codes3[i]).double().mean())
            assert agree >= 0.999, (i, agree)
            assert int((k4 - codes3[i]).abs().max()) <= 1
            total += k4.numel()
            same += int((k4 == codes3[i]).sum())
    assert same / total >= 0.9999


def test_gain_edit_keeps_codes_and_outputs_chained_float64(calibrated):
    model, caps = _step3_model(calibrated, torch.float64)
    x = _codes_input(1, 98).double()
    y3, feats3 = _run(model, x)
    codes3 = _check_step3_codes(feats3, caps)
    _to_step4(model, caps)
    y4, feats4 = _run(model, x)
    for i, (f4, k3) in enumerate(zip(feats4, codes3)):
        assert torch.equal(f4, torch.round(f4)), f"layer {i}: not integer"
        agree = float((f4.long() == k3).double().mean())
        assert agree >= 0.999, (i, agree)
    # host output: code * cap_last / 31 in both steps (step 4 through output_scale)
    assert y4.shape == y3.shape == (1, 14, 14, 12)
    assert float(y3.abs().max()) > 0
    assert float((y4 - y3).norm() / y3.norm()) < 1e-4
    assert float(torch.isclose(y4, y3, rtol=1e-4, atol=1e-6).double().mean()) >= 0.999


def _quantized_step3(calibrated, gain_aware):
    model, caps = _step3_model(calibrated)
    model.gain_aware = gain_aware
    for conv in model.convs():
        conv.enable_fake_quant()
    return model, caps


def test_gain_aware_step3_is_step4_bit_for_bit(calibrated):
    """Gain-aware step 3 computes the step-4 model itself: the integers gain editing will store,
    integer codes between the layers, the host scale cap_last / 31. After the gain edit every layer's
    codes and the output are equal bit for bit, in eval mode (exact convolutions) and in training
    mode (the same float32 arithmetic), and the gradients reach the unedited weights through the
    gain (chain rule: d/dW = d/dW_edit * cap_in / cap_out)."""
    model, caps = _quantized_step3(calibrated, True)
    x = _codes_input(2, 97)
    model.eval()
    y3, feats3 = _run(model, x)
    assert all(conv.gain is not None for conv in model.convs())
    assert all(r.code_domain for r in model.relus())
    for f in feats3:                           # step-3 activations are the integer codes themselves
        assert torch.equal(f, torch.round(f)) and float(f.min()) >= 0 and float(f.max()) <= 31
    assert all(int(f.max()) > 0 for f in feats3)
    assert len(torch.unique(torch.cat([f.reshape(-1) for f in feats3]))) == 32   # all codes occur
    step3_params = [conv.quantized_params() for conv in model.convs()]
    model.train()
    y3_train = model(x)
    (y3_train * torch.linspace(-1, 1, y3_train.numel()).reshape(y3_train.shape)).sum().backward()
    g3 = [conv.weight.grad.clone() for conv in model.convs()]
    gb3 = [conv.bias.grad.clone() for conv in model.convs()]

    model.zero_grad()
    fold_requant_multipliers(model)
    apply_stage(model, STAGES["step4"])
    assert all(conv.gain is None for conv in model.convs())      # cleared by fold_requant_multipliers / apply_stage
    assert not model.set_gains() and not any(r.code_domain for r in model.relus())   # off in step 4
    for conv, (w3, b3, s3) in zip(model.convs(), step3_params):
        w4, b4, s4 = conv.integer_params()                         # what the chip will store
        assert s3 == s4
        assert torch.equal(w3.detach().double() * 2 ** s4, w4.double())
        assert torch.equal(b3.detach().double() * 2 ** s4, b4.double())
    model.eval()
    y4, feats4 = _run(model, x)
    for i, (f3, f4) in enumerate(zip(feats3, feats4)):
        assert torch.equal(f3, f4), f"layer {i}: {int((f3 != f4).sum())} codes differ"
    assert torch.equal(y3, y4)
    model.train()
    y4_train = model(x)
    assert torch.equal(y3_train.detach(), y4_train.detach())
    (y4_train * torch.linspace(-1, 1, y4_train.numel()).reshape(y4_train.shape)).sum().backward()
    prev = 31.0
    for i, (conv, gw, gb, c) in enumerate(zip(model.convs(), g3, gb3, caps)):
        assert float(gw.abs().max()) > 0, f"layer {i}: no gradient"
        torch.testing.assert_close(gw, conv.weight.grad * (prev / c), rtol=1e-5, atol=1e-6 * float(gw.abs().max()))
        torch.testing.assert_close(gb, conv.bias.grad * (31.0 / c), rtol=1e-5, atol=1e-6 * float(gb.abs().max()))
        prev = c


def test_learned_caps_get_gradients_and_step4_stays_exact(calibrated):
    """With caps that require grad (step 3, cap_lr > 0) the forward and the weights' gradients are
    those of fixed caps, every cap gets a finite nonzero gradient (through the gains and, for the
    last, the host scale), and after an update of weights and caps the gain-edited step-4 model
    still gives step 3's codes and outputs bit for bit."""
    model, caps = _quantized_step3(calibrated, True)
    x = _codes_input(2, 96)
    weights = torch.linspace(-1, 1, 2 * 14 * 14 * 12).reshape(2, 14, 14, 12)
    model.train()
    y_fixed = model(x)
    (y_fixed * weights).sum().backward()
    g_fixed = [c.weight.grad.clone() for c in model.convs()]
    model.zero_grad()
    for r in model.relus():
        r.cap.requires_grad_(True)
    y = model(x)
    assert all(c.gain_tensors is not None for c in model.convs())
    assert torch.equal(y.detach(), y_fixed.detach())
    (y * weights).sum().backward()
    for c, g in zip(model.convs(), g_fixed):
        torch.testing.assert_close(c.weight.grad, g, rtol=1e-6, atol=1e-7 * float(g.abs().max()))
    cap_grads = [r.cap.grad for r in model.relus()]
    assert all(g is not None and torch.isfinite(g) and float(g) != 0.0 for g in cap_grads), cap_grads
    copy.deepcopy(model)                   # after a training forward (the EMA and tools copy models)
    # one SGD step on weights and caps, then the step 3 -> step 4 transition
    with torch.no_grad():
        for c in model.convs():
            c.weight.sub_(1e-3 * c.weight.grad)
        for r in model.relus():
            r.cap.sub_(1e-2 * torch.sign(r.cap.grad))
    new_caps = [float(r.cap.detach()) for r in model.relus()]
    assert all(abs(a - b) > 1e-3 for a, b in zip(new_caps, caps))
    model.eval()
    y3, f3 = _run(model, x)
    for r in model.relus():
        r.cap.requires_grad_(False)
    assert fold_requant_multipliers(model) == new_caps
    apply_stage(model, STAGES["step4"])
    model.eval()
    y4, f4 = _run(model, x)
    assert all(torch.equal(a, b) for a, b in zip(f3, f4))
    assert torch.equal(y3, y4)


def test_gti_flow_step4_changes_the_step3_codes(calibrated):
    """GTI's flow (gain_aware false) quantizes the unedited weights in step 3 and re-quantizes the
    edited ones at other shifts in step 4: the integers change and so do many codes."""
    model, caps = _quantized_step3(calibrated, False)
    x = _codes_input(1, 97)
    with torch.no_grad():
        feats3 = _run(model, x)[1]
    assert all(conv.gain is None for conv in model.convs())
    assert not any(r.code_domain for r in model.relus())
    codes3 = [activation_codes(f, c) for f, c in zip(feats3, caps)]      # step 3 holds values
    step3_params = [conv.quantized_params() for conv in model.convs()]
    fold_requant_multipliers(model)
    apply_stage(model, STAGES["step4"])
    model.eval()
    prev, same_ints = 31.0, []
    for conv, (w3, b3, s3), c in zip(model.convs(), step3_params, caps):
        w4, b4, s4 = conv.integer_params()
        same_ints.append(s3 == s4 and torch.equal(torch.round(w3.double() * prev / c * 2 ** s4).long(), w4)
                         and torch.equal(torch.round(b3.double() * 31 / c * 2 ** s4).long(), b4))
        prev = c
    agree = []
    with torch.no_grad():
        for i, layer in enumerate(model.layers):
            inp = x if i == 0 else codes3[i - 1].float()
            k4 = layer(inp).long()
            agree.append(float((k4 == codes3[i]).double().mean()))
    assert not all(same_ints)
    assert min(agree) < 0.95, agree


def test_gain_edit_through_stage_hook_matches_direct_call(calibrated):
    model_a, caps = _step3_model(calibrated)
    model_b, _ = _step3_model(calibrated)
    fold_requant_multipliers(model_a)
    for hook in STAGES["step4"].enter:                       # fold (no-op) then gain edit
        hook(model_b, "step3")
    for ca, cb in zip(model_a.convs(), model_b.convs()):
        assert torch.equal(ca.weight, cb.weight) and torch.equal(ca.bias, cb.bias)
    assert torch.equal(model_a.output_scale, model_b.output_scale)


def test_gain_edit_refuses_uncalibrated_model():
    model = GNetDet(use_bn=False, **TINY)
    w0 = model.layers[0].conv.weight.detach().clone()
    with pytest.raises(RuntimeError, match="cap"):
        fold_requant_multipliers(model)
    # one missing cap is enough
    for r in model.relus():
        r.cap.fill_(5.0)
    model.relus()[3].cap.fill_(0.0)
    with pytest.raises(RuntimeError, match="cap"):
        fold_requant_multipliers(model)
    assert torch.equal(model.layers[0].conv.weight, w0)     # refused before editing anything
    assert float(model.relus()[0].cap) == 5.0


def test_gain_edit_refuses_model_with_bn():
    model = GNetDet(use_bn=True, **TINY)
    for r in model.relus():
        r.cap.fill_(5.0)
    w0 = model.layers[0].conv.weight.detach().clone()
    with pytest.raises(RuntimeError, match="BatchNorm"):
        fold_requant_multipliers(model)
    assert torch.equal(model.layers[0].conv.weight, w0)
    assert all(float(r.cap) == 5.0 for r in model.relus())


# ------------------------------------------------------------------ loss
GRID, C = 14, 2


def _targets(n, seed):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        k = int(rng.integers(1, 4))
        xy = rng.uniform(0.0, 0.6, size=(k, 2))
        wh = rng.uniform(0.05, 0.4, size=(k, 2))
        boxes = np.concatenate([xy, xy + wh], axis=1).astype(np.float32)
        labels = rng.integers(0, C, size=k)
        out.append(encode_targets(boxes, labels, GRID, C))
    return torch.from_numpy(np.stack(out))


def _one_object_target(n, w, h):
    """(n, GRID, GRID, 10 + C) targets: image 0 holds one class-0 object centred in cell (3, 4), size w x h."""
    target = torch.zeros(n, GRID, GRID, 10 + C)
    target[0, 3, 4, 0:5] = torch.tensor([0.5, 0.5, w, h, 1.0])
    target[0, 3, 4, 5:10] = target[0, 3, 4, 0:5]
    target[0, 3, 4, 10] = 1.0
    return target


def test_loss_split_invariance():
    target = _targets(8, 0)
    assert target.shape == (8, GRID, GRID, 10 + C)
    assert int((target[..., 4] > 0).sum()) >= 8
    g = torch.Generator().manual_seed(1)
    pred = torch.rand(8, GRID, GRID, 10 + C, generator=g)
    # make some object cells' predictions close to their targets so both slots get used
    pred[:4] = 0.5 * pred[:4] + 0.5 * target[:4]
    full = gnetdet_loss(pred, target)
    a = gnetdet_loss(pred[:4], target[:4])
    b = gnetdet_loss(pred[4:], target[4:])
    assert set(full) == {"loc", "conf", "noresp", "noobj", "cls", "total"}
    for key in full:
        half_mean = (float(a[key]) + float(b[key])) / 2
        assert float(full[key]) == pytest.approx(half_mean, rel=1e-6, abs=1e-7), key
        assert float(full[key]) > 0, key
    # the two halves differ, so a wrong normaliser would show
    assert abs(float(a["total"]) - float(b["total"])) > 1e-3
    # uneven split too: 8 = 2 + 6 -> weighted mean
    c = gnetdet_loss(pred[:2], target[:2])
    d = gnetdet_loss(pred[2:], target[2:])
    for key in full:
        assert float(full[key]) == pytest.approx((2 * float(c[key]) + 6 * float(d[key])) / 8, rel=1e-6, abs=1e-7)


def test_loss_total_is_sum_and_weights_apply():
    target = _targets(4, 3)
    pred = torch.rand(4, GRID, GRID, 10 + C, generator=torch.Generator().manual_seed(4))
    base = gnetdet_loss(pred, target, l_coord=1.0, l_noobj=1.0, l_class=1.0)
    weighted = gnetdet_loss(pred, target, l_coord=5.0, l_noobj=0.005, l_class=2.0)
    assert float(weighted["loc"]) == pytest.approx(5 * float(base["loc"]), rel=1e-6)
    assert float(weighted["noobj"]) == pytest.approx(0.005 * float(base["noobj"]), rel=1e-6)
    assert float(weighted["cls"]) == pytest.approx(2 * float(base["cls"]), rel=1e-6)
    parts = sum(float(weighted[k]) for k in ("loc", "conf", "noresp", "noobj", "cls"))
    assert float(weighted["total"]) == pytest.approx(parts, rel=1e-6)


def test_loss_of_perfect_prediction():
    target = _targets(4, 7)
    pred = target.clone()
    obj = target[..., 4] > 0
    pred[..., 4][obj] = 1.0
    pred[..., 9][obj] = 1.0
    terms = gnetdet_loss(pred, target)
    assert float(terms["loc"]) == 0.0
    assert float(terms["cls"]) == 0.0
    assert float(terms["noobj"]) == 0.0                      # empty cells predict 0
    assert float(terms["conf"]) < 1e-6                      # IoU of identical boxes is 1
    # the second slot of every object cell predicts conf 1 toward 0: smooth-L1(1) = 0.5 per object cell
    per_image = obj.reshape(4, -1).sum(1).double()
    assert float(terms["noresp"]) == pytest.approx(0.5 * float(per_image.mean()), rel=1e-6)
    # a shifted box is not perfect
    worse = pred.clone()
    worse[..., 0][obj] = (worse[..., 0][obj] + 0.3) % 1.0
    worse[..., 5][obj] = (worse[..., 5][obj] + 0.3) % 1.0
    assert float(gnetdet_loss(worse, target)["loc"]) > 0


def test_loss_refuses_bad_shapes():
    with pytest.raises(ValueError):
        gnetdet_loss(torch.zeros(2, 14, 14, 12), torch.zeros(2, 14, 14, 11))
    with pytest.raises(ValueError):
        gnetdet_loss(torch.zeros(2, 14, 14, 10), torch.zeros(2, 14, 14, 10))


def test_one_box_slot_keeps_slot_1_responsible():
    # one object cell whose second slot matches the target and whose first is off by a cell:
    # YOLOv1's rule (box_slots 2) makes slot 2 responsible, box_slots 1 keeps slot 1 responsible
    target = _one_object_target(1, 0.2, 0.2)
    pred = torch.zeros(1, GRID, GRID, 10 + C)
    pred[0, 3, 4, 0:5] = torch.tensor([0.9, 0.9, 0.1, 0.3, 0.7])     # IoU with the target ~0.05
    pred[0, 3, 4, 5:10] = torch.tensor([0.5, 0.5, 0.2, 0.2, 0.4])    # the target itself: IoU 1
    two = gnetdet_loss(pred, target, box_slots=2)
    one = gnetdet_loss(pred, target, box_slots=1)
    assert float(two["loc"]) == pytest.approx(0.0, abs=1e-7)          # slot 2 responsible and exact
    # box_slots 1: the localisation error of slot 1 (x, y off by 0.4 each, sqrt w / sqrt h)
    import math
    sl1 = lambda d: 0.5 * d * d if abs(d) < 1 else abs(d) - 0.5
    loc1 = sl1(0.4) + sl1(0.4) + sl1(math.sqrt(0.1) - math.sqrt(0.2)) + sl1(math.sqrt(0.3) - math.sqrt(0.2))
    assert float(one["loc"]) == pytest.approx(5.0 * loc1, rel=1e-5)
    # slot 2's confidence (0.4) is trained toward 0 in the noresp term: smooth-L1(0.4) = 0.08
    assert float(one["noresp"]) == pytest.approx(0.08, rel=1e-5)
    assert float(two["noresp"]) == pytest.approx(sl1(0.7), rel=1e-5)
    # slot 2's outputs get no localisation gradient with one slot
    p = pred.clone().requires_grad_(True)
    gnetdet_loss(p, target, box_slots=1)["loc"].backward()
    assert bool((p.grad[0, 3, 4, 5:10] == 0).all()) and bool((p.grad[0, 3, 4, 0:4] != 0).all())
    with pytest.raises(ValueError, match="box_slots"):
        gnetdet_loss(pred, target, box_slots=3)


def test_safe_sqrt_values_and_bounded_slope():
    tau = 1e-2
    x = torch.tensor([0.0, 0.0025, 0.005, tau, 0.04, 0.25, 1.0], dtype=torch.float64, requires_grad=True)
    y = safe_sqrt(x, tau)
    # exact sqrt from tau up; below it the tangent at tau: sqrt(tau) + (x - tau) / (2 sqrt(tau))
    assert y[3:].tolist() == pytest.approx([0.1, 0.2, 0.5, 1.0], rel=1e-12)
    assert y[:3].tolist() == pytest.approx([0.05, 0.0625, 0.075], rel=1e-12)
    y.sum().backward()
    assert x.grad.tolist() == pytest.approx([5.0, 5.0, 5.0, 5.0, 2.5, 1.0, 0.5], rel=1e-12)


def test_loss_size_gradient_is_bounded_at_zero():
    # an object cell whose size outputs are 0 (the output ReLU at its floor): the size term's gradient
    # is l_coord * (sqrt(tau)/2 - sqrt(t)) * 5 per output, not the ~250x of sqrt(w + 1e-6)
    target = _one_object_target(1, 0.36, 0.16)
    pred = target.clone()
    pred[0, 3, 4, 2:4] = 0.0
    pred[0, 3, 4, 7:9] = 0.0
    pred.requires_grad_()
    gnetdet_loss(pred, target, l_coord=5.0)["loc"].backward()
    g = pred.grad[0, 3, 4]
    # ties in IoU pick slot 0 as the responsible box
    assert float(g[2]) == pytest.approx(5.0 * (0.05 - 0.6) * 5.0, rel=1e-5)
    assert float(g[3]) == pytest.approx(5.0 * (0.05 - 0.4) * 5.0, rel=1e-5)
    assert float(pred.grad.abs().max()) <= 5.0 * 0.6 * 5.0 + 1e-4


def test_logit_head_scores_and_clipped_cross_entropy():
    from gnetmdk.models.gnetdet.head import output_scores
    from gnetmdk.models.gnetdet.loss import LOGIT_MAX, logit_bce
    y = torch.tensor([0.0, 0.5, 1.0, 2.0])
    conf, cls = output_scores(y, y, "logit", score_offset=0.5, score_scale=10.0)
    expect = torch.sigmoid(torch.tensor([-5.0, 0.0, 5.0, 15.0]))
    assert torch.allclose(conf, expect) and torch.allclose(cls, expect)
    # an output the ReLU switched off costs 0 for a negative target, any offset and scale
    assert float(logit_bce(torch.zeros(1), torch.zeros(1), 0.5, 10.0)) == 0.0
    # the loss equals softplus(z) - t z - (1 - t) softplus(-k b) below the clip
    yy = torch.tensor([0.2, 0.7], dtype=torch.float64)
    t = torch.tensor([1.0, 0.0], dtype=torch.float64)
    z = 10.0 * (yy - 0.5)
    ref = torch.nn.functional.softplus(z) - t * z - (1 - t) * torch.nn.functional.softplus(
        torch.tensor(-5.0, dtype=torch.float64))
    assert torch.allclose(logit_bce(yy, t, 0.5, 10.0), ref)
    # above LOGIT_MAX a positive gets no upward push; a negative is still pushed down
    hi = torch.tensor([0.5 + (LOGIT_MAX + 2) / 10.0] * 2, requires_grad=True)
    logit_bce(hi, torch.tensor([1.0, 0.0]), 0.5, 10.0).sum().backward()
    assert float(hi.grad[0]) == 0.0
    assert float(hi.grad[1]) == pytest.approx(10.0 * float(torch.sigmoid(torch.tensor(LOGIT_MAX))), rel=1e-5)
    # below the clip the positive's gradient is k (p - 1) < 0
    lo = torch.tensor([0.6], requires_grad=True)
    logit_bce(lo, torch.tensor([1.0]), 0.5, 10.0).sum().backward()
    assert float(lo.grad[0]) == pytest.approx(10.0 * (float(torch.sigmoid(torch.tensor(1.0))) - 1), rel=1e-5)


def test_range_term_bounds_untrained_outputs():
    from gnetmdk.models.gnetdet.loss import LOGIT_MAX
    target = _one_object_target(2, 0.3, 0.3)
    pred = torch.zeros(2, GRID, GRID, 10 + C)
    y_max = 0.5 + LOGIT_MAX / 10.0                       # 1.1
    pred[0, 3, 4, 10:] = 3.0                             # an object cell's classes: trained by cls, not range
    pred[0, 3, 4, 0:4] = torch.tensor([0.5, 0.5, 0.3, 0.3])   # slot 0 matches the target: responsible ...
    pred[0, 3, 4, 7] = 1.5                               # ... so slot 1 is free: its w above 1 counts
    pred[0, 0, 0, 10] = y_max + 0.5                      # empty cells' class outputs above the clip point
    pred[1, 5, 5, 11] = y_max + 1.0
    pred[1, 6, 6, 10] = y_max - 0.05                     # below: free
    pred[1, 2, 2, 2] = 1.2                               # an empty cell's box outputs (slot 0 w, slot 1 x)
    pred[1, 2, 2, 5] = 3.0
    pred[1, 2, 2, 9] = 3.0                               # conf: trained by noobj, not range
    kw = dict(score_head="logit", score_offset=0.5, score_scale=10.0)
    assert "range" not in gnetdet_loss(pred, target, **kw)                       # off by default
    terms = gnetdet_loss(pred, target, l_range=2.0, **kw)
    # image 0: 0.5^2 (class) + 0.5^2 (free slot w); image 1: 1.0^2 (class) + 0.2^2 + 2.0^2 (boxes)
    img0, img1 = 0.25 + 0.25, 1.0 + 0.04 + 4.0
    assert float(terms["range"]) == pytest.approx(2.0 * (img0 + img1) / 2, rel=1e-5)
    # the linear head bounds class outputs at 1 (its largest target) instead of the logit clip point
    lin = gnetdet_loss(pred, target, l_range=2.0)
    lin0 = 0.6 ** 2 + 0.25                               # class output 1.6, free slot w 1.5
    lin1 = 1.1 ** 2 + 0.05 ** 2 + 0.04 + 4.0            # class outputs 2.1 and 1.05, boxes as above
    assert float(lin["range"]) == pytest.approx(2.0 * (lin0 + lin1) / 2, rel=1e-5)
    # gradient only on the hinged outputs
    p = pred.clone().requires_grad_(True)
    gnetdet_loss(p, target, l_range=1.0, **kw)["range"].backward()
    hinged = torch.zeros_like(pred, dtype=torch.bool)
    for idx in [(0, 3, 4, 7), (0, 0, 0, 10), (1, 5, 5, 11), (1, 2, 2, 2), (1, 2, 2, 5)]:
        hinged[idx] = True
    assert bool((p.grad[hinged] > 0).all()) and bool((p.grad[~hinged] == 0).all())
    terms = gnetdet_loss(pred, target, l_range=2.0, **kw)
    parts = sum(float(terms[k]) for k in ("loc", "conf", "noresp", "noobj", "cls", "range"))
    assert float(terms["total"]) == pytest.approx(parts, rel=1e-6)


def test_range_equalization_keeps_the_float_network_and_narrows_the_channels_device_cpu():
    """equalize_channel_ranges on a tiny GNetDet in float64 (weights not quantized): the outputs stay
    within float64 rounding (each value passes through at most 16 products and quotients, relative
    error about 16 x 2^-53 per path: 1e-12 of the output's scale is far above it), every channel's
    range becomes r_c s_c (to the observers' float32 rounding) with s_c = clip((R / r_c)^alpha, 1,
    max_scale), the largest channel keeps
    its range, the last conv is never scaled, and bad arguments are refused."""
    from gnetmdk.gti.transforms import equalize_channel_ranges
    from gnetmdk.layers.observers import ChannelMaxObserver, observe_inputs
    torch.manual_seed(0)
    model = GNetDet(use_bn=False, **TINY).double()
    _init_weights(model, 11)
    model.eval()
    apply_stage(model, STAGES["cal"], calibrating=True)
    for conv in model.convs():
        conv.disable_fake_quant()
    x = _codes_input(2, 21).double()
    relus, convs = list(model.relus()), list(model.convs())

    def ranges():
        obs = [ChannelMaxObserver() for _ in relus]
        with observe_inputs(relus, obs), torch.no_grad():
            out = model(x)
        return out, [o.value.double().clamp_min(0) for o in obs]

    before, r = ranges()
    with torch.no_grad():
        convs[2].weight[3].zero_()
        convs[2].bias[3] = -1.0                               # a dead channel: range 0, scale 1
    before, r = ranges()
    last_w = convs[-1].weight.detach().clone()
    scales = equalize_channel_ranges(convs, r, alpha=0.5, max_scale=4.0)
    after, r2 = ranges()
    assert len(scales) == len(convs) - 1
    assert float((after - before).abs().max()) <= 1e-12 * float(before.abs().max())
    for i, s in enumerate(scales):
        top = r[i].max()
        want = torch.where(r[i] > 0, (top / r[i].clamp_min(1e-300)).sqrt().clamp(1.0, 4.0), torch.ones_like(r[i]))
        assert torch.allclose(s, want, rtol=1e-12, atol=0)
        # the observers keep float32 maxima: each range carries a relative rounding of 2^-24
        assert torch.allclose(r2[i], r[i] * s, rtol=2 ** -22, atol=1e-12)
        assert float(r2[i].max()) == pytest.approx(float(top), rel=2 ** -22)
    assert float(scales[2][3]) == 1.0 and float(r2[2][3]) == 0.0
    assert max(float(s.max()) for s in scales) > 1.5           # it did something
    assert torch.equal(convs[-1].weight.sum(0), (last_w / scales[-1].view(1, -1, 1, 1)).sum(0))
    with pytest.raises(ValueError, match="alpha must be in"):
        equalize_channel_ranges(convs, r, alpha=1.5)
    with pytest.raises(ValueError, match="max_scale must be"):
        equalize_channel_ranges(convs, r, max_scale=0.5)
    with pytest.raises(ValueError, match="conv 0 has"):
        equalize_channel_ranges(convs, [r[0][:-1]] + r[1:])


def test_calibration_with_equalization_measures_caps_of_the_equalized_model_device_cpu():
    """calibrate_caps with ``equalize`` scales the convs before measuring: the caps are those
    measure_caps gives on the equalized model, and the layer maxima are unchanged by the scaling."""
    from gnetmdk.engine.calibration import calibrate_caps, measure_caps
    from gnetmdk.models.calibration import equalize_ranges
    torch.manual_seed(0)
    model = GNetDet(use_bn=False, **TINY)
    _init_weights(model, 12)
    twin = copy.deepcopy(model)
    batches = lambda: [_codes_input(1, 22), _codes_input(1, 23)]
    caps = calibrate_caps(model, batches, "mse", equalize=0.5, equalize_max_scale=8.0)
    twin.eval()
    apply_stage(twin, STAGES["cal"], calibrating=True)
    for relu in twin.relus():
        relu.cap.zero_()
    plain_max = measure_caps(copy.deepcopy(twin), batches, "percentile")   # percentile 99 caps: any statistic
    scales = equalize_ranges(twin, batches, 0.5, 8.0)
    assert max(float(s.max()) for s in scales) > 1.0
    assert caps == measure_caps(twin, batches, "mse")
    for a, b in zip(model.convs(), twin.convs()):
        assert torch.equal(a.weight, b.weight) and torch.equal(a.bias, b.bias)
    assert plain_max != measure_caps(twin, batches, "percentile")         # the scaling moved the 99th percentiles


def test_bias_correction_matches_the_float_activations_channel_means_device_cpu():
    """correct_biases after calibration (caps halved, so clipping shifts the means far): measured again
    afterwards by full forwards, at the positions where the cal model (float activations) is active,
    every channel's mean pre-activation in the step-3 model (5-bit activations) equals the cal model's
    to within one step of the quantized bias (2^-shift, times cap_out / 31 in the code domain of
    gain-aware step 3): each layer's shift is exact in float64, only the bias's rounding to the chip's
    grid remains, and correcting a later layer does not move an earlier one's input. Before the
    correction most layers are off by more than ten steps; the caps do not change, the weights do not
    move, and step 3's mode is left set."""
    from gnetmdk.models.calibration import calibrate_caps, correct_biases
    torch.manual_seed(0)
    model = GNetDet(use_bn=False, **TINY)
    _init_weights(model, 13)
    batches = lambda: [_codes_input(2, 24), _codes_input(2, 25)]
    caps = calibrate_caps(model, batches, "mse")
    caps = [float(torch.tensor(c * 0.5, dtype=torch.float32)) for c in caps]
    for r, c in zip(model.relus(), caps):
        r.cap.fill_(c)
    reference = copy.deepcopy(model)
    apply_stage(reference, STAGES["cal"])
    reference.eval()
    weights = [c.weight.detach().clone() for c in model.convs()]

    def pre_activations(m):
        seen = [[] for _ in m.relus()]
        hooks = [r.register_forward_pre_hook(lambda mod, a, k=k: seen[k].append(a[0].double()))
                 for k, r in enumerate(m.relus())]
        with torch.no_grad():
            for x in batches():
                m(x)
        for h in hooks:
            h.remove()
        return [torch.cat(v) for v in seen]

    def errors_and_steps():
        apply_stage(model, STAGES["step3"])
        model.eval()
        out = []
        for r, c, ref, q in zip(model.relus(), model.convs(), pre_activations(reference), pre_activations(model)):
            unit = float(r.cap) / 31 if r.code_domain else 1.0
            active = ref > 0
            n = active.double().sum(dim=(0, 2, 3))
            d = torch.where(active, ref - q * unit, torch.zeros((), dtype=torch.float64)).sum(dim=(0, 2, 3))
            err = torch.where(n > 0, d / n.clamp_min(1), torch.zeros_like(d))
            out.append((float(err.abs().max()), 2.0 ** -int(c.quantized_params()[2]) * unit))
        return out

    before = errors_and_steps()
    assert sum(e > 10 * s for e, s in before) >= 8
    shifts = correct_biases(model, batches)
    assert len(shifts) == len(caps) and next(iter(model.relus())).fake_quant_enabled and not model.training
    assert [float(r.cap) for r in model.relus()] == caps
    assert all(torch.equal(w, c.weight) for w, c in zip(weights, model.convs()))
    for i, (e, s) in enumerate(errors_and_steps()):
        assert e <= s, f"layer {i}: {e} > {s}"
    assert max(float(t.abs().max()) for t in shifts) > 0.05
