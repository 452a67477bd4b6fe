"""In-place activated BatchNorm (InPlace-ABN; Rota Bulo, Porzi, Kontschieder, "In-Place Activated
BatchNorm for Memory-Optimized Training of DNNs", CVPR 2018, arXiv 1712.02616) and its synchronised form.

The idea
--------
A conv -> BatchNorm -> activation -> conv chain keeps two activation-sized tensors per layer for the
backward pass: BatchNorm's input ``x`` (its backward needs ``xhat = (x - mean) invstd``) and the
activation's output ``y`` (the next conv needs it; the activation's own backward reads it too). The
paper fuses BatchNorm and activation into one layer whose backward recomputes what it needs from the
stored *output*: with ``z = gamma xhat + beta`` and ``y = act(z)``, an invertible ``act`` gives
``z = act^-1(y)`` and ``xhat = (z - beta) / gamma``, so ``x`` need not be kept (the paper's
"InPlace-ABN II": the gradient written in terms of the output, Sec. 3). The BatchNorm gradient is
the usual one (Ioffe & Szegedy 2015, Sec. 3)::

    dz = dy * act'(z)                       (act' read from the sign of y)
    dbeta = sum dz,   dgamma = sum dz * xhat
    dx = gamma invstd (dz - mean(dz) - xhat mean(dz xhat))       (batch statistics)
    dx = gamma invstd dz                                          (frozen / running statistics)

What is stored, per activation
------------------------------
* ``leaky_relu`` (slope > 0) and ``identity``: invertible. Saved: ``y`` alone (the tensor the next
  layer saves anyway) plus per-channel statistics. BatchNorm + activation then hold one
  activation-sized tensor instead of two: the paper's "up to 50%".
* ``relu``: not invertible where ``y = 0``. The paper and its reference implementation
  (mapillary/inplace_abn) do not support it in place: ``InPlaceABN`` accepts only ``leaky_relu``,
  ``elu`` and ``identity`` (a slope of 0 divides by zero, their issue #15), and the paper trains
  with leaky ReLU 0.01 instead. GNetDet's chip computes ReLU, so that substitution is not open here.
  The sign of ``y`` gives the ReLU derivative (``y > 0``) and, where ``y > 0``, ``z = y`` exactly, so
  ``dgamma`` (which only sums where ``dz != 0``) and the frozen-statistics ``dx`` need nothing more.
  The batch-statistics ``dx`` however has the term ``-gamma invstd xhat_i mean(dz xhat)`` at *every*
  position, the dead ones included, and ``xhat_i`` there is lost by the ReLU: keeping "the sign from
  the output" is not enough. This layer therefore keeps, besides ``y``, BatchNorm's output ``z`` at
  the positions where ``y = 0`` only, compacted (``p N`` values for a fraction ``p`` of zeros, in
  memory order; the mask itself is recomputed from ``y``), scatters them back into the copy of ``y``
  in the backward, and recovers ``x - mean`` from the full ``z`` like for the invertible activations.
  The gradients are exact (float32 rounding; no approximation).

  Memory accounting: what the backward keeps per conv -> BatchNorm -> activation unit, N elements
  of b bytes each, counting the activation's output once (the next conv keeps it anyway)::

      BatchNorm2d + ReLU:        x + y                               = 2 N b   (ReLU's backward reads y)
      BatchNorm2d + leaky ReLU:  x + z + y                           = 3 N b   (leaky's reads its input z)
      this layer, leaky / identity:  y                               = 1 N b
      this layer, ReLU:          y + z where y = 0 (p N b)           = (1 + p) N b

  p is the fraction of zeros: about 1/2 at initialisation (beta = 0), so BatchNorm + ReLU storage
  drops by about 25% (half of BatchNorm's input), against 50-67% for leaky ReLU; with sparser ReLU
  outputs (p > 1/2, common deeper in trained nets) the saving shrinks toward 0. With frozen
  statistics (eval-mode BatchNorm inside training) ReLU keeps ``y`` alone. Storing the dead positions
  in bfloat16 would halve that extra but break float32 equality with BatchNorm2d + ReLU; not done.
  Transient memory: the forward allocates one activation-sized buffer (statistics scratch, then the
  output) and, for ReLU, a bool mask and the compacted values; the backward one (dz, which becomes
  grad x) besides the incoming gradient, and works through y in slices of 2^22 elements (two passes:
  the per-channel sums, then grad x), where torch's BatchNorm + activation backward hold two (the
  general path, for other layouts or ill-conditioned channels, also holds ``x - mean`` whole).
  Time: leaky ReLU / identity cost about what BatchNorm2d + activation cost; ReLU adds a
  compaction in the forward (numpy's ``extract`` on the CPU, ~1 ns per element) and a
  ``masked_scatter_`` in the backward (serial on the CPU, ~4 ns per element): the price of exact
  gradients.

Small gamma
-----------
``xhat = (z - beta) / gamma`` loses about ``|beta| / |gamma|`` ulps (``z`` is rounded relative to
``|z| ~ |gamma xhat + beta|``) and is undefined at ``gamma = 0``. The paper and its implementation
avoid this by computing with ``|gamma| + eps`` in place of ``gamma`` (the layer's scale is then never
below eps, nor negative). That changes the function the layer computes: a checkpoint would no longer
give the same outputs in a plain ``BatchNorm2d``, ``fold_bn`` (which reads ``weight``) would fold the
wrong scale, and a negative gamma would flip sign. This layer keeps BatchNorm2d's function and
instead stores, for the channels where inversion is ill-conditioned (``|gamma| < sqrt(tiny)`` of the
dtype, or ``|beta| > cond_max |gamma|``, ``cond_max = 16`` by default: at most ~17 ulps lost in
``xhat``, of the order of the float32 error of the per-channel sums themselves), their BatchNorm input
(``index_select`` over those channels). Normally that set is empty; it costs ``k / C`` of an
activation for ``k`` such channels, and the gradients stay exact.

Statistics
----------
Training statistics come from :mod:`gnetmdk.dist.syncbn`'s shared functions: ``batch_moments``,
``combine_moments`` and ``update_running_stats_`` (float64 per-channel count / mean / ``M2``,
Chan's combination over ranks in rank order, torch's running-statistics update), bit for bit those
of ``DistBatchNorm2d``, so :class:`BatchNormAct2d` with ``sync=True`` normalises with exactly its
statistics (its output is the activation of DistBatchNorm2d's output). The backward all-reduces the
same per-channel sums ``[sum dz, sum dz (x - mean)]`` (computed from the recovered ``x - mean``:
``channel_grad_sums`` in the general path, slice by slice otherwise) and turns them into the input
gradient with the shared ``input_grad_coefficients``. One process runs the same arithmetic without
the collectives (2 x B/2 equals 1 x B).

:func:`convert_inplace_abn` swaps the BatchNorm that directly precedes a ReLU / leaky ReLU for
:class:`BatchNormAct2d`, sharing parameters and buffers, and turns the activation that followed
into an identity (GNetDet sublayers, PP-YOLO ``ConvBNLayer``, and ``nn.Sequential`` pairs).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from gnetmdk.dist.syncbn import (DistBatchNorm2d, _all_reduce_, batch_moments, channel_grad_sums,
                                 combine_moments, input_grad_coefficients, share_bn_state,
                                 update_running_stats_)
from gnetmdk.layers.units import ConvBNAct, ConvBNQReLU

__all__ = ["BatchNormAct2d", "convert_inplace_abn", "count_inplace_abn", "ACTIVATIONS"]

ACTIVATIONS = ("relu", "leaky_relu", "identity")
_DIMS = (0, 2, 3)
_LOW = (torch.float16, torch.bfloat16)


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _activate_(z: torch.Tensor, act: str, slope: float) -> torch.Tensor:
    """The activation, in place on ``z`` (the same kernels as F.relu / F.leaky_relu out of place)."""
    if act == "relu":
        return torch.relu_(z)
    if act == "leaky_relu":
        return F.leaky_relu_(z, slope)
    return z


def _ill_conditioned(weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], cond_max: float,
                     dtype: torch.dtype) -> Optional[torch.Tensor]:
    """Indices (int64, on the parameters' device) of the channels whose ``xhat`` cannot be recovered
    from ``z = gamma xhat + beta`` to a few ulps: ``|gamma| < sqrt(finfo(dtype).tiny)`` (``gamma xhat``
    could be subnormal) or ``|beta| > cond_max |gamma|``; None when there is none (or no affine).
    One host read of a (C,) bool (a device synchronisation on CUDA)."""
    if weight is None:
        return None
    g = weight.detach().double().abs()
    b = bias.detach().double().abs() if bias is not None else torch.zeros_like(g)
    bad = (g < math.sqrt(torch.finfo(dtype).tiny)) | (b > cond_max * g)
    if not bool(bad.any()):
        return None
    return bad.nonzero().flatten()


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A 1-d view of a dense (N, C, H, W) tensor in memory order (contiguous or channels_last), or
    the tensor itself (masked operations then run in logical order; consistent between the forward
    and the backward, which see the same layout)."""
    if t.is_contiguous():
        return t.view(-1)
    if t.is_contiguous(memory_format=torch.channels_last):
        return t.permute(0, 2, 3, 1).reshape(-1)                       # a view: NHWC is contiguous
    return t


_INT_OF = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _compact(t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``t.masked_select(mask)`` (1-d, in ``t``'s order). On the CPU through numpy's ``extract`` on
    an integer view of the bits (same values; about 10x faster than torch's serial masked_select)."""
    if t.device.type == "cpu" and t.dim() == 1:
        import numpy as np
        bits = t.view(_INT_OF[t.element_size()]).numpy()
        return torch.from_numpy(np.extract(mask.numpy(), bits)).view(t.dtype)
    return t.masked_select(mask)


class _InPlaceABNFunction(torch.autograd.Function):
    """BatchNorm (batch or running statistics) + activation whose backward reads the output.

    forward(x, weight, bias, running_mean, running_var, num_batches_tracked, batch_stats, update,
    eps, momentum, sync, act, slope, cond_max, record, unbiased=True):
        x (N, C, H, W) float16 / bfloat16 / float32 / float64, any memory format; weight, bias (C,)
        or None. ``batch_stats``: normalise with the (global, with ``sync``) batch statistics
        (float64, gnetmdk.dist.syncbn) and, with ``update``, update the running statistics as
        torch; otherwise the running statistics (``F.batch_norm`` in eval mode, bit for bit).
        Low-precision input: statistics and the affine map in float32, ``z`` rounded to the input
        dtype, the activation applied in that dtype (as torch's BatchNorm kernel + activation under
        autocast). ``record``: whether a backward can follow (else nothing is stored). ``unbiased``:
        the running variance takes the unbiased (torch) or the biased (PaddlePaddle) batch variance.
    Saved: the output y, per-channel statistics, and (see the module docstring) z where y == 0
    (ReLU, batch statistics, input gradient wanted) and the input of ill-conditioned channels.
    backward: gradients of x (x's dtype), weight and bias; with ``sync`` the per-channel sums are
    all-reduced exactly as DistBatchNorm2d's.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, num_batches_tracked, batch_stats, update,
                eps, momentum, sync, act, slope, cond_max, record, unbiased=True):
        c = x.shape[1]
        view = (1, c, 1, 1)
        low = x.dtype in _LOW
        cdt = torch.float32 if low else x.dtype                      # compute dtype
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        with torch.autocast(x.device.type, enabled=False):
            if batch_stats:
                xs = x.float() if low else x
                local, scratch = batch_moments(xs)
                n, mean, var = combine_moments(local, sync, "BatchNormAct2d", counts=[xs.numel() // c])
                if update:
                    update_running_stats_(running_mean, running_var, num_batches_tracked, mean, var, n, momentum,
                                          unbiased)
                invstd = torch.rsqrt(var + eps)
                scale = invstd if weight is None else invstd * weight.detach().double()
                shift = -mean * scale if bias is None else bias.detach().double() - mean * scale
                # z = x * scale + shift into the statistics' scratch buffer (as DistBatchNorm2d)
                z = scratch if scratch is not None else torch.empty_like(xs)
                torch.addcmul(shift.to(cdt).view(view), xs, scale.to(cdt).view(view), out=z)
                del xs, scratch
                if low:
                    z = z.to(x.dtype)
                mean_c = mean.to(cdt)
                # the input gradient needs x - mean everywhere, the weight gradient where dz != 0
                need_dev = need_x or need_w
            else:
                z = F.batch_norm(x, running_mean, running_var, weight, bias, False, 0.0, eps)
                n = 0.0
                invstd = torch.rsqrt(running_var.detach().double() + eps)
                mean_c = running_mean.detach().to(cdt, copy=True)
                need_dev = need_w                                        # dx = gamma invstd dz
            z_neg = x_ill = ill = None
            if record:
                if need_dev:
                    ill = _ill_conditioned(weight, bias, cond_max, x.dtype)
                    if ill is not None:
                        x_ill = x.index_select(1, ill.to(x.device))
                if act == "relu" and batch_stats and need_x:
                    zf = _flat(z)                                        # z where ReLU outputs 0, compacted
                    z_neg = _compact(zf, zf <= 0)
                    del zf
            y = _activate_(z, act, slope)
        if record:
            ctx.save_for_backward(y, weight, bias, mean_c, invstd, z_neg, x_ill, ill)
            ctx.n, ctx.sync, ctx.act, ctx.slope = n, sync, act, slope
            ctx.batch_stats, ctx.need_dev, ctx.x_dtype = batch_stats, need_dev, x.dtype
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        y, weight, bias, mean_c, invstd, z_neg, x_ill, ill = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        c = y.shape[1]
        view = (1, c, 1, 1)
        cdt = torch.float32 if y.dtype in _LOW else y.dtype
        # dz = dy * act'(z), the derivative read from the sign of y (y > 0 <=> z > 0): torch's own
        # ReLU / leaky ReLU backward kernels, given y in place of z, into one buffer of y's layout
        # (which later receives grad x)
        dz = torch.empty_like(y, dtype=cdt)
        dyc = dy if dy.dtype == cdt else dy.to(cdt)
        if ctx.act == "relu":
            if y.dtype == cdt:
                torch.ops.aten.threshold_backward.grad_input(dyc, y, 0, grad_input=dz)
            else:
                torch.where(y > 0, dyc, dyc.new_zeros(()), out=dz)
        elif ctx.act == "leaky_relu":
            torch.ops.aten.leaky_relu_backward.grad_input(dyc, y if y.dtype == cdt else y.to(cdt), ctx.slope,
                                                          False, grad_input=dz)
        else:
            dz.copy_(dyc)
        del dyc
        g64 = invstd.new_ones(c) if weight is None else weight.detach().double()
        # x - mean = (z - beta) / (gamma invstd) = z r + shift, z = act^-1(y)
        r = 1.0 / (g64 * invstd)
        shift = -(bias.detach().double() if bias is not None else torch.zeros_like(r)) * r
        rows = _Rows(y, dz) if ill is None else None
        if ctx.need_dev and rows is not None and rows.ok:
            # chunked (no activation-sized x - mean buffer); the sums need x - mean only where
            # dz != 0, so the ReLU's kept z is scattered back in the second pass alone
            sums = rows.grad_sums(cdt, ctx.act, ctx.slope, r, shift)
        elif ctx.need_dev:
            dev = _recover_dev(y, cdt, ctx.act, ctx.slope, z_neg, r, shift, ill, x_ill, mean_c)
            sums = _grad_sums_by_image(dz, dev)
        else:
            sums = torch.zeros(2 * c, dtype=torch.float64, device=y.device)
            sums[:c] = dz.sum(dim=_DIMS, dtype=dz.dtype).double()
        grad_w = (sums[c:] * invstd).to(weight.dtype) if weight is not None and need_w else None
        grad_b = sums[:c].to(bias.dtype) if bias is not None and need_b else None
        if not need_x:
            return (None, grad_w, grad_b) + (None,) * 13
        if ctx.batch_stats:
            total = _all_reduce_(sums.clone(), ctx.sync)
            a, b, base = input_grad_coefficients(total, ctx.n, weight, invstd)
            # grad_x = a dz + b (x - m) + base (the BatchNorm gradient, as DistBatchNorm2d), into dz
            if rows is not None and rows.ok:
                rows.grad_input_(cdt, ctx.act, ctx.slope, z_neg, r, shift, a, b, base)
            else:
                dz.mul_(a.to(cdt).view(view)).add_(base.to(cdt).view(view)).addcmul_(dev, b.to(cdt).view(view))
        else:
            dz.mul_((g64 * invstd).to(cdt).view(view))                  # running statistics
        return (dz.to(ctx.x_dtype), grad_w, grad_b) + (None,) * 13


def _recover_dev(y, cdt, act, slope, z_neg, r, shift, ill, x_ill, mean_c) -> torch.Tensor:
    """``x - mean`` as one y-shaped tensor (the general path: any layout, ill-conditioned channels)."""
    c = y.shape[1]
    view = (1, c, 1, 1)
    dev = y.to(cdt, copy=True)
    if z_neg is not None:                                                # ReLU: the kept z where y == 0
        yf, df = _flat(y), _flat(dev)
        if yf.dim() != df.dim() or yf.stride() != df.stride():
            yf, df = y, dev                                              # layouts differ: logical order
        df.masked_scatter_(yf <= 0, z_neg.to(cdt))
    elif act == "leaky_relu":
        F.leaky_relu_(dev, 1.0 / slope)                                  # y / slope where y < 0
    r, shift = r.clone(), shift.clone()
    if ill is not None:
        r[ill], shift[ill] = 1.0, 0.0                                    # overwritten from x_ill below
    torch.addcmul(shift.to(cdt).view(view), dev, r.to(cdt).view(view), out=dev)
    if x_ill is not None:
        dev.index_copy_(1, ill, x_ill.to(cdt) - mean_c[ill].view(1, -1, 1, 1))
    return dev


def _grad_sums_by_image(dz: torch.Tensor, dev: torch.Tensor) -> torch.Tensor:
    """``channel_grad_sums(dz, dz * dev)`` summed over the images one at a time (the product is never
    materialised whole)."""
    sums = None
    for i in range(dz.shape[0]):
        d, v = dz[i:i + 1], dev[i:i + 1]
        part = channel_grad_sums(d, d * v)
        sums = part if sums is None else sums.add_(part)
    return sums


class _Rows:
    """Memory-order 2-d views of y and dz, walked in slices of about 2^22 elements: rows are pixels
    and columns channels for channels_last tensors, rows are (image, channel) planes for contiguous
    ones. ``ok`` is False for other layouts (the caller then uses :func:`_recover_dev`).

    With ``x - m = z r + shift`` per channel (r = 1 / (gamma invstd), shift = -beta r):
    ``sum dz (x - m) = r sum dz z + shift sum dz`` and
    ``a dz + b (x - m) + base = a dz + (b r) z + (base + b shift)``, so a slice needs z alone."""

    CHUNK = 1 << 22

    def __init__(self, y: torch.Tensor, dz: torch.Tensor):
        n, c, h, w = y.shape
        self.c = c
        self.ok = False
        if y.stride() != dz.stride():
            return
        if y.is_contiguous():
            self.y2, self.d2, self.planes = y.view(n * c, h * w), dz.view(n * c, h * w), True
        elif y.is_contiguous(memory_format=torch.channels_last):
            self.y2 = y.permute(0, 2, 3, 1).reshape(-1, c)
            self.d2, self.planes = dz.permute(0, 2, 3, 1).reshape(-1, c), False
        else:
            return
        self.ok = True
        self.step = max(1, self.CHUNK // max(1, self.y2.shape[1]))
        self.starts = range(0, self.y2.shape[0], self.step)

    def _coef(self, v: torch.Tensor, i: int) -> torch.Tensor:
        """Per-channel vector ``v`` shaped to broadcast over rows i:i+step."""
        if not self.planes:
            return v.view(1, -1)
        idx = torch.arange(i, min(i + self.step, self.y2.shape[0]), device=v.device) % self.c
        return v[idx].view(-1, 1)

    def _z(self, i: int, cdt, act: str, slope: float, z_neg=None, offset: int = 0, count: int = 0):
        """z = act^-1(y) on rows i:i+step (with ``z_neg``: the ReLU's kept z put back where y == 0)."""
        yc = self.y2[i:i + self.step]
        if z_neg is not None:
            z = yc.to(cdt, copy=True)
            z.masked_scatter_(yc <= 0, z_neg[offset:offset + count].to(cdt))
            return z
        z = yc if yc.dtype == cdt else yc.to(cdt)
        if act == "leaky_relu":
            z = F.leaky_relu(z, 1.0 / slope)                              # y / slope where y < 0
        return z

    def grad_sums(self, cdt, act, slope, r64, shift64) -> torch.Tensor:
        """float64 ``[sum dz, sum dz (x - m)]`` per channel (float32 partial sums per slice); for ReLU
        z is taken as y (wrong where y == 0, harmless there: dz == 0)."""
        c = self.c
        sums = torch.empty(2 * c, dtype=torch.float64, device=self.y2.device)
        if self.planes:
            sums[:c] = self.d2.sum(1, dtype=self.d2.dtype).double().view(-1, c).sum(0)
        else:
            sums[:c] = self.d2.sum(0, dtype=self.d2.dtype).double()
        dzz = torch.zeros(c, dtype=torch.float64, device=self.y2.device)
        for i in self.starts:
            prod = self.d2[i:i + self.step] * self._z(i, cdt, act, slope)
            if self.planes:
                rows = torch.arange(i, i + prod.shape[0], device=prod.device) % c
                dzz.index_add_(0, rows, prod.sum(1, dtype=prod.dtype).double())
            else:
                dzz += prod.sum(0, dtype=prod.dtype).double()
        sums[c:] = r64 * dzz + shift64 * sums[:c]
        return sums

    def grad_input_(self, cdt, act, slope, z_neg, r64, shift64, a, b, base) -> None:
        """dz <- a dz + b (x - m) + base = a dz + (b r) z + (base + b shift), slice by slice."""
        counts = None
        if z_neg is not None:
            counts = torch.stack([(self.y2[i:i + self.step] <= 0).sum() for i in self.starts]).tolist()
        a_c, br, const = a.to(cdt), (b * r64).to(cdt), (base + b * shift64).to(cdt)
        offset = 0
        for k, i in enumerate(self.starts):
            cnt = counts[k] if counts is not None else 0
            z = self._z(i, cdt, act, slope, z_neg, offset, cnt)
            offset += cnt
            dzc = self.d2[i:i + self.step]
            torch.addcmul(self._coef(const, i), dzc, self._coef(a_c, i), out=dzc)
            dzc.addcmul_(z, self._coef(br, i))


class BatchNormAct2d(nn.BatchNorm2d):
    """BatchNorm2d followed by an activation, trained in place (InPlace-ABN, arXiv 1712.02616).

    A ``nn.BatchNorm2d`` subclass with BatchNorm2d's parameters, buffers and state_dict keys: a
    checkpoint written with it loads into ``BatchNorm2d`` + the activation and gives the same
    outputs, and BN folding (gnetmdk.gti.transforms.fold_bn) reads the same ``running_mean``,
    ``running_var``, ``weight``, ``bias`` and ``eps``. What differs is what the training backward keeps
    (the module docstring: the output, plus for ReLU the pre-activation where the output is 0).

    Args:
        num_features: C.
        activation: ``"relu"``, ``"leaky_relu"`` (``F.leaky_relu(z, slope)``) or ``"identity"``.
        slope: negative slope of leaky ReLU, > 0 (0 would be ReLU: use ``"relu"``); unused otherwise.
        eps, momentum, affine, track_running_stats: as ``nn.BatchNorm2d`` (momentum None: cumulative
            average).
        sync: when a process group of more than one process is initialised, training statistics are
            those of the global batch, exactly as ``gnetmdk.dist.syncbn.DistBatchNorm2d`` (shared
            code: an all-gather forward and an all-reduce backward per layer; every rank must call
            forward and backward alike). In one process, or with ``sync=False``, the same float64
            arithmetic without collectives.
        cond_max: largest ``|beta| / |gamma|`` for which a channel's normalised input is recovered
            by inversion; channels beyond it (or with ``|gamma|`` below ``sqrt(tiny)``) keep their input.

    Modes (torch's rules): training, or no running statistics: batch statistics (running statistics
    updated when tracked); otherwise the running statistics: without gradients exactly
    ``BatchNorm2d.forward`` then the activation (bit for bit); with gradients ("frozen" BatchNorm
    inside training) the same forward values through the in-place Function, whose ReLU backward then
    needs the output alone.

    Input / output: (N, C, H, W) float16 / bfloat16 / float32 / float64, any memory format; the
    output has the input's dtype and layout; the input is not modified. Under autocast, low-precision
    input gets float32 statistics and returns the input's dtype.

    Raises:
        ValueError: unknown activation, slope not a finite number > 0 for leaky ReLU, cond_max not
            > 0, input not 4-d or with other than ``num_features`` channels, or at most one value per
            channel over the (global) batch in training.
    """

    def __init__(self, num_features: int, activation: str = "relu", slope: float = 0.01, eps: float = 1e-5,
                 momentum: Optional[float] = 0.1, affine: bool = True, track_running_stats: bool = True,
                 sync: bool = False, cond_max: float = 16.0, device=None, dtype=None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        slope = float(slope)
        if activation == "leaky_relu" and not (math.isfinite(slope) and slope > 0):
            raise ValueError(f"leaky_relu needs a finite slope > 0 to be invertible, got {slope!r} "
                             "(slope 0 is ReLU: use activation='relu')")
        if not cond_max > 0:
            raise ValueError(f"cond_max must be > 0, got {cond_max!r}")
        self.activation = activation
        self.slope = slope
        self.sync = bool(sync)
        self.cond_max = float(cond_max)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """BatchNorm then the activation on ``x`` (N, C, H, W); see the class docstring for the modes.

        Raises:
            ValueError: input not 4-d or without ``num_features`` channels, or running statistics tracked
                without ``num_batches_tracked``.
        """
        if x.dim() != 4:
            raise ValueError(f"BatchNormAct2d expects (N, C, H, W) input, got {tuple(x.shape)}")
        if x.shape[1] != self.num_features:
            raise ValueError(f"BatchNormAct2d({self.num_features}) got {x.shape[1]} channels")
        bn_training = self.training or (self.running_mean is None and self.running_var is None)
        params_grad = self.weight is not None and (self.weight.requires_grad or self.bias.requires_grad)
        grad = torch.is_grad_enabled() and (x.requires_grad or params_grad)
        if not bn_training and not grad:
            return _activate_(super().forward(x), self.activation, self.slope)
        track = self.training and self.track_running_stats and self.running_mean is not None
        if track and self.num_batches_tracked is None:
            raise ValueError("BatchNormAct2d: running statistics tracked without num_batches_tracked")
        return _InPlaceABNFunction.apply(
            x, self.weight, self.bias,
            self.running_mean if (track or not bn_training) else None,
            self.running_var if (track or not bn_training) else None,
            self.num_batches_tracked if track else None,
            bn_training, track, self.eps, self.momentum, self.sync and bn_training and _world() > 1,
            self.activation, self.slope, self.cond_max, grad, getattr(self, "unbiased_running_var", True))

    def extra_repr(self) -> str:
        """BatchNorm2d's fields plus the activation (with its slope for leaky ReLU) and ``sync``."""
        act = self.activation + (f"({self.slope:g})" if self.activation == "leaky_relu" else "")
        return f"{super().extra_repr()}, activation={act}, sync={self.sync}"


# ---------------------------------------------------------------------------------- conversion
def _is_plain_bn(m) -> bool:
    return (isinstance(m, (nn.BatchNorm2d, nn.SyncBatchNorm)) and not isinstance(m, BatchNormAct2d)
            and type(m).forward in (nn.BatchNorm2d.forward, DistBatchNorm2d.forward, nn.SyncBatchNorm.forward))


def _abn_from(bn, activation: str, slope: float, sync: Optional[bool]) -> BatchNormAct2d:
    """A BatchNormAct2d computing ``activation(bn(x))``, sharing bn's parameters and buffers."""
    if sync is None:
        sync = isinstance(bn, (DistBatchNorm2d, nn.SyncBatchNorm))
    return share_bn_state(bn, BatchNormAct2d(bn.num_features, activation, slope, bn.eps, bn.momentum, bn.affine,
                                             bn.track_running_stats, sync=sync))


class _ReluAfterABN:
    """Forward hook of a GNetDet sublayer's QReLU: while the sublayer's ``bn`` is a ReLU
    BatchNormAct2d and the QReLU is a plain ReLU (step 1: no cap, no quantization, not calibrating),
    hand on the input (already ReLU-ed) instead of the QReLU's fresh copy, so that one tensor, not
    two, is alive. In every other mode (BatchNorm folded, caps, calibration) the QReLU's own output
    stands; it starts with a clamp at 0, so applying it to a ReLU-ed input changes nothing."""

    def __init__(self, sublayer: nn.Module):
        self.sublayer = sublayer

    def __call__(self, relu, inputs, output):
        bn = self.sublayer.bn
        if (isinstance(bn, BatchNormAct2d) and bn.activation == "relu" and not relu.fake_quant_enabled
                and not relu.observer_enabled and not relu.revive):
            return inputs[0]
        return None


def convert_inplace_abn(module: nn.Module, sync: Optional[bool] = None) -> nn.Module:
    """Replace every BatchNorm2d directly followed by a ReLU / leaky ReLU by a :class:`BatchNormAct2d`
    doing both (in place on ``module``; returns it). The new layers share the old ones' parameters
    and buffers (same objects: optimizers, EMA copies and state_dict keys are unchanged).

    Recognised units (the block classes of gnetmdk.layers.units, which the families' blocks inherit):
      * :class:`~gnetmdk.layers.units.ConvBNQReLU`, GNetDet's ``Sublayer`` (conv -> bn -> QReLU): ``bn``
        becomes a ReLU BatchNormAct2d and the QReLU gets a forward hook (:class:`_ReluAfterABN`) that
        passes its input through while it is a plain ReLU (step 1); once ``fold_bn`` removes ``bn``, or
        caps / calibration are on, the QReLU computes as before. Sublayers whose QReLU has ``revive`` (gradient below 0) are left alone.
      * :class:`~gnetmdk.layers.units.ConvBNAct`, PP-YOLO's ``ConvBNLayer``, with ``act`` "relu" / "leaky"
        (slope 0.1): ``bn`` becomes the BatchNormAct2d and ``act`` is set to None (the layer's documented
        identity).
      * ``nn.Sequential`` children: a BatchNorm2d immediately followed by ``nn.ReLU`` /
        ``nn.LeakyReLU``: the pair becomes (BatchNormAct2d, ``nn.Identity``).
    BatchNorm2d, DistBatchNorm2d and torch.nn.SyncBatchNorm are converted; ``sync=None`` makes the new
    layer synchronised exactly when the old one was (DistBatchNorm2d / SyncBatchNorm), True / False
    force it. Convert *after* ``convert_sync_batchnorm`` / ``prepare_model``: those replace every
    BatchNorm (this subclass included) by a plain synchronised one and would drop the activation.

    The module's function is unchanged (outputs and gradients to float rounding, see BatchNormAct2d).
    """
    for m in list(module.modules()):
        if isinstance(m, ConvBNQReLU):
            if _is_plain_bn(m.bn) and not m.relu.revive:
                m.bn = _abn_from(m.bn, "relu", 0.01, sync)
                if not any(isinstance(h, _ReluAfterABN) for h in m.relu._forward_hooks.values()):
                    m.relu.register_forward_hook(_ReluAfterABN(m))
        elif isinstance(m, ConvBNAct):
            if m.act in ("relu", "leaky") and _is_plain_bn(m.bn):
                m.bn = _abn_from(m.bn, "relu" if m.act == "relu" else "leaky_relu", 0.1, sync)
                m.act = None
        elif isinstance(m, nn.Sequential):
            names = list(m._modules)
            for first, second in zip(names, names[1:]):
                bn, act = m._modules[first], m._modules[second]
                if not _is_plain_bn(bn):
                    continue
                if type(act) is nn.ReLU:
                    m._modules[first] = _abn_from(bn, "relu", 0.01, sync)
                elif type(act) is nn.LeakyReLU and act.negative_slope > 0:
                    m._modules[first] = _abn_from(bn, "leaky_relu", act.negative_slope, sync)
                else:
                    continue
                m._modules[second] = nn.Identity()
    return module


def count_inplace_abn(module: nn.Module) -> int:
    """How many :class:`BatchNormAct2d` layers ``module`` holds."""
    return sum(isinstance(m, BatchNormAct2d) for m in module.modules())
