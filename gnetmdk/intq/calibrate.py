"""Calibration of the activation ranges of gnetmdk.intq quantizers (the "cal" stage).

Two passes over the training data, the weights fake-quantized and the activations float:

1. each quantizer's input minimum and maximum (all-reduced with MIN / MAX over the ranks);
2. a histogram of each input over ``[min, max]`` widened to hold 0 (:data:`RANGE_HIST_BINS` bins; the
   counting of gnetmdk.gti.quantize.value_histogram, which the chip's caps use too; counts all-reduced
   by sum, exact in float64), from which the range is chosen:

   * "mse": the range ``a [min, max]`` (``a`` in :data:`RANGE_SHRINK_RATIOS`; both ends shrink together, the
     zero point moves with them) whose uint8 quantization of the histogram's bin centres has the least
     squared error, counting clipping and rounding;
   * "percentile": ``[the (100 - p)th percentile, the pth percentile]`` of the histogram (bin edges
     outward), ``p`` = ``percentile``;
   * "minmax": ``[min, max]``.

Every range then holds 0 (``min_val <= 0 <= max_val``). Each pass attaches one observer per quantizer
(:class:`MinMaxObserver`, :class:`HistogramObserver`: ``forward`` / ``calculate_qparams``, torch.ao's names). The bin of a value depends on that value alone and the
counts are integers, so N processes find the ranges one process finds, bit for bit.
"""
from __future__ import annotations

from typing import Callable, Dict, Iterable, Optional, Tuple

import torch
import torch.nn as nn

from gnetmdk.dist.comm import all_reduce
from gnetmdk.dist.virtual import forward_batch
from gnetmdk.gti.quantize import histogram_mse_argmin, value_histogram

from .fake import ACT_QMAX, act_qparams, round_half_up

__all__ = ["METHODS", "RANGE_HIST_BINS", "RANGE_SHRINK_RATIOS", "HistogramObserver", "MinMaxObserver",
           "calibrate_ranges", "range_from_histogram"]

METHODS = ("mse", "percentile", "minmax")
#: bins of each quantization point's histogram (GNetDet's caps use gnetmdk.engine.calibration.CAP_HIST_BINS)
RANGE_HIST_BINS = 2048
#: factors the "mse" method shrinks the measured [min, max] by (weights use gnetmdk.intq.fake.WEIGHT_CLIP_RATIOS)
RANGE_SHRINK_RATIOS = tuple(1.0 - 0.0125 * i for i in range(73))          # 1.0 .. 0.1


def range_from_histogram(counts: torch.Tensor, lo: float, hi: float, method: str = "mse",
                         percentile: float = 99.99) -> Tuple[float, float]:
    """The quantization range a histogram asks for (module docstring).

    Args:
        counts: ``(bins,)`` float64 counts over ``[lo, hi]`` (equal-width bins).
        lo, hi: the observed minimum and maximum (``lo <= hi``).
        method: "mse", "percentile" or "minmax".
        percentile: for "percentile", in (50, 100].

    Returns:
        (lo', hi') as floats with ``lo' <= 0 <= hi'``.

    Raises:
        ValueError: unknown method, or a percentile outside (50, 100].
    """
    if method not in METHODS:
        raise ValueError(f"calibration method must be one of {METHODS}, got {method!r}")
    lo, hi = min(float(lo), 0.0), max(float(hi), 0.0)
    if method == "minmax" or hi <= lo or float(counts.sum()) == 0:
        return lo, hi
    bins = counts.numel()
    edges = torch.linspace(lo, hi, bins + 1, dtype=torch.float64)
    if method == "percentile":
        if not 50.0 < percentile <= 100.0:
            raise ValueError(f"calibration percentile must be in (50, 100], got {percentile}")
        cum = torch.cumsum(counts.double(), 0) / counts.sum()
        top = int(torch.searchsorted(cum, torch.tensor(percentile / 100.0, dtype=torch.float64)))
        bottom = int(torch.searchsorted(cum, torch.tensor(1.0 - percentile / 100.0, dtype=torch.float64)))
        return min(float(edges[min(bottom, bins - 1)]), 0.0), max(float(edges[min(top + 1, bins)]), 0.0)
    centres = (edges[:-1] + edges[1:]) / 2
    ranges, scales, zps = [], [], []
    for a in RANGE_SHRINK_RATIOS:              # the candidates: [lo, hi] shrunk by a, uint8 with a zero point
        l, h = lo * a, hi * a
        s = (h - l) / ACT_QMAX
        ranges.append((l, h))
        scales.append(s)
        zps.append(min(max(float(round_half_up(torch.tensor(-l / s))), 0.0), float(ACT_QMAX)))
    s = torch.tensor(scales, dtype=torch.float64).unsqueeze(1)                              # (J, 1)
    z = torch.tensor(zps, dtype=torch.float64).unsqueeze(1)
    q = torch.clamp(round_half_up(centres.unsqueeze(0) / s) + z, 0, ACT_QMAX)                # (J, K) codes
    return ranges[histogram_mse_argmin(counts.double(), centres, (q - z) * s)]


@torch.no_grad()
def calibrate_ranges(model: nn.Module, quant: nn.ModuleDict, batches: Callable[[], Iterable[torch.Tensor]],
                     method: str = "mse", percentile: float = 99.99, device: Optional[torch.device] = None,
                     progress: Callable = lambda it, desc: it) -> Dict[str, Tuple[float, float]]:
    """Measure every quantizer's range over ``batches`` and set it (``min_val``, ``max_val`` buffers).

    The caller sets the model's mode (weights fake-quantized, eval mode); this function attaches an
    observer to every quantizer and enables it for the passes, and leaves observers and fake
    quantization disabled.

    Args:
        model: called on each batch (its forward must run the quantizers).
        quant: the quantizers (gnetmdk.intq.fake.ActQuant), by key.
        batches: returns an iterable of ``(N, 3, H, W)`` image batches (called once per pass).
        method, percentile: :func:`range_from_histogram`.
        device: where the batches go (default: the model's).
        progress: wraps each pass's iterable, ``progress(iterable, description)``.

    Returns:
        {key: (min_val, max_val)} as set (float32 values).

    Raises:
        ValueError: unknown method; RuntimeError: a quantizer that saw no value.
    """
    if method not in METHODS:
        raise ValueError(f"calibration method must be one of {METHODS}, got {method!r}")
    device = device or next(model.parameters()).device
    keys = list(quant.keys())
    big = torch.finfo(torch.float32).max
    mins = torch.full((len(keys),), big, dtype=torch.float32, device=device)
    maxs = torch.full((len(keys),), -big, dtype=torch.float32, device=device)

    def run(desc: str) -> None:
        for images in progress(batches(), desc):
            forward_batch(model, images.to(device, non_blocking=True).float())

    observers = [MinMaxObserver(mins, maxs, i) for i in range(len(keys))]
    for k, obs in zip(keys, observers):
        quant[k].activation_post_process = obs
        quant[k].enable_observer().disable_fake_quant()
    try:
        run("cal (range)")
        neg = -mins
        all_reduce(neg, "max")
        all_reduce(maxs, "max")
        mins = -neg
        if bool((maxs < mins).any()):
            raise RuntimeError("calibration saw no activations (empty training set?)")
        counts = torch.zeros((len(keys), RANGE_HIST_BINS), dtype=torch.float64, device=device)
        observers = [HistogramObserver(counts, i, float(mins[i]), float(maxs[i]), method, percentile)
                     for i in range(len(keys))]
        if method != "minmax":
            for k, obs in zip(keys, observers):
                quant[k].activation_post_process = obs
            run("cal (histogram)")
            all_reduce(counts, "sum")
    finally:
        for k in keys:
            quant[k].activation_post_process = None
            quant[k].disable_observer()
    out: Dict[str, Tuple[float, float]] = {}
    for k, obs in zip(keys, observers):
        lo, hi = obs.range()
        quant[k].min_val.fill_(lo)
        quant[k].max_val.fill_(hi)
        out[k] = (float(quant[k].min_val), float(quant[k].max_val))
    return out


class MinMaxObserver:
    """The range pass's observer of quantizer ``i``: folds each input's minimum and maximum into
    ``mins[i]`` / ``maxs[i]`` (float32 rows shared by every quantizer, so that one all-reduce serves
    them all; min and max are exact in any order).

    Args:
        mins, maxs: ``(quantizers,)`` float32 tensors on the model's device.
        i: this quantizer's row.
    """

    def __init__(self, mins: torch.Tensor, maxs: torch.Tensor, i: int):
        self.mins, self.maxs, self.i = mins, maxs, int(i)

    def __call__(self, x: torch.Tensor) -> None:
        """Observe ``x`` (any shape, float)."""
        i = self.i
        self.mins[i] = torch.minimum(self.mins[i], x.min().float())
        self.maxs[i] = torch.maximum(self.maxs[i], x.max().float())

    forward = observe = __call__

    def range(self) -> Tuple[float, float]:
        """``(min, max)`` observed so far, widened to hold 0."""
        return min(float(self.mins[self.i]), 0.0), max(float(self.maxs[self.i]), 0.0)

    def calculate_qparams(self) -> Tuple[float, int]:
        """(scale, zero point) of :meth:`range` (gnetmdk.intq.fake.act_qparams)."""
        return act_qparams(*self.range())


class HistogramObserver:
    """The histogram pass's observer of quantizer ``i``: counts each input's values into row ``i`` of
    ``counts`` (gnetmdk.gti.quantize.value_histogram, the histogram the chip's caps count too, with
    :data:`RANGE_HIST_BINS` equal bins and values outside into the end bins) over the range pass's
    ``[lo, hi]`` widened to hold 0, the range :func:`range_from_histogram` reads the bins against;
    :meth:`range` is :func:`range_from_histogram` of the row with ``method`` / ``percentile``.

    Args:
        counts: ``(quantizers, RANGE_HIST_BINS)`` float64 (integer counts: exact when all-reduced).
        i: this quantizer's row; lo, hi: the range pass's minimum and maximum.
    """

    def __init__(self, counts: torch.Tensor, i: int, lo: float, hi: float, method: str = "mse",
                 percentile: float = 99.99):
        self.counts, self.i = counts, int(i)
        self.lo, self.hi = min(float(lo), 0.0), max(float(hi), 0.0)
        self.method, self.percentile = method, float(percentile)

    def __call__(self, x: torch.Tensor) -> None:
        """Observe ``x`` (any shape, float); nothing to count when the range is a single point (0)."""
        if self.hi > self.lo:
            self.counts[self.i] += value_histogram(x, RANGE_HIST_BINS, self.hi, self.lo, outside="clamp")

    forward = observe = __call__

    def range(self) -> Tuple[float, float]:
        """The range the counts ask for (:func:`range_from_histogram`), ``lo' <= 0 <= hi'``."""
        return range_from_histogram(self.counts[self.i].cpu(), self.lo, self.hi, self.method, self.percentile)

    def calculate_qparams(self) -> Tuple[float, int]:
        """(scale, zero point) of :meth:`range` (gnetmdk.intq.fake.act_qparams)."""
        return act_qparams(*self.range())
