"""The open chip-model file: one self-describing JSON file holding everything the chip runs.

It takes the place of GTI's proprietary ``.model`` binary (docs/chip.md, "GTI's text and JSON
files"): the layer structure, the integer weights and biases (W_int, b_int), the shift of every
sublayer, pooling, caps, the input size, the chip, the class names, the host-side decode settings
and a format version. docs/chip.md documents every field; :func:`load_chip_model` checks them all.

Integer tensors are stored as ``{"dtype", "shape", "encoding": "base64-le", "sha256", "data"}``:
the little-endian bytes of the C-ordered array, base64-encoded, with the SHA-256 of those bytes.
Weights are int16 (the widest weight register is 12 bits), biases int32 (at most 20 bits).
"""
from __future__ import annotations

import base64
import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import numpy as np

from gnetmdk.config.base import BaseConfig, ConfigError
from gnetmdk.gti.quantize import ACT_MAX, MAX_SHIFT

FORMAT = "gnetmdk-chip-model"
#: 2: a layer's weight format is stored as "weight_format" (version 1 named it "scheme"; both are read);
#: 3: a layer's largest code, "max_code" (1023 for a 10-bit output layer). A file is written with the
#: lowest version that describes it (2 while every code is 5 bits), so older readers refuse only what
#: they would misread
VERSION = 3
#: the largest code of a 10-bit output layer (the chip's 10-bit output mode, docs/chip.md)
OUTPUT_MAX_CODE_10 = 1023
#: partial sums below this are exact in float32 (24-bit significand); docs/quantization.md, "Integer semantics"
FLOAT32_EXACT_LIMIT = 2 ** 24


class ChipModelError(ConfigError):
    """A chip-model file that is missing, malformed or inconsistent; the message names the file and field."""


# ------------------------------------------------------------------ tensors
def encode_tensor(array: np.ndarray, dtype: str) -> Dict[str, Any]:
    """Encode an integer array for the chip-model file.

    Args:
        array: integer array (any shape); every value must fit ``dtype``.
        dtype: "int16" or "int32".
    Returns:
        {"dtype", "shape", "encoding": "base64-le", "sha256", "data"}.
    Raises:
        ValueError: a value does not fit ``dtype``.
    """
    a = np.asarray(array)
    info = np.iinfo(dtype)
    if a.size and (a.min() < info.min or a.max() > info.max):
        raise ValueError(f"values {a.min()}..{a.max()} do not fit {dtype}")
    raw = np.ascontiguousarray(a.astype("<" + np.dtype(dtype).str[1:])).tobytes()
    return {"dtype": dtype, "shape": list(a.shape), "encoding": "base64-le",
            "sha256": hashlib.sha256(raw).hexdigest(), "data": base64.b64encode(raw).decode("ascii")}


def decode_tensor(obj: Dict[str, Any], where: str) -> np.ndarray:
    """Decode a tensor written by :func:`encode_tensor` into an int64 array.

    Raises:
        ChipModelError: unknown dtype or encoding, wrong byte count, checksum mismatch (``where``
        names the file and field).
    """
    try:
        dtype, shape, enc, digest, data = (obj["dtype"], obj["shape"], obj["encoding"], obj["sha256"], obj["data"])
    except (KeyError, TypeError):
        raise ChipModelError(f"{where}: a tensor needs dtype, shape, encoding, sha256 and data") from None
    if dtype not in ("int8", "int16", "int32", "int64") or enc != "base64-le":
        raise ChipModelError(f"{where}: unsupported tensor dtype {dtype!r} / encoding {enc!r} "
                             "(expected int8..int64, base64-le)")
    try:
        raw = base64.b64decode(data.encode("ascii"), validate=True)
    except Exception:
        raise ChipModelError(f"{where}: data is not valid base64") from None
    if hashlib.sha256(raw).hexdigest() != digest:
        raise ChipModelError(f"{where}: SHA-256 mismatch: the file is corrupted or was edited by hand; "
                             "convert the checkpoint again (tools/convert_to_chip.py)")
    dt = np.dtype("<" + np.dtype(dtype).str[1:])
    n = int(np.prod(shape)) if len(shape) else 1
    if len(raw) != n * dt.itemsize:
        raise ChipModelError(f"{where}: {len(raw)} bytes for shape {shape} of {dtype}")
    return np.frombuffer(raw, dtype=dt).reshape(shape).astype(np.int64)


# ------------------------------------------------------------------ structure
@dataclass
class ChipLayer:
    """One sublayer as the chip runs it: 3x3 conv (stride 1, pad 1) + ReLU to codes + optional 2x2 pool.

    Attributes:
        major, index_in_major: 0-based major layer and position inside it.
        in_channels, out_channels: channel counts as stored (the last conv is padded, see
            gnetmdk.chip.convert.padded_output_channels).
        weight_format, weight_bits, bias_bits: mask bits and register widths (Bw, Bb) of the major layer.
        shift: s, 0..12: out = clamp(R((sum W_int * a + b_int) / 2^s), 0, max_code).
        pool_after: a 2x2/2 max pool on the codes follows.
        input_size: spatial side (pixels) of this sublayer's input.
        weight: (out_channels, in_channels, 3, 3) int64 W_int.
        bias: (out_channels,) int64 b_int.
        calibrated_cap: the cap calibration measured for this conv before gain editing (None if unknown).
        max_code: the largest output code: 31, or 1023 for a 10-bit output layer (the last layer only,
            alone in its major layer, without a pool: the chip's 10-bit output mode, docs/chip.md).
    """
    major: int
    index_in_major: int
    in_channels: int
    out_channels: int
    weight_format: int
    weight_bits: int
    bias_bits: int
    shift: int
    pool_after: bool
    input_size: int
    weight: np.ndarray
    bias: np.ndarray
    calibrated_cap: Optional[float] = None
    max_code: int = ACT_MAX

    @property
    def output_size(self) -> int:
        """Spatial side after the optional pool."""
        return self.input_size // 2 if self.pool_after else self.input_size

    def max_abs_acc(self) -> int:
        """Bound on |every partial sum| of the integer accumulation: max_o sum|W_int[o]| * 31 + |b_int[o]|
        (the input codes are 5-bit: only the last layer may have wider codes)."""
        w = np.abs(self.weight.reshape(self.out_channels, -1)).sum(axis=1) * ACT_MAX
        return int((w + np.abs(self.bias)).max()) if self.out_channels else 0

    def float32_exact(self) -> bool:
        """True when every partial sum stays below 2^24, so float32 convolution would be exact too."""
        return self.max_abs_acc() < FLOAT32_EXACT_LIMIT


@dataclass
class ChipModel:
    """A converted network: what the chip stores plus what the host needs to decode its output.

    Attributes:
        chip: "2801", "2803" or "5801".
        model_name: "gnetdet".
        input_size: square input side in pixels (the chip reads (input_size, input_size) 8-bit BGR).
        layers: the sublayers in order.
        class_names: C names, label order.
        used_channels: 10 + C, the output channels the host decodes (the rest is padding).
        output_scale: float32 cap_last / 31 (cap_last / 1023 with a 10-bit output layer): the host
            multiplies the output codes by it.
        grid: S, the output side (14).
        conf_thresh, nms_thresh, max_detections: decode settings used for mAP.
        predict_thresh: score threshold of tools/predict.py.
        score_head, score_offset, score_scale: how the host turns confidence / class outputs into scores: "linear"
            (the outputs themselves, GTI) or "logit" (sigmoid(score_scale * (output - score_offset)));
            gnetmdk.models.gnetdet.head.output_scores.
        size_head, size_min: how the host turns the w, h outputs into box sizes: "linear" (the outputs
            themselves, GTI) or "log" (size_min ** (1 - output)); gnetmdk.models.gnetdet.head.output_sizes.
        source: where it came from (checkpoint path, SHA-256, stage, mAP ...).
    """
    chip: str
    model_name: str
    input_size: int
    layers: List[ChipLayer]
    class_names: List[str]
    used_channels: int
    output_scale: float
    grid: int = 14
    conf_thresh: float = BaseConfig.conf_thresh
    nms_thresh: float = 0.5
    max_detections: int = 100
    predict_thresh: float = 0.3
    score_head: str = "linear"
    score_offset: float = 4.0
    score_scale: float = 1.0
    size_head: str = "linear"
    size_min: float = 1.0 / 64
    source: Dict[str, Any] = field(default_factory=dict)

    # -------------------------------------------------------------- derived
    @property
    def num_classes(self) -> int:
        """C, the number of classes."""
        return len(self.class_names)

    @property
    def output_channels(self) -> int:
        """Channels the chip outputs (padded)."""
        return self.layers[-1].out_channels

    @property
    def cap_last(self) -> float:
        """The last conv's calibrated cap: output_scale * 31 (* 1023 with a 10-bit output layer)."""
        return float(np.float32(self.output_scale)) * self.output_max_code

    @property
    def output_max_code(self) -> int:
        """The output layer's largest code: 31, or 1023 in the chip's 10-bit output mode."""
        return int(self.layers[-1].max_code) if self.layers else ACT_MAX

    @property
    def output_bits(self) -> int:
        """The output codes' width in bits: 5, or 10 (the chip's 10-bit output mode)."""
        return 10 if self.output_max_code == OUTPUT_MAX_CODE_10 else 5

    @property
    def version(self) -> int:
        """The format version this model is written with: 3 with a 10-bit output layer, else 2."""
        return 3 if any(l.max_code != ACT_MAX for l in self.layers) else 2

    def major_layers(self) -> List[List[int]]:
        """Sublayer indices grouped by major layer."""
        groups: Dict[int, List[int]] = {}
        for i, l in enumerate(self.layers):
            groups.setdefault(l.major, []).append(i)
        return [groups[m] for m in sorted(groups)]

    def calibrated_caps(self) -> Optional[List[float]]:
        """Per-conv caps before gain editing, or None when the source did not record them."""
        caps = [l.calibrated_cap for l in self.layers]
        return None if any(c is None for c in caps) else [float(c) for c in caps]

    # -------------------------------------------------------------- (de)serialisation
    def header(self) -> Dict[str, Any]:
        """Everything but the tensors (also stored in the ONNX model's metadata)."""
        majors = []
        for m, idx in enumerate(self.major_layers()):
            first, last = self.layers[idx[0]], self.layers[idx[-1]]
            majors.append({"major_layer": m + 1, "coef_bits": first.weight_format, "image_size": first.input_size,
                           "input_channels": first.in_channels, "output_channels": last.out_channels,
                           "pooling": bool(last.pool_after), "sublayer_number": len(idx),
                           "scaling": [self.layers[i].shift for i in idx]})
            if last.max_code != ACT_MAX:            # GTI's name for the 10-bit output mode of a major layer
                majors[-1]["ten_bits_enable"] = True
        activation = {"bits": 5, "max_code": ACT_MAX}
        if self.output_bits != 5:
            activation.update(output_bits=self.output_bits, output_max_code=self.output_max_code)
        return {
            "format": FORMAT, "version": self.version, "chip": self.chip, "model": self.model_name,
            "input": {"height": self.input_size, "width": self.input_size, "channels": 3, "pixel_bits": 8,
                      "color_order": "BGR", "to_codes": "x5 = min(((x8 >> 2) + 1) >> 1, 31)"},
            "activation": activation,
            "output": {"height": self.grid, "width": self.grid, "channels": self.output_channels,
                       "used_channels": self.used_channels, "scale": float(np.float32(self.output_scale)),
                       "cap_last": self.cap_last,
                       "host": "pred[n, y, x, c] = codes[n, c, y, x] * scale for c < used_channels"},
            "classes": list(self.class_names),
            "decode": {"grid": self.grid, "boxes_per_cell": 2, "conf_thresh": float(self.conf_thresh),
                       "nms_thresh": float(self.nms_thresh), "max_detections": int(self.max_detections),
                       "predict_thresh": float(self.predict_thresh), "score_head": self.score_head,
                       "score_offset": float(self.score_offset), "score_scale": float(self.score_scale),
                       "size_head": self.size_head, "size_min": float(self.size_min)},
            "major_layers": majors,
            "source": dict(self.source),
        }

    def to_dict(self) -> Dict[str, Any]:
        """The whole file as a JSON-ready dict (header plus "layers" with encoded tensors)."""
        d = self.header()
        d["layers"] = [{
            "name": f"conv{i + 1}", "major": l.major + 1, "sublayer": l.index_in_major + 1,
            "in_channels": l.in_channels, "out_channels": l.out_channels, "input_size": l.input_size,
            "weight_format": l.weight_format, "weight_bits": l.weight_bits, "bias_bits": l.bias_bits, "shift": l.shift,
            "pool_after": bool(l.pool_after), "cap": float(l.max_code), "calibrated_cap": l.calibrated_cap,
            "max_abs_acc": l.max_abs_acc(), "float32_exact": l.float32_exact(),
            "weight": encode_tensor(l.weight, "int16"), "bias": encode_tensor(l.bias, "int32"),
            **({"max_code": int(l.max_code)} if l.max_code != ACT_MAX else {}),
        } for i, l in enumerate(self.layers)]
        return d

    def to_json(self, where: str = "chip model") -> str:
        """Validate, then the file's text (what :meth:`save` writes).

        Raises:
            ChipModelError: the model is inconsistent (see :meth:`validate`).
        """
        self.validate(where)
        return json.dumps(self.to_dict(), indent=1) + "\n"

    def save(self, path: str) -> str:
        """Validate, then write the file atomically; returns ``path``.

        Raises:
            ChipModelError: the model is inconsistent (see :meth:`validate`).
        """
        from gnetmdk.utils.atomic import atomic_write_text
        atomic_write_text(path, self.to_json(path))
        return path

    # -------------------------------------------------------------- checks
    def validate(self, where: str = "chip model") -> None:
        """Check the structure against itself (the chip's own limits are checked by the converter).

        Raises:
            ChipModelError: naming the layer and field: a channel chain that does not connect, a
            tensor of the wrong shape, a weight or bias outside its register, a shift outside
            0..12, a pool on an odd size, an output grid or channel count that does not match.
        """
        if not self.layers:
            raise ChipModelError(f"{where}: no layers")
        size, cin = self.input_size, 3
        for i, l in enumerate(self.layers):
            name = f"{where}: layers[{i}] (conv{i + 1})"
            if l.in_channels != cin:
                raise ChipModelError(f"{name}: in_channels {l.in_channels}, but the previous layer gives {cin}")
            if l.input_size != size:
                raise ChipModelError(f"{name}: input_size {l.input_size}, but the previous layer gives {size}")
            if tuple(l.weight.shape) != (l.out_channels, l.in_channels, 3, 3):
                raise ChipModelError(f"{name}: weight shape {tuple(l.weight.shape)}, expected "
                                     f"({l.out_channels}, {l.in_channels}, 3, 3)")
            if tuple(l.bias.shape) != (l.out_channels,):
                raise ChipModelError(f"{name}: bias shape {tuple(l.bias.shape)}, expected ({l.out_channels},)")
            if not 0 <= l.shift <= MAX_SHIFT:
                raise ChipModelError(f"{name}: shift {l.shift} outside 0..{MAX_SHIFT}")
            wlim, blim = 2 ** (l.weight_bits - 1) - 1, 2 ** (l.bias_bits - 1) - 1
            if l.weight.size and np.abs(l.weight).max() > wlim:
                raise ChipModelError(f"{name}: |W_int| up to {np.abs(l.weight).max()} exceeds the {l.weight_bits}-bit "
                                     f"weight register (+-{wlim})")
            if l.bias.size and np.abs(l.bias).max() > blim:
                raise ChipModelError(f"{name}: |b_int| up to {np.abs(l.bias).max()} exceeds the {l.bias_bits}-bit "
                                     f"bias register (+-{blim})")
            if l.pool_after and size % 2:
                raise ChipModelError(f"{name}: 2x2 pool on an odd size {size}")
            if l.max_code != ACT_MAX:
                alone = [o for o in self.layers if o.major == l.major]
                if (l.max_code != OUTPUT_MAX_CODE_10 or i != len(self.layers) - 1 or len(alone) != 1
                        or l.pool_after):
                    raise ChipModelError(f"{name}: max_code {l.max_code}: codes are 0..{ACT_MAX}, or 0.."
                                         f"{OUTPUT_MAX_CODE_10} in the last layer alone in its major layer and "
                                         "without a pool (the chip's 10-bit output mode)")
            size, cin = l.output_size, l.out_channels
        if size != self.grid:
            raise ChipModelError(f"{where}: the layers end at {size}x{size}, but grid is {self.grid}")
        if not 10 < self.used_channels <= cin or self.used_channels != 10 + self.num_classes:
            raise ChipModelError(f"{where}: used_channels {self.used_channels} must be 10 + {self.num_classes} "
                                 f"classes and at most the {cin} output channels")
        pad = self.layers[-1]
        if np.any(pad.weight[self.used_channels:]) or np.any(pad.bias[self.used_channels:]):
            raise ChipModelError(f"{where}: padded output channels {self.used_channels}..{cin - 1} must have zero "
                                 "weights and biases")
        if self.score_head not in ("linear", "logit"):
            raise ChipModelError(f"{where}: decode.score_head {self.score_head!r} must be 'linear' or 'logit'")
        if not (math.isfinite(self.score_scale) and self.score_scale > 0):
            raise ChipModelError(f"{where}: decode.score_scale {self.score_scale} must be a positive number")
        if self.size_head not in ("linear", "log"):
            raise ChipModelError(f"{where}: decode.size_head {self.size_head!r} must be 'linear' or 'log'")
        if not (math.isfinite(self.size_min) and 0 < self.size_min < 1):
            raise ChipModelError(f"{where}: decode.size_min {self.size_min} must be in (0, 1) (a fraction of the "
                                 "image side)")
        if not (math.isfinite(self.output_scale) and self.output_scale > 0):
            raise ChipModelError(f"{where}: output scale {self.output_scale} must be a positive number")


def _field(d: Dict[str, Any], key: str, where: str):
    try:
        return d[key]
    except (KeyError, TypeError):
        raise ChipModelError(f"{where}: missing field '{key}'") from None


def chip_model_from_dict(d: Dict[str, Any], where: str = "chip model") -> ChipModel:
    """Rebuild a ChipModel from :meth:`ChipModel.to_dict` output, validating it.

    Raises:
        ChipModelError: wrong format tag, newer version, missing field, bad tensor, inconsistency.
    """
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise ChipModelError(f"{where}: not a gnetmdk chip model (format tag '{FORMAT}' missing): convert a "
                             "step-4 checkpoint with tools/convert_to_chip.py")
    version = d.get("version")
    if not isinstance(version, int) or version > VERSION:
        raise ChipModelError(f"{where}: format version {version!r}; this gnetmdk reads version {VERSION} and "
                             "older: update gnetmdk or convert again")
    layers = []
    for i, ld in enumerate(_field(d, "layers", where)):
        lw = f"{where}: layers[{i}]"
        layers.append(ChipLayer(
            major=int(_field(ld, "major", lw)) - 1, index_in_major=int(_field(ld, "sublayer", lw)) - 1,
            in_channels=int(_field(ld, "in_channels", lw)), out_channels=int(_field(ld, "out_channels", lw)),
            weight_format=int(_field(ld, "weight_format" if version >= 2 else "scheme", lw)),
            weight_bits=int(_field(ld, "weight_bits", lw)),
            bias_bits=int(_field(ld, "bias_bits", lw)), shift=int(_field(ld, "shift", lw)),
            pool_after=bool(_field(ld, "pool_after", lw)), input_size=int(_field(ld, "input_size", lw)),
            weight=decode_tensor(_field(ld, "weight", lw), lw + ".weight"),
            bias=decode_tensor(_field(ld, "bias", lw), lw + ".bias"),
            calibrated_cap=None if ld.get("calibrated_cap") is None else float(ld["calibrated_cap"]),
            max_code=int(ld.get("max_code", ACT_MAX))))
    out = _field(d, "output", where)
    dec = _field(d, "decode", where)
    inp = _field(d, "input", where)
    cm = ChipModel(chip=str(_field(d, "chip", where)), model_name=str(d.get("model", "gnetdet")),
                   input_size=int(_field(inp, "height", where + ": input")), layers=layers,
                   class_names=[str(c) for c in _field(d, "classes", where)],
                   used_channels=int(_field(out, "used_channels", where + ": output")),
                   output_scale=float(_field(out, "scale", where + ": output")),
                   grid=int(_field(dec, "grid", where + ": decode")),
                   conf_thresh=float(_field(dec, "conf_thresh", where + ": decode")),
                   nms_thresh=float(_field(dec, "nms_thresh", where + ": decode")),
                   max_detections=int(_field(dec, "max_detections", where + ": decode")),
                   predict_thresh=float(dec.get("predict_thresh", 0.3)),
                   score_head=str(dec.get("score_head", "linear")), score_offset=float(dec.get("score_offset", 4.0)),
                   score_scale=float(dec.get("score_scale", 1.0)),
                   size_head=str(dec.get("size_head", "linear")), size_min=float(dec.get("size_min", 1.0 / 64)),
                   source=dict(d.get("source", {})))
    cm.validate(where)
    _check_structure(d, cm, where)
    return cm


def _check_structure(d: Dict[str, Any], cm: ChipModel, where: str) -> None:
    """The layers against themselves and against the file's ``major_layers`` summary, which the
    converter writes from the same layers: a sublayer deleted, added or moved in one place and not in
    the other (a hand edit, a bad merge) is refused rather than run.

    Raises:
        ChipModelError: naming the layer or major layer and the field that disagrees.
    """
    expect_major, expect_sub = 0, 0
    for i, l in enumerate(cm.layers):
        if l.major == expect_major + 1 and i > 0:
            expect_major, expect_sub = expect_major + 1, 0
        if l.major != expect_major or l.index_in_major != expect_sub:
            raise ChipModelError(f"{where}: layers[{i}] (conv{i + 1}) is sublayer {l.index_in_major + 1} of major layer "
                                 f"{l.major + 1}; expected sublayer {expect_sub + 1} of major layer {expect_major + 1} "
                                 "(a sublayer was deleted, added or moved): convert the checkpoint again")
        expect_sub += 1
    summary = d.get("major_layers")
    if not isinstance(summary, list):
        raise ChipModelError(f"{where}: missing field 'major_layers' (the per-major-layer summary): convert again")
    have = cm.header()["major_layers"]
    if len(summary) != len(have):
        raise ChipModelError(f"{where}: major_layers lists {len(summary)} major layers, the layers make {len(have)}: "
                             "a major layer was deleted or added; convert the checkpoint again")
    for m, (a, b) in enumerate(zip(summary, have)):
        for key in ("sublayer_number", "scaling", "coef_bits", "pooling", "image_size", "input_channels",
                    "output_channels", "ten_bits_enable"):
            if not isinstance(a, dict) or a.get(key) != b.get(key):
                got = a.get(key) if isinstance(a, dict) else a
                raise ChipModelError(f"{where}: major layer {m + 1}: major_layers says {key} {got!r}, the layers give "
                                     f"{b[key]!r} (a sublayer was deleted, added or edited): convert the checkpoint "
                                     "again")


def load_chip_model(path: str) -> ChipModel:
    """Read and validate a chip-model file.

    Args:
        path: the .json file written by tools/convert_to_chip.py (or a folder holding chip_model.json).
    Raises:
        ChipModelError: missing or unreadable file, not JSON, or any check of chip_model_from_dict.
    """
    if os.path.isdir(path):
        path = os.path.join(path, "chip_model.json")
    if not os.path.isfile(path):
        raise ChipModelError(f"chip model '{path}' does not exist: convert a step-4 checkpoint first "
                             "(python3 tools/convert_to_chip.py)")
    try:
        with open(path, "r", encoding="utf-8") as fh:
            d = json.load(fh)
    except (OSError, ValueError) as exc:
        raise ChipModelError(f"chip model '{path}' cannot be read as JSON ({exc}): convert again") from None
    return chip_model_from_dict(d, f"chip model '{path}'")
