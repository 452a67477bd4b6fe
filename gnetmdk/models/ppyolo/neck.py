"""PP-YOLO's FPN neck (PaddleDetection ``PPYOLOFPN``, ``ppdet/modeling/necks/yolo_fpn.py``) and its
parts: CoordConv, SPP, DropBlock.

Per level, deepest first, a "detection block" of conv units (leaky ReLU 0.1) produces a *route*
(``c_i`` channels) and a *tip* (``2 c_i`` channels, what the head sees). The route of level i goes
through a 1x1 "transition" conv (``r_i`` channels), is upsampled 2x (nearest) and concatenated in
front of the next shallower backbone level. Channels follow PaddleDetection's formulas for L
levels: ``c_i = 64 * 2**L / 2**i`` (512, 256, 128 for r50vd) and ``r_i = 256 / 2**i``; both can be
overridden (``channels``, ``route_channels``) for narrow test models.

Block layouts (PaddleDetection, ``conv_block_num``):

* 2 (r50vd): deepest level ``1x1 c, 3x3 2c, 1x1 c, [SPP], 3x3 2c, [DropBlock], route 1x1 c,
  tip 3x3 2c``; other levels ``1x1 c, 3x3 2c, [DropBlock], 1x1 c, 3x3 2c, route 1x1 c, tip 3x3 2c``.
* 0 (r18vd): ``[SPP (deepest)], [DropBlock], route 1x1 c, tip 3x3 2c``.

With ``coord_conv`` the 1x1 convs of the block, the route and the tip are CoordConvs (as in
PaddleDetection); the inner 3x3 convs, the SPP conv and the transitions are plain.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .common import ConvBNLayer

__all__ = ["coord_channels", "CoordConv", "SPP", "DropBlock", "PPYOLODetBlock", "PPYOLOFPN"]


COORD_RANGES = ("full", "paddle")


def coord_channels(n: int, h: int, w: int, dtype: torch.dtype = torch.float32,
                   device: Optional[torch.device] = None, coord_range: str = "full") -> Tuple[torch.Tensor, torch.Tensor]:
    """The two CoordConv channels (Liu et al., "An intriguing failing of convolutional neural
    networks and the CoordConv solution", NeurIPS 2018, arXiv 1807.03247).

    ``gx[..., j] = 2 j / (w - 1) - 1`` (column index scaled to [-1, 1], -1 at the left column, +1
    at the right), ``gy`` likewise over rows; a 1-wide axis gets -1. This is the range of the
    paper and of PaddleDetection's original PP-YOLO code; PaddleDetection's current ``add_coord``
    (since a 2021 refactor) computes ``j / (2 (w - 1)) - 1``, i.e. [-1, -0.5]: ``coord_range="paddle"``
    gives that range, for weights trained by it (the function differs, the weights' shapes do not).

    Returns:
        ``(gx, gy)``, each ``(n, 1, h, w)`` of ``dtype`` (no gradient).

    Raises:
        ValueError: ``coord_range`` not "full" or "paddle".
    """
    if coord_range not in COORD_RANGES:
        raise ValueError(f"coord_range must be one of {COORD_RANGES}, got {coord_range!r}")
    hi = 1.0 if coord_range == "full" else -0.5
    gx = torch.linspace(-1.0, hi, w, dtype=dtype, device=device)
    gy = torch.linspace(-1.0, hi, h, dtype=dtype, device=device)
    return gx.view(1, 1, 1, w).expand(n, 1, h, w), gy.view(1, 1, h, 1).expand(n, 1, h, w)


class CoordConv(nn.Module):
    """Concatenate ``(gx, gy)`` (:func:`coord_channels`) after the input channels, then a conv unit.

    Shapes: ``(N, ch_in, H, W) -> (N, ch_out, H, W)``; the inner conv has ``ch_in + 2`` inputs.
    """

    def __init__(self, ch_in: int, ch_out: int, kernel_size: int, coord_range: str = "full"):
        super().__init__()
        if coord_range not in COORD_RANGES:
            raise ValueError(f"coord_range must be one of {COORD_RANGES}, got {coord_range!r}")
        self.coord_range = coord_range
        self.conv = ConvBNLayer(ch_in + 2, ch_out, kernel_size, 1, act="leaky")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Append the (gx, gy) coordinate channels of ``x``'s size to it, then the conv unit."""
        gx, gy = coord_channels(x.shape[0], x.shape[2], x.shape[3], x.dtype, x.device, self.coord_range)
        return self.conv(torch.cat([x, gx, gy], dim=1))


class SPP(nn.Module):
    """Spatial pyramid pooling as in YOLOv3-SPP / PP-YOLO: ``[x, maxpool_5(x), maxpool_9(x),
    maxpool_13(x)]`` (stride 1, "same" padding) concatenated on channels, then a 1x1 conv unit.

    Shapes: ``(N, ch_in, H, W) -> (N, ch_out, H, W)``; the conv has ``4 * ch_in`` inputs.
    """

    def __init__(self, ch_in: int, ch_out: int, pool_sizes: Sequence[int] = (5, 9, 13)):
        super().__init__()
        self.pool_sizes = [int(k) for k in pool_sizes]
        self.conv = ConvBNLayer(ch_in * (1 + len(self.pool_sizes)), ch_out, 1, 1, act="leaky")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate ``x`` and its stride-1 max pools, then the 1x1 conv unit."""
        outs = [x] + [F.max_pool2d(x, k, 1, k // 2) for k in self.pool_sizes]
        return self.conv(torch.cat(outs, dim=1))


class DropBlock(nn.Module):
    """DropBlock (Ghiasi, Lin, Le, "DropBlock: A regularization method for convolutional networks",
    NeurIPS 2018, arXiv 1810.12890), as PaddleDetection's ``DropBlock`` (``ppdet/modeling/layers.py``).

    In training: block seeds are drawn with rate ``gamma = (1 - keep_prob) / block_size**2 *
    prod_s s / (s - block_size + 1)`` over the two spatial sizes s, grown to ``block_size`` squares
    by a stride-1 max pool; the kept activations are rescaled by ``numel / kept`` over the whole
    tensor. Departure: ``s - block_size + 1`` is floored at 1, so a map smaller than the block
    (2x2 at stride 32 of a 64x64 input) gets a finite rate instead of a division by zero.

    Identity when not training, when ``keep_prob == 1``, or when the attribute ``enabled`` is
    ``False`` (set it for alignment runs; the forward then returns its input object unchanged).

    Args:
        block_size: odd side of the dropped squares (PP-YOLO: 3).
        keep_prob: in (0, 1] (PP-YOLO: 0.9).

    Raises:
        ValueError: even or non-positive ``block_size``, ``keep_prob`` outside (0, 1].
    """

    def __init__(self, block_size: int = 3, keep_prob: float = 0.9):
        super().__init__()
        if block_size < 1 or block_size % 2 == 0:
            raise ValueError(f"DropBlock block_size must be a positive odd int, got {block_size}")
        if not 0.0 < keep_prob <= 1.0:
            raise ValueError(f"DropBlock keep_prob must be in (0, 1], got {keep_prob}")
        self.block_size, self.keep_prob = int(block_size), float(keep_prob)
        self.enabled = True

    def gamma(self, h: int, w: int) -> float:
        """Seed rate for an ``h x w`` map (formula in the class docstring)."""
        g = (1.0 - self.keep_prob) / self.block_size ** 2
        for s in (h, w):
            g *= s / max(s - self.block_size + 1, 1)
        return g

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Drop ``block_size`` squares of ``x`` and rescale the rest (training only; see the class docstring)."""
        if not self.training or not self.enabled or self.keep_prob == 1.0:
            return x
        seeds = (torch.rand_like(x) < self.gamma(x.shape[2], x.shape[3])).to(x.dtype)
        keep = 1.0 - F.max_pool2d(seeds, self.block_size, 1, self.block_size // 2)
        return x * keep * (keep.numel() / keep.sum().clamp(min=1.0))

    def extra_repr(self) -> str:
        """Block size, keep probability and ``enabled``."""
        return f"block_size={self.block_size}, keep_prob={self.keep_prob}, enabled={self.enabled}"


class PPYOLODetBlock(nn.Module):
    """A sequence of layers producing the route, then the tip conv.

    Forward: ``(N, ch_in, H, W) -> (route (N, c, H, W), tip (N, 2c, H, W))``.
    """

    def __init__(self, layers: List[Tuple[str, nn.Module]], tip: nn.Module):
        super().__init__()
        self.body = nn.Sequential()
        for name, m in layers:
            self.body.add_module(name, m)
        self.tip = tip

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """The body's output (the route, passed to the next level) and the tip conv's output on it."""
        route = self.body(x)
        return route, self.tip(route)


class PPYOLOFPN(nn.Module):
    """PP-YOLO FPN neck (module docstring for the layout).

    Args:
        in_channels: backbone channels per level, shallow to deep (as the backbone returns them).
        coord_conv, spp, drop_block: PP-YOLO's tricks (r50vd: all True).
        coord_range: the CoordConv channels' range, "full" [-1, 1] or "paddle" (:func:`coord_channels`).
        block_size, keep_prob: DropBlock settings (3, 0.9).
        conv_block_num: 2 (r50vd) or 0 (r18vd).
        channels: detection-block widths ``c_i`` per level, deepest first (default
            ``64 * 2**L / 2**i``); each must be even.
        route_channels: transition widths ``r_i``, deepest first, one per level but the last
            (default ``256 / 2**i``).

    Forward: list of ``L`` tensors shallow to deep, ``(N, in_channels[l], H_l, W_l)`` with
    ``H_l = 2 H_{l+1}``; returns the tips deepest first, ``(N, out_channels[i], H, W)``.
    Attribute ``out_channels`` (``2 c_i``, deepest first).

    Raises:
        ValueError: an unsupported ``conv_block_num``, or width lists of the wrong length.
    """

    def __init__(self, in_channels: Sequence[int], coord_conv: bool = False, spp: bool = False,
                 drop_block: bool = False, block_size: int = 3, keep_prob: float = 0.9, conv_block_num: int = 2,
                 channels: Optional[Sequence[int]] = None, route_channels: Optional[Sequence[int]] = None,
                 coord_range: str = "full"):
        super().__init__()
        n = len(in_channels)
        if n < 1:
            raise ValueError("PPYOLOFPN needs at least one input level")
        if conv_block_num not in (0, 2):
            raise ValueError(f"conv_block_num must be 2 (PP-YOLO r50vd) or 0 (r18vd), got {conv_block_num}")
        if channels is None:
            channels = [64 * 2 ** n // 2 ** i for i in range(n)]
        if route_channels is None:
            route_channels = [256 // 2 ** i for i in range(n - 1)]
        channels, route_channels = [int(c) for c in channels], [int(c) for c in route_channels]
        if len(channels) != n or any(c < 1 for c in channels):
            raise ValueError(f"channels must give {n} positive widths (one per level, deepest first), got {channels}")
        if len(route_channels) != n - 1 or any(c < 1 for c in route_channels):
            raise ValueError(f"route_channels must give {n - 1} positive widths (one per level but the "
                             f"shallowest), got {route_channels}")
        self.channels, self.route_channels = channels, route_channels

        def unit(cin, cout, k, coord):
            return CoordConv(cin, cout, k, coord_range) if coord else ConvBNLayer(cin, cout, k, 1, act="leaky")

        self.blocks = nn.ModuleList()
        self.transitions = nn.ModuleList()
        for i, ch_in in enumerate(list(in_channels)[::-1]):
            if i > 0:
                ch_in += route_channels[i - 1]
            c = channels[i]
            drop = [("dropblock", DropBlock(block_size, keep_prob))] if drop_block else []
            if conv_block_num == 2:
                conv0 = ("conv0", unit(ch_in, c, 1, coord_conv))
                conv1 = ("conv1", ConvBNLayer(c, 2 * c, 3, 1, act="leaky"))
                conv2 = ("conv2", unit(2 * c, c, 1, coord_conv))
                conv3 = ("conv3", ConvBNLayer(c, 2 * c, 3, 1, act="leaky"))
                if i == 0:
                    layers = [conv0, conv1, conv2] + ([("spp", SPP(c, c))] if spp else []) + [conv3] + drop
                else:
                    layers = [conv0, conv1] + drop + [conv2, conv3]
                layers.append(("route", unit(2 * c, c, 1, coord_conv)))
            else:
                layers = ([("spp", SPP(ch_in, ch_in))] if (spp and i == 0) else []) + drop
                layers.append(("route", unit(ch_in, c, 1, coord_conv)))
            self.blocks.append(PPYOLODetBlock(layers, unit(c, 2 * c, 3, coord_conv)))
            if i < n - 1:
                self.transitions.append(ConvBNLayer(c, route_channels[i], 1, 1, act="leaky"))
        self.out_channels = [2 * c for c in channels]

    def drop_blocks(self) -> List[DropBlock]:
        """The DropBlock modules (empty when built with ``drop_block=False``)."""
        return [m for m in self.modules() if isinstance(m, DropBlock)]

    def forward(self, feats: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """From the deepest level up: each level's block on its features (concatenated with the upsampled
        route of the level below it in depth); the tips, deepest first.

        Raises:
            ValueError: not one feature map per level.
        """
        if len(feats) != len(self.blocks):
            raise ValueError(f"PPYOLOFPN was built for {len(self.blocks)} levels, got {len(feats)}")
        tips = []
        route = None
        for i, x in enumerate(list(feats)[::-1]):
            if route is not None:
                x = torch.cat([route, x], dim=1)
            r, tip = self.blocks[i](x)
            tips.append(tip)
            if i < len(self.transitions):
                route = F.interpolate(self.transitions[i](r), scale_factor=2.0, mode="nearest")
        return tips
