"""QDQ ONNX model of an integer program (gnetmdk.intq.program): the form the standard int8 runtimes
consume (onnxruntime's CPU, CUDA and NPU providers, OpenVINO), QuantizeLinear / DequantizeLinear
around float operators, from which each runtime fuses what it has integer kernels for.

The integer export (gnetmdk.intq.onnx_export) writes step 4's arithmetic itself and equals it bit for
bit; a QDQ model states only the scales and zero points, and the runtime chooses the arithmetic.
How far that lands from step 4 is measured by ``tools/export_int.py --format qdq --check``
(docs/ppyolo.md, "QDQ export").

Graph (opset 13, NCHW):

    image  uint8 (N, 3, H, W)  RGB pixels
      -> Cast int64, Add 256 c, Gather from the 768-entry table     = the input codes (uint8), exactly
                                                                      step 4's input quantizer
    conv:     DequantizeLinear(codes, s_x, z_x)
              Conv(x, DequantizeLinear(W int8, s_w per output channel, axis 0, zero point 0),
                      DequantizeLinear(b int32, s_x s_w per channel, axis 0, zero point 0))
              -> Relu | LeakyRelu(0.1) | nothing
              -> QuantizeLinear(s_y, z_y) uint8                       (the program's tensor name)
    add:      DequantizeLinear of both inputs -> Add -> Relu -> QuantizeLinear
    concat:   DequantizeLinear of every input -> Concat -> QuantizeLinear
    maxpool:  Pad(codes, 0) -> MaxPool on uint8;  upsample: Resize nearest x2 on uint8
    outputs:  DequantizeLinear -> Conv with dequantized weights and bias -> float32 ("out0", ...)

Weights are per-channel symmetric int8 (zero point 0), activations per-tensor uint8 with zero points,
biases int32 with scale ``s_x s_w`` (float32) and zero point 0: the layout onnxruntime's QDQ
transformer turns into QLinearConv / QLinearAdd / QLinearConcat. The ResNet-D shortcut (2x2 average
pool, then a 1x1 conv) is the program's 2x2 stride-2 conv with the weight scale divided by 4 (exact).
TensorRT's explicit quantization takes only int8 activations with zero point 0 (symmetric); the
project's activations are asymmetric uint8, so TensorRT is not a target of this form.

Tensor names: the program's tensor names hold the uint8 codes (QuantizeLinear outputs), so
``all_layers`` can list them as outputs for the per-layer comparison.
"""
from __future__ import annotations

from typing import Any, Dict, List

import numpy as np

from .onnx_export import OPSET, OUTPUT_PREFIX, GraphBuilder

__all__ = ["build_qdq", "QDQ_META_KEY", "OPSET", "WEIGHT_TYPES"]

QDQ_META_KEY = "gnetmdk.qdq_model"
LEAKY_ALPHA = 0.1
WEIGHT_TYPES = ("int8", "uint8")


def build_qdq(prog: Dict[str, Any], all_layers: bool = False, meta: Dict[str, Any] = None,
              weights: str = "int8"):
    """The QDQ ONNX ModelProto of an integer program (layout in the module docstring).

    Args:
        prog: gnetmdk.intq.program.build_program's result.
        all_layers: also output every quantized tensor's uint8 codes under its tensor name.
        meta: plain data stored as JSON in the model's metadata_props (key :data:`QDQ_META_KEY`).
        weights: "int8" (symmetric, zero point 0: the layout every QDQ runtime takes) or "uint8"
            (the same values as codes + 128 with zero point 128, for onnxruntime on x86 CPUs without
            VNNI, whose int8-weight kernels can saturate 16-bit pair sums; docs/ppyolo.md).

    Returns:
        onnx.ModelProto (checked with onnx.checker).

    Raises:
        ValueError: an unknown ``weights``, or an op kind the QDQ form does not know.
    """
    if weights not in WEIGHT_TYPES:
        raise ValueError(f"weights must be one of {WEIGHT_TYPES}, got {weights!r}")
    from onnx import TensorProto, helper

    g = GraphBuilder()
    const, node = g.const, g.node
    tensors = prog["tensors"]

    def qparams(name: str):
        t = tensors[name]
        return const("scale", t["scale"], np.float32), const("zp", t["zp"], np.uint8)

    def dq(name: str) -> str:
        s, z = qparams(name)
        return node("DequantizeLinear", [name, s, z], "dq")

    def q(x: str, name: str) -> None:
        s, z = qparams(name)
        node("QuantizeLinear", [x, s, z], "q", out=name)

    def act(x: str, kind) -> str:
        if kind == "relu":
            return node("Relu", [x], "relu")
        if kind == "leaky":
            return node("LeakyRelu", [x], "leaky", alpha=LEAKY_ALPHA)
        return x

    outputs: List[Any] = []
    layer_outputs: List[Any] = []
    n_out = 0
    for op in prog["ops"]:
        kind, name = op["op"], op["output"]
        if g.code_op(op):               # input, maxpool, upsample, identity: alike in both exports
            pass
        elif kind == "conv":
            x_name = op["inputs"][0]
            sx = np.float32(tensors[x_name]["scale"])
            sw = np.asarray(op["w_scale"], dtype=np.float32)
            sb = (sx * sw).astype(np.float32)                       # float32 product, as the runtimes form it
            c_out = sw.shape[0]
            if weights == "int8":
                wq, wz = const("w", op["w"], np.int8), const("w_zp", np.zeros(c_out), np.int8)
            else:
                wq = const("w", op["w"].astype(np.int16) + 128, np.uint8)
                wz = const("w_zp", np.full(c_out, 128), np.uint8)
            w = node("DequantizeLinear", [wq, const("w_scale", sw, np.float32), wz], "wdq", axis=0)
            b = node("DequantizeLinear", [const("b", op["b"], np.int32), const("b_scale", sb, np.float32),
                                          const("b_zp", np.zeros(c_out), np.int32)], "bdq", axis=0)
            ph, pw = op["pad"]
            y = node("Conv", [dq(x_name), w, b], "conv", kernel_shape=list(op["w"].shape[2:]),
                     strides=list(op["stride"]), pads=[ph, pw, ph, pw])
            if "scale" in op:                                       # an output conv: float32 out
                out = f"{OUTPUT_PREFIX}{n_out}"
                n_out += 1
                node("Identity", [y], "out", out=out)
                outputs.append(helper.make_tensor_value_info(out, TensorProto.FLOAT, [None] * 4))
                continue
            q(act(y, op.get("act")), name)
        elif kind == "add":
            q(act(node("Add", [dq(i) for i in op["inputs"]], "add"), op["act"]), name)
        elif kind == "concat":
            q(node("Concat", [dq(i) for i in op["inputs"]], "cat", axis=1), name)
        else:
            raise ValueError(f"{name}: op {kind!r} has no QDQ form")
        if all_layers:
            layer_outputs.append(helper.make_tensor_value_info(name, TensorProto.UINT8, [None] * 4))
    return g.model("gnetmdk_qdq_model", outputs + layer_outputs, QDQ_META_KEY, meta, OPSET)
