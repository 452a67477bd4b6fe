"""Synchronised BatchNorm for data parallelism, on CPU (gloo) as well as on CUDA (NCCL).

With N processes each holding B/N images, a BatchNorm that normalises with its own shard's mean
and variance computes something else than one process holding all B images. Synchronising the
statistics over the processes makes them the statistics of the global batch, so N x B/N equals
1 x B (alignment.md). ``torch.nn.SyncBatchNorm`` does this on CUDA only (it refuses CPU
tensors); :class:`DistBatchNorm2d` does it anywhere with an autograd-aware all-reduce
(:func:`all_reduce_sum`, like ``torch.distributed.nn.functional.all_reduce``, which torch 2.13
deprecates), whose backward all-reduces the gradients, so the
gradient of every rank's input includes the other ranks' losses exactly as in one process.

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


class _AllReduceSum(torch.autograd.Function):
    """Differentiable all-reduce (SUM): the gradient of every rank's input is the sum over ranks of the
    gradients of the output, so each rank's backward carries the other ranks' losses."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        out = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Autograd-aware all-reduce SUM over the default process group (a collective: every rank calls it)."""
    return _AllReduceSum.apply(tensor)


class DistBatchNorm2d(nn.BatchNorm2d):
    """BatchNorm2d whose training statistics are those of the global batch over all processes.

    Training (and a process group of more than one process): per channel, every rank computes
    ``sum x``, ``sum x^2`` and the element count in float64; one all-reduce (SUM, autograd-aware)
    gives the global mean and biased variance used to normalise; the running statistics are
    updated like BatchNorm2d (momentum, unbiased variance ``var * n / (n - 1)``,
    ``num_batches_tracked``), identically on every rank. Evaluation, or a single process: exactly
    ``nn.BatchNorm2d`` (running statistics).

    Input / output: (N, C, H, W) float tensors (any memory format); N may differ between ranks.
    Every rank must call forward the same number of times in training mode (it is a collective).

    Raises:
        ValueError: the global batch has at most one value per channel in training.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or _world() <= 1:
            return super().forward(x)
        if x.dim() != 4:
            raise ValueError(f"DistBatchNorm2d expects (N, C, H, W) input, got {tuple(x.shape)}")
        c = x.shape[1]
        x64 = x.double()
        local = torch.cat([x64.sum(dim=(0, 2, 3)), (x64 * x64).sum(dim=(0, 2, 3)),
                           x64.new_full((1,), float(x.numel() // c))])
        total = all_reduce_sum(local)
        n = total[2 * c].detach()
        if float(n) <= 1:
            raise ValueError(f"DistBatchNorm2d: {int(n)} value(s) per channel over all processes; "
                             "training needs more than one (raise batch_size)")
        mean = total[:c] / n
        var = (total[c:2 * c] / n - mean * mean).clamp(min=0)
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                if self.momentum is None:
                    factor = 1.0 / float(self.num_batches_tracked)
                else:
                    factor = self.momentum
                unbiased = var * (n / (n - 1))
                self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
                self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype), alpha=factor)
        invstd = torch.rsqrt(var + self.eps)
        scale = invstd if self.weight is None else invstd * self.weight.double()
        shift = -mean * scale if self.bias is None else self.bias.double() - mean * scale
        return x * scale.to(x.dtype).view(1, c, 1, 1) + shift.to(x.dtype).view(1, c, 1, 1)


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
