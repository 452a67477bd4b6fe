"""Calibration observers: they watch a layer's input during the calibration pass and hold a statistic,
apart from the fake quantizer that later uses it (as torch.ao.quantization separates observers from
FakeQuantize). The quantizer (gnetmdk.layers.quant.QReLU) keeps only its cap and its switches.

Each observer is attached to a module with a forward pre-hook (:func:`observe_inputs`), sees every
batch's input tensor, and keeps a running statistic:

    MaxObserver          the largest value seen                                  (0-d float32)
    PercentileObserver   the running max over batches of each batch's percentile (0-d float32;
                         GTI's calibration, docs/quantization.md, "Calibration")
    HistogramObserver    counts of the positive values over [0, vmax] in equal bins (float64)

Under data parallelism the statistics of all processes are combined by the caller (all-reduce MAX for
the first two, SUM for the histogram); the percentile of each batch is that of the global batch when
``percentile_fn`` is gnetmdk.dist.comm.global_percentile (exact, no gathering).
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import torch
import torch.nn as nn

from gnetmdk.gti.quantize import ACT_MAX, mse_cap_from_histogram, value_histogram


def batch_percentile(x: torch.Tensor, percentile: float) -> torch.Tensor:
    """The ``percentile``-th percentile (nearest rank) of all elements of x, as a 0-d float32 tensor.

    The rank is k = ceil(percentile x n / 100), clipped to 1..n (the k-th smallest value). If that value
    is not positive (fewer than (100 - p)% positive values) the largest value is used, so that a cap
    is never 0 or negative while some output is positive.
    """
    flat = x.detach().float().reshape(-1)
    k = max(1, min(flat.numel(), int(-(-percentile * flat.numel() // 100))))
    value = flat.kthvalue(k).values
    if value <= 0:
        value = flat.max()
    return value


class Observer:
    """Base of the observers: ``observe(x)`` for each batch's tensor, ``value`` the statistic so far, and
    ``calculate_qparams()`` the 5-bit activation's (scale, zero point) that statistic gives, in torch.ao's
    names (scale = cap / 31, zero point 0; docs/quantization.md, "Activations"). Under data parallelism
    the caller combines ``value`` over the processes first (module docstring); before that,
    calculate_qparams is this process's."""

    def cap(self) -> float:
        """The cap the statistic gives (the statistic itself here; 0.0 before any batch)."""
        return 0.0 if self.value is None else float(self.value)

    def calculate_qparams(self):
        """(scale, zero point): a 0-d float32 tensor ``cap / 31`` and a 0-d int32 tensor 0."""
        return (torch.tensor(self.cap(), dtype=torch.float32) / ACT_MAX, torch.zeros((), dtype=torch.int32))

    def observe(self, x: torch.Tensor) -> None:
        """Fold one batch's tensor into :attr:`value`.

        Raises:
            NotImplementedError: always; each observer overrides it.
        """
        raise NotImplementedError


class MaxObserver(Observer):
    """The largest value over every batch (0-d float32 on the input's device; 0 before any batch)."""

    def __init__(self):
        self.value: Optional[torch.Tensor] = None

    def observe(self, x: torch.Tensor) -> None:
        """Keep the maximum of ``value`` and this batch's largest element."""
        m = x.detach().float().max()
        self.value = m if self.value is None else torch.maximum(self.value, m)


class ChannelMaxObserver(Observer):
    """The largest value of each channel over every batch: (C,) float32 on the input's device, for
    inputs (N, C, H, W); None before any batch. Used by the range equalization before calibration
    (gnetmdk.models.calibration.equalize_ranges)."""

    def __init__(self):
        self.value: Optional[torch.Tensor] = None

    def observe(self, x: torch.Tensor) -> None:
        """Keep the channel-wise maximum of ``value`` and this batch's per-channel largest element."""
        m = x.detach().float().amax(dim=[d for d in range(x.dim()) if d != 1])
        self.value = m if self.value is None else torch.maximum(self.value, m)


class PercentileObserver(Observer):
    """The running maximum over batches of each batch's ``percentile``-th percentile (GTI's calibration).

    Args:
        percentile: in (0, 100] (100: the batch's largest value).
        percentile_fn: ``fn(x, percentile) -> 0-d tensor``; default :func:`batch_percentile` (this
            process's batch); gnetmdk.dist.comm.global_percentile gives the global batch's under data
            parallelism (a collective: every rank must observe the same number of batches).
    """

    def __init__(self, percentile: float, percentile_fn: Optional[Callable] = None):
        self.percentile = float(percentile)
        self.percentile_fn = percentile_fn or batch_percentile
        self.value: Optional[torch.Tensor] = None

    def observe(self, x: torch.Tensor) -> None:
        """Keep the maximum of ``value`` and this batch's ``percentile``-th percentile (``percentile_fn``)."""
        v = self.percentile_fn(x, self.percentile).float().to(x.device)
        self.value = v if self.value is None else torch.maximum(self.value, v)


class HistogramObserver(Observer):
    """Counts of the positive values over [0, ``vmax``] in ``bins`` equal bins, summed over batches
    ((bins,) float64; gnetmdk.gti.quantize.value_histogram with ``outside "drop"``, the counting the
    int8 ranges use too: torch.histc's bins, exact counts)."""

    def __init__(self, vmax: float, bins: int = 4096):
        self.vmax = float(vmax)
        self.bins = int(bins)
        self.value: Optional[torch.Tensor] = None

    def observe(self, x: torch.Tensor) -> None:
        """Add this batch's histogram of positive values over [0, vmax] (nothing when vmax is not positive)."""
        if not self.vmax > 0:
            return
        h = value_histogram(x, self.bins, self.vmax)
        self.value = h if self.value is None else self.value + h

    def cap(self) -> float:
        """The MSE cap of the counts (gnetmdk.gti.quantize.mse_cap_from_histogram); 0.0 before any batch
        or when ``vmax`` is not positive."""
        if self.value is None or not self.vmax > 0:
            return 0.0
        return mse_cap_from_histogram(self.value, self.vmax)


class observe_inputs:
    """Context manager: each module of ``modules`` passes its forward input to its observer.

        with observe_inputs(relus, observers):
            for images in loader:
                model(images)
    """

    def __init__(self, modules: Sequence[nn.Module], observers: Sequence[Observer]):
        if len(modules) != len(observers):
            raise ValueError(f"{len(modules)} modules but {len(observers)} observers")
        self.modules, self.observers = list(modules), list(observers)
        self.handles: List = []

    def __enter__(self):
        for m, obs in zip(self.modules, self.observers):
            self.handles.append(m.register_forward_pre_hook(lambda mod, args, o=obs: o.observe(args[0])))
        return self.observers

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        self.handles = []
        return False
