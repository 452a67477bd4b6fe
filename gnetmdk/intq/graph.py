"""A model as a list of nodes over named tensors: what the fake-quantized forward, calibration, the
integer program and its ONNX export share.

A family writes its model's graph once (e.g. gnetmdk.models.ppyolo.quant.ppyolo_graph); each node
names the modules it uses by their path in the model. Ops:

=========== ======================= ============================================================
op          inputs -> output        computes (float; ``q`` = the node's quantizer, if any)
=========== ======================= ============================================================
input       image -> x              ``q((image / 255 - mean) / std)``; image (N, 3, H, W) 0..255
conv        x -> y                  ``q(act(conv(x, W) + b))``; ``pool``: a 2x2/2 average pool
                                    first (ResNet-D shortcut); act None, "relu" or "leaky" (0.1);
                                    a conv without ``quant`` is an output (float)
maxpool     x -> y                  ``max_pool2d(x, k, s, p)`` (keeps x's quantization)
upsample    x -> y                  nearest, x2 (keeps x's quantization)
dropblock   x -> y                  the named DropBlock module (identity in evaluation and in the
                                    integer model; keeps x's quantization)
add         a, b -> y               ``q(act(a + b))``; act None or "relu"
concat      x1, x2, .. -> y         ``q(cat(x1, x2, .., dim=1))``
=========== ======================= ============================================================

Quantizers live in the model's ``quant`` ModuleDict (gnetmdk.intq.fake.ActQuant), keyed by the
node's ``quant`` name, so their ranges travel in the checkpoint's state dict.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from .fake import ActQuant, fake_quant_weight

__all__ = ["Node", "LEAKY_SLOPE", "OPS", "run_graph", "tensor_quantizers", "check_graph"]

LEAKY_SLOPE = 0.1
OPS = ("input", "conv", "maxpool", "upsample", "dropblock", "add", "concat")


@dataclass
class Node:
    """One op of a graph (table in the module docstring).

    Attributes:
        op: one of :data:`OPS`.
        inputs: names of the input tensors ("image" for the input node).
        output: name of the tensor it writes (unique in the graph).
        module: path of the conv (``nn.Conv2d``-like: weight, bias, stride, padding) or DropBlock.
        act: None, "relu" or "leaky" (conv, add).
        quant: key of its output quantizer in the model's ``quant`` dict; None for ops that keep
            their input's quantization, and for output convs.
        pool: conv only: 2x2 average pool (stride 2) before the conv.
        k, s, p: maxpool kernel, stride and padding.
    """
    op: str
    inputs: Tuple[str, ...]
    output: str
    module: str = ""
    act: Optional[str] = None
    quant: Optional[str] = None
    pool: bool = False
    k: int = 0
    s: int = 0
    p: int = 0


def check_graph(nodes: Sequence[Node]) -> None:
    """Refuse a malformed graph (unknown op, a tensor read before it is written or written twice, a
    quantizer missing where the op needs one).

    Raises:
        ValueError: naming the node.
    """
    seen = {"image"}
    for n in nodes:
        if n.op not in OPS:
            raise ValueError(f"graph node {n.output}: unknown op {n.op!r} (known: {OPS})")
        for i in n.inputs:
            if i not in seen:
                raise ValueError(f"graph node {n.output}: input {i!r} is not written before it")
        if n.output in seen:
            raise ValueError(f"graph node {n.output}: tensor written twice")
        if n.op in ("input", "add", "concat") and not n.quant:
            raise ValueError(f"graph node {n.output}: a {n.op} node needs a quantizer")
        seen.add(n.output)


def tensor_quantizers(nodes: Sequence[Node]) -> Dict[str, Optional[str]]:
    """Tensor name -> the key of the quantizer that sets its scale and zero point (ops that keep
    their input's quantization inherit it); None for float outputs."""
    out: Dict[str, Optional[str]] = {}
    for n in nodes:
        if n.op in ("maxpool", "upsample", "dropblock"):
            out[n.output] = out[n.inputs[0]]
        else:
            out[n.output] = n.quant
    return out


def _act(v: torch.Tensor, act: Optional[str]) -> torch.Tensor:
    if act == "relu":
        return F.relu(v)
    if act == "leaky":
        return F.leaky_relu(v, LEAKY_SLOPE)
    return v


def run_graph(model: nn.Module, nodes: Sequence[Node], image: torch.Tensor, quant: nn.ModuleDict,
              weight_bits: Optional[int], weight_scale: str = "max",
              normalize=None) -> List[torch.Tensor]:
    """The float / fake-quantized forward of a graph.

    Args:
        model: the module whose submodules the nodes name.
        nodes: the graph, in execution order.
        image: ``(N, 3, H, W)`` float pixels 0..255.
        quant: the quantizers (each one's ``observer_enabled`` / ``fake_quant_enabled`` decide).
        weight_bits: fake-quantize conv weights to this many bits (per output channel), or None.
        weight_scale: "max" or "mse" (gnetmdk.intq.fake.weight_scales).
        normalize: ``image -> x`` of the input node (the model's normalisation).

    Returns:
        the output convs' tensors, in graph order, float.
    """
    env: Dict[str, torch.Tensor] = {"image": image}
    outs: List[torch.Tensor] = []
    for n in nodes:
        if n.op == "input":
            v = quant[n.quant](normalize(image))
        elif n.op == "conv":
            conv = model.get_submodule(n.module)
            x = env[n.inputs[0]]
            if n.pool:
                x = F.avg_pool2d(x, 2, 2, ceil_mode=True, count_include_pad=False)
            w = conv.weight if weight_bits is None else fake_quant_weight(conv.weight, weight_bits, weight_scale)
            v = _act(F.conv2d(x, w, conv.bias, conv.stride, conv.padding, conv.dilation, conv.groups), n.act)
            if n.quant:
                v = quant[n.quant](v)
            else:
                outs.append(v)
        elif n.op == "maxpool":
            v = F.max_pool2d(env[n.inputs[0]], n.k, n.s, n.p)
        elif n.op == "upsample":
            v = F.interpolate(env[n.inputs[0]], scale_factor=2.0, mode="nearest")
        elif n.op == "dropblock":
            v = model.get_submodule(n.module)(env[n.inputs[0]])
        elif n.op == "add":
            v = quant[n.quant](_act(env[n.inputs[0]] + env[n.inputs[1]], n.act))
        else:                                                   # concat
            v = quant[n.quant](torch.cat([env[i] for i in n.inputs], dim=1))
        env[n.output] = v
    return outs


def make_quantizers(nodes: Sequence[Node]) -> nn.ModuleDict:
    """A fresh (uncalibrated, off) :class:`~gnetmdk.intq.fake.ActQuant` per quantizer key, in graph order."""
    return nn.ModuleDict({n.quant: ActQuant() for n in nodes if n.quant})
