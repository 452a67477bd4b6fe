"""The chip path (docs/chip.md, "What the chip computes"): converter, bit-exact integer
emulator, ONNX export, chip evaluation, predict, stage report.

Models are made without training (tests/chip_helpers.py): a tiny BN-free GNetDet-224, calibrated on
real images from ../shared/data, gain-edited to step 4.
"""
import importlib.util
import json
import math
import os
import shutil
from fractions import Fraction

import cv2
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from chip_helpers import (DATASETS, REPO, build_step4_model, have, load_images, run_tool,  # noqa: E402
                          save_step4_checkpoint, write_config)

from gnetmdk.config import load_config  # noqa: E402
from gnetmdk.dataset.dataset import build_dataset, preprocess_image  # noqa: E402
from gnetmdk.dataset.image_io import decode_image  # noqa: E402
from gnetmdk.chip import (ChipEmulator, ChipModelError, ConversionError, check_bit_exact,  # noqa: E402
                              chip_model_from_gnetdet, codes_to_predictions, convert_checkpoint, load_chip_model,
                              padded_output_channels, rounding_shift)
from gnetmdk.chip.emulator import sublayer_codes  # noqa: E402
from gnetmdk.chip.model_file import ChipLayer  # noqa: E402
from repo_paths import load_tool

needs_data = pytest.mark.skipif(not (have("raccoon") and have("cards")), reason="shared datasets not present")


pytestmark = pytest.mark.usefixtures("one_thread_module")




class Setup:
    """One dataset's config, images, step-4 model, checkpoint and chip model."""


def _setup(tmp_path_factory, name, n_calib=8, **cfg_extra):
    s = Setup()
    s.dir = str(tmp_path_factory.mktemp(name))
    s.config = write_config(s.dir, name, **cfg_extra)
    s.cfg = load_config(s.config)
    s.val = build_dataset(s.cfg, "valid")
    s.images = load_images(s.val)
    s.model, s.caps = build_step4_model(len(DATASETS[name]), load_images(build_dataset(s.cfg, "train"), n_calib))
    s.ckpt = save_step4_checkpoint(os.path.join(s.dir, "checkpoint", "step4", "best.pth"), s.model, s.config)
    s.chip = chip_model_from_gnetdet(s.model, DATASETS[name], calibrated_caps=s.caps)
    return s


@pytest.fixture(scope="module")
def raccoon(tmp_path_factory):
    if not have("raccoon"):
        pytest.skip("raccoon dataset not present")
    return _setup(tmp_path_factory, "raccoon")


@pytest.fixture(scope="module")
def cards(tmp_path_factory):
    if not have("cards"):
        pytest.skip("cards dataset not present")
    return _setup(tmp_path_factory, "cards")


# ------------------------------------------------------------------ integer semantics
def _exact_round_shift(acc: int, s: int) -> int:
    f = Fraction(acc, 2 ** s)
    r = math.floor(abs(f) + Fraction(1, 2))
    return r if f >= 0 else -r


@settings(max_examples=200, deadline=None)
@given(acc=st.integers(-2 ** 31 + 2 ** 13, 2 ** 31 - 2 ** 13), s=st.integers(0, 12))
def test_rounding_shift_is_round_half_away_from_zero(acc, s):
    for dtype in (torch.int32, torch.int64):
        got = int(rounding_shift(torch.tensor([acc], dtype=dtype), s)[0])
        assert got == _exact_round_shift(acc, s)


@settings(max_examples=200, deadline=None)
@given(acc=st.lists(st.integers(-2 ** 31 + 2 ** 13, 2 ** 31 - 2 ** 13), min_size=1, max_size=20),
       s=st.integers(0, 12), near=st.booleans())
def test_fast_activation_equals_literal_rule(acc, s, near):
    """The "gemm" backend's clamp((acc + 2^(s-1)) >> s) form equals clamp(R(acc / 2^s), 0, 31)."""
    from gnetmdk.chip.emulator import activation_codes_from_acc
    if near:   # values around 0 and around the top code, where the two forms could differ
        acc = [a % (70 << s) - (3 << s) for a in acc]
    t = torch.tensor(acc, dtype=torch.int32)
    want = [min(max(_exact_round_shift(a, s), 0), 31) for a in acc]
    assert activation_codes_from_acc(t, s).tolist() == want
    assert rounding_shift(t, s).clamp(0, 31).tolist() == want


def test_rounding_shift_ties():
    acc = torch.tensor([-6, -5, -3, -2, -1, 0, 1, 2, 3, 5, 6], dtype=torch.int32)
    assert rounding_shift(acc, 1).tolist() == [-3, -3, -2, -1, -1, 0, 1, 1, 2, 3, 3]
    assert rounding_shift(acc, 0).tolist() == acc.tolist()


# ------------------------------------------------------------------ emulator vs the step-4 model
@needs_data
@pytest.mark.parametrize("which", ["raccoon", "cards"])
def test_emulator_bit_exact_every_layer_on_real_images(which, request):
    s = request.getfixturevalue(which)
    rep = check_bit_exact(s.model, ChipEmulator(s.chip).run, s.chip, images=s.images, batch_size=16)
    assert rep.num_images == len(s.val) > 30
    assert len(rep.mismatches) == 16 and all(n > 0 for n in rep.elements)
    assert rep.mismatches == [0] * 16, rep.format()
    assert rep.padded_nonzero == 0 and rep.max_output_diff == 0.0 and rep.ok
    # the codes are alive: the output layer uses much of 0..31
    codes = ChipEmulator(s.chip).run(s.images[:4])
    assert len(np.unique(codes[:, :s.chip.used_channels])) > 10


def test_wide_head_converts_from_its_checkpoint_and_runs_bit_exact_device_cpu(raccoon, tmp_path):
    """A head wider than the rest (head_width_mult 0.25 at width_mult 1/16: 64 channels in 6.1 and 6.2,
    16 before) converts from its checkpoint (the converter reads head_width_mult from the model's
    meta), pads the output layer to the head's 64 channels, and the emulator equals the step-4 model
    in every layer's codes."""
    s = raccoon
    model, caps = build_step4_model(1, s.images[:8], head_width_mult=0.25)
    assert [c.out_channels for c in model.convs()][-4:] == [16, 64, 64, 11]
    ckpt = save_step4_checkpoint(str(tmp_path / "step4" / "best.pth"), model, s.config)
    chip, rebuilt = convert_checkpoint(ckpt)
    assert [c.weight.shape for c in rebuilt.convs()] == [c.weight.shape for c in model.convs()]
    assert chip.used_channels == 11 and chip.output_channels == 64
    assert [l.out_channels for l in chip.layers][-3:] == [64, 64, 64]
    rep = check_bit_exact(model, ChipEmulator(chip).run, chip, images=s.images, batch_size=16)
    assert rep.mismatches == [0] * 16 and rep.padded_nonzero == 0 and rep.ok, rep.format()


@needs_data
def test_emulator_backends_agree(raccoon):
    """int8 GEMM (default), integer conv2d and the numpy int64 reference give the same codes."""
    s = raccoon
    emu = ChipEmulator(s.chip)
    assert emu.layer_backends == ["gemm"] * 16 or not hasattr(torch, "_int_mm")
    a, la = emu.run(s.images[:2], return_all=True)
    for backend in ("conv", "numpy"):
        b, lb = ChipEmulator(s.chip, backend=backend).run(s.images[:2], return_all=True)
        assert np.array_equal(a, b) and all(np.array_equal(x, y) for x, y in zip(la, lb))
    assert a.dtype == np.uint8 and a.shape == (2, 16, 14, 14)
    assert [x.shape[1:] for x in la][:3] == [(4, 224, 224), (4, 112, 112), (8, 112, 112)]
    with pytest.raises(ValueError, match="0..31"):
        emu.run_codes(np.full((1, 3, 224, 224), 32, np.int32))
    with pytest.raises(ValueError, match="uint8"):
        emu.run(s.images[:1].astype(np.float32))


def test_large_fan_in_exact_where_float32_rounds():
    """1024 input channels, 12-bit weights near +-2047, partial sums up to ~2^29: the chip's
    integers (emulator, numpy reference) and the step-4 float64 path agree on every code, float32
    convolution does not (results sit on rounding ties that its lost low bits flip)."""
    from gnetmdk.gti.spec import register_bits
    from gnetmdk.layers.quant import QConv2d, QReLU
    bw, bb = register_bits("2803", 12)
    i_ch, o_ch, size = 1024, 128, 2
    g = torch.Generator().manual_seed(0)
    half = i_ch // 2
    pos = torch.randint(1200, 2048, (o_ch, half, 3, 3), generator=g)
    w = torch.cat([pos, -pos], 1)                                 # large positive, then large negative terms
    a_half = torch.randint(16, 32, (2, half, size, size), generator=g)
    a = torch.cat([a_half, a_half], 1)                            # the sum cancels to 0 exactly ...
    k = torch.randint(0, 31, (o_ch,), generator=g)
    b = (2 * k + 1) * 2048                                        # ... and the bias puts it on a tie k + 0.5
    conv = QConv2d(i_ch, o_ch, 12, bw, bb)
    with torch.no_grad():
        conv.weight.copy_(w.double() / 4096)
        conv.bias.copy_(b.double() / 4096)
    conv.enable_fake_quant()
    relu = QReLU()
    relu.cap.fill_(31.0)
    relu.enable_fake_quant()
    relu.integer = True
    w_int, b_int, shift = conv.integer_params()
    assert shift == 12 and torch.equal(w_int, w) and torch.equal(b_int, b)
    layer = ChipLayer(0, 0, i_ch, o_ch, 12, bw, bb, shift, False, size, w_int.numpy(), b_int.numpy())
    assert layer.max_abs_acc() > 2 ** 28 and not layer.float32_exact()
    emu = sublayer_codes(layer, a.to(torch.int32))                # int8 GEMM, weights split 128 * Hi + Lo
    for backend in ("conv", "numpy"):
        assert torch.equal(emu, sublayer_codes(layer, a.to(torch.int32), backend=backend))
    assert torch.equal(emu, (k + 1).view(1, -1, 1, 1).expand_as(emu).to(torch.int32))   # R(k + 0.5) = k + 1
    with torch.no_grad():
        conv.exact = True                                         # the step-4 eval path
        exact = relu(conv(a.double()))
        conv.exact = False                                        # plain float32
        f32 = relu(conv(a.float()))
    assert exact.dtype == torch.float64 and int((exact != emu.double()).sum()) == 0
    assert int((f32 != emu.float()).sum()) > 0


# ------------------------------------------------------------------ padding of the output layer
def test_padded_output_channels_rule():
    assert padded_output_channels(11, [16, 16], 4) == 16
    assert padded_output_channels(16, [16, 16], 4) == 16
    assert padded_output_channels(13, [64, 64], 4) == 64
    assert padded_output_channels(11, [], 4) == 16
    assert padded_output_channels(11, [], 32) == 32
    with pytest.raises(ConversionError, match="do not fit the 16 channels"):
        padded_output_channels(17, [16, 16], 4)


@needs_data
def test_padded_channels_are_zero_and_ignored(raccoon):
    s = raccoon
    cm = s.chip
    assert cm.used_channels == 11 and cm.output_channels == 16
    last = cm.layers[-1]
    assert not last.weight[11:].any() and not last.bias[11:].any()
    codes = ChipEmulator(cm).run(s.images[:4])
    assert not codes[:, 11:].any()
    garbage = codes.copy()
    garbage[:, 11:] = 31
    assert torch.equal(codes_to_predictions(codes, cm), codes_to_predictions(garbage, cm))
    assert codes_to_predictions(codes, cm).shape == (4, 14, 14, 11)


@needs_data
def test_logit_score_head_chip_map_equals_model(raccoon):
    """A model with the logit score head (sigmoid on the host): the chip model records the head, and
    the chip's mAP and detections equal the step-4 model's evaluator."""
    from torch.utils.data import DataLoader
    from gnetmdk.dataset.dataset import collate
    from gnetmdk.evaluation.evaluator import evaluate_model
    from gnetmdk.chip import evaluate_chip
    s = raccoon
    model, caps = build_step4_model(1, s.images[:6], seed=5, score_head="logit", score_offset=0.5,
                                    score_scale=10.0)
    cm = chip_model_from_gnetdet(model, ["raccoon"], calibrated_caps=caps)
    assert (cm.score_head, cm.score_offset, cm.score_scale) == ("logit", 0.5, 10.0)
    assert cm.header()["decode"]["score_head"] == "logit"
    assert cm.header()["decode"]["score_scale"] == 10.0
    ref = evaluate_model(model, DataLoader(s.val, batch_size=16, collate_fn=collate), s.val, torch.device("cpu"),
                         0.05, 0.5, 100)
    res = evaluate_chip(ChipEmulator(cm).run, cm, s.val)
    assert res["map"] == ref["map"] and res["num_det"] == ref["num_det"] and res["map"] > 0


# ------------------------------------------------------------------ chip-model file
@needs_data
def test_chip_model_file_roundtrip_and_refusals(raccoon, tmp_path):
    s = raccoon
    path = s.chip.save(str(tmp_path / "m.json"))
    back = load_chip_model(path)
    assert back.header() == s.chip.header()
    for a, b in zip(back.layers, s.chip.layers):
        assert np.array_equal(a.weight, b.weight) and np.array_equal(a.bias, b.bias) and a.shift == b.shift
    assert back.calibrated_caps() == pytest.approx(s.caps)
    assert back.class_names == ["raccoon"] and back.input_size == 224 and back.chip == "5801"
    d = json.load(open(path))
    assert d["format"] == "gnetmdk-chip-model" and d["version"] == 2
    assert [l["weight_format"] for l in d["layers"]] == [l.weight_format for l in s.chip.layers]
    # a version-1 file names the weight format "scheme": it is read as before
    old = json.loads(json.dumps(d))
    old["version"] = 1
    for l in old["layers"]:
        l["scheme"] = l.pop("weight_format")
    json.dump(old, open(tmp_path / "v1.json", "w"))
    assert [l.weight_format for l in load_chip_model(str(tmp_path / "v1.json")).layers] == \
        [l.weight_format for l in s.chip.layers]
    old["layers"][0].pop("scheme")
    json.dump(old, open(tmp_path / "v1bad.json", "w"))
    with pytest.raises(ChipModelError, match="missing field 'scheme'"):
        load_chip_model(str(tmp_path / "v1bad.json"))
    # a corrupted tensor
    bad = json.loads(json.dumps(d))
    data = bad["layers"][3]["weight"]["data"]
    bad["layers"][3]["weight"]["data"] = ("B" if data[0] == "A" else "A") + data[1:]
    json.dump(bad, open(tmp_path / "bad.json", "w"))
    with pytest.raises(ChipModelError, match="SHA-256"):
        load_chip_model(str(tmp_path / "bad.json"))
    # a newer version, a non-chip JSON, a missing file
    newer = dict(d, version=99)
    json.dump(newer, open(tmp_path / "new.json", "w"))
    with pytest.raises(ChipModelError, match="version"):
        load_chip_model(str(tmp_path / "new.json"))
    json.dump({"a": 1}, open(tmp_path / "other.json", "w"))
    with pytest.raises(ChipModelError, match="not a gnetmdk chip model"):
        load_chip_model(str(tmp_path / "other.json"))
    with pytest.raises(ChipModelError, match="does not exist"):
        load_chip_model(str(tmp_path / "nope.json"))
    # a score head the host cannot apply
    for key, value, needle in (("score_head", "softmax", "score_head"), ("score_scale", -1.0, "score_scale")):
        wrong = json.loads(json.dumps(d))
        wrong["decode"][key] = value
        json.dump(wrong, open(tmp_path / "head.json", "w"))
        with pytest.raises(ChipModelError, match=needle):
            load_chip_model(str(tmp_path / "head.json"))
    # a weight outside its register is refused on save
    cm = load_chip_model(path)
    cm.layers[2].weight[0, 0, 0, 0] = 2 ** (cm.layers[2].weight_bits - 1)
    with pytest.raises(ChipModelError, match="weight register"):
        cm.save(str(tmp_path / "x.json"))


# ------------------------------------------------------------------ ONNX
@needs_data
def test_onnx_equals_emulator_on_real_images(raccoon, tmp_path):
    pytest.importorskip("onnxruntime")
    import onnx
    from gnetmdk.chip.onnx_export import OnnxChipRunner, onnx_header, save_onnx
    s = raccoon
    path = save_onnx(s.chip, str(tmp_path / "m.onnx"))
    m = onnx.load(path)
    ins = [(i.name, i.type.tensor_type.elem_type, [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim])
           for i in m.graph.input]
    outs = [(o.name, o.type.tensor_type.elem_type, [d.dim_param or d.dim_value for d in o.type.tensor_type.shape.dim])
            for o in m.graph.output]
    assert ins == [("image", onnx.TensorProto.UINT8, ["N", 3, 224, 224])]
    assert outs == [("codes", onnx.TensorProto.UINT8, ["N", 16, 14, 14]),
                    ("pred", onnx.TensorProto.FLOAT, ["N", 14, 14, 11])]
    assert {n.op_type for n in m.graph.node} >= {"ConvInteger", "MaxPool", "Clip", "Div", "Gather"}
    assert not any(n.op_type == "Conv" for n in m.graph.node)
    assert onnx_header(path)["classes"] == ["raccoon"]
    emu = ChipEmulator(s.chip)
    with open(path, "rb") as fh:
        runner = OnnxChipRunner(fh.read(), threads=1)
    for i in range(0, len(s.images), 16):
        batch = s.images[i:i + 16]
        e = emu.run(batch)
        o = runner.run(batch)
        assert o.dtype == np.uint8 and np.array_equal(o, e)
        assert torch.equal(torch.from_numpy(runner.predictions(batch)), codes_to_predictions(e, s.chip))
    # every layer
    full = OnnxChipRunner(s.chip, all_layers=True)
    _, lo = full.run(s.images[:8], return_all=True)
    _, le = emu.run(s.images[:8], return_all=True)
    assert len(lo) == 16 and all(np.array_equal(x, y) for x, y in zip(lo, le))


@needs_data
def test_extreme_registers_onnx_and_emulator(raccoon):
    """Weights at the register limits (+-127), biases at +-(2^19 - 1), codes 31: the largest
    accumulations the 8-bit chip can make; int8 GEMM, integer conv, numpy and onnxruntime agree."""
    pytest.importorskip("onnxruntime")
    import copy
    from gnetmdk.chip.onnx_export import OnnxChipRunner
    s = raccoon
    cm = copy.deepcopy(s.chip)
    g = np.random.default_rng(0)
    for i, l in enumerate(cm.layers):
        w = np.where(g.random(l.weight.shape) < 0.7, 127, -127).astype(np.int64)
        w[1::2] = -w[1::2]
        b = np.where(np.arange(l.out_channels) % 3 == 0, 2 ** 19 - 1, -(2 ** 19 - 1)).astype(np.int64)
        b[2::3] = g.integers(-5000, 5000, len(b[2::3]))
        if i == len(cm.layers) - 1:
            w[cm.used_channels:] = 0
            b[cm.used_channels:] = 0
        l.weight, l.bias, l.shift = w, b, 12 if i % 2 else 7
    cm.validate()
    imgs = np.stack([np.full((224, 224, 3), 255, np.uint8), np.zeros((224, 224, 3), np.uint8), s.images[0]])
    ref, lref = ChipEmulator(cm, backend="numpy").run(imgs, return_all=True)
    assert 0 < np.count_nonzero(lref[3]) < lref[3].size          # neither all 0 nor all saturated
    for backend in ("gemm", "conv"):
        out, lout = ChipEmulator(cm, backend=backend).run(imgs, return_all=True)
        assert all(np.array_equal(x, y) for x, y in zip(lout, lref))
    _, lo = OnnxChipRunner(cm, all_layers=True).run(imgs, return_all=True)
    assert all(np.array_equal(x, y) for x, y in zip(lo, lref))


@needs_data
def test_onnx_and_emulator_with_12_bit_registers(raccoon):
    """Chip 2803 (5-bit and 12-bit weight formats, 12-bit weight registers): W_int beyond int8 goes through
    the ONNX Hi/Lo split; model, emulator and onnxruntime agree on every layer."""
    pytest.importorskip("onnxruntime")
    from gnetmdk.chip.onnx_export import OnnxChipRunner
    s = raccoon
    model, caps = build_step4_model(1, s.images[:4], seed=3, chip="2803")
    cm = chip_model_from_gnetdet(model, ["raccoon"], calibrated_caps=caps)
    assert max(int(np.abs(l.weight).max()) for l in cm.layers) > 127
    assert [l.weight_format for l in cm.layers][-1] == 12
    imgs = s.images[:3]
    rep = check_bit_exact(model, ChipEmulator(cm).run, cm, images=imgs)
    assert rep.ok, rep.format()
    rep2 = check_bit_exact(model, OnnxChipRunner(cm, all_layers=True).run, cm, images=imgs)
    assert rep2.ok, rep2.format()


# ------------------------------------------------------------------ converter
@needs_data
def test_convert_tool_writes_chip_gti_and_onnx_files(raccoon, tmp_path, capsys):
    s = raccoon
    out = tmp_path / "model"
    out.mkdir()
    # calibration's relu_cap.txt (pre-edit caps): kept, and read into the chip model
    (out / "relu_cap.txt").write_text("".join(f"{c:.8g}\n" for c in s.caps))
    rc = load_tool("convert_to_chip").main([s.ckpt, "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "padded with zero filters to 16" in text
    cm = load_chip_model(str(out))
    ref, _ = convert_checkpoint(s.ckpt)
    assert cm.header()["major_layers"] == s.chip.header()["major_layers"]
    assert all(np.array_equal(a.weight, b.weight) and np.array_equal(a.bias, b.bias)
               for a, b in zip(cm.layers, s.chip.layers))
    assert cm.calibrated_caps() == pytest.approx(s.caps, rel=1e-6)
    assert cm.source["stage"] == "step4" and cm.source["sha256"] == ref.source["sha256"]
    # GTI text files: w_q = W_int / 2^s, OIHW, one per line, padded channels included
    filt = np.loadtxt(out / "filter.txt")
    bias = np.loadtxt(out / "bias.txt")
    assert len(filt) == sum(l.weight.size for l in cm.layers) and len(bias) == sum(l.out_channels for l in cm.layers)
    off = 0
    for l in cm.layers:
        n = l.weight.size
        assert np.array_equal(filt[off:off + n] * 2.0 ** l.shift, l.weight.ravel())
        off += n
    caps = [float(x) for x in (out / "relu_cap.txt").read_text().split()]
    assert caps == pytest.approx(s.caps, rel=1e-6)
    dat = json.load(open(out / "5801_gnetdet_dat_224.json"))
    assert dat["model"] == [{"ChipType": 5801, "MajorLayerNumber": 6}]
    assert [l["sublayer_number"] for l in dat["layer"]] == [2, 2, 3, 3, 3, 3]
    assert [l["major_layer"] for l in dat["layer"]] == [1, 2, 3, 4, 5, 6]
    assert [l["pooling"] for l in dat["layer"]] == [True, True, True, True, False, False]
    assert [l["image_size"] for l in dat["layer"]] == [224, 112, 56, 28, 14, 14]
    assert [l["coef_bits"] for l in dat["layer"]] == [3, 3, 3, 3, 3, 8]
    assert dat["layer"][-1]["output_channels"] == 16 and dat["layer"][0]["input_channels"] == 3
    assert sum(dat["layer"][i]["scaling"] == [l.shift for l in cm.layers if l.major == i] for i in range(6)) == 6
    mj = json.load(open(out / "5801_gnetdet_model_224.json"))
    assert [l["operation"] for l in mj["layer"]] == ["IMAGEREADER", "GTICNN"]
    assert mj["layer"][0]["input format"] == "CS_BGR24_PLANAR" and mj["layer"][0]["output height"] == 224
    assert mj["layer"][1]["output channels"] == 16 and mj["layer"][1]["device"]["chip"] == "5801"
    assert (out / "chip_model.onnx").stat().st_size > 1000


@needs_data
def test_converter_refusals(raccoon, tmp_path):
    from gnetmdk.checkpoint.io import load_checkpoint, save_checkpoint
    s = raccoon
    base = load_checkpoint(s.ckpt)

    def variant(name, **changes):
        ck = dict(base)
        meta = dict(base["model_meta"])
        meta.update(changes.pop("meta", {}))
        ck.update(changes, model_meta=meta)
        ck.pop("format", None)
        ck.pop("version", None)
        p = str(tmp_path / f"{name}.pth")
        save_checkpoint(p, ck)
        return p

    cases = [
        (variant("step3", stage="step3"), "is a 'step3' checkpoint"),
        (variant("cal", stage="cal"), "is a 'cal' checkpoint"),
        (variant("big", meta={"chip": "2801", "image_size": 448, "mask_bits": []}), "7 major layers, chip 2801 allows at most 6"),
        (variant("classes", meta={"num_classes": 7}), "do not fit the 16 channels"),
        (variant("many", meta={"num_classes": 250}), "at most 256"),
        (variant("bits", meta={"mask_bits": [3, 3, 3, 3, 3, 5]}), "weight format 5 not on chip 5801"),
    ]
    for path, msg in cases:
        with pytest.raises(ConversionError, match=msg):
            convert_checkpoint(path)
    # through the command line: one line on stderr, exit status 2, nothing written
    out = tmp_path / "out"
    r = run_tool("convert_to_chip.py", cases[0][0], "--out", out)
    assert r.returncode == 2 and r.stderr.startswith("error: ") and len(r.stderr.strip().splitlines()) == 1
    assert "train.py --step 4" in r.stderr and not out.exists()
    garbage = tmp_path / "garbage.pth"
    garbage.write_bytes(b"not a checkpoint")
    r = load_tool("convert_to_chip").main([str(garbage), "--out", str(out)])
    assert r == 2


# ------------------------------------------------------------------ chip evaluation = eval_voc
@needs_data
def test_chip_eval_map_equals_eval_voc_and_check_passes(raccoon, tmp_path, capsys):
    s = raccoon
    out = tmp_path / "model"
    assert load_tool("convert_to_chip").main([s.ckpt, "--out", str(out)]) == 0
    capsys.readouterr()
    assert load_tool("eval_voc").main([s.ckpt, "--config", s.config]) == 0
    ev = capsys.readouterr().out
    rc = load_tool("chip_eval").main([str(out / "chip_model.json"), "--config", s.config, "--check"])
    ce = capsys.readouterr().out
    assert rc == 0, ce

    def map_line(text):
        return [l for l in text.splitlines() if l.startswith("mAP")][-1].split()[1]
    assert map_line(ev) == map_line(ce) and float(map_line(ce)) > 0
    assert "bit-exact: every activation code of every layer agrees" in ce and "| equal" in ce
    rows = [l.split() for l in ce.splitlines() if l.startswith("conv")]
    assert len(rows) == 16 and all(r[2] == "0" for r in rows)
    if importlib.util.find_spec("onnxruntime"):
        rc = load_tool("chip_eval").main([str(out / "chip_model.json"), "--config", s.config, "--backend", "onnx"])
        assert rc == 0 and map_line(capsys.readouterr().out) == map_line(ce)


def test_tools_tell_a_section_field_from_a_path():
    """chip_eval and export_int take their model path as an optional positional: a family's section field
    as the first override word (dotted, or by its own name) stays an override, a path stays the path."""
    args, rest = load_tool("chip_eval").parse_args(["--config", "c.py", "gnetdet.size_head", "log"])
    assert args.chip_model is None and rest == ["gnetdet.size_head", "log"]
    args, rest = load_tool("chip_eval").parse_args(["--config", "c.py", "size_head", "log"])
    assert args.chip_model is None and rest == ["size_head", "log"]
    args, rest = load_tool("chip_eval").parse_args(["model/chip_model.json", "size_head", "log"])
    assert args.chip_model == "model/chip_model.json" and rest == ["size_head", "log"]
    args, rest = load_tool("export_int").parse_args(["ppyolo.depth", "18"])
    assert args.checkpoint is None and rest == ["ppyolo.depth", "18"]
    args, rest = load_tool("export_int").parse_args(["ck/best.pth", "depth", "18"])
    assert args.checkpoint == "ck/best.pth" and rest == ["depth", "18"]
    # options first, then overrides, as train.py reads them: --check's optional value is never an override,
    # a path after an override word is that override's value, an option after the overrides is refused
    ov = ["checkpoint_root", "R/ck", "log_root", "R/log", "model_root", "R/model"]
    args, rest = load_tool("chip_eval").parse_args(["--config", "C", "--check", *ov])
    assert args.chip_model is None and args.check is not None and rest == ov
    args, rest = load_tool("chip_eval").parse_args(["--config", "C", "--check", "ck/best.pth", *ov])
    assert args.check == "ck/best.pth" and rest == ov
    args, rest = load_tool("convert_to_chip").parse_args(["--config", "C", *ov[:2], *ov[-2:]])
    assert args.checkpoint is None and rest == [*ov[:2], *ov[-2:]]
    args, rest = load_tool("convert_to_chip").parse_args(["--name", "model_root", "--config", "C"])
    assert args.name == "model_root" and rest == []                 # an option's value, not an override
    with pytest.raises(SystemExit) as stop:
        load_tool("export_int").parse_args(["--config", "C", "depth", "18", "--check"])
    assert stop.value.code == 2


@needs_data
def test_chip_eval_check_reports_and_fails_on_a_wrong_model(raccoon, tmp_path, capsys):
    s = raccoon
    cm = load_chip_model(s.chip.save(str(tmp_path / "ok.json")))
    layer = cm.layers[5]
    layer.bias = layer.bias + (1 << layer.shift)                 # every pre-activation of conv6 moves by 1 code
    cm.save(str(tmp_path / "bad.json"))
    rc = load_tool("chip_eval").main([str(tmp_path / "bad.json"), "--config", s.config, "--check", s.ckpt,
                                      "max_val_images=6"])
    text = capsys.readouterr().out
    assert rc == 1
    rows = {l.split()[0]: int(l.split()[2]) for l in text.splitlines() if l.startswith("conv")}
    assert all(rows[f"conv{i}"] == 0 for i in range(1, 6)) and rows["conv6"] > 0
    assert "NOT bit-exact" in text
    # the right model passes, on the train split too (evaluated without augmentation), with the model
    # family's section fields among the overrides (benchmarks/accuracy.py passes its own on)
    rc = load_tool("chip_eval").main([str(tmp_path / "ok.json"), "--config", s.config, "--check", s.ckpt,
                                      "--split", "train", "max_train_images=5", "gnetdet.size_head", "linear",
                                      "l_range=0"])
    text = capsys.readouterr().out
    assert rc == 0 and "train split: 5 images" in text and "| equal" in text, text
    # user errors: one line, exit 2
    assert load_tool("chip_eval").main([str(tmp_path / "missing.json"), "--config", s.config]) == 2
    other = write_config(str(tmp_path), "cards")
    assert load_tool("chip_eval").main([str(tmp_path / "ok.json"), "--config", other]) == 2
    err = capsys.readouterr().err
    assert "VOC_CLASSES" in err and "does not exist" in err


@needs_data
def test_eval_voc_user_errors(raccoon, tmp_path):
    s = raccoon
    r = run_tool("eval_voc.py", str(tmp_path / "none.pth"), "--config", s.config)
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "does not exist" in r.stderr
    other = write_config(str(tmp_path), "cards")
    assert load_tool("eval_voc").main([s.ckpt, "--config", other]) == 2
    r = run_tool("eval_voc.py", s.ckpt, "--config", s.config, "--stitch")     # raccoon is not a tiled set
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "not a tiled dataset" in r.stderr
    assert r.stdout == ""                                                   # refused before evaluating


# ------------------------------------------------------------------ predict
@needs_data
def test_preprocess_image_is_the_dataset_path(raccoon):
    s = raccoon
    sizes = [s.val.original_size(i) for i in range(len(s.val))]
    big = max(range(len(s.val)), key=lambda i: max(sizes[i]))
    assert max(sizes[big]) > 448                                  # the downscale step is exercised
    for i in (0, big):
        assert np.array_equal(preprocess_image(decode_image(s.val.image_path(i)), 224), s.val.prepare(i)[0])


@needs_data
def test_predict_writes_images_video_and_json(raccoon, tmp_path, capsys):
    s = raccoon
    cm_path = s.chip.save(str(tmp_path / "chip_model.json"))
    src = tmp_path / "in"
    src.mkdir()
    for i in range(2):
        shutil.copy(s.val.image_path(i), src / os.path.basename(s.val.image_path(i)))
    predict = load_tool("predict")
    out = tmp_path / "out"
    assert predict.main([cm_path, str(src), "--out", str(out), "--thresh", "0.05"]) == 0
    doc = json.load(open(out / "detections.json"))
    assert doc["model_kind"] == "chip" and doc["classes"] == ["raccoon"] and len(doc["results"]) == 2
    for r in doc["results"]:
        img = cv2.imread(r["output"])
        assert img is not None and img.shape[:2] == (r["height"], r["width"])
        assert r["detections"] and all(d["class"] == "raccoon" and d["score"] > 0.05 for d in r["detections"])
        assert all(0 <= d["box"][0] <= d["box"][2] <= r["width"] for d in r["detections"])
    # the checkpoint gives the same detections as the chip model
    out2 = tmp_path / "out2"
    assert predict.main([s.ckpt, str(src), "--out", str(out2), "--thresh", "0.05", "--no-draw"]) == 0
    doc2 = json.load(open(out2 / "detections.json"))
    assert [r["detections"] for r in doc2["results"]] == [r["detections"] for r in doc["results"]]
    # a video: 3 frames in, 3 frames out
    frame = cv2.resize(decode_image(s.val.image_path(0)), (160, 120))
    vid = tmp_path / "clip.avi"
    w = cv2.VideoWriter(str(vid), cv2.VideoWriter_fourcc(*"MJPG"), 5, (160, 120))
    for k in range(3):
        w.write(np.roll(frame, 10 * k, axis=1))
    w.release()
    out3 = tmp_path / "out3"
    assert predict.main([cm_path, str(vid), "--out", str(out3)]) == 0
    cap = cv2.VideoCapture(str(out3 / "clip_pred.mp4"))
    n = 0
    while cap.read()[0]:
        n += 1
    assert n == 3
    doc3 = json.load(open(out3 / "detections.json"))
    assert [r["frame"] for r in doc3["results"]] == [0, 1, 2]
    capsys.readouterr()
    assert predict.main([cm_path, str(tmp_path / "missing.jpg")]) == 2
    assert "does not exist" in capsys.readouterr().err


# ------------------------------------------------------------------ stage report
@needs_data
def test_stage_report_step1_to_chip(raccoon, tmp_path, capsys):
    from gnetmdk.models.gnetdet.model import GNetDet
    s = raccoon
    folder = tmp_path / "run"
    cfg_file = write_config(str(folder), "raccoon", max_val_images=12)
    # steps 1..3 from the same initial weights and caps as the step-4 model (helpers' init + calibration)
    from chip_helpers import _init
    pre = GNetDet(num_classes=1, image_size=224, width_mult=0.0625, use_bn=False, chip="5801")
    _init(pre, 0)
    for r, c in zip(pre.relus(), s.caps):
        r.cap.fill_(c)
    for k in (1, 2, 3):
        save_step4_checkpoint(str(folder / "checkpoint" / f"step{k}" / "best.pth"), pre, cfg_file, stage=f"step{k}")
    save_step4_checkpoint(str(folder / "checkpoint" / "step4" / "best.pth"), s.model, cfg_file)
    rc = load_tool("stage_report").main(["--config", cfg_file])
    text = capsys.readouterr().out
    assert rc == 0, text
    table = text[text.index("mAP@0.5"):]
    rows = {l.split()[0]: l.split() for l in table.splitlines() if l.split() and l.split()[0] in
            ("step1", "step2", "step3", "step4", "chip")}
    assert list(rows) == ["step1", "step2", "step3", "step4", "chip"]
    assert rows["chip"][2] == "+0.0000" and rows["chip"][3] == "0" and rows["chip"][4] == "0"
    assert float(rows["step2"][3]) > 0                            # weight quantization moved the outputs
    assert "bit-exact" in text
    # step 3's weights with float activations: the step-3 checkpoint holds the step-2 weights here, so
    # under step 2's switches it scores the step-2 row's mAP exactly; the rest is what its activations cost
    line = next(l for l in text.splitlines() if l.startswith("step 3's weights with float activations"))
    m2, m3 = float(rows["step2"][1]), float(rows["step3"][1])
    assert f"mAP {m2:.4f}," in line
    # the printed difference comes from unrounded mAPs, the rows' from 4-decimal ones: 1e-4 apart at most
    act = float(line.split("5-bit activations ")[1].split()[0])
    assert abs(act - (m3 - m2)) <= 1e-4 + 1e-12 and line.endswith("(the activations)")
    from gnetmdk.checkpoint.io import CheckpointError
    from gnetmdk.chip.report import float_activation_map
    cfg = load_config(cfg_file)
    val = build_dataset(cfg, "valid")
    val.augment = False
    got = float_activation_map(val, str(folder / "checkpoint" / "step3" / "best.pth"), cfg.conf_thresh,
                               cfg.nms_thresh, cfg.max_detections, 16, cfg)
    assert f"{got:.4f}" == rows["step2"][1]
    for k, needle in ((1, "step-1 \\(float\\) model"), (4, "pass the step-3 checkpoint")):
        with pytest.raises(CheckpointError, match=needle):
            float_activation_map(val, str(folder / "checkpoint" / f"step{k}" / "best.pth"), cfg=cfg)
