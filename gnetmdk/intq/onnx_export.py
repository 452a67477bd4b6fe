"""ONNX model of an integer program (gnetmdk.intq.program), built node by node with onnx.helper, and
its evaluation with onnxruntime.

Graph (opset 13; integer operators from the image to the head's accumulators):

    image  uint8 (N, 3, H, W)  RGB pixels
      -> Cast int64, Add 256 c, Gather from the 768-entry table      = the input codes (uint8)
    conv:     Pad(codes, z_in) -> ConvInteger(codes, W + 128 as uint8, zero points z_in / 128)
              -> Add b (int32) -> Cast int64 -> Mul M (Where(acc < 0, M_neg, M) under leaky ReLU)
              -> Add 2^(n-1) + 2^61 -> Div 2^n -> Sub 2^(61-n)      = floor((acc M + 2^(n-1)) / 2^n)
              -> Add z_out -> Clip(lo, 255) -> Cast uint8
              (requant "float": Cast float -> Mul m_c (float32) -> Round (ties to even) -> Cast int64
              -> Add z_out -> Clip -> Cast uint8)
    add:      Cast int64, Sub z, Mul M per input, Add, then the same rounding tail
    concat:   each input requantized as above (when its scale or zero point differs), Concat
    maxpool:  Pad(codes, 0) -> MaxPool on uint8;  upsample: Resize nearest x2 on uint8
    outputs:  accumulators (int32) -> Cast double -> Mul (s_x s_w,c) -> Cast float   ("out0", "out1", ..)

The rounding offset 2^61 keeps the dividend non-negative (``|acc M| < 2^60``, checked when the
program is built), so integer Div (which truncates) floors. Weights are stored as uint8 with zero
point 128 (as the chip model's export, gnetmdk.chip.onnx_export). The program's tensor names
become the graph's; ``all_layers`` adds every op's codes as outputs (the per-layer check).
"""
from __future__ import annotations

import json
from typing import Any, Dict, List

import numpy as np

__all__ = ["build_onnx", "make_session", "run_onnx", "PROVIDERS", "check_provider", "OUTPUT_PREFIX", "INPUT_NAME", "META_KEY"]

OPSET = 13
IR_VERSION = 8
INPUT_NAME = "image"
OUTPUT_PREFIX = "out"
META_KEY = "gnetmdk.int_model"
OFFSET_BITS = 61


class GraphBuilder:
    """Nodes and initializers of one ONNX graph under unique names, for the two exports of an integer
    program (this module and gnetmdk.intq.qdq_export)."""

    def __init__(self):
        self.inits: List[Any] = []
        self.nodes: List[Any] = []
        self._count = 0

    def uid(self, base: str) -> str:
        """``base`` with a counter appended: a name used once in the graph."""
        self._count += 1
        return f"{base}__{self._count}"

    def const(self, name: str, value, dtype) -> str:
        """An initializer holding ``value`` as ``dtype`` (numpy); returns its name."""
        from onnx import numpy_helper
        name = self.uid(name)
        self.inits.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def node(self, op: str, inputs: List[str], base: str, out: str = None, **attrs) -> str:
        """A node of type ``op`` with one output (named ``out``, else a new name from ``base``)."""
        from onnx import helper
        out = out or self.uid(base)
        self.nodes.append(helper.make_node(op, inputs, [out], **attrs))
        return out

    def code_op(self, op: Dict[str, Any]) -> bool:
        """Write an op of an integer program that acts on uint8 codes alike in both exports: "input" (the
        pixels through the 768-entry table), "maxpool" (padding by code 0, below every code), "upsample"
        (nearest x2) and "identity"; its output tensor gets the op's name. Returns False for other ops.
        """
        from onnx import TensorProto
        kind, name = op["op"], op["output"]
        if kind == "input":
            px = self.node("Cast", [INPUT_NAME], "px", to=TensorProto.INT64)
            idx = self.node("Add", [px, self.const("chan", np.arange(3).reshape(1, 3, 1, 1) * 256, np.int64)], "idx")
            self.node("Gather", [self.const("lut", op["lut"].reshape(-1), np.uint8), idx], "lut", out=name, axis=0)
        elif kind == "maxpool":
            x, p = op["inputs"][0], op["p"]
            if p:
                x = self.node("Pad", [x, self.const("pads", [0, 0, p, p, 0, 0, p, p], np.int64),
                                      self.const("padv", 0, np.uint8)], "pad")
            self.node("MaxPool", [x], "pool", out=name, kernel_shape=[op["k"], op["k"]], strides=[op["s"], op["s"]])
        elif kind == "upsample":
            self.node("Resize", [op["inputs"][0], "", self.const("scales", [1, 1, 2, 2], np.float32)], "up", out=name,
                      mode="nearest", coordinate_transformation_mode="asymmetric", nearest_mode="floor")
        elif kind == "identity":
            self.node("Identity", [op["inputs"][0]], "id", out=name)
        else:
            return False
        return True

    def model(self, name: str, outputs: List[Any], meta_key: str, meta: Dict[str, Any] = None, opset: int = OPSET):
        """The checked ModelProto: a uint8 ``(N, 3, H, W)`` image input named :data:`INPUT_NAME`, the
        given output value infos, ``meta`` as JSON under ``meta_key`` in metadata_props.

        Raises:
            onnx.checker.ValidationError: a malformed graph (a bug of the builder, not of the input).
        """
        import onnx
        from onnx import TensorProto, helper
        graph = helper.make_graph(self.nodes, name,
                                  [helper.make_tensor_value_info(INPUT_NAME, TensorProto.UINT8, ["N", 3, "H", "W"])],
                                  outputs, initializer=self.inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], producer_name="gnetmdk")
        model.ir_version = IR_VERSION
        if meta is not None:
            entry = model.metadata_props.add()
            entry.key, entry.value = meta_key, json.dumps(meta)
        onnx.checker.check_model(model)
        return model


def build_onnx(prog: Dict[str, Any], all_layers: bool = False, meta: Dict[str, Any] = None):
    """The ONNX ModelProto of an integer program.

    Args:
        prog: gnetmdk.intq.program.build_program's result.
        all_layers: also output every op's uint8 codes under its tensor name.
        meta: plain data stored as JSON in the model's metadata_props (key :data:`META_KEY`).

    Returns:
        onnx.ModelProto (checked with onnx.checker).
    """
    from onnx import TensorProto, helper

    g = GraphBuilder()
    nodes, uid, const, node = g.nodes, g.uid, g.const, g.node

    def round_shift(v64: str, shift: int, zp: int, lo: int, base: str, out_name: str) -> None:
        """floor((v + 2^(n-1)) / 2^n) + zp, clipped to lo..255, as uint8 named out_name."""
        off = (1 << (shift - 1)) + (1 << OFFSET_BITS)
        v = node("Add", [v64, const("off", off, np.int64)], base)
        v = node("Div", [v, const("div", 1 << shift, np.int64)], base)
        v = node("Sub", [v, const("unoff", 1 << (OFFSET_BITS - shift), np.int64)], base)
        v = node("Add", [v, const("zp", zp, np.int64)], base)
        v = node("Clip", [v, const("lo", lo, np.int64), const("hi", 255, np.int64)], base)
        nodes.append(helper.make_node("Cast", [v], [out_name], to=TensorProto.UINT8))

    def pc(a) -> np.ndarray:
        return np.asarray(a, dtype=np.int64).reshape(1, -1, 1, 1)

    outputs: List[Any] = []
    layer_outputs: List[Any] = []
    n_out = 0
    for op in prog["ops"]:
        kind, name = op["op"], op["output"]
        if g.code_op(op):               # input, maxpool, upsample, identity: alike in both exports
            pass
        elif kind == "conv":
            x = op["inputs"][0]
            ph, pw = op["pad"]
            if ph or pw:
                x = node("Pad", [x, const("pads", [0, 0, ph, pw, 0, 0, ph, pw], np.int64),
                                 const("padv", op["zp_in"], np.uint8)], "pad")
            w = (op["w"].astype(np.int64) + 128).astype(np.uint8)
            acc = node("ConvInteger", [x, const("w", w, np.uint8), const("xzp", op["zp_in"], np.uint8),
                                       const("wzp", 128, np.uint8)], "acc",
                       kernel_shape=list(w.shape[2:]), strides=list(op["stride"]))
            acc = node("Add", [acc, const("b", op["b"].reshape(1, -1, 1, 1), np.int32)], "accb")
            if "scale" in op:
                f = node("Cast", [acc], "acc64", to=TensorProto.DOUBLE)
                f = node("Mul", [f, const("scale", np.asarray(op["scale"]).reshape(1, -1, 1, 1), np.float64)], "deq")
                out = f"{OUTPUT_PREFIX}{n_out}"
                n_out += 1
                nodes.append(helper.make_node("Cast", [f], [out], to=TensorProto.FLOAT))
                outputs.append(helper.make_tensor_value_info(out, TensorProto.FLOAT, [None] * 4))
                continue
            if "m_float" in op:                    # requant "float": rint(float32(acc) * m_c) + z_out
                f = node("Cast", [acc], "accf", to=TensorProto.FLOAT)
                f = node("Mul", [f, const("mf", np.asarray(op["m_float"]).reshape(1, -1, 1, 1), np.float32)], "fm")
                v = node("Cast", [node("Round", [f], "rint")], "r64", to=TensorProto.INT64)
                v = node("Add", [v, const("zp", op["zp"], np.int64)], "rq")
                v = node("Clip", [v, const("lo", op["lo"], np.int64), const("hi", 255, np.int64)], "rq")
                nodes.append(helper.make_node("Cast", [v], [name], to=TensorProto.UINT8))
                if all_layers:
                    layer_outputs.append(helper.make_tensor_value_info(name, TensorProto.UINT8, [None] * 4))
                continue
            a64 = node("Cast", [acc], "acc64", to=TensorProto.INT64)
            if np.array_equal(op["m_pos"], op["m_neg"]):
                m = const("m", pc(op["m_pos"]), np.int64)
            else:
                neg = node("Less", [a64, const("zero", 0, np.int64)], "neg")
                m = node("Where", [neg, const("mneg", pc(op["m_neg"]), np.int64), const("mpos", pc(op["m_pos"]),
                                                                                          np.int64)], "m")
            round_shift(node("Mul", [a64, m], "prod"), op["shift"], op["zp"], op["lo"], "rq", name)
        elif kind == "add":
            terms = []
            for i, zp, m in zip(op["inputs"], (op["zp_a"], op["zp_b"]), (op["m_a"], op["m_b"])):
                v = node("Cast", [i], "a64", to=TensorProto.INT64)
                v = node("Sub", [v, const("zp", zp, np.int64)], "a")
                terms.append(node("Mul", [v, const("m", m, np.int64)], "am"))
            round_shift(node("Add", terms, "sum"), op["shift"], op["zp"], op["lo"], "rq", name)
        else:                                                                      # concat
            parts = []
            for i, part in zip(op["inputs"], op["parts"]):
                if part is None:
                    parts.append(i)
                    continue
                v = node("Cast", [i], "c64", to=TensorProto.INT64)
                v = node("Sub", [v, const("zp", part["zp_in"], np.int64)], "c")
                v = node("Mul", [v, const("m", part["m"], np.int64)], "cm")
                out = uid("part")
                round_shift(v, part["shift"], op["zp"], 0, "rq", out)
                parts.append(out)
            nodes.append(helper.make_node("Concat", parts, [name], axis=1))
        if all_layers:
            layer_outputs.append(helper.make_tensor_value_info(name, TensorProto.UINT8, [None] * 4))
    return g.model("gnetmdk_int_model", outputs + layer_outputs, META_KEY, meta)


#: onnxruntime execution providers by the name the tools take
PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}


def check_provider(provider: str) -> str:
    """onnxruntime's name of ``provider`` ("cpu" or "cuda").

    Raises:
        ValueError: an unknown provider, or one this onnxruntime build does not have (the message
            names the installed ones and the fix).
    """
    import onnxruntime as ort
    if provider not in PROVIDERS:
        raise ValueError(f"unknown onnxruntime provider {provider!r}: choose one of {', '.join(PROVIDERS)}")
    name = PROVIDERS[provider]
    if name not in ort.get_available_providers():
        raise ValueError(f"this onnxruntime has no {name} (it has {', '.join(ort.get_available_providers())}); "
                         "install onnxruntime-gpu for --provider cuda, or use --provider cpu")
    return name


def make_session(model, threads: int = 0, provider: str = "cpu"):
    """An onnxruntime InferenceSession for ``model`` (ModelProto, serialized bytes or a file path) with
    ``threads`` intra-op threads (0: onnxruntime's default) on ``provider`` ("cpu" or "cuda").

    Raises:
        ValueError: an unknown provider, or one this onnxruntime build does not have (the message
            names the installed ones).
    """
    import onnxruntime as ort
    name = check_provider(provider)
    if not isinstance(model, (bytes, str)):
        model = model.SerializeToString()
    opts = ort.SessionOptions()
    if threads:
        opts.intra_op_num_threads = threads
    return ort.InferenceSession(model, opts, providers=[name])


def run_onnx(model, image: np.ndarray, threads: int = 0) -> Dict[str, np.ndarray]:
    """Run an exported integer model with onnxruntime (CPU).

    Args:
        model: ModelProto, serialized bytes or a file path.
        image: ``(N, 3, H, W)`` uint8 RGB pixels.
        threads: intra-op threads (0: onnxruntime's default).

    Returns:
        {output name: array}: ``out0``.. float32, and with ``all_layers`` every op's uint8 codes.
    """
    sess = make_session(model, threads)
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, {INPUT_NAME: np.ascontiguousarray(image, dtype=np.uint8)})))
