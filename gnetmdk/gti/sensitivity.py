"""Per-layer quantization sensitivity of GNetDet: which sublayer's weights or activations cost accuracy
when quantized alone, and the weight formats (``mask_bits``) that follow from it.

Four measurements on one split, each against the float model (BatchNorm folded, nothing quantized):

* **weights, one sublayer at a time**: only that conv's weights quantized with its weight format (the
  model's ``mask_bits``) and the model's ``weight_scale`` rule; activations float;
* **weights, one major layer at a time, every weight format the chip has**: the major layer's convs share
  one weight format on the chip (docs/quantization.md, "Weight formats (mask bits)"), so this is the table
  ``mask_bits`` is chosen from;
* **activations, one layer at a time**: only that ReLU capped with its calibrated cap and quantized
  to 5-bit codes (needs a calibrated checkpoint); weights float.
* **the output layer's codes, one group of outputs at a time**: the box centres (x, y), the box sizes
  (w, h) or the scores (confidences, classes) rounded to the output layer's 5-bit code grid
  (``cap / 31`` steps, clamped to ``[0, cap]``), everything else float. The output layer is the only
  one whose codes are read as numbers; this says which of them its resolution costs. With GTI's linear
  size head the box sizes are fractions of the input side, so one step is ``cap / 31`` of it (8.8 px at
  224 px with cap 1.22): boxes of a few code steps cannot be sized within IoU 0.5 (docs/results/accuracy-matrix.md, "The
  dense set through 2 x 2 tiles"); with the log size head one step multiplies the size by
  ``size_min ** (-cap / 31)`` (gnetmdk.models.gnetdet.head.output_sizes). A model with the 10-bit output
  (``gnetdet.output_bits 10``) has 1023 steps there.

Each cell holds the val mAP@0.5 and the output error: the relative L2 difference ``||y - y_float|| /
||y_float||`` of the model's outputs over every image (values, as ``forward`` returns them).

:func:`suggest_mask_bits` picks per major layer the weight format with the fewest bits whose mAP lies within
``tolerance`` of the float model's, else the weight format with the best mAP. (Jacob et al. 2018 and the
HAWQ line of work, Dong et al. 2019, rank layers by such sensitivities; this is the measured,
one-layer-at-a-time form.) Each of those cells is one evaluation with one major layer quantized, and
neither its noise nor the layers' costs adding up is in it: on the shapes demo's train split one
major layer at 1 bit read +0.48 points, the same layer at 1 bit cost cards 48.7. So
:func:`check_mask_bits` then quantizes every major layer's weights at once with the suggestion and
evaluates it; while that misses the tolerance it raises the major layer whose chosen format had the
largest output error alone (a deterministic measure, where one mAP reading is noisy) to its next weight
format, and evaluates again. What it ends on is what a user passes as ``gnetdet.mask_bits``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .spec import get_chip_spec, register_bits

__all__ = ["Sensitivity", "MaskBitsCheck", "OUTPUT_GROUPS", "output_group_channels", "quantize_output_channels",
           "measure_sensitivity", "suggest_mask_bits", "check_mask_bits", "format_sensitivity"]

#: the groups of GNetDet's output channels measured one at a time (gnetmdk/models/gnetdet/decode.py's layout:
#: [x, y, w, h, conf] per box slot, then the class scores)
OUTPUT_GROUPS = ("box centres (x, y)", "box sizes (w, h)", "scores (conf, classes)")


def output_group_channels(num_classes: int) -> Dict[str, List[int]]:
    """{group name: channel indices} of GNetDet's (N, S, S, 10 + C) output, for :data:`OUTPUT_GROUPS`."""
    return {OUTPUT_GROUPS[0]: [0, 1, 5, 6], OUTPUT_GROUPS[1]: [2, 3, 7, 8],
            OUTPUT_GROUPS[2]: [4, 9] + list(range(10, 10 + int(num_classes)))}


def quantize_output_channels(out: torch.Tensor, channels: Sequence[int], cap: float, codes: int = 31) -> torch.Tensor:
    """A copy of ``out`` (..., 10 + C) float with the last-axis ``channels`` on the 5-bit code grid:
    ``clamp(round(v / (cap / 31)), 0, 31) * cap / 31`` (1023 for 31 with ``codes`` 1023, the 10-bit
    output); the other channels unchanged (dtype kept)."""
    step = float(cap) / float(codes)
    q = out.clone()
    idx = list(channels)
    q[..., idx] = torch.clamp(torch.round(out[..., idx] / step), 0, codes) * step
    return q


@dataclass
class Sensitivity:
    """Results of :func:`measure_sensitivity`.

    Attributes:
        base_map / base_err: the float model's mAP (error 0 by definition).
        layers: sublayer names "major.sub" (1-based), in order; ``majors`` the major index of each.
        weights: per sublayer (mAP, output error) with only its weights quantized.
        weight_formats: {major (0-based): {weight_format: (mAP, output error)}} with only that major layer's
            weights quantized with that weight format.
        acts: per sublayer (mAP, output error) with only its activation quantized; empty without caps.
        outputs: {group of OUTPUT_GROUPS: (mAP, output error)} with only that group of outputs on the
            output layer's code grid; ``output_cap`` that layer's cap; both empty / 0 without caps;
            ``output_codes`` its largest code (31, or 1023 with the 10-bit output).
        current: the model's mask_bits; weights_per_major: weight count of each major layer.
        size_head, size_min: the model's size head ("linear" or "log"; output_sizes), for the text.
    """
    base_map: float
    layers: List[str]
    majors: List[int]
    weights: List[Tuple[float, float]]
    weight_formats: Dict[int, Dict[int, Tuple[float, float]]]
    acts: List[Tuple[float, float]] = field(default_factory=list)
    current: List[int] = field(default_factory=list)
    weights_per_major: List[int] = field(default_factory=list)
    outputs: Dict[str, Tuple[float, float]] = field(default_factory=dict)
    output_cap: float = 0.0
    size_head: str = "linear"
    size_min: float = 1.0 / 64
    output_codes: int = 31


def output_error(outs: Sequence[torch.Tensor], ref: Sequence[torch.Tensor]) -> torch.Tensor:
    """Relative L2 difference ``||y - y_float|| / ||y_float||`` over every image: ``outs`` and ``ref`` are
    lists of float tensors of equal shapes (the batches' outputs in one order); a 0-d float64 tensor."""
    ref_norm = torch.sqrt(sum((r.double() ** 2).sum() for r in ref))
    return torch.sqrt(sum(((o.double() - r.double()) ** 2).sum() for o, r in zip(outs, ref))) / ref_norm


@torch.no_grad()
def measure_sensitivity(model, evaluate: Callable[[torch.nn.Module], Tuple[float, List[torch.Tensor]]],
                        chip: str, caps: Optional[Sequence[float]] = None,
                        progress: Callable = lambda it, desc: it) -> Sensitivity:
    """Measure the four tables of the module docstring (the last two need ``caps``).

    Args:
        model: a GNetDet with BatchNorm folded (step-2 layout), eval mode; its switches are changed
            and restored to "nothing quantized".
        evaluate: ``model -> (mAP, outputs)`` over the split (outputs: list of (N, S, S, 10 + C) float
            tensors in a fixed image order).
        chip: the chip whose weight formats are tried.
        caps: calibrated caps, one per ReLU (from a cal checkpoint), or None to skip activations.
        progress: wraps the list of cases, ``progress(list, description)``.

    Returns:
        :class:`Sensitivity`.
    """
    convs, relus = model.convs(), model.relus()

    def nothing_quantized():
        for c in convs:
            c.disable_fake_quant()
        for r in relus:
            r.disable_fake_quant().disable_observer()
            r.integer = False
        model.exact_eval = False
        model.set_gains()

    nothing_quantized()
    base_map, ref = evaluate(model)

    def run() -> Tuple[float, float]:
        model.set_gains()
        m, outs = evaluate(model)
        err = output_error(outs, ref)
        return float(m), float(err)

    specs = model.specs
    names = [f"{s.major + 1}.{s.index_in_major + 1}" for s in specs]
    majors = [s.major for s in specs]
    weights = []
    for i in progress(list(range(len(convs))), "weights per sublayer"):
        convs[i].enable_fake_quant()
        weights.append(run())
        convs[i].disable_fake_quant()
    weight_formats: Dict[int, Dict[int, Tuple[float, float]]] = {}
    spec = get_chip_spec(chip)
    cases = [(m, s) for m in sorted(set(majors)) for s in sorted(spec.weight_formats)]
    for m, weight_format in progress(cases, "weights per major layer and weight format"):
        idx = [i for i, mm in enumerate(majors) if mm == m]
        with _weight_formats(convs, {i: weight_format for i in idx}, chip):
            weight_formats.setdefault(m, {})[weight_format] = run()
    acts = []
    if caps is not None:
        if len(caps) != len(relus):
            raise ValueError(f"{len(caps)} caps for {len(relus)} ReLUs: pass the calibration checkpoint of this model")
        for r, c in zip(relus, caps):
            r.cap.fill_(float(c))
        for i in progress(list(range(len(relus))), "activations per layer"):
            relus[i].enable_fake_quant()
            acts.append(run())
            relus[i].disable_fake_quant()
    outputs: Dict[str, Tuple[float, float]] = {}
    if caps is not None:
        for name, chans in progress(list(output_group_channels(model.num_classes).items()), "output groups"):
            hook = model.register_forward_hook(
                lambda mod, inp, out, chans=chans: quantize_output_channels(out, chans, caps[-1], relus[-1].codes))
            try:
                outputs[name] = run()
            finally:
                hook.remove()
    nothing_quantized()
    per_major = [sum(convs[i].weight.numel() for i, mm in enumerate(majors) if mm == m) for m in sorted(set(majors))]
    return Sensitivity(float(base_map), names, majors, weights, weight_formats, acts, list(model.mask_bits()),
                       per_major,
                       outputs, float(caps[-1]) if caps is not None else 0.0,
                       str(getattr(model, "size_head", "linear")), float(getattr(model, "size_min", 1.0 / 64)),
                       int(relus[-1].codes))


class _weight_formats:
    """Context: the convs named in ``formats`` ({conv index: weight format}) quantize their weights with
    that format (its register bits on ``chip``); on exit every one gets its format, bits and fake-quant
    switch back."""

    def __init__(self, convs, formats: Dict[int, int], chip: str):
        self.convs, self.formats, self.chip = convs, formats, chip

    def __enter__(self):
        self.saved = {i: (self.convs[i].weight_format, self.convs[i].weight_bits, self.convs[i].bias_bits,
                          self.convs[i].fake_quant_enabled) for i in self.formats}
        for i, weight_format in self.formats.items():
            bw, bb = register_bits(self.chip, weight_format)
            c = self.convs[i]
            c.weight_format, c.weight_bits, c.bias_bits = weight_format, bw, bb
            c.enable_fake_quant()
        return self

    def __exit__(self, *exc):
        for i, (s0, w0, b0, on) in self.saved.items():
            c = self.convs[i]
            c.weight_format, c.weight_bits, c.bias_bits = s0, w0, b0
            c.enable_fake_quant(on)
        return False


def suggest_mask_bits(sens: Sensitivity, tolerance: float = 0.005) -> List[int]:
    """Per major layer, the weight format with the fewest bits whose mAP is at least ``base_map - tolerance``
    (mAP units: 0.005 = half a point), else the weight format with the highest mAP (fewer bits on a tie).

    Returns:
        one weight format per major layer, in order (a valid ``gnetdet.mask_bits`` for the measured chip).
    """
    out = []
    for m in sorted(sens.weight_formats):
        by = sens.weight_formats[m]
        ok = [s for s in sorted(by) if by[s][0] >= sens.base_map - tolerance]
        out.append(ok[0] if ok else max(sorted(by), key=lambda s: (by[s][0], -s)))
    return out


@dataclass
class MaskBitsCheck:
    """Results of :func:`check_mask_bits`.

    Attributes:
        trail: every weight-format choice evaluated with all major layers' weights quantized at once, in
            the order tried: (mask_bits, mAP, output error); the first is the one-layer-at-a-time suggestion.
        chosen: the first choice of the trail within the tolerance, else the one with the best mAP (fewer
            bits in all on a tie).
        within: whether ``chosen`` is within the tolerance of the float model's mAP.
    """
    trail: List[Tuple[List[int], float, float]]
    chosen: List[int]
    within: bool


@torch.no_grad()
def check_mask_bits(model, evaluate: Callable[[torch.nn.Module], Tuple[float, List[torch.Tensor]]], chip: str,
                    sens: Sensitivity, mask_bits: Sequence[int], tolerance: float = 0.005) -> MaskBitsCheck:
    """Evaluate ``mask_bits`` with every major layer's weights quantized at once (activations float),
    and raise weight formats until the model is within ``tolerance`` of the float model's mAP.

    While the whole model misses ``sens.base_map - tolerance``, the major layer below the chip's widest
    format whose current format had the largest output error with it quantized alone
    (``sens.weight_formats``; the earlier layer on a tie) moves to the next wider format, and the model is
    evaluated again: at most (formats - 1) x major layers + 1 evaluations, after one of the float model
    (the reference of the output error).

    Args:
        model: the GNetDet :func:`measure_sensitivity` measured (BatchNorm folded, eval mode, nothing
            quantized); its convs' formats and switches are restored.
        evaluate: as for :func:`measure_sensitivity`.
        chip: the chip whose weight formats are tried.
        sens: :func:`measure_sensitivity`'s result for this model and split.
        mask_bits: one weight format per major layer to start from (usually :func:`suggest_mask_bits`).
        tolerance: mAP (fraction) the whole model may lose, as for :func:`suggest_mask_bits`.

    Returns:
        :class:`MaskBitsCheck`.

    Raises:
        ValueError: ``mask_bits`` does not give one of the chip's formats for each measured major layer.
    """
    formats = sorted(get_chip_spec(chip).weight_formats)
    majors_measured = sorted(sens.weight_formats)
    cand = [int(b) for b in mask_bits]
    if len(cand) != len(majors_measured) or any(b not in formats for b in cand):
        raise ValueError(f"mask_bits {list(mask_bits)}: give one of the chip's weight formats {formats} for each "
                         f"of the {len(majors_measured)} major layers")
    convs = model.convs()
    model.set_gains()
    ref = evaluate(model)[1]
    trail: List[Tuple[List[int], float, float]] = []
    while True:
        with _weight_formats(convs, {i: cand[m] for i, m in enumerate(sens.majors)}, chip):
            model.set_gains()
            m_ap, outs = evaluate(model)
        model.set_gains()
        err = output_error(outs, ref)
        trail.append((list(cand), float(m_ap), float(err)))
        if m_ap >= sens.base_map - tolerance:
            return MaskBitsCheck(trail, list(cand), True)
        raisable = [j for j in range(len(cand)) if cand[j] < formats[-1]]
        if not raisable:
            break
        j = max(raisable, key=lambda j: (sens.weight_formats[majors_measured[j]][cand[j]][1], -j))
        cand[j] = formats[formats.index(cand[j]) + 1]
    best = max(trail, key=lambda t: (t[1], -sum(b * n for b, n in zip(t[0], sens.weights_per_major))))
    return MaskBitsCheck(trail, list(best[0]), False)


def format_sensitivity(sens: Sensitivity, tolerance: float = 0.005, check: Optional[MaskBitsCheck] = None) -> str:
    """The tables as text (mAP, its change from the float model in points, output error in %); with
    ``check`` (:func:`check_mask_bits`) also its trail, and the suggestion is the one it chose."""
    lines = [f"float model (BatchNorm folded, nothing quantized): mAP {sens.base_map:.4f}", "",
             "weights quantized in one sublayer only (its weight format from mask_bits):",
             f"{'layer':<7} {'format':>6} {'mAP':>7} {'d mAP':>7} {'out err %':>9}"]
    for name, m, (mp, err) in zip(sens.layers, sens.majors, sens.weights):
        lines.append(f"{name:<7} {sens.current[m]:>6} {mp:>7.4f} {100 * (mp - sens.base_map):>+7.2f} "
                     f"{100 * err:>9.2f}")
    weight_formats = sorted({s for by in sens.weight_formats.values() for s in by})
    lines += ["", "weights quantized in one major layer only, each weight format of the chip (mAP / d mAP in points):",
              f"{'major':<6} {'weights':>8} " + " ".join(f"{f'{s}-bit':>16}" for s in weight_formats)]
    for m in sorted(sens.weight_formats):
        cells = []
        for s in weight_formats:
            mp = sens.weight_formats[m].get(s, (float("nan"), 0.0))[0]
            cells.append(f"{mp:.4f} ({100 * (mp - sens.base_map):+.2f})".rjust(16))
        lines.append(f"{m + 1:<6} {sens.weights_per_major[m]:>8} " + " ".join(cells))
    if sens.acts:
        lines += ["", "activations quantized in one layer only (5-bit codes, calibrated cap):",
                  f"{'layer':<7} {'mAP':>7} {'d mAP':>7} {'out err %':>9}"]
        for name, (mp, err) in zip(sens.layers, sens.acts):
            lines.append(f"{name:<7} {mp:>7.4f} {100 * (mp - sens.base_map):>+7.2f} {100 * err:>9.2f}")
    if sens.outputs:
        step = sens.output_cap / sens.output_codes
        if sens.size_head == "log":
            sizes = (f"log size head: one step multiplies a box size by {sens.size_min ** -step:.3g}")
        else:
            sizes = f"box sizes are fractions of the input side, a step of {step:.4g} of it"
        width = "5-bit" if sens.output_codes == 31 else "10-bit"
        lines += ["", f"one group of outputs only on the output layer's {width} code grid (cap {sens.output_cap:.3g}: "
                      f"steps of {step:.4g}; {sizes}):",
                  f"{'outputs':<24} {'mAP':>7} {'d mAP':>7} {'out err %':>9}"]
        for name, (mp, err) in sens.outputs.items():
            lines.append(f"{name:<24} {mp:>7.4f} {100 * (mp - sens.base_map):>+7.2f} {100 * err:>9.2f}")
    sug = suggest_mask_bits(sens, tolerance)
    how = f"per major layer the fewest bits within {100 * tolerance:g} points of the float model"
    if check is not None:
        lines += ["", "every major layer's weights quantized at once (activations float), from the per-layer "
                      "choice; while the model misses the tolerance the layer with the largest output error "
                      "alone gets its next format:",
                  f"{'mask_bits':<22} {'mAP':>7} {'d mAP':>7} {'out err %':>9}"]
        for bits_, mp, err in check.trail:
            lines.append(f"{str(bits_):<22} {mp:>7.4f} {100 * (mp - sens.base_map):>+7.2f} {100 * err:>9.2f}")
        sug = check.chosen
        how = (f"all layers quantized together within {100 * tolerance:g} points of the float model" if check.within
               else f"no choice tried was within {100 * tolerance:g} points together: the best one")
    bits = sum(b * n for b, n in zip(sug, sens.weights_per_major))
    now = sum(b * n for b, n in zip(sens.current, sens.weights_per_major))
    lines += ["", f"suggested mask_bits: {sug} ({how}; weight memory {bits / 8 / 1024:.1f} KiB against "
                  f"{now / 8 / 1024:.1f} KiB with the current {sens.current})",
              "    train with it: python3 train.py --step 2 gnetdet.mask_bits [" + ",".join(map(str, sug)) + "]"]
    return "\n".join(lines)
