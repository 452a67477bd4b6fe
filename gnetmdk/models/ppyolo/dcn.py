"""Modulated deformable convolution (DCNv2) in plain torch, through ``F.grid_sample``.

Zhu, Hu, Lin, Dai, "Deformable ConvNets v2: More Deformable, Better Results", CVPR 2019,
arXiv 1811.11168, eq. (3): for an output position p and the k-th kernel tap p_k,

    y(p) = sum_k w_k * x(p0 + p_k + dp_k) * m_k,

where p0 is the ordinary conv's window origin, dp_k = (dy_k, dx_k) a learned fractional offset
(input pixels), m_k in [0, 1] a learned modulation scalar, and x(.) is bilinear interpolation
of the input with zeros outside the image.

Layouts follow PaddlePaddle's ``deform_conv2d`` (and the original CUDA kernels): the offset
tensor has ``2 * kh * kw`` channels, tap ``k = i * kw + j`` (row-major) owning channels
``2k`` (dy, rows) and ``2k + 1`` (dx, columns); the mask tensor has ``kh * kw`` channels, one per
tap. One deformable group, one conv group.

Sampling: pixel centre ``(py, px)`` (integer = exactly on an input pixel) is mapped to
``grid_sample``'s normalised coordinate with ``align_corners=False``:
``g = (2 * p + 1) / size - 1``, which grid_sample maps back to ``((g + 1) * size - 1) / 2 = p``.
Integer positions therefore land on pixels up to float rounding, so zero offsets with mask 1
reproduce ``F.conv2d`` up to rounding; out-of-image neighbours contribute 0 (``padding_mode=
"zeros"``), the DCN convention. ``align_corners=True`` (``g = 2p / (size - 1) - 1``) would be
equally exact but is undefined for a 1-pixel-wide map, which a 32x32 input reaches at stride 32.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["deform_conv2d", "DeformConv2d"]

_Pair = Union[int, Tuple[int, int]]


def _pair(v: _Pair, name: str) -> Tuple[int, int]:
    if isinstance(v, int):
        return v, v
    if isinstance(v, (tuple, list)) and len(v) == 2 and all(isinstance(t, int) for t in v):
        return int(v[0]), int(v[1])
    raise ValueError(f"{name} must be an int or a pair of ints, got {v!r}")


def deform_conv2d(x: torch.Tensor, offset: torch.Tensor, mask: Optional[torch.Tensor], weight: torch.Tensor,
                  bias: Optional[torch.Tensor] = None, stride: _Pair = 1, padding: _Pair = 0,
                  dilation: _Pair = 1) -> torch.Tensor:
    """Modulated deformable convolution (DCNv2, arXiv 1811.11168), functional form.

    Args:
        x: ``(N, C, H, W)`` float input.
        offset: ``(N, 2 * kh * kw, Ho, Wo)`` offsets in input pixels, (dy, dx) per tap, taps
            row-major (module docstring).
        mask: ``(N, kh * kw, Ho, Wo)`` modulation in [0, 1] (already through a sigmoid), or
            ``None`` for DCNv1 (mask 1).
        weight: ``(O, C, kh, kw)`` conv weight.
        bias: ``(O,)`` or ``None``.
        stride, padding, dilation: as ``F.conv2d`` (int or pair).

    Returns:
        ``(N, O, Ho, Wo)`` tensor, ``Ho = (H + 2 pad_h - dil_h (kh - 1) - 1) // stride_h + 1``.

    Raises:
        ValueError: shapes that do not agree (channels, offset or mask size, output size).
    """
    sh, sw = _pair(stride, "stride")
    ph, pw = _pair(padding, "padding")
    dh, dw = _pair(dilation, "dilation")
    if x.dim() != 4 or weight.dim() != 4:
        raise ValueError(f"x and weight must be 4-d, got {tuple(x.shape)} and {tuple(weight.shape)}")
    n, c, h, w = x.shape
    o, cw, kh, kw = weight.shape
    if cw != c:
        raise ValueError(f"weight has {cw} input channels but x has {c} (groups are not supported)")
    ho = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    wo = (w + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    if ho <= 0 or wo <= 0:
        raise ValueError(f"output size ({ho}, {wo}) is empty for input {h}x{w}, kernel {kh}x{kw}, "
                         f"padding {(ph, pw)}, dilation {(dh, dw)}")
    k = kh * kw
    if tuple(offset.shape) != (n, 2 * k, ho, wo):
        raise ValueError(f"offset must have shape {(n, 2 * k, ho, wo)}, got {tuple(offset.shape)}")
    if mask is not None and tuple(mask.shape) != (n, k, ho, wo):
        raise ValueError(f"mask must have shape {(n, k, ho, wo)}, got {tuple(mask.shape)}")

    dtype, dev = x.dtype, x.device
    # Undeformed sampling positions (input pixels) of every tap at every output position.
    tap_y = (torch.arange(kh, device=dev, dtype=dtype) * dh).repeat_interleave(kw)    # (K,)
    tap_x = (torch.arange(kw, device=dev, dtype=dtype) * dw).repeat(kh)               # (K,)
    out_y = torch.arange(ho, device=dev, dtype=dtype) * sh - ph                       # (Ho,)
    out_x = torch.arange(wo, device=dev, dtype=dtype) * sw - pw                       # (Wo,)
    base_y = tap_y[:, None, None] + out_y[None, :, None]                               # (K, Ho, 1)
    base_x = tap_x[:, None, None] + out_x[None, None, :]                               # (K, 1, Wo)
    off = offset.reshape(n, k, 2, ho, wo)
    py = base_y + off[:, :, 0]                                                         # (N, K, Ho, Wo)
    px = base_x + off[:, :, 1]
    grid = torch.stack(((2.0 * px + 1.0) / w - 1.0, (2.0 * py + 1.0) / h - 1.0), dim=-1)
    cols = F.grid_sample(x, grid.reshape(n, k * ho, wo, 2), mode="bilinear", padding_mode="zeros",
                         align_corners=False)                                          # (N, C, K*Ho, Wo)
    cols = cols.reshape(n, c, k, ho, wo)
    if mask is not None:
        cols = cols * mask.reshape(n, 1, k, ho, wo)
    out = torch.matmul(weight.reshape(o, c * k), cols.reshape(n, c * k, ho * wo))    # (N, O, Ho*Wo)
    out = out.reshape(n, o, ho, wo)
    if bias is not None:
        out = out + bias.reshape(1, o, 1, 1)
    return out


class DeformConv2d(nn.Module):
    """DCNv2 layer that owns its offset / mask predictor (PaddleDetection ``ConvNormLayer`` with
    ``dcn_v2=True``, ``backbones/resnet.py``).

    A plain conv with the same kernel, stride and padding as the deformable one predicts
    ``3 * k * k`` channels per output position: the first ``2 * k * k`` are the offsets (dy, dx
    per tap, input pixels), the last ``k * k`` go through a sigmoid and become the mask. As in
    PaddleDetection that predictor starts at weight 0 and bias 0, so a fresh layer samples the
    ordinary conv positions with mask sigmoid(0) = 0.5 everywhere: its output is half the
    ordinary conv's. The main weight uses Paddle's default Normal(0, sqrt(2 / fan_in)).

    Args:
        in_channels, out_channels: channel counts.
        kernel_size: square kernel size (default 3).
        stride, padding, dilation: as ``nn.Conv2d``; ``padding=None`` means
            ``dilation * (kernel_size - 1) // 2``.
        bias: add a learned bias to the output (PaddleDetection's backbone uses ``False``).

    Shapes: input ``(N, in_channels, H, W)``, output ``(N, out_channels, Ho, Wo)`` as ``nn.Conv2d``.
    Attributes: ``weight`` ``(out, in, k, k)``, ``bias`` or ``None``, ``offset_conv``
    (``nn.Conv2d`` to ``3 k k`` channels).
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int = 3, stride: int = 1,
                 padding: Optional[int] = None, dilation: int = 1, bias: bool = False):
        super().__init__()
        if kernel_size < 1:
            raise ValueError(f"kernel_size must be >= 1, got {kernel_size}")
        if padding is None:
            padding = dilation * (kernel_size - 1) // 2
        self.in_channels, self.out_channels = in_channels, out_channels
        self.kernel_size, self.stride, self.padding, self.dilation = kernel_size, stride, padding, dilation
        self.weight = nn.Parameter(torch.empty(out_channels, in_channels, kernel_size, kernel_size))
        nn.init.normal_(self.weight, 0.0, math.sqrt(2.0 / (in_channels * kernel_size * kernel_size)))
        self.bias = nn.Parameter(torch.zeros(out_channels)) if bias else None
        k2 = kernel_size * kernel_size
        self.offset_conv = nn.Conv2d(in_channels, 3 * k2, kernel_size, stride=stride, padding=padding,
                                     dilation=dilation, bias=True)
        nn.init.zeros_(self.offset_conv.weight)
        nn.init.zeros_(self.offset_conv.bias)

    def offsets_and_mask(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """The predicted ``(offset (N, 2kk, Ho, Wo), mask (N, kk, Ho, Wo) in (0, 1))`` for ``x``."""
        k2 = self.kernel_size * self.kernel_size
        om = self.offset_conv(x)
        return om[:, : 2 * k2], torch.sigmoid(om[:, 2 * k2:])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Modulated deformable convolution of ``x`` at the offsets and mask its own predictor gives."""
        offset, mask = self.offsets_and_mask(x)
        return deform_conv2d(x, offset, mask, self.weight, self.bias, self.stride, self.padding, self.dilation)

    def extra_repr(self) -> str:
        """Channels, kernel size, stride, padding, dilation and whether there is a bias."""
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
                f"padding={self.padding}, dilation={self.dilation}, bias={self.bias is not None}")
