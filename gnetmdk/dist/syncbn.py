"""Synchronised BatchNorm for data parallelism, on CPU (gloo) as well as on CUDA (NCCL).

With N processes each holding B/N images, a BatchNorm that normalises with its own shard's mean
and variance computes something else than one process holding all B images. Synchronising the
statistics over the processes makes them the statistics of the global batch, so N x B/N equals
1 x B (docs/alignment.md). ``torch.nn.SyncBatchNorm`` does this on CUDA only (it refuses CPU
tensors); :class:`DistBatchNorm2d` does it anywhere, as an autograd Function whose forward
gathers every rank's per-channel moments and whose backward gathers every rank's per-channel gradient
sums (what an autograd-aware all-reduce such as ``torch.distributed.nn.functional.all_reduce``,
deprecated in torch 2.13, gives), so the gradient of every rank's input includes the other ranks'
losses exactly as in one process. Every sum over ranks is folded in rank order (gnetmdk.dist.comm),
so the ranks may be processes or virtual ranks of one process, on any machine, with the same bits.

:func:`convert_sync_batchnorm` swaps every ``BatchNorm2d`` of a model for the synchronised kind
(sharing the parameters and buffers, so the optimizer and the state_dict keys are unchanged:
checkpoints written by 1 and by N processes are interchangeable, and BN folding reads the same
``running_mean / running_var / weight / bias / eps``).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .comm import (VirtualRankError, current_virtual_ranks, fold_rows, gather_process_rows, get_world_size,
                   process_world, virtual_rank)


def _world() -> int:
    """Ranks of the run (processes x virtual ranks inside a virtual rank's thread; gnetmdk.dist.comm)."""
    return get_world_size()


_DIMS = (0, 2, 3)


def _all_reduce_(t: torch.Tensor, sync: bool) -> torch.Tensor:
    """With ``sync``: ``t`` replaced by the sum over the processes, folded in rank order (an all-gather,
    then ``fold_rows``: the same additions in the same order on any machine); returns it."""
    if sync:
        t.copy_(fold_rows(gather_process_rows(t.unsqueeze(0))))
    return t


# ------------------------------------------------------------------ statistics shared with InPlace-ABN
# (gnetmdk.layers.inplace_abn computes its statistics with these functions, so its synchronised form
# and DistBatchNorm2d agree exactly; the arithmetic is described in _SyncBNFunction)

def batch_moments(x: torch.Tensor):
    """Per-channel count, mean and ``M2 = sum (x - mean)^2`` of one rank's (N, C, H, W) tensor.

    Two passes of ``x.dtype`` reductions: the mean, then the squared deviations from that mean
    rounded to ``x.dtype`` (``m0``), corrected to the float64 mean by
    ``sum (x - mean)^2 = sum (x - m0)^2 - n (mean - m0)^2`` (no ``E[x^2] - mean^2`` cancellation).

    Returns:
        (local, scratch): ``local`` a (2C + 1,) float64 tensor ``[n, mean (C), M2 (C)]`` on x's device;
        ``scratch`` an x-shaped tensor of x's dtype and memory format that the caller may overwrite
        (it holds ``(x - m0)^2``), or None when x is empty.
    """
    c = x.shape[1]
    view = (1, c, 1, 1)
    n_local = x.numel() // c
    local = torch.zeros(2 * c + 1, dtype=torch.float64, device=x.device)   # [n, mean (C), M2 (C)]
    local[0] = float(n_local)
    dev = None
    if n_local:
        mean_r = x.sum(dim=_DIMS, dtype=x.dtype).double() / n_local
        m0 = mean_r.to(x.dtype)
        dev = torch.sub(x, m0.view(view))
        d2 = dev.mul_(dev).sum(dim=_DIMS, dtype=x.dtype).double()   # sum (x - m0)^2, no cancellation
        local[1:c + 1] = mean_r
        # sum (x - mean_r)^2 = sum (x - m0)^2 - n (mean_r - m0)^2
        local[c + 1:] = (d2 - n_local * (mean_r - m0.double()) ** 2).clamp_(min=0)
    return local, dev


def combine_moments(local: torch.Tensor, sync: bool, who: str = "DistBatchNorm2d", counts=None):
    """The global batch's count, mean and biased variance from every rank's :func:`batch_moments`.

    ``local``: this process's (2C + 1,) float64 ``[n, mean, M2]`` (or (k, 2C + 1), one row per rank
    of this process: its virtual ranks). With ``sync`` the rows of every process are all-gathered (one
    collective) and :func:`combine_table` combines the table in rank order on every rank, so every
    rank gets the same numbers and one process runs the same arithmetic on a table of one row.
    ``counts``: the host's own count of each of this process's rows (Python ints, the ``n`` of each
    :func:`batch_moments`), so that the global count is never read back from the device (on CUDA such
    a read makes the host wait for the GPU, and with several processes for the slowest of them, at
    every BatchNorm layer). Without ``sync`` their sum is the global count (the fold of the table's
    float64 counts exactly: integers below 2^53); with ``sync`` the global count stays a 0-d float64
    tensor on the device, the same value, and more than one local value already proves it above one.

    Returns:
        (n, mean, var): n a Python float (or, with ``sync`` and ``counts``, a 0-d float64 tensor of the
        same value: every use of n divides by it or forms n / (n - 1), the same IEEE operations either
        way), mean and var (C,) float64 tensors.
    Raises:
        ValueError: at most one value per channel over the global batch (``who`` names the layer).
    """
    table = local if local.dim() == 2 else local.unsqueeze(0)
    own = None if counts is None else sum(int(k) for k in counts)
    if sync:
        table = gather_process_rows(table)                          # (W, 2C + 1), rank order
        return combine_table(table, who, device_count=own is not None and own > 1)
    return combine_table(table, who, None if own is None else float(own))


def combine_table(table: torch.Tensor, who: str = "DistBatchNorm2d", n: float = None,
                  device_count: bool = False):
    """Count, mean and biased variance of the union of W ranks' batches from their (W, 2C + 1) float64
    rows ``[n, mean, M2]`` in rank order, with Chan et al.'s parallel formula
    ``M2 = sum_r M2_r + sum_r n_r (mean_r - mean)^2`` (Chan, Golub & LeVeque 1979); every sum over ranks
    is the left fold in rank order (gnetmdk.dist.comm.fold_rows). ``n``: the total count when the
    host knows it (:func:`combine_moments`), else the fold of the table's counts: read to the host,
    or with ``device_count`` (the caller knows it is above one) left a 0-d tensor on the device.

    Returns:
        (n, mean, var): n a Python float (a 0-d float64 tensor with ``device_count``), mean and var
        (C,) float64 tensors.
    Raises:
        ValueError: at most one value per channel over the global batch (``who`` names the layer).
    """
    c = (table.shape[1] - 1) // 2
    counts = table[:, :1]
    if n is None:
        n = fold_rows(counts)[0] if device_count else float(fold_rows(counts)[0])
    if not device_count and n <= 1:
        raise ValueError(f"{who}: {int(n)} value(s) per channel in the batch; training needs more "
                         "than one (raise batch_size)")
    means = table[:, 1:c + 1]
    mean = fold_rows(counts * means) / n
    m2 = fold_rows(table[:, c + 1:]) + fold_rows(counts * (means - mean) ** 2)
    var = (m2 / n).clamp_(min=0)
    return n, mean, var


def update_running_stats_(running_mean: torch.Tensor, running_var: torch.Tensor,
                          num_batches_tracked: torch.Tensor, mean: torch.Tensor, var: torch.Tensor,
                          n, momentum, unbiased: bool = True) -> None:
    """BatchNorm2d's running-statistics update, in place: ``num_batches_tracked += 1``, factor
    ``momentum`` (or ``1 / num_batches_tracked`` when momentum is None: cumulative average),
    ``running_mean = (1 - f) running_mean + f mean``, ``running_var = (1 - f) running_var + f var n / (n - 1)``
    (the unbiased batch variance, as torch), or ``+ f var`` with ``unbiased=False`` (the biased batch
    variance, as PaddlePaddle's BatchNorm updates its moving variance: paddle.nn.BatchNorm2D's docs)."""
    num_batches_tracked.add_(1)
    factor = (1.0 / float(num_batches_tracked)) if momentum is None else momentum
    running_mean.mul_(1 - factor).add_(mean.to(running_mean.dtype), alpha=factor)
    batch_var = var * (n / (n - 1)) if unbiased else var
    running_var.mul_(1 - factor).add_(batch_var.to(running_var.dtype), alpha=factor)


def channel_grad_sums(dy: torch.Tensor, dev_dy: torch.Tensor) -> torch.Tensor:
    """The backward's per-channel sums of one rank, ``[sum dy (C), sum dy * (x - mean) (C)]``, as a
    (2C,) float64 tensor (``dy.dtype`` reductions); ``dev_dy`` is the x-shaped ``dy * (x - mean)``."""
    c = dy.shape[1]
    sums = torch.empty(2 * c, dtype=torch.float64, device=dy.device)
    sums[:c] = dy.sum(dim=_DIMS, dtype=dy.dtype).double()
    sums[c:] = dev_dy.sum(dim=_DIMS, dtype=dy.dtype).double()
    return sums


def input_grad_coefficients(total: torch.Tensor, n, weight, invstd: torch.Tensor):
    """Per-channel float64 coefficients of BatchNorm's input gradient (training statistics).

    From the global sums ``total = [sum dy, sum dy (x - m)]`` (all ranks) and the count n:
    ``grad_x = a dy + b (x - m) + base`` with ``a = gamma invstd``,
    ``b = -a invstd^2 mean(dy (x - m))`` and ``base = -a mean(dy)`` (the gradient of Ioffe & Szegedy
    2015, Sec. 3, ``a (dy - mean(dy) - xhat mean(dy xhat))``, expanded).

    Returns:
        (a, b, base): three (C,) float64 tensors.
    """
    c = invstd.numel()
    w = invstd.new_ones(c) if weight is None else weight.detach().double()
    a = w * invstd                                                # d out / d x at fixed statistics
    mean_dy = total[:c] / n
    mean_dy_dev = total[c:] / n
    b = -a * invstd * invstd * mean_dy_dev                        # coefficient of (x - m)
    return a, b, -a * mean_dy


class _SyncBNFunction(torch.autograd.Function):
    """Batch normalisation over the global batch (training mode), precise and the same for any split
    of the batch over ranks: processes, virtual ranks of one process (gnetmdk.dist.comm), or both.

    Inputs: ``running_mean, running_var, num_batches_tracked`` (None when not tracked), ``eps``,
    ``momentum``, ``sync`` (gather over the processes), ``unbiased``, then one ``(x, weight, bias)``
    triple per rank of this process, in rank order (one triple in a process of its own; V for V virtual
    ranks, whose weights are their replicas of the same values). Outputs: one normalised tensor per
    rank, of its x's shape, dtype and memory format.

    forward: per rank and channel, the count, the mean and ``M2 = sum (x - mean)^2`` from two passes of
    float32 reductions over that rank's x (cascade-summed, ~1e-7 relative; squaring deviations from the
    mean avoids the cancellation of ``E[x^2] - mean^2``, where torch's channels-last CPU BatchNorm loses
    ~1e-4); the rows of every rank (an all-gather of 2C + 1 float64 numbers over the processes) are
    combined in rank order (:func:`combine_table`), so every rank gets the global mean and biased
    variance. Each output ``x * scale + shift`` is written into the buffer of its deviations. The
    running statistics are updated once per process.
    backward: the standard BatchNorm gradient; each rank's per-channel ``sum dy`` and
    ``sum dy * (x - m)`` are gathered from every rank and folded in rank order, so every rank's input
    gradient is that of the sum of all ranks' losses (the parameter gradients are each rank's own:
    DDP or the virtual ranks then average them in rank order). Saves x and per-channel statistics only.
    Two small collectives per layer and iteration (an all-gather forward and backward); none in one
    process. Every rank computes with its own chunk exactly what a process holding that chunk computes.
    """

    @staticmethod
    def forward(ctx, running_mean, running_var, num_batches_tracked, eps, momentum, sync, unbiased, *chunks):
        xs, weights, biases = chunks[0::3], chunks[1::3], chunks[2::3]
        x0, weight, bias = xs[0], weights[0], biases[0]
        c = x0.shape[1]
        view = (1, c, 1, 1)
        moments = [batch_moments(x) for x in xs]
        n, mean, var = combine_moments(torch.stack([m[0] for m in moments]), sync, "DistBatchNorm2d",
                                       counts=[x.numel() // c for x in xs])
        if running_mean is not None:
            update_running_stats_(running_mean, running_var, num_batches_tracked, mean, var, n, momentum, unbiased)
        mean_f = mean.to(x0.dtype)
        invstd = torch.rsqrt(var + eps)
        scale = invstd if weight is None else invstd * weight.detach().double()
        shift = -mean * scale if bias is None else bias.detach().double() - mean * scale
        outs = []
        for x, (_, dev) in zip(xs, moments):
            # out = x * scale + shift, written into the deviation buffer (one large allocation per call)
            out = dev if dev is not None else torch.empty_like(x)
            torch.addcmul(shift.to(x.dtype).view(view), x, scale.to(x.dtype).view(view), out=out)
            outs.append(out)
        ctx.save_for_backward(weight, mean_f, invstd, *xs)
        ctx.n = n
        ctx.sync = sync
        ctx.chunks = len(xs)
        ctx.has_bias = bias is not None
        return tuple(outs)

    @staticmethod
    def backward(ctx, *dys):
        weight, mean_f, invstd, *xs = ctx.saved_tensors
        c = xs[0].shape[1]
        view = (1, c, 1, 1)
        need = ctx.needs_input_grad
        bufs, sums, grads = [], [], []
        for i, (x, dy) in enumerate(zip(xs, dys)):
            buf = torch.sub(x, mean_f.view(view)).mul_(dy)            # dy * (x - m); becomes grad_x below
            s = channel_grad_sums(dy, buf)
            bufs.append(buf)
            sums.append(s)
            grad_weight = (s[c:] * invstd).to(weight.dtype) if weight is not None and need[8 + 3 * i] else None
            grad_bias = s[:c].to(dy.dtype) if ctx.has_bias and need[9 + 3 * i] else None
            grads.append([None, grad_weight, grad_bias])
        if any(need[7 + 3 * i] for i in range(ctx.chunks)):
            table = torch.stack(sums)                                  # (ranks of this process, 2C)
            total = fold_rows(gather_process_rows(table) if ctx.sync else table)
            a, b, base = input_grad_coefficients(total, ctx.n, weight, invstd)
            # grad_x = a * (dy - mean(dy) - xhat * mean(dy * xhat)) = a * dy + b * x + (-a * mean(dy) - b * m)
            const = base - b * mean_f.double()
            for i, (x, dy, buf) in enumerate(zip(xs, dys, bufs)):
                grad_x = torch.addcmul(const.to(x.dtype).view(view), x, b.to(x.dtype).view(view), out=buf)
                grad_x.addcmul_(dy, a.to(x.dtype).view(view))
                grads[i][0] = grad_x
        return (None,) * 7 + tuple(g for triple in grads for g in triple)


def _same_layer(items) -> bool:
    """Whether the virtual ranks' modules in ``items`` are replicas of one BatchNorm (they share its
    running buffers, or its parameters' storage)."""
    def key(m):
        if m.running_mean is not None:
            return ("buffer", id(m.running_mean))
        return ("weight", m.weight.data_ptr() if m.weight is not None else id(m))
    return len({key(it[3]) for it in items}) == 1 and len({tuple(it[0].shape[1:]) for it in items}) == 1


class DistBatchNorm2d(nn.BatchNorm2d):
    """BatchNorm2d whose training statistics are those of the global batch over all ranks.

    Training: the global mean and biased variance from the ranks' gathered counts, means and
    ``sum (x - mean)^2``; the backward gathers ``sum dy`` and ``sum dy * (x - mean)``
    (see :class:`_SyncBNFunction`); the running
    statistics are updated like BatchNorm2d (momentum, unbiased variance ``var * n / (n - 1)``,
    ``num_batches_tracked``), identically on every rank; with ``unbiased_running_var = False`` (set by
    the config's ``bn_running_var biased``) the running variance takes the biased batch variance, as
    PaddlePaddle's BatchNorm does. In a single process the same arithmetic runs
    without the collectives, so 1 and N processes compute the same thing (torch's own CPU BatchNorm
    accumulates channels-last statistics in float32: errors near 1e-4 on activations with a large
    mean, enough to break a 1e-5 alignment). Evaluation: exactly ``nn.BatchNorm2d`` (running statistics).

    Virtual ranks (gnetmdk.dist.comm.VirtualRanks): each rank runs a replica of the model in its own
    thread; at this layer the ranks hand their inputs to one :class:`_SyncBNFunction` call over all of
    them (one autograd node: its backward needs every rank's gradient at once, so no rank waits for
    another inside the backward pass), whose per-rank arithmetic is that of a process.

    Mixed precision (bfloat16 / float16 input under ``amp``): one rank uses torch's BatchNorm2d
    kernel (float32 statistics; the float64 path is about 4x slower on bfloat16 tensors on CPU); N
    ranks run the synchronised path on the input cast to float32 and return the input's dtype.

    Input / output: (N, C, H, W) float tensors (any memory format); N may differ between ranks.
    In training every rank must call forward (and backward) the same number of times: they are collectives.

    Raises:
        ValueError: not 4-d input, or at most one value per channel over the global batch in training.
    """

    #: running variance from the unbiased (torch) or the biased (PaddlePaddle) batch variance
    unbiased_running_var: bool = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise ``x`` (N, C, H, W) with the global batch's statistics in training (running
        statistics in evaluation); see the class docstring."""
        if not self.training and self.track_running_stats:
            return super().forward(x)
        if x.dim() != 4:
            raise ValueError(f"DistBatchNorm2d expects (N, C, H, W) input, got {tuple(x.shape)}")
        ranks = _world()
        low = x.dtype in (torch.bfloat16, torch.float16)
        if low and ranks == 1 and self.unbiased_running_var:
            # mixed precision (amp), one process: torch's kernel (float32 statistics, vectorised for
            # bfloat16 and about 4x faster here than the float64 path on bfloat16 tensors); amp runs are
            # not bit-aligned between 1 and N processes anyway (docs/distributed.md)
            return super().forward(x)
        track = self.track_running_stats and self.training
        head = (self.running_mean if track else None, self.running_var if track else None,
                self.num_batches_tracked if track else None, self.eps, self.momentum, process_world() > 1,
                self.unbiased_running_var)
        xin = x.float() if low else x
        vr = current_virtual_ranks()
        if vr is None:
            (y,) = _SyncBNFunction.apply(*head, xin, self.weight, self.bias)
        else:
            v = virtual_rank()

            def joint(items):
                if not _same_layer(items):
                    raise VirtualRankError("virtual ranks reached different BatchNorm layers")
                return _SyncBNFunction.apply(*head, *(t for it in items for t in it[:3]))

            y = vr.exchange(v, (xin, self.weight, self.bias, self), joint)[v]
        # mixed precision over N ranks: statistics from the float32 values (a bfloat16 sum keeps
        # 8 bits), the output handed back in the input's precision
        return y.to(x.dtype) if low else y


def share_bn_state(src: nn.Module, dst: nn.Module) -> nn.Module:
    """Make BatchNorm ``dst`` use ``src``'s parameters and running buffers (the same tensor objects, so
    optimizers, EMA copies and state_dict keys are unchanged) and its train/eval mode; returns ``dst``.
    Both must have been built with the same ``affine`` and ``track_running_stats``."""
    if src.affine:
        dst.weight = src.weight
        dst.bias = src.bias
    if src.track_running_stats:
        dst.running_mean = src.running_mean
        dst.running_var = src.running_var
        dst.num_batches_tracked = src.num_batches_tracked
    dst.train(src.training)
    return dst


def convert_sync_batchnorm(module: nn.Module, use_cuda: bool = False) -> nn.Module:
    """Return ``module`` with every BatchNorm2d replaced by a synchronised one (in place where possible).

    On CUDA: ``torch.nn.SyncBatchNorm.convert_sync_batchnorm``. Otherwise: :class:`DistBatchNorm2d`
    sharing the original parameters and buffers (same objects, same state_dict keys). Modules that
    are already synchronised are left alone.
    """
    if use_cuda:
        return nn.SyncBatchNorm.convert_sync_batchnorm(module)
    if isinstance(module, nn.BatchNorm2d) and not isinstance(module, DistBatchNorm2d):
        return share_bn_state(module, DistBatchNorm2d(module.num_features, module.eps, module.momentum,
                                                      module.affine, module.track_running_stats))
    for name, child in module.named_children():
        new_child = convert_sync_batchnorm(child, use_cuda)
        if new_child is not child:
            setattr(module, name, new_child)
    return module


def count_sync_batchnorm(module: nn.Module) -> int:
    """How many synchronised BatchNorm layers ``module`` holds (DistBatchNorm2d or SyncBatchNorm)."""
    return sum(isinstance(m, (DistBatchNorm2d, nn.SyncBatchNorm)) for m in module.modules())
