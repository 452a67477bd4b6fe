"""The chip's memory limits: feature-map memory per layer and coefficient memory per chip (docs/chip.md,
"Memory limits").

GTI's material for the 5801 states two budgets (docs/chip.md cites it):

* **per layer** - a layer's input feature map plus its output feature map, counted in values
  (channels x height x width each), at most ``ChipSpec.max_layer_io`` (4,816,896 on the 5801);
* **per chip** - the coefficient memory of the whole network, the sum over the convs of
  ``in_channels x out_channels / d`` with ``d`` = 4 for 1- and 2-bit kernels, 2 for 3- and 5-bit kernels
  and 1 for 8- and 12-bit kernels, below ``ChipSpec.max_coef_memory`` (489,216 on the 5801). The unit
  is one 8-bit 3x3 kernel; a 3-bit kernel takes half of one, a 1-bit kernel a quarter.

How the project counts (the choices docs/chip.md explains, with what stays uncertain):

* a conv that ends its major layer in a 2x2 pool counts its output after the pool (the chip pools
  as it writes);
* the image's 3 channels count as 3 (GTI's VGG16 example needs it), and the last conv's outputs as
  used (``10 + C``): a network over the budget by that count is over by any reading of the rule, and is
  refused. Counted as the converter stores them (padded with zero filters to the width of the major
  layer, gnetmdk.chip.convert.padded_output_channels), GTI's own 5801 GNetDet-448 would be over
  the budget, so a network over only by that count is noted (:func:`memory_note`,
  gnetmdk.models.gnetdet.config.gnetdet_memory_note), not refused.

The checks raise :class:`gnetmdk.gti.spec.ChipSpecError` (a ConfigError) with one line naming the
layer, the amount against the limit and the fix. The table of docs/chip.md for the example configs and
the full-width GNetDets is GNetDet's (``python3 -m gnetmdk.models.gnetdet.memory``).
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Dict, List, Optional, Sequence

from gnetmdk.gti.spec import ChipSpec, ChipSpecError

#: mask bits -> the divisor of in x out channels in the coefficient count (GTI's multi-chip split script
#: in the Caffe MDK's conversion tool: 1- and 2-bit kernels 4 to a unit, 3- and 5-bit 2, wider ones 1)
COEF_DIVISOR: Dict[int, int] = {1: 4, 2: 4, 3: 2, 5: 2, 8: 1, 12: 1}


def coefficient_divisor(mask_bits: int) -> int:
    """How many kernels of ``mask_bits`` share one coefficient unit (4, 2 or 1; :data:`COEF_DIVISOR`).

    Raises:
        ChipSpecError: a weight format none of the chips has.
    """
    try:
        return COEF_DIVISOR[int(mask_bits)]
    except KeyError:
        raise ChipSpecError(f"no coefficient size is known for {mask_bits}-bit kernels (known: "
                            f"{sorted(COEF_DIVISOR)})") from None


@dataclass(frozen=True)
class MemoryLayer:
    """One conv as the chip's memory sees it.

    Attributes:
        in_channels, out_channels: channel counts as stored (padded ones included).
        in_height, in_width: the input feature map's size in values (pixels).
        out_height, out_width: the output's size as written (after the 2x2 pool when one follows).
        mask_bits: the conv's weight format (1, 2, 3, 5, 8 or 12).
        name: how messages name the layer, e.g. "conv 3 (major layer 2, sublayer 1)".
        major: 0-based major layer, or None when the caller has no major layers (no mask_bits advice).
    """
    in_channels: int
    out_channels: int
    in_height: int
    in_width: int
    out_height: int
    out_width: int
    mask_bits: int
    name: str = ""
    major: Optional[int] = None

    @property
    def input_values(self) -> int:
        """in_channels x in_height x in_width."""
        return self.in_channels * self.in_height * self.in_width

    @property
    def output_values(self) -> int:
        """out_channels x out_height x out_width."""
        return self.out_channels * self.out_height * self.out_width

    @property
    def io_values(self) -> int:
        """Input plus output, in feature-map values: what the per-layer limit bounds."""
        return self.input_values + self.output_values

    @property
    def coefficients(self) -> Fraction:
        """in_channels x out_channels / coefficient_divisor(mask_bits), in coefficient units (one 8-bit
        3x3 kernel = 1)."""
        return Fraction(self.in_channels * self.out_channels, coefficient_divisor(self.mask_bits))


@dataclass(frozen=True)
class MemoryReport:
    """The two amounts of a layer list against a chip's limits.

    Attributes:
        layers: the layers counted.
        largest_io: the largest input + output of one layer, in values; largest_layer: its index.
        coefficient_total: the sum of :attr:`MemoryLayer.coefficients`, in coefficient units.
        max_layer_io, max_coef_memory: the chip's limits (None: no limit stated for the chip).
    """
    layers: Sequence[MemoryLayer]
    largest_io: int
    largest_layer: int
    coefficient_total: Fraction
    max_layer_io: Optional[int]
    max_coef_memory: Optional[int]

    @property
    def io_fits(self) -> bool:
        """Every layer's input + output is at most the per-layer limit (or there is none)."""
        return self.max_layer_io is None or self.largest_io <= self.max_layer_io

    @property
    def coefficients_fit(self) -> bool:
        """The coefficient total is below the chip's budget (or there is none)."""
        return self.max_coef_memory is None or self.coefficient_total < self.max_coef_memory

    @property
    def fits(self) -> bool:
        """The layer list fits the chip: both :attr:`io_fits` and :attr:`coefficients_fit`."""
        return self.io_fits and self.coefficients_fit


def fmt(n) -> str:
    """An exact amount with thousands separators (a fraction keeps its exact value: 1,234.5)."""
    n = Fraction(n)
    if n.denominator == 1:
        return f"{int(n):,}"
    return f"{float(n):,.2f}" if n.denominator in (2, 4) else f"{n.numerator:,}/{n.denominator:,}"


def memory_report(layers: Sequence[MemoryLayer], spec: ChipSpec) -> MemoryReport:
    """Each layer's input + output and the coefficient total of ``layers`` against ``spec``'s limits.

    Args:
        layers: the convs in order (see :class:`MemoryLayer` for units).
        spec: the chip (its ``max_layer_io`` and ``max_coef_memory``; None = not checked).
    Returns:
        a MemoryReport (the amounts and the limits; nothing is raised).
    Raises:
        ChipSpecError: an empty list, or a layer with a weight format of unknown size.
    """
    if not layers:
        raise ChipSpecError("no layers to count")
    io = [l.io_values for l in layers]
    largest = max(range(len(io)), key=lambda i: io[i])
    total = sum((l.coefficients for l in layers), Fraction(0))
    return MemoryReport(list(layers), io[largest], largest, total, spec.max_layer_io, spec.max_coef_memory)


def _majors(layers: Sequence[MemoryLayer]) -> Optional[List[int]]:
    """The weight format of each major layer, or None when the layers carry no major layers."""
    if any(l.major is None for l in layers):
        return None
    out: Dict[int, int] = {}
    for l in layers:
        out[int(l.major)] = int(l.mask_bits)
    return [out[m] for m in sorted(out)]


def suggest_mask_bits(layers: Sequence[MemoryLayer], spec: ChipSpec) -> Optional[List[int]]:
    """Weight formats per major layer that fit the coefficient budget, chosen greedily: the widest weight format in use
    is lowered first (8-bit before 3-bit; among equals the major layer with the largest coefficient
    share), one weight format of the chip at a time, until the total is below the budget. Major layers must be
    numbered 0, 1, 2, ... (as GNetDet's and the converter's layers are).

    Returns:
        the mask_bits list, or None (no major layers given, no budget, or no list of the chip's
        weight formats fits).
    """
    weight_formats = _majors(layers)
    if weight_formats is None or spec.max_coef_memory is None:
        return None
    lower = sorted(s for s in spec.weight_formats if s in COEF_DIVISOR)
    bits = list(weight_formats)

    def total(b):
        return sum(Fraction(l.in_channels * l.out_channels, coefficient_divisor(b[l.major])) for l in layers)

    def share(m, b):
        return sum(Fraction(l.in_channels * l.out_channels, coefficient_divisor(b[m])) for l in layers
                   if l.major == m)

    while total(bits) >= spec.max_coef_memory:
        movable = [m for m in range(len(bits)) if any(s < bits[m] and coefficient_divisor(s) >
                                                      coefficient_divisor(bits[m]) for s in lower)]
        if not movable:
            return None
        m = max(movable, key=lambda k: (-coefficient_divisor(bits[k]), share(k, bits), k))
        bits[m] = max(s for s in lower if coefficient_divisor(s) > coefficient_divisor(bits[m]))
    return bits


def check_chip_memory(layers: Sequence[MemoryLayer], spec: ChipSpec, where: str = "",
                      width_fix: str = "a narrower width_mult") -> MemoryReport:
    """Refuse a layer list that breaks ``spec``'s memory limits (docs/chip.md, "Memory limits").

    Per layer: input + output (channels x height x width each, the output after its pool) at most
    ``spec.max_layer_io``. Per chip: the sum over the convs of in x out channels / 4, 2 or 1 (1-/2-bit,
    3-/5-bit, 8-/12-bit kernels) below ``spec.max_coef_memory``. A limit that is None is not checked.

    Args:
        layers: the convs in order (:class:`MemoryLayer`); with ``major`` set the coefficient message
            suggests a mask_bits list.
        spec: the chip.
        where: a prefix for the message (e.g. the checkpoint or config it comes from), or "".
        width_fix: the width advice of the message (e.g. "width_mult 0.5").
    Returns:
        the MemoryReport, when everything fits.
    Raises:
        ChipSpecError: one line naming the layer, the amount against the limit and the fix.
    """
    rep = memory_report(layers, spec)
    pre = f"{where}: " if where else ""
    if not rep.io_fits:
        l = rep.layers[rep.largest_layer]
        raise ChipSpecError(
            f"{pre}{l.name or f'layer {rep.largest_layer + 1}'}: input {l.in_channels}x{l.in_height}x{l.in_width} + "
            f"output {l.out_channels}x{l.out_height}x{l.out_width} = {fmt(l.io_values)} feature-map values, over "
            f"chip {spec.name}'s per-layer limit of {fmt(spec.max_layer_io)}: use {width_fix} or a smaller "
            f"image_size")
    if not rep.coefficients_fit:
        run, at = Fraction(0), len(rep.layers) - 1
        for i, l in enumerate(rep.layers):
            run += l.coefficients
            if run >= spec.max_coef_memory:
                at = i
                break
        l = rep.layers[at]
        weight_formats, bits = _majors(rep.layers), suggest_mask_bits(rep.layers, spec)
        eight = sum(1 for s in (weight_formats or []) if coefficient_divisor(s) == 1)
        advice = (f"mask_bits {bits} ({'fewer 8-bit major layers' if eight else 'narrower kernels'}) or {width_fix}"
                  if bits is not None else width_fix)
        raise ChipSpecError(
            f"{pre}coefficient memory {fmt(rep.coefficient_total)}"
            + (f" with mask_bits {weight_formats}" if weight_formats is not None else "")
            + f" is not below chip {spec.name}'s budget of {fmt(spec.max_coef_memory)} (sum of in x out channels / 4 "
            f"for 1-bit, / 2 for 3-bit, / 1 for 8-bit kernels; the running sum reaches it at "
            f"{l.name or f'layer {at + 1}'}): use " + advice)
    return rep


def chip_layers_memory(layers, input_size: int, used_out: Optional[int] = None) -> List[MemoryLayer]:
    """MemoryLayers of a converted chip model's layers (gnetmdk.chip.model_file.ChipLayer: channels as
    stored, ``input_size`` per sublayer, ``pool_after``, ``weight_format``, ``major``, ``index_in_major``).

    Args:
        layers: the ChipLayers in order.
        input_size: the network's input side in pixels (for the first layer when a layer lacks one).
        used_out: the last layer's output channels that carry outputs (``10 + C`` of a GNetDet), counted
            instead of its stored (zero-padded) count; None: as stored.
    """
    out, size = [], int(input_size)
    for i, l in enumerate(layers):
        size = int(getattr(l, "input_size", size))
        o = size // 2 if l.pool_after else size
        cout = int(l.out_channels) if used_out is None or i < len(layers) - 1 else min(int(used_out), int(l.out_channels))
        out.append(MemoryLayer(int(l.in_channels), cout, size, size, o, o, int(l.weight_format),
                               f"conv {i + 1} (major layer {l.major + 1}, sublayer {l.index_in_major + 1})",
                               int(l.major)))
        size = o
    return out


def memory_note(cm) -> str:
    """One line when a chip model (gnetmdk.chip.model_file.ChipModel) fits its chip's coefficient
    budget counted with the output layer's used channels but not with its zero filters (the reading
    docs/chip.md, "Memory limits", leaves open), else "".
    """
    from gnetmdk.gti.spec import get_chip_spec
    spec = get_chip_spec(cm.chip)
    if spec.max_coef_memory is None:
        return ""
    used = memory_report(chip_layers_memory(cm.layers, cm.input_size, used_out=cm.used_channels), spec)
    padded = memory_report(chip_layers_memory(cm.layers, cm.input_size), spec)
    if not used.fits or padded.fits:
        return ""
    return (f"chip {spec.name} memory: coefficient memory {fmt(used.coefficient_total)} is below the budget of "
            f"{fmt(spec.max_coef_memory)}, but {fmt(padded.coefficient_total)} if the output layer's zero filters "
            "count; GTI's own GNetDet-448 for this chip is in the same case (docs/chip.md, \"Memory limits\")")
