"""Calibration of the activation caps (docs/quantization.md, "Calibration"): observers watch every capped
ReLU's input over the training data, and their statistics become the caps.

``method "output"``: the "mse" caps, then a short greedy search against the network's output error
(:func:`refine_caps_for_output`). ``method "percentile"`` (GTI): one pass; each cap is the running max over batches of the batch's
percentile (the output layer's ``output_cap_percentile``, 100 by default). ``method "mse"``: two passes;
the first finds each layer's largest value, the second histograms the positive values over [0,
largest], and each cap minimises the 5-bit quantization error over that histogram (the 10-bit one
for a 10-bit output layer)
(gnetmdk.gti.quantize.mse_cap_from_histogram). Over N ranks (processes, or virtual ranks that each run
their chunk of the batch: gnetmdk.dist.virtual.forward_batch) the maxima are all-reduced (MAX), the
percentiles are those of the global batch (gnetmdk.dist.comm.global_percentile) and the histograms are
summed (exact counts), so N processes and one process of N virtual ranks give the same caps bit for bit
(tests/dist/test_dist_train.py).

It is GNetDet's calibration (gnetmdk.models.gnetdet.family.GNetDetFamily.calibrate), below the chip
model, so it sits with the models; gnetmdk.engine.calibration re-exports it.
"""
from __future__ import annotations

from typing import Callable, Iterable, List, Optional

import torch

from gnetmdk.dist.comm import all_reduce, global_percentile, is_dist
from gnetmdk.dist.virtual import forward_batch
from gnetmdk.gti.quantize import ACT_MAX, mse_cap_from_histogram
from gnetmdk.gti.transforms import equalize_channel_ranges
from gnetmdk.layers.observers import (ChannelMaxObserver, HistogramObserver, MaxObserver, PercentileObserver,
                                      batch_percentile, observe_inputs)

#: bins of the GNetDet cap calibration's histograms (the MSE method; the int8 target's ranges use
#: gnetmdk.intq.calibrate.RANGE_HIST_BINS)
CAP_HIST_BINS = 4096


def percentile(x: torch.Tensor, p: float) -> torch.Tensor:
    """The ``p``-th percentile (nearest rank) of the batch of every rank (gnetmdk.dist.comm.global_percentile)
    when this rank has peers, else of ``x`` alone (gnetmdk.layers.observers.batch_percentile): the two
    are equal for the same values. A 0-d float32 tensor."""
    if is_dist():
        return global_percentile(x, p)
    return batch_percentile(x, p)


def observe_pass(model, relus, observers, batches: Callable[[], Iterable[torch.Tensor]], device: torch.device,
                 progress: Callable, desc: str) -> None:
    """One calibration pass: every batch of ``batches()`` (N, 3, H, W) through ``model`` on ``device``
    (as float, by gnetmdk.dist.virtual.forward_batch), each ReLU's input given to its observer
    (``relus[i]`` to ``observers[i]``); ``progress(iterable, desc)`` wraps the batches."""
    with observe_inputs(relus, observers):
        for images in progress(batches(), desc):
            forward_batch(model, images.to(device, non_blocking=True).float())


@torch.no_grad()
def measure_caps(model, batches: Callable[[], Iterable[torch.Tensor]], method: str = "percentile",
                 device: Optional[torch.device] = None, progress: Callable = lambda it, desc: it) -> List[float]:
    """Run the calibration observers over ``batches`` and return the caps they give (floats rounded to
    float32, one per capped ReLU); the model's mode is the caller's (its ReLUs must be plain ReLUs:
    ``observer_enabled`` on or ``fake_quant_enabled`` off), nothing is set.

    Args:
        model: a model with ``relus()`` (QReLU modules; each one's ``percentile`` is its observer's).
        batches: a function returning an iterable of input batches (N, 3, H, W) (called once per pass).
        method: "percentile" or "mse".
        device: where the batches go (default: the model's).
        progress: wraps each pass's iterable (a progress bar), ``progress(iterable, description)``.
    Raises:
        ValueError: unknown method.
    """
    if method not in ("percentile", "mse"):
        raise ValueError(f"calibration method must be 'percentile' or 'mse', not {method!r}")
    device = device or next(model.parameters()).device
    relus = list(model.relus())

    def one_pass(observers, desc: str) -> None:
        observe_pass(model, relus, observers, batches, device, progress, desc)

    def stacked(observers) -> torch.Tensor:
        zero = torch.zeros((), dtype=torch.float32, device=device)
        return torch.stack([torch.maximum(o.value.float(), zero) if o.value is not None else zero for o in observers])

    if method == "mse":
        maxima = [MaxObserver() for _ in relus]
        one_pass(maxima, "cal (max)")
        caps = all_reduce(stacked(maxima), "max")
        hists = [HistogramObserver(float(c), CAP_HIST_BINS) for c in caps.tolist()]
        one_pass(hists, "cal (histogram)")
        counts = torch.stack([h.value if h.value is not None else
                              torch.zeros(CAP_HIST_BINS, dtype=torch.float64, device=device) for h in hists])
        all_reduce(counts, "sum")
        values = [mse_cap_from_histogram(h, c, codes=int(getattr(r, "codes", ACT_MAX))) if c > 0 else 0.0
                  for h, c, r in zip(counts, caps.tolist(), relus)]
    else:
        # the global batch's percentile over every rank (virtual ranks included), the batch's in one
        observers = [PercentileObserver(r.percentile, percentile) for r in relus]
        one_pass(observers, "cal")
        values = all_reduce(stacked(observers), "max").tolist()
    return [float(torch.tensor(float(c), dtype=torch.float32)) for c in values]


@torch.no_grad()
def equalize_ranges(model, batches: Callable[[], Iterable[torch.Tensor]], alpha: float, max_scale: float,
                    device: Optional[torch.device] = None,
                    progress: Callable = lambda it, desc: it) -> List[torch.Tensor]:
    """Equalize the channels' activation ranges of ``model`` before its caps are measured: one pass
    over ``batches`` measures each channel's largest pre-ReLU value (all-reduced, MAX, over ranks),
    then gnetmdk.gti.transforms.equalize_channel_ranges scales the convs (docs/quantization.md,
    "Range equalization"). The model's mode is the caller's (plain ReLUs, as for measure_caps).

    Args:
        model: a GNetDet (``convs()`` and ``relus()`` in chain order, one ReLU per conv).
        batches: returns an iterable of input batches (N, 3, H, W).
        alpha, max_scale: equalize_channel_ranges's.
    Returns:
        the (O,) float64 scales of every conv but the last.
    """
    device = device or next(model.parameters()).device
    relus, convs = list(model.relus()), list(model.convs())
    observers = [ChannelMaxObserver() for _ in relus]
    observe_pass(model, relus, observers, batches, device, progress, "cal (channel ranges)")
    ranges = []
    for o, conv in zip(observers, convs):
        v = o.value if o.value is not None else torch.zeros(conv.weight.shape[0], device=device)
        ranges.append(all_reduce(v.float().clone(), "max"))
    return equalize_channel_ranges(convs, ranges, alpha, max_scale)


#: cap factors the output-error search tries for each layer (1 = keep)
OUTPUT_FACTORS = (0.5, 0.7, 0.85, 1.15, 1.3)
#: batches (per process) the output-error search measures on
OUTPUT_BATCHES = 4


def _first_batches(batches: Callable[[], Iterable[torch.Tensor]], max_batches: int,
                   device: torch.device) -> List[torch.Tensor]:
    """The first ``max_batches`` image batches of ``batches()`` (this process's), as float32 on
    ``device``: the data the output-error cap search and the bias correction measure on."""
    data = []
    for k, images in enumerate(batches()):
        if k >= max_batches:
            break
        data.append(images.to(device, non_blocking=True).float())
    return data


def _sorted_sum(rows: torch.Tensor) -> torch.Tensor:
    """The rows (images,) or (images, C) float64 of every process gathered and added per column in sorted
    order, so the sum (a scalar, or (C,)) does not depend on which process held which image or on
    their order."""
    from gnetmdk.dist.comm import all_gather_object
    every = torch.cat(all_gather_object(rows.cpu()))
    return torch.sort(every, dim=0).values.sum(dim=0)


def _f32(v: float) -> float:
    """v rounded to float32 (caps are float32 buffers)."""
    return float(torch.tensor(v, dtype=torch.float32))


@torch.no_grad()
def refine_caps_for_output(model, batches: Callable[[], Iterable[torch.Tensor]], caps: List[float],
                           device: Optional[torch.device] = None, factors=OUTPUT_FACTORS,
                           max_batches: int = OUTPUT_BATCHES, progress: Callable = lambda it, desc: it) -> List[float]:
    """Caps chosen against the network's output error instead of each layer's own.

    The reference is the model with quantized weights and float activations (the cal stage's model);
    the error of a set of caps is the squared difference between the step-3 model's outputs (5-bit
    activations with those caps) and the reference, summed over the first ``max_batches`` batches.
    Layer by layer, in order, each cap is multiplied by each of ``factors`` and the factor with the
    least error is kept (greedy coordinate descent, one sweep; the start is ``caps``). Per-image errors
    are gathered from every process and summed in sorted order, so N processes choose the caps one
    process chooses.

    Args:
        model: GNetDet with ``relus()`` (caps set to ``caps`` on return), any mode; left in step-3
            eval mode.
        batches: returns an iterable of image batches (N, 3, H, W).
        caps: the starting caps (e.g. the "mse" ones), one per ReLU.
    Returns:
        the chosen caps (float32 values as floats).
    """
    from .stages import STAGES, apply_stage
    device = device or next(model.parameters()).device
    relus = list(model.relus())
    data = _first_batches(batches, max_batches, device)
    for r, c in zip(relus, caps):
        r.cap.fill_(c)
    apply_stage(model, STAGES["cal"])
    model.eval()
    refs = [forward_batch(model, x).double() for x in data]
    apply_stage(model, STAGES["step3"])
    model.eval()

    def error() -> float:
        per = torch.cat([((forward_batch(model, x).double() - r) ** 2).flatten(1).sum(1)
                         for x, r in zip(data, refs)])
        return float(_sorted_sum(per))

    cur = [_f32(float(c)) for c in caps]
    best = error()
    for i in progress(list(range(len(relus))), "cal (output error)"):
        keep = cur[i]
        for f in factors:
            c = _f32(keep * f)
            relus[i].cap.fill_(c)
            e = error()
            if e < best:
                best, cur[i] = e, c
        relus[i].cap.fill_(cur[i])
    return cur


#: batches (per process) the bias correction measures the channel means on
BIAS_BATCHES = 16


class _StopForward(Exception):
    """Raised by a hook to end a forward pass once the input it needs was seen."""


def _input_of(model, module, x: torch.Tensor) -> torch.Tensor:
    """``module``'s input when ``model`` runs the batch ``x`` (N, ...), the forward ended there (the
    layers after it cannot change that input); each virtual rank runs its chunk
    (gnetmdk.dist.virtual.forward_batch) and the chunks' inputs are concatenated in rank order."""
    seen = []

    def grab(mod, args):
        seen.append(args[0].detach())
        raise _StopForward

    def upto(c):
        try:
            model(c)
        except _StopForward:
            pass
        return c.new_zeros(c.shape[0])

    handle = module.register_forward_pre_hook(grab)
    try:
        forward_batch(upto, x)
    finally:
        handle.remove()
    return torch.cat(seen)


@torch.no_grad()
def correct_biases(model, batches: Callable[[], Iterable[torch.Tensor]], device: Optional[torch.device] = None,
                   max_batches: int = BIAS_BATCHES, progress: Callable = lambda it, desc: it) -> List[torch.Tensor]:
    """Empirical bias correction after the caps are set: each conv's bias is shifted so that, where the
    cal stage's model (quantized weights, float activations) has a channel active (pre-activation > 0),
    the step-3 model (5-bit activations at the caps) has the same mean pre-activation there, layer by
    layer in order, each layer measured after the ones before it were corrected.

    Clipping a layer's activations at its cap and rounding them to 5-bit codes shift the next layer's
    pre-activations; the mean shift is taken out (Nagel et al. 2019, "Data-Free Quantization Through
    Weight Equalization and Bias Correction", section 4.2, there from BatchNorm statistics; here
    measured on the calibration data, docs/quantization.md, "Bias correction"). The mean is over the
    positions where the reference is active, because the ReLU zeroes the rest whatever their error.

    Per image and channel the differences at those positions and their count are summed in float64 (each
    image on its own), gathered from every process and added in sorted order (:func:`_sorted_sum`),
    over the first ``max_batches`` batches of ``batches()`` on each process, so N processes and one
    process shift the biases alike. A channel never active keeps its bias.

    Args:
        model: a GNetDet whose caps are calibrated (``convs()`` and ``relus()`` in order, one ReLU
            per conv, whose input is the conv's output: BatchNorm folded); left in step-3 eval mode.
        batches: returns an iterable of image batches (N, 3, H, W).
    Returns:
        the shifts, one (C_out,) float64 tensor per conv, in value units (added to ``conv.bias``).
    """
    import copy
    from .stages import STAGES, apply_stage
    device = device or next(model.parameters()).device
    data = _first_batches(batches, max_batches, device)
    reference = copy.deepcopy(model)
    apply_stage(reference, STAGES["cal"])
    reference.eval()
    apply_stage(model, STAGES["step3"])
    model.eval()
    relus, convs, ref_relus = list(model.relus()), list(model.convs()), list(reference.relus())
    shifts = []
    for i in progress(list(range(len(relus))), "cal (bias correction)"):
        scale = float(relus[i].cap) / relus[i].codes if relus[i].code_domain else 1.0     # codes -> values
        diffs, counts = [], []
        for x in data:
            ref = _input_of(reference, ref_relus[i], x).double()
            q = _input_of(model, relus[i], x).double() * scale
            active = ref > 0
            d = torch.where(active, ref - q, torch.zeros((), dtype=torch.float64, device=ref.device))
            for n in range(x.shape[0]):
                diffs.append(d[n].sum(dim=(1, 2)))
                counts.append(active[n].sum(dim=(1, 2)).double())
        total, n_active = _sorted_sum(torch.stack(diffs)), _sorted_sum(torch.stack(counts))
        shift = torch.where(n_active > 0, total / n_active.clamp_min(1), torch.zeros_like(total))
        bias = convs[i].bias
        bias.copy_((bias.detach().double() + shift.to(bias.device)).to(bias.dtype))
        shifts.append(shift)
    return shifts


#: the cap of a layer whose pre-activations were never positive over the calibration set (a dead
#: layer: its output is 0 whatever the cap, so any positive cap keeps the model's values; a cap of 0
#: would divide by zero in the 5-bit codes and in gain editing)
DEAD_LAYER_CAP = 1.0


@torch.no_grad()
def calibrate_caps(model, batches: Callable[[], Iterable[torch.Tensor]], method: str = "percentile",
                   device: Optional[torch.device] = None, progress: Callable = lambda it, desc: it,
                   output_cap_max: float = 0.0, equalize: float = 0.0,
                   equalize_max_scale: float = 8.0, bias_correct: bool = False,
                   dead: Optional[List[int]] = None) -> List[float]:
    """The calibration stage on ``model``: switch it to the "cal" stage (quantized weights, plain
    ReLUs, eval mode), with ``equalize`` > 0 equalize the channels' ranges first (:func:`equalize_ranges`,
    ``alpha = equalize``, ``max_scale = equalize_max_scale``), :func:`measure_caps` ("output": the "mse" caps refined by
    :func:`refine_caps_for_output`), set every cap, then switch it to step 3 (caps on, 5-bit
    activations) in training mode. Returns the caps (arguments as measure_caps).

    ``output_cap_max`` > 0 limits the last capped ReLU's cap (the output layer's) to that value, before
    and after the output-error search. The output layer's values that the loss trains (GNetDet's
    boxes and scores) lie in [0, 1]; values far above it (untrained slots, confident cells) can pull a
    measured cap to several units, and 5-bit codes over such a range leave the trained range a few
    codes (docs/results/shapes-demo.md: a cap of 5.7 cost 15 points of mAP on its own, 2.0 cost 2).

    ``bias_correct`` then, with every cap set, shifts the convs' biases (:func:`correct_biases`).

    A layer that saw no positive pre-activation (measured cap 0) gets :data:`DEAD_LAYER_CAP`, before
    the output-error search and the limit; its index (0-based, in ``model.relus()`` order) is appended
    to ``dead`` when a list is given, for the caller to report."""
    from .stages import STAGES, apply_stage
    relus = list(model.relus())
    for relu in relus:
        relu.cap.zero_()
    apply_stage(model, STAGES["cal"], calibrating=True)
    model.eval()
    if equalize > 0:
        equalize_ranges(model, batches, equalize, equalize_max_scale, device, progress)
    caps = measure_caps(model, batches, "mse" if method == "output" else method, device, progress)
    for i, c in enumerate(caps):
        if not c > 0:
            caps[i] = DEAD_LAYER_CAP
            if dead is not None:
                dead.append(i)
    limit = float(output_cap_max)
    if limit > 0:
        caps[-1] = min(caps[-1], _f32(limit))
    if method == "output":
        caps = refine_caps_for_output(model, batches, caps, device, progress=progress)
        if limit > 0:
            caps[-1] = min(caps[-1], _f32(limit))
    for relu, c in zip(relus, caps):
        relu.cap.fill_(c)
    if bias_correct:
        correct_biases(model, batches, device, progress=progress)
    apply_stage(model, STAGES["step3"])   # evaluate as step 3 will start
    model.train()
    return caps
