"""GNetDet's config section (``cfg.gnetdet``): the chip model, its quantization, calibration, loss and
data augmentation. Plain typed fields, no torch (read by the config system at start-up).

In configs.py::

    class Config(BaseConfig):
        gnetdet = dict(score_head="logit", l_noobj=0.05, mask_bits=[8, 3, 3, 3, 3, 8])

On the command line: ``gnetdet.l_noobj 0.05``, or ``l_noobj 0.05`` while the config's model is a
GNetDet (a section's field may be written without its section's name when the run's model family
has it; gnetmdk.config.overrides).
"""
from __future__ import annotations

import math
from typing import List

from gnetmdk.config.base import ConfigError, ConfigSection, register_section


class GNetDetConfig(ConfigSection):
    """GNetDet's fields (docs/quantization.md, "GNetDet on the chip"; docs/pipeline.md)."""

    # ---------------------------------------------------------------- model and chip
    width_mult: float = 1.0                 # channel multiplier; widths rounded to powers of 2
    head_width_mult: float = 0.0            # the last major layer's hidden convs (the head): their own
                                            # multiplier; 0 = width_mult (docs/pipeline.md "The head's width")
    use_bn: bool = True                     # BatchNorm in step 1 (folded into the conv on entry to step 2)
    step2_bn: str = "fold"                  # "fold": BatchNorm folded on entry to step 2 | "keep": step 2 trains
                                            # with it, quantizing the folded weights; folded on entry to cal
                                            # (docs/quantization.md "BatchNorm kept through step 2")
    step3_bn: str = "fold"                  # "keep" (with step2_bn keep): cal and step 3 keep it too, folded on
                                            # entry to step 4 (docs/quantization.md "BatchNorm kept through step 3")
    step3_bn_freeze: int = 0                # with step3_bn keep: step 3's epochs on batch statistics; later epochs
                                            # normalize with the running statistics, frozen (0 = never freeze)
    chip: str = "5801"                      # 2801, 2803 or 5801
    output_bits: int = 5                    # the output layer's activations: 5-bit codes, or 10 (the chip's 10-bit
                                            # output: the output conv in a major layer of its own; GNetDet-224 on
                                            # the 5801; docs/quantization.md "The 10-bit output mode")
    mask_bits: List[int] = []               # weight format per major layer; [] = chip default (docs/quantization.md)
    weight_scale: str = "mse"               # "mse": MSE-best d per kernel; "gti": d = mean|w|/4 (GTI's rule)
    cap_percentile: float = 99.0            # calibration: per-batch percentile of the pre-ReLU values
    output_cap_percentile: float = 100.0    # the same for the output layer (100 = max: scores keep their order)
    cap_method: str = "mse"                 # calibration: mse (5-bit MSE-best cap per layer) | percentile (GTI)
                                            # | output (mse, then a search against the network's output error)
    output_cap_max: float = -1.0            # calibration: the output layer's cap at most this; 0 = as measured;
                                            # -1 = a rule: the top of the trained output range times 2
                                            # (linear size head) or 1.25 (log size head) (output_cap_limit)
    equalize: float = 0.0                   # calibration: equalize the channels' ranges first, exponent in [0, 1]
                                            # (0 = off; docs/quantization.md "Range equalization")
    equalize_max_scale: float = 8.0         # ... the largest factor a channel is scaled by
    bias_correct: bool = False              # calibration: then shift each conv's bias so that its channels' mean
                                            # where active matches the float activations' (docs/quantization.md
                                            # "Bias correction")
    gain_aware: bool = True                 # step 3 quantizes weights as gain-edited step 4 holds them
    cap_lr: float = 0.0                     # step 3: learning rate of the activation caps (0 = the calibrated caps stay)

    # ---------------------------------------------------------------- loss (docs/pipeline.md, Loss)
    l_coord: float = 5.0
    l_noobj: float = 0.005
    l_class: float = 1.0
    score_loss: str = "smooth_l1"           # smooth_l1 (GTI) | bce (cross-entropy on the scores)
    score_head: str = "linear"              # linear (GTI: scores = outputs) | logit (scores = sigmoid(out - offset))
    score_offset: float = 4.0               # logit head: score = sigmoid(score_scale * (output - score_offset))
    score_scale: float = 1.0                # logit head: logits per unit of output (keeps outputs near box range)
    l_range: float = 0.0                    # hinge on untrained outputs (empty cells, free slot) above the trained range
    box_slots: int = 2                      # box slots trained per cell: 2 (YOLOv1: the better-IoU slot) | 1 (slot 1 only)
    size_head: str = "linear"               # linear (GTI: w, h outputs = sizes) | log (size = size_min ** (1 - output))
    size_min: float = 1.0 / 64              # log size head: the smallest box, a fraction of the image side

    # ---------------------------------------------------------------- freezing (sublayers)
    finetune: int = 0                       # freeze the first freeze_convs sublayers for this many epochs
    freeze_convs: int = 1                   # ... how many leading sublayers finetune freezes
    freeze_at: int = 0                      # leading sublayers frozen for the whole run (not optimized)

    # ---------------------------------------------------------------- augmentation (gnetmdk.dataset.dataset)
    hsv_gain: List[float] = [0.015, 0.5, 0.3]
    scale_range: List[float] = [0.75, 1.25]
    shift_fraction: float = 0.15
    flip_prob: float = 0.5
    blur_prob: float = 0.1
    mosaic_prob: float = 0.0                # probability of a 4-image mosaic sample (objects keep their scale)
    rotate_prob: float = 0.0                # probability of a 90/180/270-degree turn (data seen from above)


register_section("gnetdet", GNetDetConfig)


def check_gnetdet_config(cfg) -> None:
    """Refuse GNetDet values out of range, naming the field (``gnetdet.<field>``) and the allowed values.

    Raises:
        ConfigError
    """
    from gnetmdk.gti.spec import get_chip_spec  # the chip table lives with the chip
    g = cfg.gnetdet

    def bad(field: str, msg: str) -> None:
        raise ConfigError(f"config field 'gnetdet.{field}' = {getattr(g, field)!r}: {msg}")

    if not 0 < g.cap_percentile <= 100:
        bad("cap_percentile", "must be in (0, 100]")
    if not 0 < g.output_cap_percentile <= 100:
        bad("output_cap_percentile", "must be in (0, 100]")
    if not (math.isfinite(g.output_cap_max) and (g.output_cap_max >= 0 or g.output_cap_max == -1)):
        bad("output_cap_max", "must be a finite number >= 0 (0: the output layer's cap as calibrated) or -1 "
                              "(a rule: the top of the trained output range times 2, or 1.25 with the log size head)")
    if not (math.isfinite(g.equalize) and 0 <= g.equalize <= 1):
        bad("equalize", "must be in [0, 1] (0: no range equalization before calibration; 0.5: halfway, in log scale)")
    if not (math.isfinite(g.equalize_max_scale) and g.equalize_max_scale >= 1):
        bad("equalize_max_scale", "must be a finite number >= 1")
    if g.cap_method not in ("percentile", "mse", "output"):
        bad("cap_method", "must be 'percentile' (GTI), 'mse' or 'output'")
    if not (math.isfinite(g.cap_lr) and g.cap_lr >= 0):
        bad("cap_lr", "must be a finite number >= 0 (0: the calibrated caps stay fixed in step 3)")
    if g.cap_lr > 0 and not g.gain_aware:
        bad("cap_lr", "learned caps need gain_aware true (the caps reach the loss through the gains); "
                      "set cap_lr 0 or gain_aware true")
    if g.step2_bn not in ("fold", "keep"):
        bad("step2_bn", "must be 'fold' (BatchNorm folded on entry to step 2) or 'keep' (folded on entry to cal)")
    if g.step2_bn == "keep" and getattr(cfg, "inplace_abn", False):
        bad("step2_bn", "'keep' trains step 2 through the sublayer's own conv + BatchNorm, which in-place "
                        "activated BatchNorm replaces: set inplace_abn false or step2_bn 'fold'")
    if g.step3_bn not in ("fold", "keep"):
        bad("step3_bn", "must be 'fold' (BatchNorm folded by the cal stage at the latest) or 'keep' (folded on "
                        "entry to step 4)")
    if g.step3_bn == "keep":
        if g.step2_bn != "keep":
            bad("step3_bn", "'keep' needs step2_bn 'keep' (a BatchNorm folded in step 2 cannot come back)")
        for field, on in (("equalize", g.equalize > 0), ("bias_correct", g.bias_correct), ("cap_lr", g.cap_lr > 0)):
            if on:
                bad("step3_bn", f"'keep' does not combine with {field} (it edits or trains folded convs): set "
                                f"{field} off or step3_bn 'fold'")
    if isinstance(g.step3_bn_freeze, bool) or not isinstance(g.step3_bn_freeze, int) or g.step3_bn_freeze < 0:
        bad("step3_bn_freeze", "must be an integer >= 0 (step 3's epochs on batch statistics before the BatchNorm "
                               "statistics freeze; 0: never)")
    if g.step3_bn_freeze > 0 and g.step3_bn != "keep":
        bad("step3_bn_freeze", "freezes the BatchNorm statistics that step3_bn 'keep' trains step 3 with: set "
                               "step3_bn 'keep' (and step2_bn 'keep'), or step3_bn_freeze 0")
    if g.weight_scale not in ("gti", "mse"):
        bad("weight_scale", "must be 'gti' or 'mse'")
    if isinstance(g.output_bits, bool) or g.output_bits not in (5, 10):
        bad("output_bits", "must be 5 (the chip's 5-bit codes) or 10 (its 10-bit output mode, last layer only)")
    from .head import check_score_head, check_size_head
    try:
        check_score_head(g.score_head, g.score_scale, g.box_slots)
    except ConfigError as exc:
        raise ConfigError(f"config section 'gnetdet': {exc}") from None
    try:
        check_size_head(g.size_head, g.size_min)
    except ConfigError as exc:
        raise ConfigError(f"config section 'gnetdet': {exc}") from None
    for name in ("l_coord", "l_noobj", "l_class", "l_range"):
        if not (math.isfinite(getattr(g, name)) and getattr(g, name) >= 0):
            bad(name, "a loss weight must be a finite number >= 0")
    if g.score_loss not in ("smooth_l1", "bce"):
        bad("score_loss", "must be smooth_l1 or bce")
    for name in ("flip_prob", "blur_prob", "mosaic_prob", "rotate_prob"):
        if not 0 <= getattr(g, name) <= 1:
            bad(name, "a probability must be in [0, 1]")
    for name in ("finetune", "freeze_convs", "freeze_at"):
        if getattr(g, name) < 0:
            bad(name, "must be >= 0")
    if not (math.isfinite(g.width_mult) and g.width_mult > 0):
        bad("width_mult", "must be a finite number above 0")
    if not (math.isfinite(g.head_width_mult) and g.head_width_mult >= 0):
        bad("head_width_mult", "must be a finite number >= 0 (0: the head at width_mult)")
    spec = get_chip_spec(str(g.chip))  # raises ChipSpecError (a ConfigError) for unknown chips
    if cfg.image_size not in spec.input_sizes:
        raise ConfigError(f"config field 'image_size' = {cfg.image_size!r}: chip {g.chip} accepts input sizes "
                          f"{list(spec.input_sizes)}")
    for i, bits in enumerate(g.mask_bits):
        if bits not in spec.weight_formats:
            bad("mask_bits", f"major layer {i + 1} asks for weight format {bits}, chip {g.chip} has "
                             f"{sorted(spec.weight_formats)}")
    if g.mask_bits and cfg.image_size in (224, 448):
        from gnetmdk.models.gnetdet.model import gnetdet_table
        majors = len(gnetdet_table(cfg.image_size, int(g.output_bits)))
        if len(g.mask_bits) != majors:
            alone = (" (output_bits 10 puts the output conv in a major layer of its own; for the 5-bit layout's "
                     "list add the last format once more)") if int(g.output_bits) == 10 else ""
            bad("mask_bits", f"GNetDet-{cfg.image_size} has {majors} major layers{alone}: give one weight format per "
                f"major layer, or [] for the chip's default")
    if cfg.image_size in (224, 448):
        if int(g.output_bits) == 10:
            from gnetmdk.models.gnetdet.model import ChipLimitError, check_chip_limits, gnetdet_layers
            layers = gnetdet_layers(cfg.image_size, cfg.num_classes, float(g.width_mult), str(g.chip),
                                    list(g.mask_bits), float(g.head_width_mult), 10)
            try:
                check_chip_limits(layers, spec, cfg.image_size, 10)
            except ChipLimitError as exc:
                bad("output_bits", f"GNetDet-{cfg.image_size} on chip {spec.name}: {exc}")
        check_gnetdet_memory(cfg.image_size, cfg.num_classes, float(g.width_mult), str(g.chip), list(g.mask_bits),
                             "config section 'gnetdet'", float(g.head_width_mult), int(g.output_bits))


def check_gnetdet_memory(image_size: int, num_classes: int, width_mult: float, chip: str, mask_bits, where: str = "",
                         head_width_mult: float = 0.0, output_bits: int = 5):
    """Refuse a GNetDet that breaks its chip's memory limits (per-layer input + output in feature-map
    values, coefficient memory in 8-bit-kernel units; gnetmdk.gti.memory, docs/chip.md "Memory limits"),
    counted with the output layer's used channels (``10 + C``): over by that count, it is over by every
    reading of GTI's rule. Over only when the output layer's zero filters count too is not refused (GTI's
    own 5801 GNetDet-448 lies there): :func:`gnetdet_memory_note` says so.

    Args:
        image_size: 224 or 448 (pixels); num_classes: C; width_mult, chip: as the gnetdet section;
        mask_bits: the weight formats per major layer ([] = the chip's default).
        where: a prefix naming the source of the model in the message.
        head_width_mult: the head's multiplier (0 = width_mult; gnetmdk.models.gnetdet.model.gnetdet_layers).
        output_bits: 5, or 10 (the output conv in a major layer of its own).
    Returns:
        the gnetmdk.gti.memory.MemoryReport, when the model fits.
    Raises:
        ChipSpecError (a ConfigError): one line naming the layer, the amount against the limit, and the
        fix (a mask_bits list with fewer 8-bit major layers, or the widest width_mult that fits).
    """
    from gnetmdk.gti.memory import check_chip_memory, memory_report
    from gnetmdk.gti.spec import get_chip_spec
    from gnetmdk.models.gnetdet.model import gnetdet_layers, gnetdet_memory_layers, major_weight_formats
    spec = get_chip_spec(chip)
    specs = gnetdet_layers(image_size, num_classes, width_mult, chip, mask_bits, head_width_mult, output_bits)
    layers = gnetdet_memory_layers(specs, image_size, chip, padded=False)
    width_fix = "a narrower width_mult"
    if not memory_report(layers, spec).fits:
        w, h = width_mult, head_width_mult
        for _ in range(8):                          # halve the widths until the model fits (widths are powers of 2)
            w, h = w / 2, h / 2
            narrow = gnetdet_layers(image_size, num_classes, w, chip, major_weight_formats(specs), h, output_bits)
            if memory_report(gnetdet_memory_layers(narrow, image_size, chip, padded=False), spec).fits:
                width_fix = f"width_mult {w:g}" + (f" and head_width_mult {h:g}" if head_width_mult > 0 else "")
                break
    head = f", head_width_mult {head_width_mult:g}" if head_width_mult > 0 else ""
    shown = f"{where} (GNetDet-{image_size}, width_mult {width_mult:g}{head}, chip {spec.name}" + (
        ", mask_bits [] = the chip default" if not mask_bits else "") + ")"
    return check_chip_memory(layers, spec, shown if where else "", width_fix)


def gnetdet_memory_note(image_size: int, num_classes: int, width_mult: float, chip: str, mask_bits,
                        head_width_mult: float = 0.0, output_bits: int = 5) -> str:
    """One line when a GNetDet fits its chip's coefficient budget counted with the output layer's used
    channels but not with its zero filters (the reading docs/chip.md leaves open; GTI's own 5801
    GNetDet-448 is such a model), else "".

    Args: as :func:`check_gnetdet_memory`.
    """
    from gnetmdk.gti.memory import fmt, memory_report
    from gnetmdk.gti.spec import get_chip_spec
    from gnetmdk.models.gnetdet.model import gnetdet_layers, gnetdet_memory_layers, major_weight_formats
    spec = get_chip_spec(chip)
    if spec.max_coef_memory is None or image_size not in (224, 448):
        return ""
    specs = gnetdet_layers(image_size, num_classes, width_mult, chip, mask_bits, head_width_mult, output_bits)
    used = memory_report(gnetdet_memory_layers(specs, image_size, chip, padded=False), spec)
    padded = memory_report(gnetdet_memory_layers(specs, image_size, chip, padded=True), spec)
    if not used.fits or padded.fits:
        return ""
    return (f"chip {spec.name} memory: coefficient memory {fmt(used.coefficient_total)} with mask_bits "
            f"{major_weight_formats(specs)} is below the budget of {fmt(spec.max_coef_memory)}, but "
            f"{fmt(padded.coefficient_total)} if the output layer's zero filters count; GTI's own GNetDet-448 for "
            f"this chip is in the same case (docs/chip.md, \"Memory limits\"); fewer 8-bit major layers leave no doubt")
