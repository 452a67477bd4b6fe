"""PP-YOLO through the quantized stages: BatchNorm folding, the model's graph for gnetmdk.intq, and
the limits of its integer form.

The chip cannot run PP-YOLO (1x1 and strided convs, residual adds, upsampling; docs/quantization.md,
"What the chip runs"), so its
stages 2..4 target the standard integer arithmetic of gnetmdk.intq: int8 weights per output channel,
uint8 activations per tensor, int32 accumulators, fixed-point requantization. Supported: ResNet-vd
18 / 34 / 50 without deformable convs, the PP-YOLO neck with SPP and DropBlock, the YOLOv3 head
(with or without the IoU-aware channels). Not supported (refused with the reason): DCNv2 layers
(``dcn_v2_stages``: bilinear sampling at learned offsets has no integer form here) and CoordConv
(``coord_conv``: the coordinate channels would need a constant input quantizer).

Quantization points (one uint8 tensor each): the normalised image; every conv unit's output (after
its activation); every residual add (after its ReLU); every concatenation. Max pooling, upsampling
and DropBlock keep their input's codes. The head's 1x1 convs are dequantized outputs.
"""
from __future__ import annotations

import math
from typing import List, Optional

import torch
import torch.nn as nn

from gnetmdk.intq.graph import Node, check_graph
from .common import ConvBNLayer
from .neck import SPP, CoordConv, DropBlock

__all__ = ["QUANT_STAGES", "quant_limits", "fold_bn_", "ppyolo_graph"]

#: the stages in which PP-YOLO's conv weights are quantized
QUANT_STAGES = ("step2", "cal", "step3", "step4")


def quant_limits(dcn_v2_stages, coord_conv: bool) -> List[str]:
    """What keeps a PP-YOLO architecture from the integer stages: a list of reasons (empty: none),
    each naming the config field and the fix."""
    out = []
    if list(dcn_v2_stages):
        out.append(f"ppyolo.dcn_v2_stages {list(dcn_v2_stages)}: deformable convs (DCNv2) have no integer form; "
                   "train the float model with dcn_v2_stages []")
    if coord_conv:
        out.append("ppyolo.coord_conv true: CoordConv's coordinate channels are not supported by the integer "
                   "model; train the float model with coord_conv false")
    return out


@torch.no_grad()
def fold_bn_(model: nn.Module, structure_only: bool = False) -> int:
    """Fold every ConvBNLayer's BatchNorm into its conv, in place: ``W' = W gamma / sqrt(var + eps)``
    (per output channel), ``b' = beta - mean gamma / sqrt(var + eps)`` (computed in float64, stored
    in the conv's dtype); the BatchNorm becomes ``nn.Identity`` and the conv gains a bias with the
    weight's ``requires_grad``. ``structure_only``: only the new structure (bias 0, weights kept), for
    loading a folded checkpoint. Returns how many were folded (already folded units are skipped).

    Raises:
        ValueError: a unit whose conv is not a plain ``nn.Conv2d`` (a deformable conv).
    """
    n = 0
    for name, unit in model.named_modules():
        if not isinstance(unit, ConvBNLayer) or isinstance(unit.bn, nn.Identity):
            continue
        conv, bn = unit.conv, unit.bn
        if type(conv) is not nn.Conv2d:
            raise ValueError(f"{name}: a {type(conv).__name__} cannot be folded and quantized (deformable conv); "
                             "train with ppyolo.dcn_v2_stages []")
        bias = torch.zeros(conv.out_channels, dtype=conv.weight.dtype, device=conv.weight.device)
        if not structure_only:
            inv = bn.weight.double() / torch.sqrt(bn.running_var.double() + bn.eps)
            conv.weight.copy_((conv.weight.double() * inv.view(-1, 1, 1, 1)).to(conv.weight.dtype))
            bias.copy_((bn.bias.double() - bn.running_mean.double() * inv).to(bias.dtype))
        conv.bias = nn.Parameter(bias, requires_grad=conv.weight.requires_grad)
        unit.bn = nn.Identity()
        n += 1
    return n


def _key(name: str) -> str:
    return name.replace(".", "_")


def ppyolo_graph(model: nn.Module) -> List[Node]:
    """The graph of a (folded) PP-YOLO model (node table: gnetmdk.intq.graph). Tensor names are the
    module paths that produce them (``backbone.stages.1.0.add``, ``neck.cat1``, ``head.outputs.0``).

    Raises:
        ValueError: a module the integer model does not support (quant_limits).
    """
    nodes: List[Node] = [Node("input", ("image",), "input", quant="input")]
    bb = model.backbone

    def unit(path: str, x: str, pool: bool = False, out: Optional[str] = None) -> str:
        m = model.get_submodule(path)
        if not isinstance(m, ConvBNLayer):
            raise ValueError(f"{path}: expected a conv unit, found {type(m).__name__}")
        act = {"relu": "relu", "leaky": "leaky", None: None}[m.act]
        name = out or path
        nodes.append(Node("conv", (x,), name, module=path + ".conv", act=act, quant=_key(name), pool=pool))
        return name

    x = "input"
    for i in range(len(bb.stem)):
        x = unit(f"backbone.stem.{i}", x)
    pool = bb.pool
    nodes.append(Node("maxpool", (x,), "backbone.pool", k=pool.kernel_size, s=pool.stride, p=pool.padding))
    x = "backbone.pool"
    feats = []
    for si, stage in enumerate(bb.stages):
        for bi, block in enumerate(stage):
            pre = f"backbone.stages.{si}.{bi}"
            names = [n for n in ("branch2a", "branch2b", "branch2c") if hasattr(block, n)]
            y = x
            for n in names:
                y = unit(f"{pre}.{n}", y)
            if block.short is None:
                s = x
            elif isinstance(block.short, nn.Sequential):        # ResNet-D: avg pool 2x2/2, then 1x1 conv
                s = unit(f"{pre}.short.1", x, pool=True, out=f"{pre}.short")
            else:
                s = unit(f"{pre}.short", x)
            nodes.append(Node("add", (y, s), f"{pre}.add", act="relu", quant=_key(f"{pre}.add")))
            x = f"{pre}.add"
        if si in bb.return_idx:
            feats.append(x)
    neck = model.neck
    route = None
    tips = []
    for i, x in enumerate(feats[::-1]):
        if route is not None:
            nodes.append(Node("concat", (route, x), f"neck.cat{i}", quant=_key(f"neck.cat{i}")))
            x = f"neck.cat{i}"
        block = neck.blocks[i]
        for name, m in block.body.named_children():
            path = f"neck.blocks.{i}.body.{name}"
            if isinstance(m, DropBlock):
                nodes.append(Node("dropblock", (x,), path, module=path))
                x = path
            elif isinstance(m, SPP):
                pools = []
                for k in m.pool_sizes:
                    nodes.append(Node("maxpool", (x,), f"{path}.pool{k}", k=k, s=1, p=k // 2))
                    pools.append(f"{path}.pool{k}")
                nodes.append(Node("concat", (x, *pools), f"{path}.cat", quant=_key(f"{path}.cat")))
                x = unit(f"{path}.conv", f"{path}.cat")
            elif isinstance(m, CoordConv):
                raise ValueError(f"{path}: CoordConv is not supported by the integer model (ppyolo.coord_conv false)")
            else:
                x = unit(path, x)
        r = x
        tips.append(unit(f"neck.blocks.{i}.tip", r))
        if i < len(neck.transitions):
            t = unit(f"neck.transitions.{i}", r)
            nodes.append(Node("upsample", (t,), f"neck.up{i}"))
            route = f"neck.up{i}"
    for lvl, tip in enumerate(tips):
        nodes.append(Node("conv", (tip,), f"head.outputs.{lvl}", module=f"head.outputs.{lvl}"))
    check_graph(nodes)
    return nodes
