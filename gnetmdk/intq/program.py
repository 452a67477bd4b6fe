"""The integer model (step 4): a graph's fake-quantized model turned into integer ops, and their
exact evaluation in torch.

:func:`build_program` reads the weights, biases and calibrated ranges once and writes plain data (a
dict of ints, lists and numpy arrays: no torch objects, nothing to unpickle), which
:func:`run_program` evaluates and gnetmdk.intq.onnx_export writes as ONNX. Arithmetic (the package
docstring gives the weight format):

* every activation tensor is uint8 codes ``q`` with (scale ``s``, zero point ``z``);
* conv: ``acc = sum W_q (q - z_in) + b_q`` in integers (int8 weights, int32 bias and accumulator;
  zero padding of ``q - z_in``, i.e. the code ``z_in``); evaluated as a float64 convolution of
  integers, exact because every partial sum is an integer below 2^53 (:func:`build_program` checks
  ``sum |W_q| * 255 + |b_q| < 2^31`` per channel, so the int32 of the ONNX model holds it too);
* requantization ``q_out = clamp(floor((acc M + 2^(n-1)) / 2^n) + z_out, lo, 255)`` in int64
  (``M`` per output channel, ``M_neg`` for negative accumulators under leaky ReLU, ``lo = z_out``
  under ReLU, else 0), with ``|acc M| < 2^60`` checked when building;
* the ResNet-D shortcut's 2x2 average pool + 1x1 conv becomes one 2x2 stride-2 conv whose four taps
  hold the same weights, with the multiplier divided by 4 (exact for even sizes, checked at run time);
* add: ``clamp(floor(((a - z_a) M_a + (b - z_b) M_b + 2^(n-1)) / 2^n) + z_out, lo, 255)``;
* concat: each input requantized to the output's (scale, zero point), then concatenated;
* max pool (padding by code 0, below every code) and nearest upsampling on the codes;
* output convs: ``acc * (s_x s_w,c)`` in float64, rounded once to float32.

Requantization modes (``requant``): "fixed" (the default, above) is the integer arithmetic of Jacob et
al. 2018; "float" computes a conv with ReLU or no activation as the int8 runtimes' fused quantized conv
does (onnxruntime's QLinearConv: ``m_c = s_x * s_w,c / s_out`` in float32, in that order, and
``q_out = clamp(rint(float32(acc) * m_c) + z_out, lo, 255)``, ties to even), so that step 4 equals a
runtime that executes the QDQ export (gnetmdk.intq.qdq_export) with those kernels. Leaky-ReLU convs,
adds and concatenations keep the fixed-point form in both modes (a runtime computes them in float,
docs/ppyolo.md).
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Sequence, Tuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from .fake import ACT_QMAX, quantize_weight, round_half_up, weight_scales
from .graph import LEAKY_SLOPE, Node, tensor_quantizers

__all__ = ["build_program", "run_program", "requant_multipliers", "ProgramError", "ACC_LIMIT", "REQUANT_MODES"]

#: bound on |acc * M| (int64 headroom, also for the ONNX model's rounding offset 2^61)
ACC_LIMIT = 2 ** 60
#: multipliers have at most this many bits
M_BITS = 31
#: requantization of convs with ReLU or no activation (module docstring)
REQUANT_MODES = ("fixed", "float")


class ProgramError(ValueError):
    """A model that cannot become the integer program (names the layer and the reason)."""


def requant_multipliers(m: np.ndarray, where: str = "?") -> Tuple[np.ndarray, int]:
    """Integer multipliers and one shift for real multipliers ``m`` (> 0): ``M = round(m 2^n)`` with
    ``n`` such that ``max M`` lies in ``[2^30, 2^31]`` (``n`` at most 62).

    Args:
        m: float64 array of positive real multipliers (any shape).
    Returns:
        (M int64 array of m's shape, n int >= 1).
    Raises:
        ProgramError: a multiplier that is not finite and positive, or one of 2^30 or more.
    """
    m = np.asarray(m, dtype=np.float64)
    if m.size == 0 or not np.all(np.isfinite(m)) or np.any(m <= 0):
        raise ProgramError(f"{where}: requantization multipliers must be finite and positive, got {m.ravel()[:4]}")
    e = math.floor(math.log2(float(m.max())))
    n = min(62, (M_BITS - 1) - e)
    if n < 1:
        raise ProgramError(f"{where}: a multiplier of {float(m.max()):.4g} is too large for a right shift")
    return np.floor(m * 2.0 ** n + 0.5).astype(np.int64), int(n)


def _qparams(quant: nn.ModuleDict, key: str, where: str) -> Tuple[float, int]:
    q = quant[key]
    if not q.calibrated:
        raise ProgramError(f"{where}: quantizer {key!r} has no calibrated range; run calibration (train.py --cal) "
                           "before building the integer model")
    return q.qparams()


@torch.no_grad()
def build_program(model: nn.Module, nodes: Sequence[Node], quant: nn.ModuleDict, weight_bits: int,
                  weight_scale: str, normalize, requant: str = "fixed") -> Dict[str, Any]:
    """The integer program of a graph's model (layout in the module docstring).

    Args:
        model, nodes, quant, weight_bits, weight_scale, normalize: as gnetmdk.intq.graph.run_graph.
        requant: :data:`REQUANT_MODES` ("fixed": integer multiplier and shift, ties up; "float": a
            float32 multiplier and ties to even for convs with ReLU or no activation).

    Returns:
        ``{"ops": [...], "tensors": {name: {"scale": float, "zp": int}}, "outputs": [names]}``: plain
        data; each op a dict with "op", "inputs", "output" and its integer parameters (numpy).

    Raises:
        ProgramError: an uncalibrated quantizer, a multiplier or accumulator out of range.
        ValueError: an unknown ``requant``.
    """
    if requant not in REQUANT_MODES:
        raise ValueError(f"requant must be one of {REQUANT_MODES}, got {requant!r}")
    owner = tensor_quantizers(nodes)
    tensors: Dict[str, Dict[str, Any]] = {}
    for name, key in owner.items():
        if key is not None:
            s, z = _qparams(quant, key, name)
            tensors[name] = {"scale": s, "zp": z}
    ops: List[Dict[str, Any]] = []
    outputs: List[str] = []
    for n in nodes:
        op: Dict[str, Any] = {"op": n.op, "inputs": list(n.inputs), "output": n.output}
        if n.op == "input":
            # the normalisation and the input quantizer as one lookup table per channel, computed by
            # the quantizer's own float32 arithmetic (so step 3 and step 4 agree on every pixel)
            pixels = torch.arange(256, dtype=torch.float32).view(1, 1, 1, 256).expand(1, 3, 1, 256)
            s, z = tensors[n.output]["scale"], tensors[n.output]["zp"]
            x = normalize(pixels.to(next(iter(model.buffers())).device)).float().cpu()
            op["lut"] = torch.clamp(round_half_up(x / s) + z, 0, ACT_QMAX).view(3, 256).numpy().astype(np.uint8)
        elif n.op == "conv":
            op.update(_conv_op(model, n, tensors, weight_bits, weight_scale, requant))
            if n.quant is None:
                outputs.append(n.output)
        elif n.op == "maxpool":
            op.update(k=n.k, s=n.s, p=n.p)
        elif n.op in ("upsample", "dropblock"):
            op["op"] = "upsample" if n.op == "upsample" else "identity"
        elif n.op == "add":
            (sa, za), (sb, zb) = [(tensors[i]["scale"], tensors[i]["zp"]) for i in n.inputs]
            so, zo = tensors[n.output]["scale"], tensors[n.output]["zp"]
            m, shift = requant_multipliers(np.array([sa / so, sb / so]), n.output)
            op.update(zp_a=za, zp_b=zb, m_a=int(m[0]), m_b=int(m[1]), shift=shift, zp=zo,
                      lo=zo if n.act == "relu" else 0, act=n.act)
            if n.act not in (None, "relu"):
                raise ProgramError(f"{n.output}: add with activation {n.act!r} is not supported (None or relu)")
        else:                                                     # concat
            so, zo = tensors[n.output]["scale"], tensors[n.output]["zp"]
            parts = []
            for i in n.inputs:
                si, zi = tensors[i]["scale"], tensors[i]["zp"]
                if si == so and zi == zo:
                    parts.append(None)
                else:
                    m, shift = requant_multipliers(np.array([si / so]), f"{n.output} <- {i}")
                    parts.append({"zp_in": zi, "m": int(m[0]), "shift": shift})
            op.update(parts=parts, zp=zo)
        ops.append(op)
    return {"ops": ops, "tensors": tensors, "outputs": outputs, "requant": requant}


def _conv_op(model: nn.Module, n: Node, tensors, weight_bits: int, weight_scale: str,
             requant: str = "fixed") -> Dict[str, Any]:
    conv = model.get_submodule(n.module)
    w = conv.weight.detach().float().cpu()
    if conv.groups != 1 or tuple(conv.dilation) != (1, 1):
        raise ProgramError(f"{n.module}: grouped or dilated convs are not supported by the integer model")
    sw = weight_scales(w, weight_bits, weight_scale)
    wq = quantize_weight(w, sw, weight_bits)
    sx, zx = tensors[n.inputs[0]]["scale"], tensors[n.inputs[0]]["zp"]
    acc_scale = sx * sw.double().numpy()                                 # (C_out,) float64
    stride, pad = list(conv.stride), list(conv.padding)
    if n.pool:
        if wq.shape[2:] != (1, 1) or stride != [1, 1] or pad != [0, 0]:
            raise ProgramError(f"{n.module}: the pooled shortcut needs a 1x1 stride-1 conv without padding")
        wq = wq.repeat(1, 1, 2, 2)                                       # avg pool 2x2 + 1x1 conv = 2x2/2 conv / 4
        stride, acc_scale = [2, 2], acc_scale / 4.0
    b = conv.bias.detach().double().cpu().numpy() if conv.bias is not None else np.zeros(w.shape[0])
    bq = np.floor(b / acc_scale + 0.5)                                 # in units of the accumulator
    wq_np = wq.numpy().astype(np.int8)
    bound = np.abs(wq_np.astype(np.int64)).reshape(wq_np.shape[0], -1).sum(1) * ACT_QMAX + np.abs(bq)
    if bound.max() >= 2 ** 31:
        raise ProgramError(f"{n.module}: accumulators could reach {bound.max():.3g}, beyond int32")
    w_scale = sw.float().numpy() / (4.0 if n.pool else 1.0)              # float32; /4 is exact
    op: Dict[str, Any] = {"w": wq_np, "b": bq.astype(np.int32), "stride": stride, "pad": pad, "zp_in": zx,
                          "pool": bool(n.pool), "w_scale": w_scale.astype(np.float32), "act": n.act}
    if n.quant is None:
        op["scale"] = acc_scale
        return op
    so, zo = tensors[n.output]["scale"], tensors[n.output]["zp"]
    real = acc_scale / so
    if n.act == "leaky":
        m, shift = requant_multipliers(np.concatenate([real, real * LEAKY_SLOPE]), n.module)
        m_pos, m_neg = m[:len(real)], m[len(real):]
    elif n.act in (None, "relu"):
        m_pos, shift = requant_multipliers(real, n.module)
        m_neg = m_pos
    else:
        raise ProgramError(f"{n.module}: activation {n.act!r} has no integer form (None, relu, leaky)")
    if float(bound.max()) * float(max(m_pos.max(), m_neg.max())) >= ACC_LIMIT:
        raise ProgramError(f"{n.module}: accumulator x multiplier could exceed 2^60")
    op.update(m_pos=m_pos, m_neg=m_neg, shift=shift, zp=zo, lo=zo if n.act == "relu" else 0)
    if requant == "float" and n.act in (None, "relu"):
        # the runtime's float32 multiplier, formed as it forms it: (s_x * s_w,c) / s_out, each step rounded
        op["m_float"] = (np.float32(sx) * w_scale.astype(np.float32)) / np.float32(so)
    return op


def _requant(acc: torch.Tensor, m: torch.Tensor, shift: int, zp: int, lo: int) -> torch.Tensor:
    """``clamp(floor((acc m + 2^(shift-1)) / 2^shift) + zp, lo, 255)`` in int64 (arithmetic shift)."""
    v = torch.bitwise_right_shift(acc * m + (1 << (shift - 1)), shift)
    return torch.clamp(v + zp, lo, ACT_QMAX)


def _per_channel(a: np.ndarray, device) -> torch.Tensor:
    return torch.as_tensor(np.asarray(a, dtype=np.int64), device=device).view(1, -1, 1, 1)


@torch.no_grad()
def run_program(prog: Dict[str, Any], image: torch.Tensor, keep: bool = False
                ) -> Tuple[List[torch.Tensor], Dict[str, torch.Tensor]]:
    """Evaluate an integer program exactly.

    Args:
        prog: :func:`build_program`'s result.
        image: ``(N, 3, H, W)`` pixels 0..255 (uint8, or float holding integers), on any device.
        keep: also return every op's output (uint8 codes; int32 accumulators are not kept).

    Returns:
        (the output convs' float32 tensors ``(N, C, H', W')`` in program order, {tensor name: uint8
        codes} when ``keep`` else {}).

    Raises:
        ValueError: a pooled shortcut on an odd-sized map (the integer pool assumes full 2x2 windows).
    """
    dev = image.device
    env: Dict[str, torch.Tensor] = {}
    kept: Dict[str, torch.Tensor] = {}
    outs: List[torch.Tensor] = []
    for op in prog["ops"]:
        kind, name = op["op"], op["output"]
        if kind == "input":
            lut = torch.as_tensor(op["lut"].astype(np.int64), device=dev)          # (3, 256)
            px = image.to(torch.int64)
            v = torch.stack([lut[c][px[:, c]] for c in range(3)], dim=1)
        elif kind == "conv":
            x = env[op["inputs"][0]]
            if op["pool"] and (x.shape[2] % 2 or x.shape[3] % 2):
                raise ValueError(f"{name}: the integer model's pooled shortcut needs even sizes, got "
                                 f"{x.shape[2]}x{x.shape[3]}; use input sizes that are multiples of 32")
            xf = (x - op["zp_in"]).to(torch.float64)
            w = torch.as_tensor(op["w"].astype(np.float64), device=dev)
            acc = F.conv2d(xf, w, None, op["stride"], op["pad"]).round().to(torch.int64)
            acc = acc + _per_channel(op["b"], dev)
            if "scale" in op:
                sc = torch.as_tensor(op["scale"], dtype=torch.float64, device=dev).view(1, -1, 1, 1)
                outs.append((acc.to(torch.float64) * sc).to(torch.float32))
                env[name] = acc
                continue
            if "m_float" in op:
                mf = torch.as_tensor(op["m_float"], dtype=torch.float32, device=dev).view(1, -1, 1, 1)
                v = torch.clamp(torch.round(acc.to(torch.float32) * mf).to(torch.int64) + op["zp"], op["lo"], ACT_QMAX)
            else:
                m = torch.where(acc < 0, _per_channel(op["m_neg"], dev), _per_channel(op["m_pos"], dev))
                v = _requant(acc, m, op["shift"], op["zp"], op["lo"])
        elif kind == "maxpool":
            x = env[op["inputs"][0]]
            p = op["p"]
            x = F.pad(x, (p, p, p, p), value=0) if p else x
            v = F.max_pool2d(x.to(torch.float64), op["k"], op["s"]).to(torch.int64)
        elif kind == "upsample":
            x = env[op["inputs"][0]]
            v = x.repeat_interleave(2, dim=2).repeat_interleave(2, dim=3)
        elif kind == "identity":
            v = env[op["inputs"][0]]
        elif kind == "add":
            a, b = (env[i] for i in op["inputs"])
            acc = (a - op["zp_a"]) * op["m_a"] + (b - op["zp_b"]) * op["m_b"]
            v = torch.clamp(torch.bitwise_right_shift(acc + (1 << (op["shift"] - 1)), op["shift"]) + op["zp"],
                            op["lo"], ACT_QMAX)
        else:                                                                          # concat
            parts = []
            for i, part in zip(op["inputs"], op["parts"]):
                x = env[i]
                if part is not None:
                    x = _requant(x - part["zp_in"], torch.tensor(part["m"], device=dev), part["shift"], op["zp"], 0)
                parts.append(x)
            v = torch.cat(parts, dim=1)
        env[name] = v
        if keep:
            kept[name] = v.to(torch.uint8)
    return outs, kept
