"""Building blocks shared by the PP-YOLO backbone and neck: the conv + BatchNorm + activation unit
and the weight initialisation.

Initialisation follows PaddlePaddle's defaults, which PaddleDetection's PP-YOLO layers rely on
(``paddle.nn.Conv2D`` with no ``weight_attr`` draws from ``Normal(0, sqrt(2 / fan_in))`` and sets a
bias to 0; ``BatchNorm2D`` starts at gamma 1, beta 0). That is torch's ``kaiming_normal_`` with
``mode="fan_in"`` and the ReLU gain. Every draw uses torch's global generator, so a
``torch.manual_seed`` before construction reproduces the weights.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from gnetmdk.layers.units import ConvBNAct

from .dcn import DeformConv2d

__all__ = ["ConvBNLayer", "init_conv_", "ACTIVATIONS"]

ACTIVATIONS = (None, "relu", "leaky")


def init_conv_(conv: nn.Conv2d) -> None:
    """Paddle's default conv initialisation, in place: weight ~ Normal(0, sqrt(2 / fan_in)), bias 0.

    Args:
        conv: a ``torch.nn.Conv2d`` (or any module with a 4-d ``weight`` and optional ``bias``).
    """
    nn.init.kaiming_normal_(conv.weight, mode="fan_in", nonlinearity="relu")
    if getattr(conv, "bias", None) is not None:
        nn.init.zeros_(conv.bias)


class ConvBNLayer(ConvBNAct):
    """Conv (no bias) + BatchNorm2d + activation: the unit of ResNet-vd and of the PP-YOLO neck.

    PaddleDetection: ``ConvNormLayer`` in ``backbones/resnet.py`` (activation ReLU or none) and
    ``ConvBNLayer`` in ``backbones/darknet.py`` (leaky ReLU, slope 0.1).

    Args:
        ch_in, ch_out: channel counts.
        kernel_size: square kernel; padding is ``(kernel_size - 1) // 2`` ("same" at stride 1).
        stride: conv stride.
        act: ``"relu"``, ``"leaky"`` (slope 0.1) or ``None`` (identity).
        dcn: make the conv a modulated deformable conv (:class:`~.dcn.DeformConv2d`, own offset
            and mask conv, DCNv2) instead of ``nn.Conv2d``.

    Shapes: input ``(N, ch_in, H, W)`` float; output ``(N, ch_out, H', W')`` with
    ``H' = floor((H - 1) / stride) + 1`` (same for W), same dtype.

    Raises:
        ValueError: unknown ``act``, or a kernel size that is not a positive odd int.
    """

    def __init__(self, ch_in: int, ch_out: int, kernel_size: int = 3, stride: int = 1,
                 act: Optional[str] = "relu", dcn: bool = False):
        super().__init__()
        if act not in ACTIVATIONS:
            raise ValueError(f"act must be one of {ACTIVATIONS}, got {act!r}")
        if kernel_size < 1 or kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be a positive odd int (same padding), got {kernel_size}")
        padding = (kernel_size - 1) // 2
        if dcn:
            self.conv = DeformConv2d(ch_in, ch_out, kernel_size, stride=stride, padding=padding, bias=False)
        else:
            self.conv = nn.Conv2d(ch_in, ch_out, kernel_size, stride=stride, padding=padding, bias=False)
            init_conv_(self.conv)
        self.bn = nn.BatchNorm2d(ch_out)   # eps 1e-5, momentum 0.1 = Paddle's epsilon 1e-5, momentum 0.9
        self.act = act

    #: set by gnetmdk.layers.stem.convert_recompute_stem (config ``recompute_stem``)
    recompute_stem = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """conv -> BatchNorm -> activation (``act``); through the recomputing stem when marked, with a plain
        conv and BatchNorm, and gradients wanted."""
        if (self.recompute_stem and isinstance(self.bn, nn.BatchNorm2d) and type(self.conv) is nn.Conv2d
                and torch.is_grad_enabled() and (x.requires_grad or self.conv.weight.requires_grad
                                                 or self.bn.weight is None or self.bn.weight.requires_grad)):
            from gnetmdk.layers.stem import conv_bn_act
            act = {"relu": "relu", "leaky": "leaky_relu", None: "identity"}[self.act]
            return conv_bn_act(x, self.conv, self.bn, act, 0.1)
        x = self.bn(self.conv(x))
        if self.act == "relu":
            return torch.relu(x)
        if self.act == "leaky":
            return nn.functional.leaky_relu(x, 0.1)
        return x
