"""ONNX model of the integer network (the chip model), built node by node with onnx.helper.

Graph (opset 13, IR version 8, integer operators only between the input and the codes):

    image  uint8 (N, 3, H, W)  8-bit BGR, planar
      -> Cast int32, Gather from a 256-entry table                = the chip's 5-bit input codes (uint8),
         the table being image_to_codes(0..255): min(((x8 >> 2) + 1) >> 1, 31)
    per sublayer (s = shift):
      -> ConvInteger(codes uint8, W_int + 128 as uint8, zero points 0 / 128, pads 1)
                                                                 int32 accumulation of sum(codes * W_int)
         (weights beyond -128..127 are split: W = 128 * Hi + Lo, Lo in 0..127, two ConvIntegers)
      -> Add b_int (int32)
      -> Clip(0, 31 * 2^s), Add 2^(s-1), Div 2^s                = clamp(R(acc / 2^s), 0, 31)
      -> Cast uint8 [-> MaxPool 2x2/2 on uint8 codes]
         (a 10-bit output layer: 1023 for 31, Cast uint16, no pool)
    codes  uint8 (N, C_out, S, S)      the chip's output codes (C_out includes the zero padding; uint16
                                       codes 0..1023 from a 10-bit output layer)
    pred   float32 (N, S, S, 10 + C)   host side: codes[:, :10 + C] * (cap_last / 31 or / 1023), computed in
                                       float64 and rounded once to float32, as the step-4 model does

Why Clip/Add/Div equals the chip's rule: for acc < 0, R(acc/2^s) <= 0 clamps to 0, and Clip gives 0;
for 0 <= acc < 31 * 2^s, (acc + 2^(s-1)) // 2^s is R(acc/2^s) <= 31; above, both give 31.
Weights are stored as uint8 with zero point 128 (onnxruntime's uint8 x uint8 kernels are about 4x faster
than its uint8 x int8 ones on x86); tests/chip/test_chip.py checks the extremes (codes 31, weights -128 and
127) against the emulator. The model's metadata_props hold the chip model's header as JSON
(key "gnetmdk.chip_model"), so tools/predict.py can use an .onnx file on its own.
"""
from __future__ import annotations

import json
from typing import Dict, List

import numpy as np

from gnetmdk.gti.quantize import image_to_codes
from .model_file import ChipModel, ChipModelError

OPSET = 13
IR_VERSION = 8
INPUT_NAME = "image"
CODES_NAME = "codes"
PRED_NAME = "pred"
META_KEY = "gnetmdk.chip_model"


def _split_weights(w: np.ndarray) -> List[np.ndarray]:
    """[W + 128] as uint8 when W fits -128..127, else [Hi + 128, Lo + 128] with W = 128 * Hi + Lo,
    Lo in 0..127 (each read back by ConvInteger with weight zero point 128)."""
    if w.size == 0 or (w.min() >= -128 and w.max() <= 127):
        parts = [w]
    else:
        lo = np.mod(w, 128)
        hi = (w - lo) // 128
        if hi.min() < -128 or hi.max() > 127:
            raise ChipModelError(f"weights up to {np.abs(w).max()} are too wide for the ONNX export (at most 15 bits)")
        parts = [hi, lo]
    return [(p.astype(np.int64) + 128).astype(np.uint8) for p in parts]


def build_onnx(chip_model: ChipModel, all_layers: bool = False):
    """Build the ONNX ModelProto of a chip model.

    Args:
        chip_model: the ChipModel.
        all_layers: also output every sublayer's codes as "layer1".."layerK" (uint8, (N, C_i, H_i, W_i);
            uint16 for a 10-bit output layer).
    Returns:
        onnx.ModelProto (checked with onnx.checker).
    Raises:
        ChipModelError: a layer whose accumulation could overflow int32.
    """
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    nodes, inits = [], []

    def const(name: str, value, dtype) -> str:
        inits.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    h = w = chip_model.input_size
    const("u8_0", 0, np.uint8)
    const("u8_128", 128, np.uint8)
    # the chip's 8-bit -> 5-bit conversion as a 256-entry table made by the training function itself
    const("to_codes_table", image_to_codes(np.arange(256, dtype=np.uint8)), np.uint8)
    nodes += [helper.make_node("Cast", [INPUT_NAME], ["image_i32"], to=TensorProto.INT32),
              helper.make_node("Gather", ["to_codes_table", "image_i32"], ["codes0"], axis=0)]
    x = "codes0"
    outputs = []
    for i, layer in enumerate(chip_model.layers):
        k = i + 1
        if layer.max_abs_acc() + (1 << max(layer.shift - 1, 0)) >= 2 ** 31:
            raise ChipModelError(f"conv{k}: accumulations up to {layer.max_abs_acc()} overflow ONNX ConvInteger's int32")
        parts = _split_weights(layer.weight)
        if len(parts) == 1:
            nodes.append(helper.make_node("ConvInteger", [x, const(f"w{k}", parts[0], np.uint8), "u8_0", "u8_128"],
                                          [f"acc{k}"], pads=[1, 1, 1, 1], kernel_shape=[3, 3], name=f"conv{k}"))
        else:
            nodes += [
                helper.make_node("ConvInteger", [x, const(f"w{k}_hi", parts[0], np.uint8), "u8_0", "u8_128"],
                                 [f"acc{k}_hi"], pads=[1, 1, 1, 1], kernel_shape=[3, 3], name=f"conv{k}_hi"),
                helper.make_node("ConvInteger", [x, const(f"w{k}_lo", parts[1], np.uint8), "u8_0", "u8_128"],
                                 [f"acc{k}_lo"], pads=[1, 1, 1, 1], kernel_shape=[3, 3], name=f"conv{k}_lo"),
                helper.make_node("Mul", [f"acc{k}_hi", const(f"i32_128_{k}", 128, np.int32)], [f"acc{k}_hi128"]),
                helper.make_node("Add", [f"acc{k}_hi128", f"acc{k}_lo"], [f"acc{k}"])]
        s = layer.shift
        nodes += [
            helper.make_node("Add", [f"acc{k}", const(f"b{k}", layer.bias.reshape(1, -1, 1, 1), np.int32)], [f"accb{k}"]),
            helper.make_node("Clip", [f"accb{k}", const(f"lo{k}", 0, np.int32),
                                      const(f"hi{k}", int(layer.max_code) << s, np.int32)], [f"clip{k}"])]
        last = f"clip{k}"
        if s > 0:
            nodes += [helper.make_node("Add", [last, const(f"half{k}", 1 << (s - 1), np.int32)], [f"half{k}_out"]),
                      helper.make_node("Div", [f"half{k}_out", const(f"div{k}", 1 << s, np.int32)], [f"rs{k}"])]
            last = f"rs{k}"
        code_type = TensorProto.UINT8 if layer.max_code <= 255 else TensorProto.UINT16
        nodes.append(helper.make_node("Cast", [last], [f"relu{k}"], to=code_type))
        last = f"relu{k}"
        if layer.pool_after:
            nodes.append(helper.make_node("MaxPool", [last], [f"pool{k}"], kernel_shape=[2, 2], strides=[2, 2]))
            last = f"pool{k}"
        if all_layers:
            nodes.append(helper.make_node("Identity", [last], [f"layer{k}"]))
            outputs.append(helper.make_tensor_value_info(f"layer{k}", code_type,
                                                         ["N", layer.out_channels, layer.output_size,
                                                          layer.output_size]))
        x = last
    g = chip_model.grid
    used = chip_model.used_channels
    scale = float(np.float32(chip_model.output_scale))
    nodes += [
        helper.make_node("Identity", [x], [CODES_NAME]),
        helper.make_node("Slice", [x, const("sl_start", [0], np.int64), const("sl_end", [used], np.int64),
                                   const("sl_axes", [1], np.int64)], ["used_codes"]),
        helper.make_node("Cast", ["used_codes"], ["used_f64"], to=TensorProto.DOUBLE),
        helper.make_node("Mul", ["used_f64", const("out_scale", scale, np.float64)], ["scaled_f64"]),
        helper.make_node("Cast", ["scaled_f64"], ["scaled_f32"], to=TensorProto.FLOAT),
        helper.make_node("Transpose", ["scaled_f32"], [PRED_NAME], perm=[0, 2, 3, 1])]
    graph = helper.make_graph(
        nodes, f"gnetmdk_{chip_model.model_name}_{chip_model.chip}_{chip_model.input_size}",
        [helper.make_tensor_value_info(INPUT_NAME, TensorProto.UINT8, ["N", 3, h, w])],
        [helper.make_tensor_value_info(CODES_NAME, TensorProto.UINT8 if chip_model.output_max_code <= 255
                                       else TensorProto.UINT16, ["N", chip_model.output_channels, g, g]),
         helper.make_tensor_value_info(PRED_NAME, TensorProto.FLOAT, ["N", g, g, used])] + outputs,
        inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION,
                              producer_name="gnetmdk", doc_string=__doc__.split("\n")[0])
    helper.set_model_props(model, {META_KEY: json.dumps(chip_model.header())})
    onnx.checker.check_model(model)
    return model


def onnx_bytes(chip_model: ChipModel, all_layers: bool = False) -> bytes:
    """The serialised ONNX model (build_onnx), nothing written."""
    return build_onnx(chip_model, all_layers).SerializeToString()


def save_onnx(chip_model: ChipModel, path: str, all_layers: bool = False) -> str:
    """Build and write the ONNX model atomically; returns ``path``."""
    from gnetmdk.utils.atomic import atomic_write_bytes
    data = onnx_bytes(chip_model, all_layers)
    atomic_write_bytes(path, lambda fh: fh.write(data))
    return path


def onnx_header(path: str) -> Dict[str, object]:
    """The chip-model header stored in an exported .onnx file's metadata.

    Raises:
        ChipModelError: the file is missing, not ONNX, or was not exported by gnetmdk.
    """
    import onnx
    try:
        model = onnx.load(path, load_external_data=False)
    except Exception as exc:
        raise ChipModelError(f"'{path}' cannot be read as an ONNX model ({exc})") from None
    props = {p.key: p.value for p in model.metadata_props}
    if META_KEY not in props:
        raise ChipModelError(f"'{path}' has no '{META_KEY}' metadata: export it with tools/convert_to_chip.py")
    return json.loads(props[META_KEY])


class OnnxChipRunner:
    """Run an exported chip model with onnxruntime (CPU).

    Args:
        model: path of the .onnx file, or a ChipModel (exported in memory).
        threads: onnxruntime intra-op threads (0 = its default).
        all_layers: with a ChipModel, export every layer's codes too (see :meth:`run`).

    Raises:
        ChipModelError: onnxruntime is not installed (pip install onnxruntime).
    """

    def __init__(self, model, threads: int = 1, all_layers: bool = False):
        try:
            import onnxruntime as ort
        except ImportError:
            raise ChipModelError("onnxruntime is not installed: pip install onnxruntime "
                                 "(or use the integer emulator, --backend emulator)") from None
        so = ort.SessionOptions()
        if threads > 0:
            so.intra_op_num_threads = int(threads)
            so.inter_op_num_threads = 1
        so.log_severity_level = 3
        if isinstance(model, ChipModel):
            data = build_onnx(model, all_layers).SerializeToString()
        else:
            data = model
        self.runtime = ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])
        self.output_names = [o.name for o in self.runtime.get_outputs()]

    def run(self, images, return_all: bool = False):
        """Run on 8-bit images.

        Args:
            images: (N, H, W, 3) uint8 BGR at network size (transposed to the model's planar input here).
            return_all: also return the per-layer codes (needs a model exported with all_layers).
        Returns:
            codes (N, C_out, S, S) uint8 (uint16 from a 10-bit output layer); with ``return_all`` (codes,
            [per-layer codes]).
        """
        x = np.ascontiguousarray(np.asarray(images, dtype=np.uint8).transpose(0, 3, 1, 2))
        if not return_all:
            return self.runtime.run([CODES_NAME], {INPUT_NAME: x})[0]
        layer_names = [n for n in self.output_names if n.startswith("layer")]
        if not layer_names:
            raise ChipModelError("this ONNX model has no per-layer outputs: export it with all_layers=True")
        res = self.runtime.run([CODES_NAME] + layer_names, {INPUT_NAME: x})
        return res[0], res[1:]

    def predictions(self, images) -> np.ndarray:
        """The host-side predictions output "pred": (N, S, S, 10 + C) float32."""
        x = np.ascontiguousarray(np.asarray(images, dtype=np.uint8).transpose(0, 3, 1, 2))
        return self.runtime.run([PRED_NAME], {INPUT_NAME: x})[0]

    __call__ = run
