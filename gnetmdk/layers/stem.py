"""The stem block recomputed in the backward pass: conv -> BatchNorm -> activation (-> 2x2 max pool)
on the input image, keeping only the image (and, with the pool, a 2-bit position code per pooled value).

Why the stem
------------
A detector's first conv reads the image (3 channels) and writes its largest activation: in GNetDet
448 x1.0 that is 64 channels at 448 x 448, 392 MiB per tensor at batch 8 in float32. Trained as
conv -> BatchNorm -> ReLU -> pool, the backward pass keeps BatchNorm's input and the ReLU's output
of that size (in-place ABN, :mod:`gnetmdk.layers.inplace_abn`, keeps the output and, for an exact
ReLU, BatchNorm's output where the ReLU outputs 0), and its own backward holds two or three such
tensors at once: in GNetDet 448 the stem is about 57% of what a training step keeps
(docs/results/memory.md). The same conv is the cheapest of the network to recompute:
C_in k^2 = 27 multiply-adds per output against 576 or more for every later 3x3 conv. So this block
keeps its input and recomputes its conv in the backward pass, image chunk by image chunk; no
activation-sized tensor of the stem survives the forward pass, and its backward holds one chunk's
worth at a time. (Activation checkpointing, ``torch.utils.checkpoint``, also recomputes from the
input, but re-runs the whole block at once, holds what it saves again for its own backward, and
updates BatchNorm's running statistics a second time; it saved no peak memory here.)

The arithmetic
--------------
Forward, with batch statistics: the conv per chunk of images, per-chunk moments
(``gnetmdk.dist.syncbn.batch_moments``: count, mean, ``M2``, float64) merged over the chunks with
Chan et al.'s parallel formula and then over the processes exactly as ``DistBatchNorm2d`` does
(``combine_moments``: one all-gather), the running statistics updated as torch
(``update_running_stats_``), ``z = x scale + shift`` (float64 per-channel scale and shift rounded to
the compute dtype, as DistBatchNorm2d), the activation in place, and the 2x2/2 max pool. With the pool,
the position of each window's maximum is stored as a uint8 code 0..3 (top-left, top-right,
bottom-left, bottom-right; the first of equal values, as torch's max pool picks): 1/16 of the
full-resolution float32 tensor.

Backward, the BatchNorm gradient of Ioffe & Szegedy (2015, Sec. 3) in the expanded form of
``input_grad_coefficients``: ``dz = dy act'(z)``; pass 1 recomputes the conv per chunk and sums
``sum dz`` and ``sum dz (x - mean)`` (float64 per channel; all-reduced over the processes as
DistBatchNorm2d); pass 2 recomputes the conv again, forms ``grad x = a dz + b (x - mean) + base`` for
the chunk and hands it to the conv's own backward (``aten.convolution_backward``: weight, bias and,
when wanted, input gradients, summed over the chunks). With the pool, dz is non-zero only at the
stored positions, so pass 1 works on the pooled grid (the recomputed conv read at those positions)
and pass 2 adds ``a dz`` at those positions to the dense ``b (x - mean) + base``. With frozen
(running) statistics there is one pass, ``grad x = gamma invstd dz``. The conv of each chunk is
computed alike in the forward and the backward passes (same shapes, same kernel), so the recomputed
values, the ReLU's signs and the pool's positions are the forward's.

Costs: the stem's conv runs three times instead of once (on CPU, GNetDet 448: about 0.18 s per pass
at batch 8 on one thread); against that the backward works on the pooled grid where BatchNorm2d + ReLU
+ max pool walk the full resolution several times. The measured step time is in docs/results.md.
Results equal conv -> BatchNorm2d -> activation -> max pool to float32 rounding (per-chunk sums in
another order; tests/layers/test_stem.py).

Mixed precision: under autocast the conv runs in the autocast dtype (as autocast would run it), the
statistics and the affine map in float32, ``z`` is rounded to that dtype before the activation
(as BatchNorm2d under autocast), and the pool and the output keep it.

:func:`convert_recompute_stem` marks the GNetDet sublayers and PP-YOLO ConvBNLayers whose conv
reads at most 4 input channels (the image); they take this path while they train with a BatchNorm,
a plain conv and a plain activation, and their ordinary forward otherwise (evaluation, BN folded,
quantization, calibration).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from gnetmdk.dist.syncbn import (_all_reduce_, batch_moments, combine_moments, input_grad_coefficients,
                                 update_running_stats_)
from gnetmdk.layers.inplace_abn import _activate_
from gnetmdk.layers.units import ConvBNUnit

__all__ = ["StemSpec", "conv_bn_act", "convert_recompute_stem", "count_recompute_stem", "MAX_STEM_CHANNELS"]

#: a conv reading at most this many input channels is recomputed (the image: 3 colours, or 1 or 4)
MAX_STEM_CHANNELS = 4
#: elements of the conv output per chunk (float32: 64 MiB); at least one image per chunk
CHUNK_ELEMENTS = 1 << 24
_DIMS = (0, 2, 3)
_LOW = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class StemSpec:
    """The non-tensor settings of one stem block.

    stride, padding, dilation: the conv's (pairs of ints); act: "relu", "leaky_relu" or "identity";
    slope: leaky ReLU's negative slope; pool: a 2x2 / stride-2 max pool follows the activation;
    eps, momentum: BatchNorm's; unbiased: the running variance takes the unbiased (torch) or the
    biased (PaddlePaddle) batch variance; sync: statistics over the process group.
    """
    stride: Tuple[int, int] = (1, 1)
    padding: Tuple[int, int] = (1, 1)
    dilation: Tuple[int, int] = (1, 1)
    act: str = "relu"
    slope: float = 0.0
    pool: bool = False
    eps: float = 1e-5
    momentum: Optional[float] = 0.1
    unbiased: bool = True
    sync: bool = False


def _chunk_images(n: int, per_image: int) -> int:
    return max(1, min(n, CHUNK_ELEMENTS // max(1, per_image)))


def _merge_moments(rows, total: int):
    """One (2C + 1,) float64 ``[n, mean, M2]`` row from per-chunk rows (Chan et al.'s parallel formula,
    as ``combine_moments`` merges ranks); ``total``: the chunks' count of values per channel, known on
    the host (no read-back of the rows' counts)."""
    table = torch.stack(rows)
    c = (table.shape[1] - 1) // 2
    counts = table[:, :1]
    n = counts.sum()
    out = torch.empty_like(table[0])
    out[0] = n
    if total == 0:
        out[1:] = 0
        return out
    means = table[:, 1:c + 1]
    mean = (counts * means).sum(0) / n
    out[1:c + 1] = mean
    out[c + 1:] = table[:, c + 1:].sum(0) + (counts * (means - mean) ** 2).sum(0)
    return out


def _act_grad(dy: torch.Tensor, z: torch.Tensor, act: str, slope: float) -> torch.Tensor:
    """dz = dy act'(z), z the pre-activation (relu / leaky: the derivative of z > 0's side)."""
    if act == "relu":
        return torch.where(z > 0, dy, dy.new_zeros(()))
    if act == "leaky_relu":
        return torch.where(z > 0, dy, dy * slope)
    return dy


def _quads(t: torch.Tensor):
    """The four (N, C, H/2, W/2) strided views of a 2x2 / stride-2 window grid, in torch's scan order."""
    return (t[..., 0::2, 0::2], t[..., 0::2, 1::2], t[..., 1::2, 0::2], t[..., 1::2, 1::2])


def _pool_codes(y: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """uint8 code 0..3 of the first window position whose value equals the pooled value ``p``."""
    q = _quads(y)
    code = torch.full_like(p, 3, dtype=torch.uint8)
    for k in (2, 1, 0):                       # the first match wins: write the earlier positions last
        code.masked_fill_(q[k] == p, k)
    return code


def _at_codes(t: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    """The values of full-resolution ``t`` at the pooled positions ``code`` (pooled shape)."""
    q = _quads(t)
    out = q[3].clone()
    for k in (2, 1, 0):
        out = torch.where(code == k, q[k], out)
    return out


class _StemFunction(torch.autograd.Function):
    """conv -> BatchNorm -> activation (-> 2x2 max pool), keeping the input only (module docstring).

    forward(x, weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, num_batches_tracked,
    batch_stats, update, spec, amp_dtype): x (N, C_in, H, W) float32 / float64, any memory format;
    weight (C, C_in, kh, kw); conv_bias, bn_weight, bn_bias (C,) or None; ``batch_stats``: normalise
    with the (global) batch statistics, and with ``update`` update the running statistics;
    otherwise the running statistics. ``amp_dtype``: the autocast dtype the conv runs in, or None.
    Returns (N, C, H', W') (pooled: H'/2, W'/2) in the conv's dtype and memory format.
    """

    @staticmethod
    def forward(ctx, x, weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, num_batches_tracked,
                batch_stats, update, spec, amp_dtype):
        with torch.autocast(x.device.type, enabled=False):
            xs, w, b = _conv_operands(x, weight, conv_bias, amp_dtype)
            n = x.shape[0]
            convs, rows, counted = [], [], 0
            step = _chunk_images(n, weight.shape[0] * _conv_out_pixels(x, weight, spec))
            for i in range(0, max(n, 1), step):      # an empty batch (a rank without images) runs once
                c = F.conv2d(xs[i:i + step], w, b, spec.stride, spec.padding, spec.dilation)
                if batch_stats:
                    local, scratch = batch_moments(c.float() if c.dtype in _LOW else c)
                    del scratch
                    rows.append(local)
                    counted += c.numel() // c.shape[1]
                convs.append(c)
            cdt = torch.float32 if convs[0].dtype in _LOW else convs[0].dtype
            if batch_stats:
                nn_, mean, var = combine_moments(_merge_moments(rows, counted), spec.sync, "recomputed stem",
                                                 counts=[counted])
                if update:
                    update_running_stats_(running_mean, running_var, num_batches_tracked, mean, var, nn_,
                                          spec.momentum, spec.unbiased)
            else:
                nn_, mean, var = 0.0, running_mean.detach().double(), running_var.detach().double()
            invstd = torch.rsqrt(var + spec.eps)
            scale = invstd if bn_weight is None else invstd * bn_weight.detach().double()
            shift = -mean * scale if bn_bias is None else bn_bias.detach().double() - mean * scale
            view = (1, scale.numel(), 1, 1)
            sc, sh = scale.to(cdt).view(view), shift.to(cdt).view(view)
            out = codes = None
            for k in range(len(convs)):
                c = convs[k]
                convs[k] = None                   # freed chunk by chunk
                z = _affine(c, sc, sh, cdt)
                y = _activate_(z, spec.act, spec.slope)
                if spec.pool:
                    p = F.max_pool2d(y, 2, 2)
                    code = _pool_codes(y, p)
                    if out is None:
                        out = _empty_as((n,) + tuple(p.shape[1:]), p.dtype, p)
                        codes = _empty_as(out.shape, torch.uint8, p)
                    out[k * step:k * step + p.shape[0]].copy_(p)
                    codes[k * step:k * step + p.shape[0]].copy_(code)
                else:
                    if out is None:
                        out = _empty_as((n,) + tuple(y.shape[1:]), y.dtype, y)
                    out[k * step:k * step + y.shape[0]].copy_(y)
                del c, z, y
        ctx.save_for_backward(x, weight, conv_bias, bn_weight, mean.to(cdt), invstd, scale, shift, codes)
        ctx.spec, ctx.amp_dtype, ctx.step, ctx.n, ctx.batch_stats = spec, amp_dtype, step, nn_, batch_stats
        ctx.bn_bias_dtype = None if bn_bias is None else bn_bias.dtype
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        x, weight, conv_bias, bn_weight, mean_c, invstd, scale, shift, codes = ctx.saved_tensors
        spec, step = ctx.spec, ctx.step
        need = ctx.needs_input_grad
        cch = weight.shape[0]
        view = (1, cch, 1, 1)
        with torch.autocast(x.device.type, enabled=False):
            xs, w, b = _conv_operands(x, weight, conv_bias, ctx.amp_dtype)
            cdt = torch.float32 if (ctx.amp_dtype is not None or x.dtype in _LOW) else x.dtype
            sc, sh, m = scale.to(cdt).view(view), shift.to(cdt).view(view), mean_c.view(view)
            douts = dout.to(cdt) if dout.dtype != cdt else dout

            def conv(i):
                c = F.conv2d(xs[i:i + step], w, b, spec.stride, spec.padding, spec.dilation)
                return c.float() if c.dtype in _LOW else c

            def dz_of(i, c):
                """dz (pooled grid with the pool, else full) and the conv values where it lives."""
                if spec.pool:
                    cp = _at_codes(c, codes[i:i + step])
                    return _act_grad(douts[i:i + step], _affine(cp, sc, sh, cdt, copy=True), spec.act,
                                     spec.slope), cp
                return _act_grad(douts[i:i + step], _affine(c, sc, sh, cdt, copy=True), spec.act, spec.slope), c

            starts = range(0, max(x.shape[0], 1), step)
            sums = torch.zeros(2 * cch, dtype=torch.float64, device=x.device)
            if ctx.batch_stats or need[3] or need[4]:
                for i in starts:                  # pass 1: sum dz, sum dz (x - mean)
                    dz, cv = dz_of(i, conv(i))
                    sums[:cch] += dz.sum(dim=_DIMS, dtype=dz.dtype).double()
                    sums[cch:] += (dz * (cv - m)).sum(dim=_DIMS, dtype=dz.dtype).double()
                    del dz, cv
            g_bnw = (sums[cch:] * invstd).to(bn_weight.dtype) if bn_weight is not None and need[3] else None
            g_bnb = sums[:cch].to(ctx.bn_bias_dtype) if ctx.bn_bias_dtype is not None and need[4] else None
            g_x = g_w = g_b = None
            if need[0] or need[1] or need[2]:
                if ctx.batch_stats:
                    total = _all_reduce_(sums.clone(), spec.sync)
                    a, bb, base = input_grad_coefficients(total, ctx.n, bn_weight, invstd)
                else:
                    g64 = invstd.new_ones(cch) if bn_weight is None else bn_weight.detach().double()
                    a, bb, base = g64 * invstd, torch.zeros_like(invstd), torch.zeros_like(invstd)
                a_c = a.to(cdt).view(view)
                # grad x = a dz + b (x - mean) + base = a dz + b x + (base - b mean)
                b_c, const = bb.to(cdt).view(view), (base - bb * mean_c.double()).to(cdt).view(view)
                mask = [need[0], need[1], conv_bias is not None and need[2]]
                for i in starts:                  # pass 2: the conv output's gradient, then the conv's backward
                    c = conv(i)
                    dz, _ = dz_of(i, c)
                    gc = torch.addcmul(const, c, b_c, out=c) if c.dtype == cdt else torch.addcmul(const, c, b_c)
                    if spec.pool:
                        adz, code = dz * a_c, codes[i:i + step]
                        for k, q in enumerate(_quads(gc)):
                            q.add_(torch.where(code == k, adz, adz.new_zeros(())))
                    else:
                        gc.addcmul_(dz, a_c)
                    del dz
                    gc = gc.to(w.dtype)
                    gi, gw, gb = torch.ops.aten.convolution_backward(
                        gc, xs[i:i + step], w, [w.shape[0]] if b is not None else None, list(spec.stride),
                        list(spec.padding), list(spec.dilation), False, [0, 0], 1, mask)
                    if gi is not None:
                        g_x = _empty_as(x.shape, x.dtype, x) if g_x is None else g_x
                        g_x[i:i + step].copy_(gi)
                    # the chunks' sums in float32 at least (bf16 convs under autocast), float64 kept
                    if gw is not None:
                        gw = gw.to(torch.promote_types(gw.dtype, torch.float32))
                        g_w = gw if g_w is None else g_w.add_(gw)
                    if gb is not None:
                        gb = gb.to(torch.promote_types(gb.dtype, torch.float32))
                        g_b = gb if g_b is None else g_b.add_(gb)
                    del c, gc, gi, gw, gb
            g_w = g_w.to(weight.dtype) if g_w is not None else None
            g_b = g_b.to(conv_bias.dtype) if g_b is not None else None
        return (g_x if need[0] else None, g_w, g_b, g_bnw, g_bnb) + (None,) * 7


def _conv_operands(x, weight, conv_bias, amp_dtype):
    if amp_dtype is None:
        return x, weight, conv_bias
    return (x.to(amp_dtype), weight.to(amp_dtype), None if conv_bias is None else conv_bias.to(amp_dtype))


def _affine(c: torch.Tensor, sc, sh, cdt, copy: bool = False) -> torch.Tensor:
    """z = c scale + shift in the compute dtype (in place on c when it may be, as DistBatchNorm2d
    writes into its own buffer), rounded back to c's dtype when that is a low precision."""
    low = c.dtype in _LOW
    cf = c.float() if low else c
    if copy or low or cf is not c:
        z = torch.addcmul(sh, cf, sc)
    else:
        z = torch.addcmul(sh, cf, sc, out=cf)
    return z.to(c.dtype) if low else z


def _empty_as(shape, dtype, ref: torch.Tensor) -> torch.Tensor:
    """An uninitialised tensor of ``shape`` and ``dtype`` on ref's device, in ref's memory format."""
    cl = ref.dim() == 4 and not ref.is_contiguous() and ref.is_contiguous(memory_format=torch.channels_last)
    return torch.empty(shape, dtype=dtype, device=ref.device,
                       memory_format=torch.channels_last if cl else torch.contiguous_format)


def _conv_out_pixels(x: torch.Tensor, weight: torch.Tensor, spec: StemSpec) -> int:
    """H' W' of the conv's output for one image."""
    size = 1
    for d in (0, 1):
        k = weight.shape[2 + d]
        size *= (x.shape[2 + d] + 2 * spec.padding[d] - spec.dilation[d] * (k - 1) - 1) // spec.stride[d] + 1
    return size


def conv_bn_act(x: torch.Tensor, conv: nn.Module, bn: nn.BatchNorm2d, act: str, slope: float = 0.0,
                pool: bool = False, sync: Optional[bool] = None) -> torch.Tensor:
    """``pool(act(bn(conv(x))))`` computed by the recomputing stem Function (module docstring).

    Args:
        x: (N, C_in, H, W) float32 / float64 (the image); any memory format.
        conv: an ``nn.Conv2d`` (or subclass whose forward is the plain conv: GNetDet's QConv2d at
            step 1), groups 1, zero padding.
        bn: a BatchNorm2d (torch's, DistBatchNorm2d, SyncBatchNorm or BatchNormAct2d: its parameters,
            buffers, eps, momentum and mode are read); training mode uses batch statistics.
        act: "relu", "leaky_relu" (``slope``) or "identity"; pool: a 2x2 / stride-2 max pool after it.
        sync: statistics over the process group; None: when ``bn`` is a synchronised BatchNorm and
            more than one process runs.

    Returns:
        (N, C, H', W') in the conv's dtype (the autocast dtype under autocast) and x's memory format;
        pooled H'/2, W'/2.

    Raises:
        ValueError: an activation other than the three, a pool over odd sizes, grouped or non-zero-
            padded conv, or at most one value per channel over the batch in training.
    """
    from gnetmdk.dist.syncbn import DistBatchNorm2d, _world
    if act not in ("relu", "leaky_relu", "identity"):
        raise ValueError(f"activation must be relu, leaky_relu or identity, got {act!r}")
    if conv.groups != 1 or conv.padding_mode != "zeros" or isinstance(conv.padding, str):
        raise ValueError("the recomputed stem needs a conv with groups 1 and numeric zero padding")
    bn_training = bn.training or (bn.running_mean is None and bn.running_var is None)
    track = bn.training and bn.track_running_stats and bn.running_mean is not None
    if sync is None:
        sync = isinstance(bn, (DistBatchNorm2d, nn.SyncBatchNorm)) or bool(getattr(bn, "sync", False))
    sync = bool(sync) and bn_training and _world() > 1
    amp = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else None
    spec = StemSpec(tuple(conv.stride), tuple(conv.padding), tuple(conv.dilation), act, float(slope), bool(pool),
                    float(bn.eps), bn.momentum, bool(getattr(bn, "unbiased_running_var", True)), sync)
    if pool:
        h = (x.shape[-2] + 2 * spec.padding[0] - spec.dilation[0] * (conv.kernel_size[0] - 1) - 1) // spec.stride[0] + 1
        w = (x.shape[-1] + 2 * spec.padding[1] - spec.dilation[1] * (conv.kernel_size[1] - 1) - 1) // spec.stride[1] + 1
        if h % 2 or w % 2:
            raise ValueError(f"the recomputed stem pools 2x2 / stride 2 over even sizes, got {h} x {w}")
    return _StemFunction.apply(x, conv.weight, conv.bias, bn.weight, bn.bias,
                               bn.running_mean if (track or not bn_training) else None,
                               bn.running_var if (track or not bn_training) else None,
                               bn.num_batches_tracked if track else None, bn_training, track, spec, amp)


# ---------------------------------------------------------------------------------- conversion
def convert_recompute_stem(module: nn.Module) -> int:
    """Mark the stem block of ``module`` for recomputation (in place); returns how many (0 or 1).

    Marked: the first :class:`gnetmdk.layers.units.ConvBNUnit` (GNetDet's ``Sublayer``, PP-YOLO's
    ``ConvBNLayer``; in module order: GNetDet's first layer, PP-YOLO's first backbone conv) with a
    BatchNorm whose conv (plain, groups 1) reads at most :data:`MAX_STEM_CHANNELS` input channels, i.e.
    the image. A marked block computes the same
    function; it takes :func:`conv_bn_act` only while gradients are on and it trains as a float
    conv -> BatchNorm -> plain activation (its ``stem_ok``), and its own forward otherwise. Parameters,
    buffers and state_dict keys do not change.
    """
    for m in module.modules():
        if isinstance(m, ConvBNUnit):
            conv = m.conv
            if (isinstance(conv, nn.Conv2d) and conv.groups == 1 and conv.in_channels <= MAX_STEM_CHANNELS
                    and isinstance(m.bn, nn.BatchNorm2d)):
                m.recompute_stem = True
                return 1
            return 0
    return 0


def count_recompute_stem(module: nn.Module) -> int:
    """How many blocks of ``module`` are marked by :func:`convert_recompute_stem`."""
    return sum(bool(getattr(m, "recompute_stem", False)) for m in module.modules())
