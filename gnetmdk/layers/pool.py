"""2x2 / stride-2 max pooling whose backward pass keeps no indices.

Why not ``F.max_pool2d``: with gradients on, torch computes ``max_pool2d_with_indices`` and keeps,
for the backward pass, its input and an int64 index per output element: 8 bytes per output, twice
the size of the float32 input it pools. In GNetDet the pool's input is a ReLU output (kept anyway by
the ReLU or BatchNormAct2d backward) and its output is the next conv's input (kept anyway by that
conv), so the indices are the only memory the pool adds: 16% of what a step-1 GNetDet keeps for
its backward pass (docs/results/memory.md). torch offers no max pool that rebuilds its
indices, hence this function.

The backward pass recomputes torch's pool with its indices from the kept input (a pass over the
input, the indices living only while that layer's gradient is computed) and runs torch's own
backward kernel with them: the gradients are torch's bit for bit (tests/layers/test_pool.py), ties and NaN
included, in two kernels.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["max_pool_2x2"]


class _MaxPool2x2(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return F.max_pool2d(x, 2, 2)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        k = [2, 2]
        _, idx = torch.ops.aten.max_pool2d_with_indices(x, k, k, [0, 0], [1, 1], False)
        return torch.ops.aten.max_pool2d_with_indices_backward(g, x, k, k, [0, 0], [1, 1], False, idx)


def max_pool_2x2(x: torch.Tensor) -> torch.Tensor:
    """``F.max_pool2d(x, 2, 2)``, with a backward pass that keeps no indices (module docstring).

    Args:
        x: ``(N, C, H, W)`` float tensor, any memory format.

    Returns:
        ``(N, C, H // 2, W // 2)``, the values of ``F.max_pool2d(x, 2, 2)`` and, in the backward pass,
        its gradients bit for bit. Odd H or W, inputs without gradient, tracing and ONNX export go
        straight to ``F.max_pool2d``.
    """
    if (not torch.is_grad_enabled() or not x.requires_grad or x.dim() != 4 or x.shape[-1] % 2
            or x.shape[-2] % 2 or torch.jit.is_tracing() or torch.onnx.is_in_onnx_export()):
        return F.max_pool2d(x, 2, 2)
    return _MaxPool2x2.apply(x)
