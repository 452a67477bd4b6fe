"""Synchronised BatchNorm for data parallelism, on CPU (gloo) as well as on CUDA (NCCL).

With N processes each holding B/N images, a BatchNorm that normalises with its own shard's mean
and variance computes something else than one process holding all B images. Synchronising the
statistics over the processes makes them the statistics of the global batch, so N x B/N equals
1 x B (alignment.md). ``torch.nn.SyncBatchNorm`` does this on CUDA only (it refuses CPU
tensors); :class:`DistBatchNorm2d` does it anywhere, as an autograd Function whose forward
all-reduces the per-channel sums and whose backward all-reduces the per-channel gradient sums (what
an autograd-aware all-reduce such as ``torch.distributed.nn.functional.all_reduce``, deprecated in
torch 2.13, gives), so the gradient of every rank's input includes the other ranks' losses exactly
as in one process.

:func:`convert_sync_batchnorm` swaps every ``BatchNorm2d`` of a model for the synchronised kind
(sharing the parameters and buffers, so the optimizer and the state_dict keys are unchanged:
checkpoints written by 1 and by N processes are interchangeable, and BN folding reads the same
``running_mean / running_var / weight / bias / eps``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


_DIMS = (0, 2, 3)


def _all_reduce_(t: torch.Tensor, sync: bool) -> torch.Tensor:
    if sync:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


class _SyncBNFunction(torch.autograd.Function):
    """Batch normalisation over the global batch (training mode), precise and the same in 1 and N processes.

    forward: two passes, each a float32 reduction (cascade-summed, ~1e-7 relative) whose per-channel
    results are all-reduced in float64: ``sum x`` and the count give the mean m; ``sum (x - m)^2``
    gives the biased variance without the cancellation of ``E[x^2] - m^2`` (torch's channels-last CPU
    BatchNorm loses ~1e-4 there). The output is ``F.batch_norm`` with these statistics (one fused pass).
    backward: the standard BatchNorm gradient; the per-channel ``sum dy`` and ``sum dy * (x - m)``
    are all-reduced, so every rank's input gradient is that of the sum of all ranks' losses (DDP then
    averages the parameter gradients: N x B/N equals 1 x B). Saves x and per-channel statistics only.
    Three small all-reduces per layer and iteration (two forward, one backward); none in one process.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, num_batches_tracked, eps, momentum, sync):
        c = x.shape[1]
        view = (1, c, 1, 1)
        head = torch.empty(c + 1, dtype=torch.float64, device=x.device)
        head[:c] = x.sum(dim=_DIMS, dtype=x.dtype).double()
        head[c] = float(x.numel() // c)
        _all_reduce_(head, sync)
        n = float(head[c])
        if n <= 1:
            raise ValueError(f"DistBatchNorm2d: {int(n)} value(s) per channel in the batch; training needs more "
                             "than one (raise batch_size)")
        mean = head[:c] / n
        mean_f = mean.to(x.dtype)
        dev = x - mean_f.view(view)
        sq = dev.mul_(dev).sum(dim=_DIMS, dtype=x.dtype).double()
        del dev
        _all_reduce_(sq, sync)
        # sum (x - m_f)^2 = sum (x - m)^2 + n (m - m_f)^2
        var = (sq / n - (mean - mean_f.double()) ** 2).clamp_(min=0)
        if running_mean is not None:
            num_batches_tracked.add_(1)
            factor = (1.0 / float(num_batches_tracked)) if momentum is None else momentum
            running_mean.mul_(1 - factor).add_(mean.to(running_mean.dtype), alpha=factor)
            running_var.mul_(1 - factor).add_((var * (n / (n - 1))).to(running_var.dtype), alpha=factor)
        var_f = var.to(x.dtype)
        out = F.batch_norm(x, mean_f, var_f, weight, bias, False, 0.0, eps)
        invstd = torch.rsqrt(var + eps)
        ctx.save_for_backward(x, weight, mean_f, invstd)
        ctx.n = n
        ctx.sync = sync
        ctx.has_bias = bias is not None
        return out

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean_f, invstd = ctx.saved_tensors
        c = x.shape[1]
        view = (1, c, 1, 1)
        sums = torch.empty(2 * c, dtype=torch.float64, device=x.device)
        sums[:c] = dy.sum(dim=_DIMS, dtype=dy.dtype).double()
        dev = x - mean_f.view(view)                                   # x - m, reused for grad_x
        sums[c:] = (dev * dy).sum(dim=_DIMS, dtype=dy.dtype).double()
        grad_weight = (sums[c:] * invstd).to(weight.dtype) if weight is not None and ctx.needs_input_grad[1] else None
        grad_bias = sums[:c].to(dy.dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        if not ctx.needs_input_grad[0]:
            return None, grad_weight, grad_bias, None, None, None, None, None, None
        total = _all_reduce_(sums.clone(), ctx.sync)
        w = invstd.new_ones(c) if weight is None else weight.detach().double()
        a = w * invstd                                                # d out / d x at fixed statistics
        mean_dy = total[:c] / ctx.n
        mean_dy_dev = total[c:] / ctx.n
        b = -a * invstd * invstd * mean_dy_dev                        # coefficient of (x - m)
        # grad_x = a * (dy - mean(dy) - xhat * mean(dy * xhat)) = a * dy + b * (x - m) - a * mean(dy)
        grad_x = dev.mul_(b.to(x.dtype).view(view)).add_((-a * mean_dy).to(x.dtype).view(view))
        grad_x.addcmul_(dy, a.to(x.dtype).view(view))
        return grad_x, grad_weight, grad_bias, None, None, None, None, None, None


class DistBatchNorm2d(nn.BatchNorm2d):
    """BatchNorm2d whose training statistics are those of the global batch over all processes.

    Training: the global mean from all-reduced ``sum x`` and counts, then the global biased variance
    from all-reduced ``sum (x - mean)^2``; the backward all-reduces ``sum dy`` and ``sum dy * (x - mean)``
    (see :class:`_SyncBNFunction`); the running
    statistics are updated like BatchNorm2d (momentum, unbiased variance ``var * n / (n - 1)``,
    ``num_batches_tracked``), identically on every rank. In a single process the same arithmetic runs
    without the collectives, so 1 and N processes compute the same thing (torch's own CPU BatchNorm
    accumulates channels-last statistics in float32: errors near 1e-4 on activations with a large
    mean, enough to break a 1e-5 alignment). Evaluation: exactly ``nn.BatchNorm2d`` (running statistics).

    Input / output: (N, C, H, W) float tensors (any memory format); N may differ between ranks.
    In training every rank must call forward (and backward) the same number of times: they are collectives.

    Raises:
        ValueError: not 4-d input, or at most one value per channel over the global batch in training.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training and self.track_running_stats:
            return super().forward(x)
        if x.dim() != 4:
            raise ValueError(f"DistBatchNorm2d expects (N, C, H, W) input, got {tuple(x.shape)}")
        track = self.track_running_stats and self.training
        return _SyncBNFunction.apply(x, self.weight, self.bias, self.running_mean if track else None,
                                     self.running_var if track else None,
                                     self.num_batches_tracked if track else None, self.eps, self.momentum,
                                     _world() > 1)


def convert_sync_batchnorm(module: nn.Module, use_cuda: bool = False) -> nn.Module:
    """Return ``module`` with every BatchNorm2d replaced by a synchronised one (in place where possible).

    On CUDA: ``torch.nn.SyncBatchNorm.convert_sync_batchnorm``. Otherwise: :class:`DistBatchNorm2d`
    sharing the original parameters and buffers (same objects, same state_dict keys). Modules that
    are already synchronised are left alone.
    """
    if use_cuda:
        return nn.SyncBatchNorm.convert_sync_batchnorm(module)
    if isinstance(module, nn.BatchNorm2d) and not isinstance(module, DistBatchNorm2d):
        new = DistBatchNorm2d(module.num_features, module.eps, module.momentum, module.affine,
                              module.track_running_stats)
        if module.affine:
            new.weight = module.weight
            new.bias = module.bias
        if module.track_running_stats:
            new.running_mean = module.running_mean
            new.running_var = module.running_var
            new.num_batches_tracked = module.num_batches_tracked
        new.train(module.training)
        return new
    for name, child in module.named_children():
        new_child = convert_sync_batchnorm(child, use_cuda)
        if new_child is not child:
            setattr(module, name, new_child)
    return module


def count_sync_batchnorm(module: nn.Module) -> int:
    """How many synchronised BatchNorm layers ``module`` holds (DistBatchNorm2d or SyncBatchNorm)."""
    return sum(isinstance(m, (DistBatchNorm2d, nn.SyncBatchNorm)) for m in module.modules())
