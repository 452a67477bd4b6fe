"""The QDQ export of PP-YOLO's integer model (device cpu): the graph's structure, onnxruntime's run of it
against step 4 layer by layer, and step 4's "float" requantization (gnetmdk.intq.qdq_export,
gnetmdk.intq.program; docs/ppyolo.md, "QDQ export").

What the runtime may differ in, from analysis: onnxruntime fuses DequantizeLinear -> Conv [-> Relu] ->
QuantizeLinear into QLinearConv (int32 accumulators, then ``rint(float32(acc) * (s_x s_w / s_y))``), so
such a conv whose inputs are equal gives step 4's codes exactly under ``requant float``; leaky-ReLU
convs, adds and concatenations it computes in float32, whose error (~1e-6 of the value) moves a code
only near a rounding boundary, by one. int8 weights of 7 bits cannot saturate the 16-bit pair sums of
the u8s8 kernels of x86 CPUs without VNNI (2 x 255 x 63 < 2^15); 8-bit ones can, so 8-bit weights are
checked in the uint8 layout.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from gnetmdk.intq.calibrate import calibrate_ranges
from gnetmdk.intq.onnx_export import build_onnx, run_onnx
from gnetmdk.intq.program import _requant, build_program, requant_multipliers, run_program
from gnetmdk.intq.qdq_export import build_qdq
from test_intq import _images, _model

torch.set_num_threads(1)


def _program(bits=8, seed=0, requant="float", **kw):
    m = _model(seed=seed, spp=True, iou_aware=True, **kw)
    m.prepare_quant(bits, "max")
    m.set_quant_mode(True, "off", False)
    calibrate_ranges(m, m.quant, lambda: [_images(4, seed=seed + 10)], "mse")
    return m, build_program(m, m.qgraph, m.quant, bits, "max", m.normalize, requant)


def _ort(model, x):
    import onnxruntime as ort
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, {"image": x.to(torch.uint8).numpy()})))


def test_qdq_graph_structure_device_cpu():
    """Per-channel int8 weights on axis 0 with zero point 0, int32 biases with scale float32(s_x s_w) and
    zero point 0, uint8 activations with the calibrated (scale, zero point), opset 13, a uint8 image in
    and float32 head outputs out; the uint8 layout holds the same values as codes + 128."""
    from onnx import TensorProto, numpy_helper
    _, prog = _program()
    model = build_qdq(prog)
    assert model.opset_import[0].version == 13
    assert model.graph.input[0].type.tensor_type.elem_type == TensorProto.UINT8
    assert [o.name for o in model.graph.output] == ["out0", "out1"]
    init = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    nodes = list(model.graph.node)
    by_out = {n.output[0]: n for n in nodes}
    convs = [op for op in prog["ops"] if op["op"] == "conv"]
    conv_nodes = [n for n in nodes if n.op_type == "Conv"]
    assert len(conv_nodes) == len(convs)
    for op, n in zip(convs, conv_nodes):
        x_dq, w_dq, b_dq = (by_out[i] for i in n.input)
        assert x_dq.op_type == w_dq.op_type == b_dq.op_type == "DequantizeLinear"
        w, sw, zw = (init[i] for i in w_dq.input)
        b, sb, zb = (init[i] for i in b_dq.input)
        assert w.dtype == np.int8 and np.array_equal(w, op["w"]) and zw.dtype == np.int8 and not zw.any()
        assert [a.i for a in w_dq.attribute if a.name == "axis"] == [0] and sw.shape == (w.shape[0],)
        assert b.dtype == np.int32 and np.array_equal(b, op["b"]) and zb.dtype == np.int32 and not zb.any()
        sx = np.float32(prog["tensors"][op["inputs"][0]]["scale"])
        assert sb.dtype == np.float32 and np.array_equal(sb, sx * sw)
        assert x_dq.input[0] == op["inputs"][0]
        if op.get("pool"):                                  # the ResNet-D shortcut: 2x2/2 conv, scale / 4
            assert w.shape[2:] == (2, 2) and [a.ints for a in n.attribute if a.name == "strides"][0] == [2, 2]
    # every quantized tensor is a QuantizeLinear output with its calibrated scale and uint8 zero point
    quantized = [op["output"] for op in prog["ops"] if op["op"] in ("add", "concat")
                 or (op["op"] == "conv" and "scale" not in op)]
    for name in quantized:
        q = by_out[name]
        assert q.op_type == "QuantizeLinear"
        s, z = init[q.input[1]], init[q.input[2]]
        assert s == np.float32(prog["tensors"][name]["scale"]) and z.dtype == np.uint8
        assert int(z) == prog["tensors"][name]["zp"]
    leaky = [n for n in nodes if n.op_type == "LeakyRelu"]
    assert leaky and all(abs(n.attribute[0].f - 0.1) < 1e-7 for n in leaky)
    u8 = {t.name: numpy_helper.to_array(t) for t in build_qdq(prog, weights="uint8").graph.initializer}
    w8 = [v for k, v in u8.items() if k.startswith("w__")]
    assert all(v.dtype == np.uint8 for v in w8)
    assert np.array_equal(w8[0].astype(np.int16) - 128, convs[0]["w"])
    with pytest.raises(ValueError, match="weights must be one of"):
        build_qdq(prog, weights="int4")


def _layer_by_layer(prog, x, weights):
    """(ops whose inputs are step 4's and whose codes differ nevertheless: [(name, op, act, largest)],
    the share of equal codes over all layers)."""
    _, kept = run_program(prog, x, keep=True)
    res = _ort(build_qdq(prog, all_layers=True, weights=weights), x)
    own, equal, total = [], 0, 0
    for op in prog["ops"]:
        k = op["output"]
        if k not in kept:
            continue
        d = np.abs(res[k].astype(np.int64) - kept[k].numpy().astype(np.int64))
        equal, total = equal + int((d == 0).sum()), total + d.size
        same_in = all(np.array_equal(res[i], kept[i].numpy()) for i in op["inputs"] if i in kept)
        if same_in and d.max() > 0:
            own.append((k, op["op"], op.get("act"), int(d.max())))
    return own, equal / total


@pytest.mark.parametrize("bits,weights", [(8, "uint8"), (7, "int8")])
@pytest.mark.parametrize("seed", [0, 1])
def test_runtime_layers_equal_float_requant_step4_device_cpu(bits, weights, seed):
    """onnxruntime on the QDQ model against step 4 with ``requant float``, each layer given step 4's
    inputs: the fused convs (ReLU or none) equal to the code, every other op within one code."""
    _, prog = _program(bits, seed)
    own, _ = _layer_by_layer(prog, _images(2, 96, seed=5 + seed), weights)
    assert all(op != "conv" or act == "leaky" for _, op, act, _ in own), own
    assert all(d == 1 for *_, d in own), own


def test_fixed_requant_differs_from_the_runtime_by_its_rounding_device_cpu():
    """Step 4's default fixed-point requantization rounds ties up and uses a 31-bit multiplier, the
    runtime rounds ties to even with a float32 one: a fused conv given equal inputs then differs by at
    most one code, and ``requant float`` removes those differences. What stays, given equal inputs, is
    one code on the ops the runtime computes in float32 (leaky-ReLU convs, adds, concatenations; module
    docstring). No share of equal codes over the whole graph is asserted: a one-code difference early
    on reaches every later layer, and where it falls depends on the calibrated scales, which follow the
    float model's summation order (kernels, threads). For the same reason whether a tie falls in this
    graph at all is left to chance there; the two roundings are compared on constructed ties instead."""
    # the rounding itself: with m = 0.5 every odd accumulator is a tie; fixed-point rounds it up, the
    # runtime's float32 product rounds it to even, one code apart on every other one
    m_int, shift = requant_multipliers(np.array([0.5]))
    acc = torch.arange(-9, 10, dtype=torch.int64)
    fixed_codes = _requant(acc, torch.tensor(int(m_int[0])), shift, 0, -1000)
    runtime = torch.from_numpy(np.rint(acc.numpy().astype(np.float32) * np.float32(0.5)).astype(np.int64))
    assert torch.equal(fixed_codes, torch.floor(acc / 2 + 0.5).long())                 # ties up
    assert torch.equal((fixed_codes - runtime).abs(), ((acc % 4) == 1).long())          # 1, 5, -3, ...: one code
    x = _images(2, 96, seed=5)
    _, fixed = _program(8, 0, "fixed")
    own, _ = _layer_by_layer(fixed, x, "uint8")
    assert all(d == 1 for *_, d in own), own
    _, flt = _program(8, 0, "float")
    own_f, _ = _layer_by_layer(flt, x, "uint8")
    assert not [o for o in own_f if o[1] == "conv" and o[2] != "leaky"], own_f
    assert all(d == 1 and (op != "conv" or act == "leaky") for _, op, act, d in own_f), own_f


def test_float_requant_program_equals_its_integer_export_device_cpu():
    """``requant float`` keeps the exact check: the integer ONNX model (Cast float, Mul, Round) equals
    the torch program on every layer and output, and differs from the fixed-point program in few codes,
    by one."""
    _, prog = _program(8, 0, "float")
    assert any("m_float" in op for op in prog["ops"])
    assert not any("m_float" in op for op in prog["ops"] if op.get("act") == "leaky")
    x = _images(2, 96, seed=3)
    outs, kept = run_program(prog, x, keep=True)
    res = run_onnx(build_onnx(prog, all_layers=True), x.to(torch.uint8).numpy(), threads=1)
    for k, v in kept.items():
        assert np.array_equal(res[k], v.numpy()), k
    for i, o in enumerate(outs):
        assert np.array_equal(res[f"out{i}"], o.numpy())
    _, fixed = _program(8, 0, "fixed")
    _, kf = run_program(fixed, x, keep=True)
    first = next(op["output"] for op in prog["ops"] if op["op"] == "conv")
    d = (kf[first].long() - kept[first].long()).abs()
    assert d.max() <= 1 and (d > 0).float().mean() < 1e-3


def test_requant_mode_travels_with_the_model_device_cpu():
    """PPYOLO.set_requant is recorded in meta() and rebuilt from it; unknown modes are refused."""
    from gnetmdk.models.ppyolo.model import PPYOLO
    m, _ = _program(8, 0)
    m.set_requant("float")
    meta = m.meta()
    assert meta["quant"]["requant"] == "float"
    rebuilt = PPYOLO(**{k: v for k, v in meta.items() if k != "name"})
    rebuilt.load_state_dict(m.state_dict())
    assert rebuilt.integer_program()["requant"] == "float"
    with pytest.raises(ValueError, match="requant must be one of"):
        m.set_requant("half")


def test_export_refuses_a_gnetdet_checkpoint_with_one_line_device_cpu(tmp_path):
    """tools/export_int.py --format qdq on a GNetDet step-4 checkpoint: exit 2, one line naming the
    model and the converter to use, nothing written (a step-3 PP-YOLO checkpoint is refused in
    tests/models/test_ppyolo_train.py)."""
    from chip_helpers import build_step4_model, have, run_tool, save_step4_checkpoint, write_config
    if not have("raccoon"):
        pytest.skip("raccoon dataset not present")
    cfg = write_config(str(tmp_path), "raccoon")
    model, _ = build_step4_model(1, np.random.default_rng(0).integers(0, 256, (2, 224, 224, 3), dtype=np.uint8))
    ck = save_step4_checkpoint(str(tmp_path / "gnetdet.pth"), model, cfg)
    out = tmp_path / "out"
    r = run_tool("export_int.py", ck, "--config", cfg, "--format", "qdq", "--out", out)
    assert r.returncode == 2, r.stdout + r.stderr
    line = r.stderr.strip()
    assert "\n" not in line and "is a 'gnetdet' model" in line and "tools/convert_to_chip.py" in line, line
    assert not out.exists()
