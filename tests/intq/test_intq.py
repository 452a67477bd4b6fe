"""gnetmdk.intq on PP-YOLO (device cpu): BatchNorm folding, fake quantizers, calibration ranges, the
integer program against its fake-quantized model and against its ONNX export."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gnetmdk.intq.calibrate import calibrate_ranges, range_from_histogram
from gnetmdk.intq.fake import ActQuant, act_qparams, fake_quant_weight, quantize_weight, weight_scales
from gnetmdk.intq.program import ProgramError, _requant, requant_multipliers, run_program
from gnetmdk.models.ppyolo.model import ppyolo_r18vd

torch.set_num_threads(1)


def _model(seed=0, **kw):
    """A small r18vd whose BatchNorms hold non-trivial statistics (a few training-mode forwards)."""
    torch.manual_seed(seed)
    m = ppyolo_r18vd(num_classes=3, **kw)
    g = torch.Generator().manual_seed(seed)
    m.train()
    with torch.no_grad():
        for _ in range(2):
            m(torch.randint(0, 256, (2, 3, 64, 64), generator=g).float())
        for mod in m.modules():
            if isinstance(mod, torch.nn.BatchNorm2d):
                mod.weight.uniform_(0.5, 1.5, generator=g)
                mod.bias.uniform_(-0.3, 0.3, generator=g)
    return m.eval()


def _images(n=2, size=64, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, size, size), generator=g).float()


def test_fold_bn_keeps_the_float_model_device_cpu():
    """Folding reorders one multiplication per layer (W * inv instead of BN after the conv): a few
    float32 ulps per layer, amplified through ~20 layers; 1e-4 of the outputs' scale bounds it."""
    m = _model()
    x = _images()
    ref = m(x)
    assert m.prepare_quant(8, "max") == 28
    assert not any(isinstance(mod, torch.nn.BatchNorm2d) for mod in m.modules())
    m.set_quant_mode(False, "off", False)
    for a, b in zip(ref, m(x)):
        assert (a - b).abs().max() <= 1e-4 * a.abs().max()
    assert m.meta()["quant"] == {"weight_bits": 8, "weight_scale": "max"}


def test_weight_scales_and_codes_device_cpu():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4, 3, 3, 3, generator=g)
    s = weight_scales(w, 8, "max")
    assert torch.allclose(s, w.abs().flatten(1).amax(1) / 127)
    q = quantize_weight(w, s, 8)
    assert q.abs().max() == 127 and torch.equal(q, q.round())
    for bits in (4, 6):
        s_mse, s_max = weight_scales(w, bits, "mse"), weight_scales(w, bits, "max")
        err = lambda sc: ((quantize_weight(w, sc, bits) * sc.view(-1, 1, 1, 1) - w) ** 2).flatten(1).sum(1)
        assert (err(s_mse) <= err(s_max)).all()                    # the max scale is one of the candidates
        assert quantize_weight(w, s_mse, bits).abs().max() <= 2 ** (bits - 1) - 1
    # straight-through: the gradient reaches W unchanged
    w.requires_grad_(True)
    fake_quant_weight(w, 4, "mse").sum().backward()
    assert torch.equal(w.grad, torch.ones_like(w))


def test_act_quant_codes_and_clipped_straight_through_device_cpu():
    q = ActQuant()
    q.min_val.fill_(-1.0)
    q.max_val.fill_(3.0)
    s, z = q.qparams()
    assert s == pytest.approx(4 / 255) and z == 64 and act_qparams(0.0, 0.0) == (1.0, 0)
    q.enable_fake_quant()
    x = torch.tensor([-2.0, -1.0, 0.0, 0.5, 2.9, 5.0], requires_grad=True)
    y = q(x)
    codes = torch.round(y / s + z)
    assert torch.equal(codes, torch.tensor([0.0, 0.0, 64.0, float(math.floor(0.5 / s + 0.5) + 64), 
                                            float(math.floor(2.9 / s + 0.5) + 64), 255.0]))
    assert y[2] == 0.0                                             # zero is exact
    y.sum().backward()
    assert torch.equal(x.grad, torch.tensor([0.0, 1.0, 1.0, 1.0, 1.0, 0.0]))


def test_act_quant_switches_observers_and_checkpoint_names_device_cpu():
    """torch.ao's contract: the switches are buffers (moved and broadcast with the model, not saved),
    set with enable_/disable_; an enabled observer sees each input and leaves it unchanged; a state
    dict that names the range lo / hi (earlier checkpoints) loads into min_val / max_val."""
    import copy
    from gnetmdk.intq.calibrate import HistogramObserver, MinMaxObserver
    q = ActQuant()
    assert set(q.state_dict()) == {"min_val", "max_val"}
    assert {n for n, _ in q.named_buffers()} == {"min_val", "max_val", "fake_quant_enabled", "observer_enabled"}
    x = torch.tensor([-0.5, 0.25, 2.0])
    assert torch.equal(q(x), x)                                    # both off: identity
    mins, maxs = torch.full((2,), 9.0), torch.full((2,), -9.0)
    q.activation_post_process = MinMaxObserver(mins, maxs, 1)
    assert q.enable_observer() is q and int(q.observer_enabled) == 1
    assert torch.equal(q(x), x) and (float(mins[1]), float(maxs[1])) == (-0.5, 2.0) and float(mins[0]) == 9.0
    assert q.activation_post_process.calculate_qparams() == act_qparams(-0.5, 2.0)
    q.disable_observer()
    q(torch.tensor([50.0]))
    assert float(maxs[1]) == 2.0                                   # not observed once disabled
    q.load_state_dict({"lo": torch.tensor(-0.5), "hi": torch.tensor(2.0)})
    assert q.calculate_qparams() == act_qparams(-0.5, 2.0) and q.calibrated
    q.enable_fake_quant()
    y = q(x)
    s, z = q.calculate_qparams()
    assert torch.equal(y, (torch.clamp(torch.floor(x / s + 0.5) + z, 0, 255) - z) * s)
    twin = copy.deepcopy(q)                                        # the EMA's copy keeps the switches
    assert torch.equal(twin(x), y) and int(twin.fake_quant_enabled) == 1
    q.disable_fake_quant()
    assert torch.equal(q(x), x) and torch.equal(twin(x), y)
    counts = torch.zeros((1, 2048), dtype=torch.float64)
    h = HistogramObserver(counts, 0, -1.0, 3.0, "minmax")
    h(torch.tensor([-1.0, 0.0, 3.0, 7.0]))
    assert float(counts.sum()) == 4 and float(counts[0, 0]) == 1 and float(counts[0, -1]) == 2
    assert h.range() == (-1.0, 3.0) and h.calculate_qparams() == act_qparams(-1.0, 3.0)
    from gnetmdk.engine.ema import ModelEMA
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 1, 1), ActQuant())
    ema = ModelEMA(net, 0.9, 1.0)
    net[1].enable_fake_quant()
    ema.sync_switches(net)                                         # the stage's switches reach the average
    assert int(ema.module[1].fake_quant_enabled) == 1 and int(ema.module[1].observer_enabled) == 0
    assert ema.module[1].fake_quant_enabled is not net[1].fake_quant_enabled


def test_range_from_histogram_device_cpu():
    counts = torch.zeros(100, dtype=torch.float64)
    counts[:] = 1.0
    assert range_from_histogram(counts, 0.5, 10.0, "minmax") == (0.0, 10.0)
    lo, hi = range_from_histogram(counts, -2.0, 8.0, "percentile", 99.0)
    assert lo == pytest.approx(-2.0 + 0.1) and hi == pytest.approx(8.0 - 0.1)   # one bin in from each end
    lo, hi = range_from_histogram(counts, 0.0, 10.0, "mse")
    assert lo == 0.0 and hi >= 9.5                                 # uniform: clipping never pays much
    heavy = torch.zeros(1000, dtype=torch.float64)
    heavy[:100] = 1e6                                              # mass near 0, one far outlier bin
    heavy[-1] = 1.0
    assert range_from_histogram(heavy, 0.0, 100.0, "mse")[1] < 50.0
    with pytest.raises(ValueError, match="percentile"):
        range_from_histogram(counts, 0.0, 1.0, "percentile", 20.0)


def test_histogram_counts_over_the_range_it_is_read_against_device_cpu():
    """The int8 observer counts over the observed [min, max] widened to hold 0, the range whose bins
    range_from_histogram reads (inputs all in [1, 3]: bins of [0, 3], not of [1, 3]), with the counting
    the chip's caps use (gnetmdk.gti.quantize.value_histogram, values outside into the end bins)."""
    from gnetmdk.gti.quantize import value_histogram
    from gnetmdk.intq.calibrate import RANGE_HIST_BINS, HistogramObserver
    b = RANGE_HIST_BINS
    k = torch.cat([torch.arange(683, 700), torch.arange(1900, b).repeat(20)])      # bins of [0, 3]
    x = torch.cat([((k.double() + 0.5) * 3.0 / b).float(), torch.tensor([3.0])])   # bin centres, and 3 itself
    want = torch.bincount(torch.cat([k, torch.tensor([b - 1])]), minlength=b).double()
    for method in ("mse", "percentile", "minmax"):
        counts = torch.zeros((2, b), dtype=torch.float64)
        obs = HistogramObserver(counts, 1, float(x.min()), float(x.max()), method, 99.0)
        obs(x[:100])
        obs(x[100:])
        assert torch.equal(counts[1], want) and float(counts[0].sum()) == 0
        assert obs.range() == range_from_histogram(want, 0.0, 3.0, method, 99.0)
    # the shared counting: "clamp" keeps every value, "drop" (the caps) only vmin < v <= vmax
    v = torch.tensor([-5.0, -1.0, 0.0, 0.5, 1.0, 9.0, float("inf"), float("nan")])
    assert value_histogram(v, 4, 1.0, -1.0, outside="clamp").tolist() == [2, 0, 1, 4]
    assert value_histogram(v, 4, 1.0, -1.0).tolist() == [0, 0, 1, 2]
    assert value_histogram(v, 4, 1.0).tolist() == [0, 0, 1, 1]
    with pytest.raises(ValueError, match="outside"):
        value_histogram(v, 4, 1.0, outside="wrap")
    with pytest.raises(ValueError, match="above vmin"):
        value_histogram(v, 4, 1.0, 1.0)


def test_mse_range_is_the_candidate_of_least_error_device_cpu():
    """The int8 "mse" range is the shrunk range whose uint8 fake quantizer (scale, zero point, ties up)
    has the least counts-weighted squared error over the bin centres, computed here candidate by
    candidate in plain Python."""
    from gnetmdk.intq.calibrate import RANGE_SHRINK_RATIOS
    g = torch.Generator().manual_seed(4)
    for lo, hi in ((-3.0, 7.0), (0.0, 2.5), (-0.2, 40.0)):
        counts = (torch.randint(0, 1000, (64,), generator=g) * (torch.rand(64, generator=g) < 0.6)).double()
        counts[5] += 1
        got = range_from_histogram(counts, lo, hi, "mse")
        w = (hi - lo) / 64
        centres = [lo + (k + 0.5) * w for k in range(64)]

        def error(l, h):
            s = (h - l) / 255
            z = min(max(math.floor(-l / s + 0.5), 0), 255)
            return sum(c * ((min(max(math.floor(v / s + 0.5) + z, 0), 255) - z) * s - v) ** 2
                       for c, v in zip(counts.tolist(), centres))
        errors = [error(lo * a, hi * a) for a in RANGE_SHRINK_RATIOS]
        assert any(got == pytest.approx((lo * a, hi * a), abs=1e-12) for a in RANGE_SHRINK_RATIOS)
        assert error(*got) <= min(errors) * (1 + 1e-9) + 1e-12


def test_requantization_is_the_exact_rounded_quotient_device_cpu():
    """floor((acc M + 2^(n-1)) / 2^n), compared with Python's exact integers, negatives included."""
    g = np.random.default_rng(0)
    m, n = requant_multipliers(np.array([0.37, 0.0021, 1.6]))
    assert 2 ** 30 <= m.max() <= 2 ** 31 and all(abs(mi / 2 ** n - r) <= 2 ** -(n + 1)
                                                   for mi, r in zip(m, (0.37, 0.0021, 1.6)))
    acc = g.integers(-2 ** 27, 2 ** 27, size=1000)
    for mi in m:
        got = _requant(torch.as_tensor(acc), torch.tensor(int(mi)), n, 7, 0).numpy()
        want = [min(max((int(a) * int(mi) + 2 ** (n - 1)) // 2 ** n + 7, 0), 255) for a in acc]
        assert got.tolist() == want
    with pytest.raises(ProgramError, match="positive"):
        requant_multipliers(np.array([0.5, 0.0]), "layer x")


def _calibrated(model, x):
    model.prepare_quant(8, "max")
    model.set_quant_mode(True, "off", False)
    calibrate_ranges(model, model.quant, lambda: [x], "mse")
    return model


@pytest.mark.parametrize("kw", [{}, {"spp": True, "iou_aware": True}])
def test_integer_program_equals_its_onnx_export_on_every_layer_device_cpu(kw):
    """Every op's uint8 codes and the float outputs, torch program vs onnxruntime: identical (leaky
    ReLU, pooled shortcut, residual adds, concat requantization, upsampling; with SPP's pools and
    concat and the IoU-aware channels in the second case)."""
    from gnetmdk.intq.onnx_export import build_onnx, run_onnx
    m = _calibrated(_model(**kw), _images(4))
    prog = m.integer_program()
    kinds = {op["op"] for op in prog["ops"]}
    assert {"input", "conv", "maxpool", "add", "concat", "upsample"} <= kinds
    assert any(op.get("pool") for op in prog["ops"]) and any(
        p is not None for op in prog["ops"] if op["op"] == "concat" for p in op["parts"])
    x = _images(2, 96, seed=5)
    outs, kept = run_program(prog, x, keep=True)
    res = run_onnx(build_onnx(prog, all_layers=True), x.to(torch.uint8).numpy())
    assert set(kept) <= set(res)
    for k, v in kept.items():
        assert np.array_equal(res[k], v.numpy()), k
    for i, o in enumerate(outs):
        assert np.array_equal(res[f"out{i}"], o.numpy())
    # the model's step-4 evaluation is this program
    m.set_quant_mode(True, "fake", True)
    for a, b in zip(m(x), outs):
        assert torch.equal(a, b)


def test_integer_first_layer_is_step3_to_one_code_device_cpu():
    """Given the same input codes, an integer conv differs from the fake-quantized one only by the
    bias's rounding (half an accumulator unit) and the multiplier's (2^-30 relative): at most one code,
    and rarely."""
    m = _calibrated(_model(), _images(4))
    x = _images(2, 64, seed=7)
    m.set_quant_mode(True, "fake", False)
    seen = {}
    q = m.quant["backbone_stem_0"]
    h = q.register_forward_hook(lambda mod, i, o: seen.setdefault("y", o.detach()))
    m(x)
    h.remove()
    s, z = q.qparams()
    fake_codes = torch.round(seen["y"] / s + z)
    _, kept = run_program(m.integer_program(), x, keep=True)
    d = (kept["backbone.stem.0"].float() - fake_codes).abs()
    assert d.max() <= 1 and (d > 0).float().mean() < 0.01


def test_uncalibrated_program_and_unsupported_models_are_refused_device_cpu():
    m = _model()
    m.prepare_quant(8, "max")
    with pytest.raises(ProgramError, match="calibrat"):
        m.integer_program()
    torch.manual_seed(0)
    dcn = ppyolo_r18vd(num_classes=3, dcn_v2_stages=[3])
    with pytest.raises(ValueError, match="dcn_v2_stages"):
        dcn.prepare_quant(8, "max")
    with pytest.raises(ValueError, match="bits"):
        _model().prepare_quant(9, "max")
    m.set_quant_mode(True, "fake", True)
    m.quant["input"].min_val.fill_(-3.0)
    m.quant["input"].max_val.fill_(3.0)
    with pytest.raises(ProgramError, match="backbone_stem_0"):
        m(_images())


def test_quantized_checkpoint_layout_rebuilds_device_cpu():
    """A quantized model's meta rebuilds the folded layout (strict load) with the same outputs."""
    from gnetmdk.models.ppyolo.model import PPYOLO
    m = _calibrated(_model(), _images(4))
    m.set_quant_mode(True, "fake", False)
    meta = {k: v for k, v in m.meta().items() if k != "name"}
    again = PPYOLO(**meta).eval()
    again.load_state_dict(m.state_dict(), strict=True)
    again.set_quant_mode(True, "fake", False)
    x = _images()
    for a, b in zip(m(x), again(x)):
        assert torch.equal(a, b)


def test_act_quant_reads_its_range_once_and_follows_every_change_device_cpu():
    """ActQuant's forward takes (scale, zero point) from a host copy: a forward after the first reads
    nothing back from the device (on CUDA: no wait per quantizer), and the copy follows the range when
    it changes in place (calibration's fill_, load_state_dict), when a buffer is replaced, and in a
    deep copy or a pickled copy (device cpu)."""
    import copy
    import pickle
    from torch.utils._python_dispatch import TorchDispatchMode

    class Reads(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default)
            return func(*args, **(kwargs or {}))

    def want(x, lo, hi):
        s, z = act_qparams(lo, hi)
        return (torch.clamp(torch.floor(x / s + 0.5) + z, 0, 255) - z) * s

    x = torch.linspace(-2.0, 5.0, 301)
    q = ActQuant().enable_fake_quant()
    q.min_val.fill_(-1.0)
    q.max_val.fill_(3.0)
    assert torch.equal(q(x), want(x, -1.0, 3.0))
    with Reads() as reads:
        y = q(x)
    assert reads.n == 0 and torch.equal(y, want(x, -1.0, 3.0))
    q.max_val.fill_(4.0)                                           # calibration writes in place
    assert torch.equal(q(x), want(x, -1.0, 4.0))
    q.load_state_dict({"min_val": torch.tensor(-0.5), "max_val": torch.tensor(2.0)})
    assert torch.equal(q(x), want(x, -0.5, 2.0))
    q.min_val = torch.tensor(0.0)                                  # a buffer replaced
    assert torch.equal(q(x), want(x, 0.0, 2.0))
    twin = copy.deepcopy(q)
    twin.max_val.fill_(1.0)
    assert torch.equal(twin(x), want(x, 0.0, 1.0)) and torch.equal(q(x), want(x, 0.0, 2.0))
    back = pickle.loads(pickle.dumps(q))
    assert torch.equal(back(x), want(x, 0.0, 2.0))
