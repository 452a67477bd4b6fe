"""The chip's 10-bit output mode (gnetdet.output_bits 10; docs/quantization.md, "The 10-bit output mode"):
the output conv in a major layer of its own, its activations on 1023 steps of cap / 1023, gain-aware step 3
equal to step 4 bit for bit, and the chip model (emulator, ONNX) equal to step 4. Device cpu."""
import copy
import dataclasses
import math

import numpy as np
import pytest
import torch

from gnetmdk.config import BaseConfig, ConfigError, build_config
from gnetmdk.engine.stages import STAGES, apply_stage
from gnetmdk.gti.quantize import capped_relu, five_bit_cap, max_code, mse_cap_from_histogram
from gnetmdk.gti.transforms import fold_requant_multipliers
from gnetmdk.models.gnetdet.family import relayout_mask_bits
from gnetmdk.models.gnetdet.model import ChipLimitError, GNetDet, gnetdet_layers

pytestmark = pytest.mark.usefixtures("one_thread_module")

TINY = dict(num_classes=2, image_size=224, width_mult=0.0625, chip="5801", use_bn=False)


def test_capped_relu_on_1023_steps_device_cpu():
    """codes 1023: y_q = R(clip(x, 0, cap) * 1023 / cap) * cap / 1023 (every value on that grid, at most half
    a step from the clipped input); the integer path returns R(clip(x, 0, 1023)); 31 is unchanged."""
    g = torch.Generator().manual_seed(0)
    x = torch.rand(20000, generator=g) * 3 - 0.5
    cap = torch.tensor(2.0)
    y = capped_relu(x, cap, codes=1023)
    k = torch.round(y.double() * 1023 / 2.0)
    assert torch.equal(y, k.float() * (cap / 1023)) and float(k.min()) == 0 and float(k.max()) == 1023
    assert float((y - x.clamp(0, 2)).abs().max()) <= 2.0 / 1023 / 2 + 1e-6
    assert len(torch.unique(k)) > 900                        # the 10-bit grid is used, not 32 levels
    y5 = capped_relu(x, cap)
    assert len(torch.unique(y5)) == 32
    assert float((y5 - x.clamp(0, 2)).abs().max()) > 0.9 * 2.0 / 31 / 2       # 5-bit: 33 times coarser
    z = torch.tensor([-3.0, 0.49, 0.5, 700.5, 1022.6, 5000.0])
    assert capped_relu(z, torch.tensor(1023.0), integer=True, codes=1023).tolist() == [0, 0, 1, 701, 1023, 1023]
    assert max_code(5) == 31 and max_code(10) == 1023
    with pytest.raises(ValueError, match="5 or 10"):
        max_code(8)
    assert five_bit_cap(1.7) == 1.7 and five_bit_cap(1.7, 1023) == 1.7 * 31 / 1023
    # the MSE-best 10-bit cap clips less than the 5-bit one on a long-tailed histogram
    counts = torch.exp(-torch.arange(4096, dtype=torch.float64) / 300)
    assert mse_cap_from_histogram(counts, 10.0, codes=1023) > mse_cap_from_histogram(counts, 10.0)


def test_ten_bit_layout_formats_and_refusals_device_cpu():
    """output_bits 10: the output conv is major layer 7 of GNetDet-224 on its own, the chip default gives it
    the head's format; GNetDet-448 (8 major layers) and the 6-major-layer chips are refused naming the
    limit; mask_bits need 7 entries; other widths are refused naming the field."""
    five = gnetdet_layers(224, 3, 0.125, "5801", ())
    ten = gnetdet_layers(224, 3, 0.125, "5801", (), output_bits=10)
    assert [(l.in_channels, l.out_channels, l.pool_after) for l in five] == \
        [(l.in_channels, l.out_channels, l.pool_after) for l in ten]            # the same convs
    assert [l.major for l in ten][-3:] == [5, 5, 6] and [l.major for l in five][-3:] == [5, 5, 5]
    assert [l.weight_format for l in ten][-3:] == [8, 8, 8] and ten[-4].weight_format == 3
    assert [l.out_channels for l in gnetdet_layers(224, 3, 0.125, "5801", (), 0.5, 10)] == \
        [l.out_channels for l in gnetdet_layers(224, 3, 0.125, "5801", (), 0.5)]      # the head: major 6 still
    with pytest.raises(ChipLimitError, match="8 major layers, chip 5801 allows at most 7.*output_bits 10"):
        GNetDet(num_classes=3, image_size=448, width_mult=0.125, output_bits=10)
    with pytest.raises(ChipLimitError, match="7 major layers, chip 2803 allows at most 6"):
        GNetDet(num_classes=3, image_size=224, width_mult=0.125, chip="2803", output_bits=10)
    base = ["image_size", "224", "width_mult", "0.0625"]
    cfg = build_config(BaseConfig, base + ["output_bits", "10"])
    assert cfg.gnetdet.output_bits == 10
    with pytest.raises(ConfigError, match=r"'gnetdet.output_bits' = 8: must be 5 .* or 10"):
        build_config(BaseConfig, base + ["output_bits", "8"])
    with pytest.raises(ConfigError, match=r"'gnetdet.output_bits' = 10: GNetDet-448 on chip 5801: 8 major layers"):
        build_config(BaseConfig, ["image_size", "448", "width_mult", "0.0625", "output_bits", "10"])
    with pytest.raises(ConfigError, match=r"mask_bits.*GNetDet-224 has 7 major layers \(output_bits 10"):
        build_config(BaseConfig, base + ["output_bits", "10", "mask_bits", "8,3,3,3,3,8"])
    assert build_config(BaseConfig, base + ["output_bits", "10", "mask_bits", "8,3,3,3,3,8,8"]).gnetdet.mask_bits \
        == [8, 3, 3, 3, 3, 8, 8]
    # a step-2 checkpoint's weight formats move between the layouts, every conv keeping its own
    assert relayout_mask_bits([8, 3, 3, 3, 3, 8], 5, 10) == [8, 3, 3, 3, 3, 8, 8]
    assert relayout_mask_bits([8, 3, 3, 3, 3, 8, 8], 10, 5) == [8, 3, 3, 3, 3, 8]
    with pytest.raises(ConfigError, match="output conv at weight format 3 .* head's major layer, whose format is 8"):
        relayout_mask_bits([8, 3, 3, 3, 3, 8, 3], 10, 5, "s2.pth")


def _init(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for conv in model.convs():
            conv.weight.copy_(torch.randn(conv.weight.shape, generator=g) * math.sqrt(2.0 / (conv.in_channels * 9)))
            conv.bias.copy_(torch.randn(conv.bias.shape, generator=g) * 0.5)
        model.layers[0].conv.weight.mul_(1 / 16.0)           # the input holds codes 0..31


def _codes(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 32, (n, 3, 224, 224), generator=g).float()


def _calibrated(output_bits):
    from gnetmdk.engine.calibration import measure_caps
    torch.manual_seed(0)
    model = GNetDet(output_bits=output_bits, **TINY)
    _init(model, 10)
    model.eval()
    apply_stage(model, STAGES["cal"], calibrating=True)
    for relu, c in zip(model.relus(), measure_caps(model, lambda: [_codes(1, 20)])):
        relu.cap.fill_(c)
    return model


def _features(model, x):
    with torch.no_grad():
        y, feats = model.features(x, return_all=True)
        return model(x), feats


def test_gain_aware_step3_is_step4_bit_for_bit_with_ten_bit_output_device_cpu():
    """Gain-aware step 3 with a 10-bit output layer computes the step-4 model: every layer's codes, the
    integers gain editing stores and the output are equal bit for bit; the output codes use the 10-bit
    range (above 31), the host scale is cap_last / 1023, and the output layer rounds to within half a
    step of cap / 1023."""
    model = _calibrated(10)
    caps = [float(r.cap) for r in model.relus()]
    x = _codes(2, 97)
    apply_stage(model, STAGES["step3"])
    model.gain_aware = True
    model.eval()
    y3, f3 = _features(model, x)
    assert model.relus()[-1].codes == 1023 and all(r.codes == 31 for r in model.relus()[:-1])
    assert model.convs()[-1].gain == (caps[-2], caps[-1] * 31 / 1023)
    assert all(float(f.max()) <= 31 for f in f3[:-1]) and float(f3[-1].max()) > 31
    assert torch.equal(f3[-1], f3[-1].round()) and float(f3[-1].max()) <= 1023
    assert torch.equal(y3, (f3[-1] * torch.tensor(caps[-1] * 31 / 1023 / 31, dtype=torch.float32))
                       .permute(0, 2, 3, 1))
    step3_params = [conv.quantized_params() for conv in model.convs()]
    # the output layer's own rounding: within half a step of cap / 1023 of its clipped pre-activation,
    # where the same weights and caps with a 5-bit output layer are up to half a step of cap / 31 off
    def rounding_error(m, codes):
        seen = []
        hook = m.relus()[-1].register_forward_hook(lambda mod, inp, out: seen.append((inp[0], out)))
        try:
            _features(m, x)
        finally:
            hook.remove()
        pre, out = seen[-1]
        return float((out - pre.clamp(0, codes)).abs().max()) * caps[-1] / codes     # in output units

    five = copy.deepcopy(model)
    five.relus()[-1].codes = 31
    err10, err5 = rounding_error(model, 1023), rounding_error(five, 31)
    assert err10 <= caps[-1] / 1023 / 2 * (1 + 1e-5) and err5 > 10 * err10
    fold_requant_multipliers(model)
    apply_stage(model, STAGES["step4"])
    assert [float(r.cap) for r in model.relus()] == [31.0] * (len(caps) - 1) + [1023.0]
    assert float(model.output_scale) == np.float32(caps[-1] * 31 / 1023 / 31)
    for conv, (w3, b3, s3) in zip(model.convs(), step3_params):
        w4, b4, s4 = conv.integer_params()
        assert s3 == s4 and torch.equal(w3.detach().double() * 2 ** s4, w4.double())
        assert torch.equal(b3.detach().double() * 2 ** s4, b4.double())
    model.eval()
    y4, f4 = _features(model, x)
    for i, (a, b) in enumerate(zip(f3, f4)):
        assert torch.equal(a, b), f"layer {i}: {int((a != b).sum())} codes differ"
    assert torch.equal(y3, y4)


def test_ten_bit_chip_model_equals_step4_in_emulator_and_onnx_device_cpu(tmp_path):
    """A 10-bit output step-4 model converts to a chip model (format version 3, the last layer's max_code
    1023, GTI's ten_bits_enable and ActivationBitMode) whose emulator backends and ONNX export give its
    codes on every layer, bit for bit; a file claiming 10-bit codes where the chip has none is refused."""
    import json
    from gnetmdk.chip import ChipEmulator, ChipModelError, check_bit_exact, chip_model_from_dict, load_chip_model
    from gnetmdk.chip.convert import chip_model_from_gnetdet
    from gnetmdk.chip.export import dat_json, gti_file_texts
    from gnetmdk.chip.onnx_export import OnnxChipRunner
    from gnetmdk.gti.quantize import image_to_codes
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (4, 224, 224, 3), dtype=np.uint8)
    model = _calibrated(10)
    caps = fold_requant_multipliers(model)
    apply_stage(model, STAGES["step4"])
    model.eval()
    cm = chip_model_from_gnetdet(model, ["a", "b"], calibrated_caps=caps)
    path = cm.save(str(tmp_path / "chip_model.json"))
    back = load_chip_model(path)
    d = json.load(open(path))
    assert d["version"] == 3 and d["layers"][-1]["max_code"] == 1023 and "max_code" not in d["layers"][-2]
    assert d["activation"] == {"bits": 5, "max_code": 31, "output_bits": 10, "output_max_code": 1023}
    assert d["major_layers"][-1]["ten_bits_enable"] and d["major_layers"][-1]["sublayer_number"] == 1
    assert back.output_bits == 10 and back.cap_last == pytest.approx(caps[-1], rel=1e-6)
    dat = dat_json(back)
    assert dat["layer"][-1]["ten_bits_enable"] and "ten_bits_enable" not in dat["layer"][-2]
    assert dat["model"][0]["ActivationBitMode"] == 1 and dat["model"][0]["MajorLayerNumber"] == 7
    # without the calibrated caps relu_cap.txt holds the chip's own: 31, and 1023 for the 10-bit layer
    bare = dataclasses.replace(back, layers=[dataclasses.replace(l, calibrated_cap=None) for l in back.layers])
    texts = gti_file_texts(bare, str(tmp_path / "gti"))
    assert [v for k, v in texts.items() if k.endswith("relu_cap.txt")] == ["31\n" * 15 + "1023\n"]
    for backend in ("gemm", "conv", "numpy"):
        rep = check_bit_exact(model, ChipEmulator(back, backend).run, back, images=images)
        assert sum(rep.mismatches) == 0 and rep.max_output_diff == 0.0, backend
    rep = check_bit_exact(model, OnnxChipRunner(back, all_layers=True).run, back, images=images)
    assert sum(rep.mismatches) == 0 and rep.max_output_diff == 0.0
    out = ChipEmulator(back).run(images)
    assert out.dtype == np.uint16 and 31 < int(out.max()) <= 1023
    x = image_to_codes(torch.from_numpy(images)).permute(0, 3, 1, 2).float()
    with torch.no_grad():
        assert np.array_equal(out[:, :12], model.features(x).numpy().astype(np.uint16))
    # 10-bit codes only in the last layer, alone in its major layer
    bad = copy.deepcopy(d)
    bad["layers"][-2]["max_code"] = 1023
    with pytest.raises(ChipModelError, match=r"layers\[14\].*max_code 1023.*last layer alone in its major layer"):
        chip_model_from_dict(bad, "m.json")
    lost = copy.deepcopy(d)
    del lost["major_layers"][-1]["ten_bits_enable"]
    with pytest.raises(ChipModelError, match="major layer 7: major_layers says ten_bits_enable None"):
        chip_model_from_dict(lost, "m.json")
