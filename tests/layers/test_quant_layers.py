"""GNetDet's quantized layers as fake quantizers in torch.ao's terms (gnetmdk.layers.quant): the switches
``fake_quant_enabled`` / ``observer_enabled``, their methods, ``calculate_qparams``, and the same names
on both families' quantizers, set by the stage table and copied by the EMA (device cpu)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gnetmdk.engine.ema import ModelEMA
from gnetmdk.engine.stages import STAGES, apply_stage
from gnetmdk.gti import quantize as Q
from gnetmdk.intq.fake import ActQuant
from gnetmdk.layers.quant import QConv2d, QReLU
from gnetmdk.models.gnetdet.model import GNetDet


def test_relu_switches_codes_and_qparams_device_cpu():
    """Off: a plain ReLU. Fake quantization on: the ReLU clipped at the cap and rounded to 5-bit codes,
    each output q * scale with q an integer 0..31, and (scale, zero point) = (cap / 31, 0) from
    calculate_qparams. The observer pass overrides it with a plain ReLU; the methods return the layer."""
    torch.manual_seed(0)
    r = QReLU()
    r.cap.fill_(3.1)
    x = torch.randn(2, 4, 8, 8) * 3
    assert torch.equal(r(x), F.relu(x))
    assert r.enable_fake_quant() is r and r.fake_quant_enabled
    y = r(x)
    assert torch.equal(y, Q.capped_relu(x, r.cap, quantize=True))
    scale, zp = r.calculate_qparams()
    assert scale.dtype == torch.float32 and float(scale) == pytest.approx(3.1 / 31, rel=1e-6)
    assert zp.dtype == torch.int32 and int(zp) == 0
    codes = Q.activation_codes(y, r.cap)                  # y = code * scale, bit for bit
    assert torch.equal(y, codes.float() * scale) and int(codes.max()) == 31 and int(codes.min()) == 0
    assert r.enable_observer() is r and torch.equal(r(x), F.relu(x))
    assert r.disable_observer() is r and torch.equal(r(x), y)
    assert r.disable_fake_quant() is r and not r.fake_quant_enabled and torch.equal(r(x), F.relu(x))
    r.cap.zero_()
    with pytest.raises(RuntimeError, match="run calibration"):
        r.enable_fake_quant()(x)


def test_conv_fake_quant_switch_device_cpu():
    """Off: the float convolution. On: the convolution with the chip's quantized weights (integer
    multiples of 2^-shift), different from the float one."""
    torch.manual_seed(1)
    c = QConv2d(3, 4, weight_format=3, weight_bits=12, bias_bits=20)
    x = torch.rand(1, 3, 6, 6) * 31
    assert torch.equal(c(x), F.conv2d(x, c.weight, c.bias, 1, 1))
    assert c.enable_fake_quant() is c
    w, b, shift = c.quantized_params()
    assert shift is not None and torch.equal(w * 2 ** shift, (w * 2 ** shift).round())
    assert torch.equal(c(x), F.conv2d(x, w, b, 1, 1)) and not torch.equal(w, c.weight)
    assert c.disable_fake_quant() is c and c.quantized_params()[2] is None


def test_both_families_share_the_switch_names_and_the_stage_table_sets_them_device_cpu():
    """intq's ActQuant and GNetDet's layers answer to the same methods; every stage of the table sets
    GNetDet's switches as its row says (the cal pass with the observers on), and the EMA copies them."""
    for cls in (QReLU, ActQuant):
        for name in ("enable_fake_quant", "disable_fake_quant", "enable_observer", "disable_observer",
                     "calculate_qparams"):
            assert callable(getattr(cls, name, None)), (cls.__name__, name)
    assert callable(getattr(QConv2d, "enable_fake_quant")) and callable(getattr(QConv2d, "disable_fake_quant"))
    torch.manual_seed(2)
    m = GNetDet(3, 224, 0.0625, use_bn=False)
    for r in m.relus():
        r.cap.fill_(4.0)
    ema = ModelEMA(m, decay=0.9, ramp=2.0)
    for name, stage in STAGES.items():
        for calibrating in ((False, True) if name == "cal" else (False,)):
            apply_stage(m, stage, calibrating=calibrating)
            ema.sync_switches(m)
            for net in (m, ema.module):
                assert all(c.fake_quant_enabled == stage.weight_fake_quant for c in net.convs()), name
                assert all(r.fake_quant_enabled == stage.act_fake_quant and r.integer == stage.integer
                           and r.observer_enabled == calibrating for r in net.relus()), (name, calibrating)


def test_observers_of_both_targets_observe_and_calculate_qparams_device_cpu():
    """Both targets' observers answer to ``observe`` and ``calculate_qparams``: the chip's give (cap / 31,
    0) of their statistic (the maximum; the MSE cap of the histogram), the int8 ones (scale, zero point)
    of their range; QConv2d gives 2^-shift and 0, the step of the integers it stores."""
    from gnetmdk.intq.calibrate import MinMaxObserver
    from gnetmdk.layers.observers import HistogramObserver, MaxObserver, PercentileObserver
    from gnetmdk.intq.fake import act_qparams
    torch.manual_seed(3)
    x = torch.randn(4, 8, 16, 16) * 2
    mx = MaxObserver()
    assert float(mx.calculate_qparams()[0]) == 0.0               # nothing observed yet
    mx.observe(x)
    scale, zp = mx.calculate_qparams()
    assert torch.equal(scale, x.max() / Q.ACT_MAX) and int(zp) == 0 and zp.dtype == torch.int32
    pc = PercentileObserver(99.0)
    pc.observe(x)
    assert 0 < float(pc.calculate_qparams()[0]) < float(scale)
    hist = HistogramObserver(float(x.max()), bins=256)
    hist.observe(x)
    cap = Q.mse_cap_from_histogram(hist.value, float(x.max()))
    assert float(hist.calculate_qparams()[0]) == pytest.approx(cap / 31, rel=1e-6) and 0 < cap <= float(x.max())
    mins, maxs = torch.full((1,), float("inf")), torch.full((1,), float("-inf"))
    mm = MinMaxObserver(mins, maxs, 0)
    mm.observe(x)
    assert mm.calculate_qparams() == act_qparams(float(x.min()), float(x.max()))
    c = QConv2d(3, 4, weight_format=3, weight_bits=12, bias_bits=20).enable_fake_quant()
    w_int, _, shift = c.integer_params()
    step, czp = c.calculate_qparams()
    w_q, _, _ = c.quantized_params()
    assert float(step) == 2.0 ** -shift and int(czp) == 0 and torch.equal(w_q.double() / float(step), w_int.double())
