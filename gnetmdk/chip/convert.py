"""Step-4 checkpoint -> chip model: integerise every sublayer with the training quantizer.

The integers come from :func:`gnetmdk.gti.quantize.integer_conv_params` (through
``QConv2d.integer_params``), the very function whose values the step-4 model computes with, so the
chip model and the trained model cannot drift.

Padding of the last conv (docs/chip.md, "The converter": a major layer has one output channel count in
GTI's dat JSON; GTI's own converter pads GNetDet's last conv to the 256 channels of its major layer):
the 10 + C outputs are padded with zero filters (W_int = 0, b_int = 0, so their codes are always 0) up
to the channel count of the other sublayers of the last major layer, a power of 2. A last major layer
with a single sublayer pads to the next power of 2 (at least the chip's minimum). When 10 + C exceeds
that width the model is refused.
"""
from __future__ import annotations

import math
import os
import sys
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch

from gnetmdk.checkpoint.outputs import file_sha256
from gnetmdk.config.base import BaseConfig
from gnetmdk.gti.quantize import ACT_MAX, MAX_SHIFT
from gnetmdk.gti.memory import check_chip_memory, chip_layers_memory
from gnetmdk.gti.spec import ChipSpecError, get_chip_spec
from gnetmdk.models.gnetdet.model import ChipLimitError, check_chip_limits, gnetdet_layers
from .model_file import ChipLayer, ChipModel


class ConversionError(ChipLimitError):
    """A checkpoint the chip cannot run (wrong stage, a chip limit, bad metadata); the message says why and the fix."""


def _next_pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def padded_output_channels(used: int, major_widths: Sequence[int], min_channels: int, where: str = "last conv") -> int:
    """Output channels the chip stores for the last conv.

    Args:
        used: 10 + C.
        major_widths: output channels of the other sublayers of the last major layer (may be empty).
        min_channels: the chip's minimum channel count.
    Returns:
        the width of the last major layer; with no other sublayer, max(next power of 2 >= used, min_channels).
    Raises:
        ConversionError: ``used`` is larger than the major layer's width.
    """
    if major_widths:
        width = int(major_widths[-1])
        if used > width:
            raise ConversionError(
                f"{where}: {used} outputs (10 + {used - 10} classes) do not fit the {width} channels of its major "
                f"layer (the chip runs one channel count per major layer): use at most {width - 10} classes or a "
                f"larger width_mult")
        return width
    return max(_next_pow2(used), int(min_channels))


def check_checkpoint_for_chip(ckpt: Dict[str, Any], path: str = "?") -> None:
    """Refuse, before building anything, a checkpoint the chip cannot run.

    Checks: the stage is "step4"; the model is GNetDet; its layer list for (image_size, classes,
    width_mult, chip, mask_bits) passes the chip's limits (input size, major layers, sublayers,
    weight_formats, channel counts, last-layer outputs) and its memory limits (per-layer input + output,
    coefficient memory; gnetmdk.gti.memory, docs/chip.md "Memory limits").

    Raises:
        ConversionError: naming the checkpoint, the reason and the fix.
    """
    stage = ckpt.get("stage")
    meta = dict(ckpt.get("model_meta") or {})
    if meta.get("name") == "ppyolo":
        raise ConversionError(
            f"checkpoint '{path}' is a PP-YOLO model, which the chip cannot run: the chip computes only GNetDet-style "
            "3x3 stride-1 convolutions with ReLU and 2x2 max pooling, and PP-YOLO has 1x1 and strided convs, "
            "residual adds, average pooling, upsampling and concatenation (and leaky ReLU; deformable convs in "
            "r50vd). Export its integer model instead: python3 tools/export_int.py checkpoint/step4/best.pth")
    if stage != "step4":
        raise ConversionError(
            f"checkpoint '{path}' is a {stage!r} checkpoint; the chip runs step-4 models (integer activations, "
            "gain-edited): run 'python3 train.py --step 4' and convert checkpoint/step4/best.pth")
    if meta.get("name") != "gnetdet":
        raise ConversionError(f"checkpoint '{path}': model {meta.get('name')!r} is not supported by the chip "
                              "converter (only gnetdet)")
    if meta.get("use_bn"):
        raise ConversionError(f"checkpoint '{path}' still has BatchNorm; a step-4 model must have it folded "
                              "(train steps 2..4 from it)")
    try:
        spec = get_chip_spec(meta.get("chip"))
        head = float(meta.get("head_width_mult", 0.0))       # 0 in checkpoints from before the field
        output_bits = int(meta.get("output_bits", 5))          # 5 in checkpoints from before the field
        layers = gnetdet_layers(int(meta["image_size"]), int(meta["num_classes"]), float(meta["width_mult"]),
                                str(meta["chip"]), meta.get("mask_bits") or (), head, output_bits)
        check_chip_limits(layers, spec, int(meta["image_size"]), output_bits)
    except KeyError as exc:
        raise ConversionError(f"checkpoint '{path}': model_meta lacks {exc}; it was not written by gnetmdk's "
                              "trainer") from None
    except ChipLimitError as exc:
        raise ConversionError(f"checkpoint '{path}' cannot run on chip {meta.get('chip')}: {exc}") from None
    others = [l.out_channels for l in layers[:-1] if l.major == layers[-1].major]
    padded_output_channels(layers[-1].out_channels, others, spec.min_channels,
                           f"checkpoint '{path}': conv {len(layers)} (the output layer)")
    from gnetmdk.models.gnetdet.config import check_gnetdet_memory
    try:
        check_gnetdet_memory(int(meta["image_size"]), int(meta["num_classes"]), float(meta["width_mult"]),
                             str(meta["chip"]), meta.get("mask_bits") or (), head_width_mult=head,
                             output_bits=output_bits)
    except ChipSpecError as exc:
        raise ConversionError(f"checkpoint '{path}' cannot run on chip {spec.name}: {exc} (and retrain)") from None


@torch.no_grad()
def chip_model_from_gnetdet(model, class_names: Sequence[str], conf_thresh: float = BaseConfig.conf_thresh, nms_thresh: float = 0.5,
                            max_detections: int = 100, predict_thresh: float = 0.3,
                            calibrated_caps: Optional[Sequence[float]] = None,
                            source: Optional[Dict[str, Any]] = None) -> ChipModel:
    """Integerise a step-4 GNetDet into a ChipModel.

    Args:
        model: GNetDet after gain editing (every ReLU cap 31, no BatchNorm); its layer switches do not
            matter (the integers are computed from its float weights).
        class_names: C names.
        conf_thresh, nms_thresh, max_detections, predict_thresh: host decode settings to store (the
            score head and offset are the model's).
        calibrated_caps: per-conv caps before gain editing (stored for reference / relu_cap.txt), or None.
        source: provenance to store.
    Returns:
        the ChipModel, validated.
    Raises:
        ConversionError: not gain-edited, BatchNorm present, class count mismatch, a chip limit (the
        memory limits included, counted on the layers as written: gnetmdk.gti.memory), a value outside
        its register.
    """
    spec = get_chip_spec(model.chip)
    if model.has_bn:
        raise ConversionError("the model still has BatchNorm: fold it (steps 2..4) before converting")
    caps = [float(r.cap) for r in model.relus()]
    codes = [int(getattr(r, "codes", ACT_MAX)) for r in model.relus()]
    if any(c != k for c, k in zip(caps, codes)):
        raise ConversionError(f"the model is not gain-edited (ReLU caps {caps}, step 4 needs every cap = 31, a "
                              "10-bit output layer's = 1023): convert a step-4 checkpoint")
    if len(class_names) != model.num_classes:
        raise ConversionError(f"{len(class_names)} class names for a model with {model.num_classes} classes: "
                              "pass the dataset's VOC_CLASSES")
    try:
        check_chip_limits(model.specs, spec, model.image_size, int(getattr(model, "output_bits", 5)))
    except ChipLimitError as exc:
        raise ConversionError(f"the model cannot run on chip {spec.name}: {exc}") from None
    if calibrated_caps is not None and len(calibrated_caps) != len(model.layers):
        calibrated_caps = None
    specs = model.specs
    layers: List[ChipLayer] = []
    size = model.image_size
    n = len(specs)
    for i, (ls, sub) in enumerate(zip(specs, model.layers)):
        w_int, b_int, shift = sub.conv.integer_params()
        w = w_int.numpy().astype(np.int64)
        b = b_int.numpy().astype(np.int64)
        name = f"conv {i + 1} (major layer {ls.major + 1}, sublayer {ls.index_in_major + 1})"
        wlim, blim = 2 ** (sub.conv.weight_bits - 1) - 1, 2 ** (sub.conv.bias_bits - 1) - 1
        if np.abs(w).max(initial=0) > wlim or np.abs(b).max(initial=0) > blim or not 0 <= shift <= MAX_SHIFT:
            raise ConversionError(f"{name}: integers outside the chip's registers (|W| <= {wlim}, |b| <= {blim}, "
                                  f"shift 0..{MAX_SHIFT})")
        out_ch = ls.out_channels
        if i == n - 1:
            others = [l.out_channels for l in specs[:-1] if l.major == ls.major]
            out_ch = padded_output_channels(ls.out_channels, others, spec.min_channels, name)
            if out_ch > ls.out_channels:
                w = np.concatenate([w, np.zeros((out_ch - ls.out_channels,) + w.shape[1:], np.int64)])
                b = np.concatenate([b, np.zeros(out_ch - ls.out_channels, np.int64)])
        layers.append(ChipLayer(major=ls.major, index_in_major=ls.index_in_major, in_channels=ls.in_channels,
                                out_channels=out_ch, weight_format=ls.weight_format, weight_bits=sub.conv.weight_bits,
                                bias_bits=sub.conv.bias_bits, shift=int(shift), pool_after=bool(ls.pool_after),
                                input_size=size, weight=w, bias=b,
                                calibrated_cap=None if calibrated_caps is None else float(calibrated_caps[i]),
                                max_code=codes[i]))
        if ls.pool_after:
            size //= 2
    try:
        check_chip_memory(chip_layers_memory(layers, model.image_size, used_out=10 + model.num_classes), spec, "",
                          "a narrower width_mult (and retrain)")
    except ChipSpecError as exc:
        raise ConversionError(f"the model cannot run on chip {spec.name}: {exc}") from None
    cm = ChipModel(chip=spec.name, model_name="gnetdet", input_size=model.image_size, layers=layers,
                   class_names=[str(c) for c in class_names], used_channels=10 + model.num_classes,
                   output_scale=float(model.output_scale), grid=model.grid_size, conf_thresh=float(conf_thresh),
                   nms_thresh=float(nms_thresh), max_detections=int(max_detections),
                   predict_thresh=float(predict_thresh), score_head=getattr(model, "score_head", "linear"),
                   score_offset=float(getattr(model, "score_offset", 4.0)),
                   score_scale=float(getattr(model, "score_scale", 1.0)),
                   size_head=str(getattr(model, "size_head", "linear")),
                   size_min=float(getattr(model, "size_min", 1.0 / 64)), source=dict(source or {}))
    cm.validate("converted model")
    return cm


def _calibrated_caps_from(ckpt: Dict[str, Any], output_scale: float, n: int,
                          cap_file: Optional[str] = None, last_codes: int = ACT_MAX) -> Optional[List[float]]:
    """Pre-gain-edit caps: the checkpoint's ``calibrated_caps`` (saved by step 4), else its ``caps`` when
    they are not all 31 (a pre-edit list), else a relu_cap.txt (from calibration) with ``n`` entries
    whose last matches output_scale * 31 (step-4 checkpoints written before calibrated_caps existed);
    ``last_codes`` is the output layer's largest code (1023 for a 10-bit output layer), 31 above."""
    stored = ckpt.get("calibrated_caps")
    if stored is not None:
        ok = isinstance(stored, (list, tuple)) and len(stored) == n and n > 0
        if ok and abs(float(stored[-1]) / last_codes - output_scale) <= 1e-5 * max(output_scale, 1e-12):
            return [float(c) for c in stored]
        detail = (f"last cap / {last_codes} = {float(stored[-1]) / last_codes:.6g} against output_scale "
                  f"{output_scale:.6g}"
                  if ok else f"{len(stored) if isinstance(stored, (list, tuple)) else type(stored).__name__} "
                             f"entries for {n} convs")
        print(f"note: the checkpoint's calibrated_caps do not fit its model ({detail}); using the other "
              "sources of the calibrated caps", file=sys.stderr)
    caps = ckpt.get("caps")
    edited = [float(ACT_MAX)] * (n - 1) + [float(last_codes)]           # the caps of a gain-edited model
    if isinstance(caps, (list, tuple)) and len(caps) == n and [float(c) for c in caps] != edited:
        return [float(c) for c in caps]
    if cap_file and os.path.isfile(cap_file):
        try:
            with open(cap_file) as fh:
                vals = [float(t) for t in fh.read().split()]
        except (OSError, ValueError):
            return None
        if len(vals) == n and abs(vals[-1] / last_codes - output_scale) <= 1e-5 * max(output_scale, 1e-12):
            return vals
    return None


def convert_checkpoint(path: str, class_names: Optional[Sequence[str]] = None, cap_file: Optional[str] = None):
    """Load a step-4 checkpoint and convert it.

    Args:
        path: checkpoint .pth (gnetmdk format, loaded with weights_only=True).
        class_names: override the checkpoint config's VOC_CLASSES.
        cap_file: a relu_cap.txt from calibration to take the pre-edit caps from when the checkpoint
            does not carry them (used only if it matches the model).
    Returns:
        (chip_model, model): the ChipModel and the rebuilt step-4 GNetDet (eval mode, step-4 switches).
    Raises:
        CheckpointError: missing or unreadable checkpoint.
        ConversionError: see check_checkpoint_for_chip / chip_model_from_gnetdet.
    """
    from gnetmdk.checkpoint.io import load_checkpoint
    from gnetmdk.models.rebuild import build_model_from_checkpoint
    from gnetmdk.models.stages import STAGES, apply_stage
    ckpt = load_checkpoint(path, "train step 4 first: python3 train.py --step 4")
    check_checkpoint_for_chip(ckpt, path)
    model = build_model_from_checkpoint(ckpt, None, path)
    apply_stage(model, STAGES["step4"])
    model.eval()
    cfg = dict(ckpt.get("config") or {})
    names = list(class_names) if class_names is not None else list(cfg.get("VOC_CLASSES") or [])
    if len(names) != model.num_classes:
        raise ConversionError(f"checkpoint '{path}': {len(names)} class names in its config for "
                              f"{model.num_classes} classes: pass --classes a,b,c")
    caps = _calibrated_caps_from(ckpt, float(model.output_scale), len(model.layers), cap_file,
                                 int(model.relus()[-1].codes))
    source = {"checkpoint": os.path.abspath(path), "sha256": file_sha256(path), "stage": ckpt.get("stage"),
              "epoch": ckpt.get("epoch"), "best_map": ckpt.get("best_map"), "dataset": cfg.get("DS_NAME"),
              "model_meta": dict(ckpt.get("model_meta") or {})}
    cm = chip_model_from_gnetdet(model, names, conf_thresh=float(cfg.get("conf_thresh", BaseConfig.conf_thresh)),
                                 nms_thresh=float(cfg.get("nms_thresh", 0.5)),
                                 max_detections=int(cfg.get("max_detections", 100)),
                                 predict_thresh=float(cfg.get("predict_thresh", 0.3)),
                                 calibrated_caps=caps, source=source)
    return cm, model
