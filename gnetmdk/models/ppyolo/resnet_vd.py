"""ResNet-vd backbone (depths 18, 34, 50) as PP-YOLO uses it.

ResNet: He et al., "Deep Residual Learning for Image Recognition", CVPR 2016.
The "d" variant: He et al., "Bag of Tricks for Image Classification with Convolutional Neural
Networks", CVPR 2019 (ResNet-D): the 7x7 stem conv becomes three 3x3 convs (32, 32, 64 channels,
the first with stride 2), and a strided block's projection shortcut becomes a 2x2 average pool
(stride 2) followed by a stride-1 1x1 conv. Bottleneck blocks put the stride on the 3x3 conv
(ResNet-B). Structure, stage layout and options follow PaddleDetection's
``ppdet/modeling/backbones/resnet.py`` (``ResNet(variant="d")``), including its choice of a 1x1
projection shortcut on the first block of *every* stage (stage 0 too, even at equal widths).

Stages are numbered 0..3 (PaddleDetection's res2..res5) with output strides 4, 8, 16, 32 and
widths 64, 128, 256, 512 (x4 for depth 50).
"""
from __future__ import annotations

from typing import Dict, List, Sequence

import torch
from torch import nn

from .common import ConvBNLayer

__all__ = ["ResNetVd", "BasicBlock", "BottleneckBlock", "RESNET_DEPTHS"]

#: blocks per stage for each supported depth
RESNET_DEPTHS: Dict[int, List[int]] = {18: [2, 2, 2, 2], 34: [3, 4, 6, 3], 50: [3, 4, 6, 3]}
_STAGE_WIDTHS = [64, 128, 256, 512]


def _shortcut(ch_in: int, ch_out: int, stride: int) -> nn.Module:
    """Projection shortcut; ResNet-D form (avg pool then 1x1 conv) when strided."""
    if stride == 2:
        return nn.Sequential(nn.AvgPool2d(2, 2, ceil_mode=True, count_include_pad=False),
                             ConvBNLayer(ch_in, ch_out, 1, 1, act=None))
    return ConvBNLayer(ch_in, ch_out, 1, stride, act=None)


class BasicBlock(nn.Module):
    """Two 3x3 conv units and a residual (ResNet-18/34). The first conv carries the stride; with
    ``dcn`` the second 3x3 conv is a DCNv2 conv (PaddleDetection's ``BasicBlock``).

    Shapes: ``(N, ch_in, H, W) -> (N, ch_out, H / stride, W / stride)``.
    """
    expansion = 1

    def __init__(self, ch_in: int, ch_out: int, stride: int, shortcut: bool, dcn: bool = False):
        super().__init__()
        self.branch2a = ConvBNLayer(ch_in, ch_out, 3, stride, act="relu")
        self.branch2b = ConvBNLayer(ch_out, ch_out, 3, 1, act=None, dcn=dcn)
        self.short = None if shortcut else _shortcut(ch_in, ch_out, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """ReLU of the two conv units' output plus the shortcut (identity or projection)."""
        out = self.branch2b(self.branch2a(x))
        return torch.relu(out + (x if self.short is None else self.short(x)))


class BottleneckBlock(nn.Module):
    """1x1 -> 3x3 (stride, optionally DCNv2) -> 1x1 (x4 width) and a residual (ResNet-50).

    Shapes: ``(N, ch_in, H, W) -> (N, 4 * ch_out, H / stride, W / stride)``.
    """
    expansion = 4

    def __init__(self, ch_in: int, ch_out: int, stride: int, shortcut: bool, dcn: bool = False):
        super().__init__()
        self.branch2a = ConvBNLayer(ch_in, ch_out, 1, 1, act="relu")
        self.branch2b = ConvBNLayer(ch_out, ch_out, 3, stride, act="relu", dcn=dcn)
        self.branch2c = ConvBNLayer(ch_out, ch_out * 4, 1, 1, act=None)
        self.short = None if shortcut else _shortcut(ch_in, ch_out * 4, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """ReLU of the three conv units' output plus the shortcut (identity or projection)."""
        out = self.branch2c(self.branch2b(self.branch2a(x)))
        return torch.relu(out + (x if self.short is None else self.short(x)))


def _check_indices(values: Sequence[int], name: str, allow_empty: bool) -> List[int]:
    vals = [int(v) for v in values]
    if not allow_empty and not vals:
        raise ValueError(f"{name} must name at least one stage in 0..3, got {list(values)}")
    bad = [v for v in vals if not 0 <= v <= 3]
    if bad:
        raise ValueError(f"{name} has stage indices {bad} outside 0..3 (stages 0..3 have strides 4, 8, 16, 32)")
    if len(set(vals)) != len(vals) or vals != sorted(vals):
        raise ValueError(f"{name} must be strictly increasing without repeats, got {vals}")
    return vals


class ResNetVd(nn.Module):
    """ResNet-vd feature extractor.

    Args:
        depth: 18, 34 (BasicBlock) or 50 (BottleneckBlock).
        return_idx: stages whose outputs are returned, increasing (e.g. ``[1, 2, 3]`` for C3, C4,
            C5 at strides 8, 16, 32). Stages after the last one named are not built.
        freeze_at: -1 freezes nothing; ``k >= 0`` sets ``requires_grad=False`` on the stem and
            stages ``0..k`` (PaddleDetection's meaning).
        freeze_norm: BatchNorm affine parameters get ``requires_grad=False`` and every BatchNorm
            stays in eval mode (running statistics used, never updated) whatever ``train()`` says.
        dcn_v2_stages: stages whose blocks use a DCNv2 3x3 conv (PP-YOLO r50vd: ``[3]``).

    Input ``(N, 3, H, W)`` float, already normalised. Output: a list with one
    ``(N, out_channels[i], H / s_i, W / s_i)`` tensor per entry of ``return_idx``, shallow to deep.
    Attributes ``out_channels`` and ``out_strides`` (lists, per returned stage).

    Raises:
        ValueError: unknown depth, bad stage indices, ``freeze_at`` outside -1..3.
    """

    def __init__(self, depth: int = 50, return_idx: Sequence[int] = (0, 1, 2, 3), freeze_at: int = -1,
                 freeze_norm: bool = False, dcn_v2_stages: Sequence[int] = ()):
        super().__init__()
        if depth not in RESNET_DEPTHS:
            raise ValueError(f"ResNet-vd depth {depth!r} is not supported; use one of {sorted(RESNET_DEPTHS)}")
        self.return_idx = _check_indices(return_idx, "return_idx", allow_empty=False)
        self.dcn_v2_stages = _check_indices(dcn_v2_stages, "dcn_v2_stages", allow_empty=True)
        if not isinstance(freeze_at, int) or not -1 <= freeze_at <= 3:
            raise ValueError(f"freeze_at must be an int in -1..3 (-1: nothing frozen), got {freeze_at!r}")
        self.depth, self.freeze_at, self.freeze_norm = depth, freeze_at, bool(freeze_norm)
        block = BottleneckBlock if depth >= 50 else BasicBlock
        self.stem = nn.Sequential(ConvBNLayer(3, 32, 3, 2, act="relu"), ConvBNLayer(32, 32, 3, 1, act="relu"),
                                  ConvBNLayer(32, 64, 3, 1, act="relu"))
        self.pool = nn.MaxPool2d(3, 2, 1)
        n_stages = max(self.return_idx) + 1
        self.stages = nn.ModuleList()
        ch_in = 64
        for s in range(n_stages):
            blocks = []
            for b in range(RESNET_DEPTHS[depth][s]):
                stride = 2 if (b == 0 and s > 0) else 1
                blocks.append(block(ch_in, _STAGE_WIDTHS[s], stride, shortcut=b > 0, dcn=s in self.dcn_v2_stages))
                ch_in = _STAGE_WIDTHS[s] * block.expansion
            self.stages.append(nn.Sequential(*blocks))
        self.out_channels = [_STAGE_WIDTHS[i] * block.expansion for i in self.return_idx]
        self.out_strides = [4 * 2 ** i for i in self.return_idx]

        if freeze_at >= 0:
            for m in [self.stem] + list(self.stages[: freeze_at + 1]):
                for p in m.parameters():
                    p.requires_grad_(False)
        if self.freeze_norm:
            for m in self.modules():
                if isinstance(m, nn.BatchNorm2d):
                    m.weight.requires_grad_(False)
                    m.bias.requires_grad_(False)
            self.train(self.training)

    def train(self, mode: bool = True) -> "ResNetVd":
        """As ``nn.Module.train``; with ``freeze_norm`` every BatchNorm stays in eval mode."""
        super().train(mode)
        if self.freeze_norm:
            for m in self.modules():
                if isinstance(m, nn.BatchNorm2d):
                    m.eval()
        return self

    def forward(self, x: torch.Tensor) -> List[torch.Tensor]:
        """Stem, 3x3 max pool, then the stages; the outputs of the stages in ``return_idx``, shallow to deep."""
        x = self.pool(self.stem(x))
        outs = []
        for i, stage in enumerate(self.stages):
            x = stage(x)
            if i in self.return_idx:
                outs.append(x)
        return outs
