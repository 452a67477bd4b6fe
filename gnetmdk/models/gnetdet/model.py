"""GNetDet: the chip-friendly VGG-style detector (docs/quantization.md, "GNetDet on the chip"; arXiv 2103.15756).

The network is a flat list of sublayers (3x3 conv [+ BN] + capped ReLU) grouped into major layers;
a major layer may end in a 2x2/2 max pool. Output: (N, S, S, 10 + C) with S = 14, each cell holding
two boxes [x, y, w, h, conf] (x, y in cell units inside the cell, w, h relative to the image) and C
class scores.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from gnetmdk.config.base import ConfigError
from gnetmdk.gti.quantize import ACT_MAX, five_bit_cap, max_code, quantize_conv_params
from gnetmdk.gti.spec import ChipSpec, get_chip_spec, register_bits
from gnetmdk.gti.transforms import folded_conv_params
from gnetmdk.layers.quant import QConv2d, QReLU, quantize_convs
from gnetmdk.layers.pool import max_pool_2x2
from gnetmdk.layers.units import ConvBNQReLU


class ChipLimitError(ConfigError):
    """The model breaks a limit of the chosen chip; the message names the layer and the limit."""


# full-width layer lists: (channels of the sublayers, pool at the end); "OUT" = 10 + C
GNETDET_448: List[Tuple[List[object], bool]] = [
    ([64], True), ([64], True), ([128, 128], True), ([256, 256, 256], True), ([256, 256, 256], True),
    ([256, 256, 256], False), ([256, 256, "OUT"], False)]
# 224 input drops the first pool; the first two convs then share one resolution and one major layer
GNETDET_224: List[Tuple[List[object], bool]] = [
    ([64, 64], True), ([128, 128], True), ([256, 256, 256], True), ([256, 256, 256], True),
    ([256, 256, 256], False), ([256, 256, "OUT"], False)]

DEFAULT_WEIGHT_FORMATS = {"5801": (3, 8), "2801": (3, 3), "2803": (5, 12)}   # (first major layers, last one)


def _pow2(c: float) -> int:
    return int(2 ** round(math.log2(max(c, 1.0))))


@dataclass
class LayerSpec:
    """One sublayer: its major layer (0-based), channels, weight format, and whether a pool follows it."""
    major: int
    index_in_major: int
    in_channels: int
    out_channels: int
    weight_format: int
    pool_after: bool


def gnetdet_table(image_size: int, output_bits: int = 5) -> List[Tuple[List[object], bool]]:
    """The full-width major layers of GNetDet at ``image_size`` (GNETDET_224 or GNETDET_448): with
    ``output_bits`` 10 the output conv is taken out of the last major layer into one of its own (the
    chip's 10-bit output needs a last major layer of a single sublayer; docs/quantization.md, "The
    10-bit output mode"), one major layer more.

    Raises:
        ChipLimitError: an input size other than 224 or 448, or ``output_bits`` other than 5 or 10.
    """
    if image_size == 448:
        table = list(GNETDET_448)
    elif image_size == 224:
        table = list(GNETDET_224)
    else:
        raise ChipLimitError(f"GNetDet is defined for image_size 224 or 448, not {image_size}")
    if output_bits == 10:
        chans, pool = table[-1]
        table[-1:] = [(list(chans[:-1]), pool), ([chans[-1]], False)]
    elif output_bits != 5:
        raise ChipLimitError(f"output_bits {output_bits!r}: the chip's output layer has 5-bit or 10-bit codes")
    return table


def gnetdet_layers(image_size: int, num_classes: int, width_mult: float = 1.0, chip: str = "5801",
                   mask_bits: Sequence[int] = (), head_width_mult: float = 0.0,
                   output_bits: int = 5) -> List[LayerSpec]:
    """Expand the GNetDet layer list for an input size, class count, width multiplier and chip.

    Hidden widths are ``width * width_mult`` rounded to a power of 2 (at least the chip's minimum,
    at most its maximum); the hidden sublayers of the head (the convs before the output conv in its
    major layer, or in the major layer before it with ``output_bits`` 10) take ``head_width_mult``
    instead where it is above 0 (docs/pipeline.md, "The head's width"); the last conv has
    10 + num_classes outputs. With ``output_bits`` 10 the output conv is a major layer of its own
    (:func:`gnetdet_table`), and the chip's default weight formats give it the head's format.

    Raises:
        ChipLimitError: unsupported input size or output_bits, or ``mask_bits`` whose length is not the
        number of major layers, or a weight format the chip lacks.
    """
    spec = get_chip_spec(chip)
    table = gnetdet_table(image_size, output_bits)
    n_major = len(table)
    head = n_major - 1 if output_bits == 5 else n_major - 2
    if mask_bits:
        if len(mask_bits) != n_major:
            alone = " (the output conv in a major layer of its own: output_bits 10)" if output_bits == 10 else ""
            raise ChipLimitError(f"mask_bits has {len(mask_bits)} entries but GNetDet-{image_size} has "
                                 f"{n_major} major layers{alone}: give one weight format per major layer")
        weight_formats = [int(b) for b in mask_bits]
    else:
        first, last = DEFAULT_WEIGHT_FORMATS[spec.name]
        weight_formats = [first] * head + [last] * (n_major - head)
    layers: List[LayerSpec] = []
    cin = 3
    for m, (chans, pool) in enumerate(table):
        mult = head_width_mult if (m == head and head_width_mult > 0) else width_mult
        for j, c in enumerate(chans):
            if c == "OUT":
                cout = 10 + num_classes
            else:
                cout = min(spec.max_channels, max(spec.min_channels, _pow2(float(c) * mult)))
            layers.append(LayerSpec(m, j, cin, cout, weight_formats[m], pool and j == len(chans) - 1))
            cin = cout
    return layers


def major_weight_formats(layers: Sequence[LayerSpec]) -> List[int]:
    """The weight format of each major layer, in order (the ``mask_bits`` list of a layer list)."""
    out: Dict[int, int] = {}
    for ls in layers:
        out[ls.major] = ls.weight_format
    return [out[m] for m in sorted(out)]


def check_chip_limits(layers: Sequence[LayerSpec], spec: ChipSpec, image_size: int, output_bits: int = 5) -> None:
    """Refuse a layer list the chip cannot run (docs/quantization.md, "Chip limits"); with ``output_bits``
    10, also one whose last major layer has more than one sublayer or ends in a pool (the chip's 10-bit
    output: docs/quantization.md, "The 10-bit output mode").

    Raises:
        ChipLimitError: naming the layer (major.sub, 1-based) and the limit.
    """
    if image_size not in spec.input_sizes:
        raise ChipLimitError(f"input size {image_size} not supported by chip {spec.name} "
                             f"(accepted: {list(spec.input_sizes)})")
    majors = sorted({l.major for l in layers})
    if len(majors) > spec.max_major_layers:
        wide = (" (output_bits 10 puts the output conv in a major layer of its own, which of GNetDet's layouts only "
                "GNetDet-224 on the 5801 has room for: use output_bits 5)") if output_bits == 10 else ""
        raise ChipLimitError(f"{len(majors)} major layers, chip {spec.name} allows at most "
                             f"{spec.max_major_layers}{wide}")
    if output_bits == 10 and layers:
        last = [l for l in layers if l.major == layers[-1].major]
        if len(last) != 1 or last[0].pool_after:
            raise ChipLimitError(f"output_bits 10: the chip's 10-bit output needs a last major layer of one sublayer "
                                 f"without a pool; major layer {layers[-1].major + 1} has {len(last)} sublayer(s)"
                                 + (" and a pool" if last[-1].pool_after else ""))
    for m in majors:
        subs = [l for l in layers if l.major == m]
        if len(subs) > spec.max_sublayers:
            raise ChipLimitError(f"major layer {m + 1} has {len(subs)} sublayers, chip {spec.name} "
                                 f"allows at most {spec.max_sublayers}")
        if len({l.weight_format for l in subs}) != 1:
            raise ChipLimitError(f"major layer {m + 1} mixes weight formats; all its sublayers must share one")
    for n, l in enumerate(layers):
        name = f"conv {n + 1} (major layer {l.major + 1}, sublayer {l.index_in_major + 1})"
        if l.weight_format not in spec.weight_formats:
            raise ChipLimitError(f"{name}: weight format {l.weight_format} not on chip {spec.name} "
                                 f"(has {sorted(spec.weight_formats)})")
        last = n == len(layers) - 1
        if last:
            if l.out_channels > spec.max_output_channels:
                raise ChipLimitError(f"{name}: {l.out_channels} output channels, the last layer of chip "
                                     f"{spec.name} allows at most {spec.max_output_channels} "
                                     f"(GNetDet: at most {spec.max_output_channels - 10} classes)")
        else:
            c = l.out_channels
            if c & (c - 1) or not spec.min_channels <= c <= spec.max_channels:
                raise ChipLimitError(f"{name}: {c} output channels; chip {spec.name} needs a power of 2 in "
                                     f"{spec.min_channels}..{spec.max_channels}")


def gnetdet_memory_layers(layers: Sequence[LayerSpec], image_size: int, chip: str = "5801", padded: bool = True):
    """The layer list as the chip's memory holds it (gnetmdk.gti.memory.MemoryLayer per conv): each conv's
    input and output sides in pixels (the output after its pool), and the last conv's ``10 + C`` outputs,
    padded as the converter pads them when ``padded`` (to the width of the other sublayers of the last
    major layer; with none, the next power of 2, at least the chip's minimum; never below ``10 + C``;
    gnetmdk.chip.convert.padded_output_channels), else as used. The image's 3 channels count as 3.
    Which of the two counts the chip applies is not settled (docs/chip.md, "Memory limits").

    Args:
        layers: from :func:`gnetdet_layers`.
        image_size: the input side in pixels.
        chip: the chip whose minimum channel count applies to the padding.
        padded: count the output layer's zero filters.
    Returns:
        List[MemoryLayer], for gnetmdk.gti.memory.check_chip_memory (docs/chip.md, "Memory limits").
    """
    from gnetmdk.gti.memory import MemoryLayer
    spec = get_chip_spec(chip)
    out, size = [], int(image_size)
    for n, l in enumerate(layers):
        cout = l.out_channels
        if n == len(layers) - 1 and padded:
            others = [o.out_channels for o in layers[:-1] if o.major == l.major]
            width = others[-1] if others else max(1 << max(0, math.ceil(math.log2(max(cout, 1)))), spec.min_channels)
            cout = max(cout, width)
        o = size // 2 if l.pool_after else size
        out.append(MemoryLayer(l.in_channels, cout, size, size, o, o, l.weight_format,
                               f"conv {n + 1} (major layer {l.major + 1}, sublayer {l.index_in_major + 1})", l.major))
        size = o
    return out


class Sublayer(ConvBNQReLU):
    """conv (QConv2d) -> optional BatchNorm2d -> capped ReLU (QReLU); pool handled by the parent."""

    def __init__(self, ls: LayerSpec, chip: str, use_bn: bool, method: str, percentile: float, codes: int = ACT_MAX):
        super().__init__()
        bw, bb = register_bits(chip, ls.weight_format)
        self.conv = QConv2d(ls.in_channels, ls.out_channels, ls.weight_format, bw, bb, method)
        self.bn: Optional[nn.BatchNorm2d] = nn.BatchNorm2d(ls.out_channels) if use_bn else None
        self.relu = QReLU(percentile, codes)
        self.pool_after = ls.pool_after
        self.major = ls.major

    #: set by gnetmdk.layers.stem.convert_recompute_stem (config ``recompute_stem``)
    recompute_stem = False

    def stem_ok(self, x: torch.Tensor) -> bool:
        """Whether this forward may take the recomputing stem (gnetmdk.layers.stem): marked, gradients
        wanted, and a float conv -> BatchNorm -> plain ReLU (step 1: no quantized weights, caps,
        calibration or revive)."""
        conv, relu = self.conv, self.relu
        return (self.recompute_stem and self.bn is not None and torch.is_grad_enabled()
                and (x.requires_grad or conv.weight.requires_grad or self.bn.weight is None
                     or self.bn.weight.requires_grad)
                and not conv.fake_quant_enabled and not conv.exact and conv.gain is None
                and not relu.fake_quant_enabled and not relu.observer_enabled and not relu.revive)

    def forward(self, x):
        """conv -> BatchNorm (if any) -> QReLU -> 2x2 max pool (if ``pool_after``); through the
        recomputing stem when :meth:`stem_ok`. (N, C_in, H, W) -> (N, C_out, H', W') float."""
        if self.recompute_stem and self.stem_ok(x):
            from gnetmdk.layers.stem import conv_bn_act
            return conv_bn_act(x, self.conv, self.bn, "relu", pool=self.pool_after)
        if self.bn is not None and self.conv.fake_quant_enabled:
            x = self._quantized_conv_bn(x)        # step 2 with step2_bn "keep"
        else:
            x = self.conv(x)
            if self.bn is not None:
                x = self.bn(x)
        x = self.relu(x)
        if self.pool_after:
            x = max_pool_2x2(x)          # F.max_pool2d's values and gradients, no int64 indices kept
        return x


    def folded_params(self):
        """The conv's weight and bias with this sublayer's BatchNorm folded in, as
        :func:`gnetmdk.gti.transforms.fold_bn` writes them (the same function,
        :func:`gnetmdk.gti.transforms.folded_conv_params`), with gradients to the conv and the
        BatchNorm's affine parameters. Returns (W' (O, I, 3, 3), b' (O,) float32, s = gamma / sigma
        (O,) float64). Raises AttributeError without BatchNorm."""
        return folded_conv_params(self.conv, self.bn)

    def _quantized_conv_bn(self, x: torch.Tensor) -> torch.Tensor:
        """Conv + BatchNorm with the chip's quantizer on the folded weights (``step2_bn "keep"``, and
        ``step3_bn "keep"`` in step 3; docs/quantization.md, "BatchNorm kept through step 2" and "...
        through step 3"): BN folding simulated in training, with the running statistics in the fold
        and the batch's in the normalization, as in Krishnamoorthi 2018 ("Quantizing deep
        convolutional networks for efficient inference: A whitepaper", arXiv:1806.08342) and torch.ao's
        fused ConvBn modules; Jacob et al. 2018 (CVPR, section 3.2) fold the batch's statistics instead.

        Evaluation (the BatchNorm in eval mode): conv(x, q(W'), q(b')) in the conv's precision
        (QConv2d.convolve), which is what the folded model computes after
        :func:`gnetmdk.gti.transforms.fold_bn` with the weights quantized: bit for bit the model the
        next stage starts from once it folds. Training: conv(x, q(W')) / s + b, then the BatchNorm
        with the batch's statistics (and its running statistics updated): the weights see the
        rounding of their folded form while the layer keeps batch normalization.

        With the conv's gain (gain-aware step 3, QConv2d.gain = (cap_in, cap_out)) x holds codes
        0..31 and q(W'), q(b') are the gain-edited folded weights (QConv2d.quantized_params), so the
        evaluation is the gain-edited step-4 layer's, in pre-activation codes. In training the
        convolution's codes are taken back to values (times cap_out / 31, the inverse of the gain on
        the weights, since x = a 31 / cap_in), normalized as above, and returned in codes (times 31 /
        cap_out) for the code-domain ReLU.
        (N, C_in, H, W) -> (N, C_out, H, W) float32 (autocast off, as every quantized conv; float64
        where the exact evaluation needs it).
        """
        if torch.is_autocast_enabled(x.device.type):
            with torch.autocast(x.device.type, enabled=False):
                return self._quantized_conv_bn(x.float())
        conv = self.conv
        w, b, s = self.folded_params()
        w_q, b_q, shift = conv.quantized_params(w, b)
        if not self.bn.training:
            return conv.convolve(x, w_q, b_q, shift)
        z = F.conv2d(x, w_q, None, 1, 1)
        if conv.gain is not None:
            z = z * (float(conv.gain[1]) / ACT_MAX)
        y = self.bn(z / s.to(x.dtype).view(1, -1, 1, 1) + conv.bias.view(1, -1, 1, 1))
        if conv.gain is not None:
            y = y * (ACT_MAX / float(conv.gain[1]))
        return y


class GNetDet(nn.Module):
    """The GNetDet detector.

    Args:
        num_classes: C.
        image_size: 224 or 448 (input is (N, 3, image_size, image_size) float, 5-bit chip codes 0..31, BGR).
        width_mult: channel multiplier (0.25 gives widths 16..64, a CPU-trainable model).
        head_width_mult: the channel multiplier of the last major layer's hidden sublayers (the head);
            0 = ``width_mult`` (see :func:`gnetdet_layers`).
        use_bn: BatchNorm after each hidden conv (step 1 only; folded on entry to step 2).
        chip: "2801", "2803" or "5801"; mask_bits: weight format per major layer ([] = chip default).
        weight_scale: "gti" or "mse"; cap_percentile: calibration percentile (hidden layers);
        output_cap_percentile: the output layer's (100 = max, so the largest scores are not clipped).
        l_coord, l_noobj, l_class, l_range: loss weights; score_loss: "smooth_l1" or "bce"; box_slots: 1 or 2
            box slots trained per cell (training only; the output keeps two slots) (gnetmdk.models.gnetdet.loss).
        score_head: "linear" (GTI: scores are the outputs) or "logit" (scores are sigmoid(output -
            score_offset), applied on the host; see gnetmdk.models.gnetdet.head.output_scores); score_scale:
            the logit head's k in sigmoid(k (output - score_offset)).
        size_head, size_min: how the w, h outputs give box sizes: "linear" (GTI: the outputs are the sizes)
            or "log" (size_min ** (1 - output), applied on the host; gnetmdk.models.gnetdet.head.output_sizes).
        gain_aware: in step 3 (quantized weights, capped 5-bit activations) compute as the gain-edited
            step-4 model does: each conv's weights and bias quantized as gain editing will leave them
            (QConv2d.gain), integer codes between the layers (QReLU.code_domain) and the host scale
            cap_last / 31 on the output, so step 3's outputs equal step 4's bit for bit (in eval
            mode; training to float32 rounding) and step 4 starts from exactly the model step 3
            chose; False: GTI's flow (step 4 re-quantizes the
            gain-edited weights at new shifts, which changed 15-50% of the codes on raccoon). The
            constructor's default is False (a checkpoint from before the option rebuilds as it was
            trained); BaseConfig.gain_aware, which training uses, is True.
        output_bits: 5 (the chip's 5-bit codes everywhere) or 10: the output layer's activations on 1023
            steps of cap / 1023, the output conv in a major layer of its own (the chip's 10-bit output
            mode, GTI's "ten_bits_enable"; docs/quantization.md, "The 10-bit output mode"); below, "31"
            of the output layer reads 1023.

    Raises:
        ChipLimitError: the layer list breaks a limit of ``chip``.

    ``forward`` returns (N, S, S, 10 + C) float predictions (S = 14); in step 4 and gain-aware step 3
    it multiplies the output codes by cap_last / 31 (the host-side rescale), so loss and decode never
    change.
    """

    def __init__(self, num_classes: int, image_size: int = 448, width_mult: float = 1.0, use_bn: bool = True,
                 chip: str = "5801", mask_bits: Sequence[int] = (), weight_scale: str = "gti",
                 cap_percentile: float = 99.0, l_coord: float = 5.0, l_noobj: float = 0.005,
                 l_class: float = 1.0, score_loss: str = "smooth_l1", score_head: str = "linear",
                 score_offset: float = 4.0, output_cap_percentile: float = 100.0, channels_last: bool = False,
                 score_scale: float = 1.0, l_range: float = 0.0, gain_aware: bool = False, box_slots: int = 2,
                 size_head: str = "linear", size_min: float = 1.0 / 64, head_width_mult: float = 0.0,
                 output_bits: int = 5):
        super().__init__()
        self.gain_aware = bool(gain_aware)
        self.output_bits = int(output_bits)
        self.num_classes = int(num_classes)
        self.image_size = int(image_size)
        self.width_mult = float(width_mult)
        self.head_width_mult = float(head_width_mult)
        self.chip = str(chip)
        self.grid_size = 14
        self.specs = gnetdet_layers(image_size, num_classes, width_mult, chip, mask_bits, self.head_width_mult,
                                    self.output_bits)
        check_chip_limits(self.specs, get_chip_spec(chip), image_size, self.output_bits)
        n = len(self.specs)
        self.layers = nn.ModuleList(
            Sublayer(ls, chip, use_bn and i < n - 1, weight_scale,
                     cap_percentile if i < n - 1 else output_cap_percentile,
                     ACT_MAX if i < n - 1 else max_code(self.output_bits)) for i, ls in enumerate(self.specs))
        # the output layer's ReLU lets object-cell gradients through below 0 (training only; the
        # forward value, and so the chip, is unchanged)
        self.layers[-1].relu.revive = True
        from .head import check_score_head, check_size_head
        check_score_head(score_head, score_scale, box_slots)
        self.score_head = score_head
        self.score_offset = float(score_offset)
        self.score_scale = float(score_scale)
        check_size_head(size_head, size_min)
        self.size_head = str(size_head)
        self.size_min = float(size_min)
        self.loss_weights = dict(l_coord=l_coord, l_noobj=l_noobj, l_class=l_class, score_loss=score_loss,
                                 score_head=score_head, score_offset=self.score_offset,
                                 score_scale=self.score_scale, l_range=float(l_range), box_slots=int(box_slots),
                                 size_head=self.size_head, size_min=self.size_min)
        self.channels_last = channels_last
        self.register_buffer("output_scale", torch.ones((), dtype=torch.float32))
        #: step 4: evaluate in float64 so every code equals the chip's integer result
        self.exact_eval = False
        #: gain-aware step 3: cap_last / 31 (set_gains), else None
        self._code_output_scale: Optional[torch.Tensor] = None
        self._code_scale_learned = False

    #: quantize all convs' weights in one pass per forward (gnetmdk.layers.quant.quantize_convs): the
    #: same values and gradients as each conv's own pass, in a fixed number of operations (kernel
    #: launches on an accelerator). None (default): one pass on accelerators, per conv on a CPU, where
    #: launches cost nothing and one pass over every kernel was not faster (its (K, 1) per-row scales
    #: broadcast over rows of 9 values, and its temporaries outgrow the cache: 0.8-2.7x the per-conv
    #: time, docs/training.md); True / False force either.
    batch_weight_quant: Optional[bool] = None

    def train(self, mode: bool = True):
        """Switch train/eval; in eval with ``exact_eval`` the convs compute in float64 (bit-exact)."""
        super().train(mode)
        for conv in self.convs():
            conv.exact = (not mode) and self.exact_eval
        return self

    # ------------------------------------------------------------------ interface
    @property
    def has_bn(self) -> bool:
        """Whether the sublayers carry BatchNorm (BN not yet folded into the convs)."""
        return any(l.bn is not None for l in self.layers)

    def meta(self) -> Dict[str, object]:
        """What is needed to rebuild this model (stored in every checkpoint)."""
        return {"name": "gnetdet", "num_classes": self.num_classes, "image_size": self.image_size,
                "width_mult": self.width_mult, "head_width_mult": self.head_width_mult,
                "use_bn": self.has_bn, "chip": self.chip,
                "mask_bits": [int(s) for s in self.mask_bits()],
                "weight_scale": self.layers[0].conv.method, "score_head": self.score_head,
                "score_offset": self.score_offset, "score_scale": self.score_scale, "gain_aware": self.gain_aware,
                "size_head": self.size_head, "size_min": self.size_min, "output_bits": self.output_bits}

    def mask_bits(self) -> List[int]:
        """The weight format (mask bits) of each major layer, in order."""
        return major_weight_formats(self.specs)

    def convs(self) -> List[QConv2d]:
        """The QConv2d of every sublayer, in order."""
        return [l.conv for l in self.layers]

    def relus(self) -> List[QReLU]:
        """The QReLU of every sublayer, in order (their caps are the model's activation caps)."""
        return [l.relu for l in self.layers]

    def set_gains(self) -> bool:
        """Give every conv its (cap_in, cap_out) gain and every ReLU ``code_domain`` when the model is
        gain-aware and in step-3 mode (quantized weights, capped 5-bit non-integer activations, every
        cap calibrated); clear them otherwise. The input's cap is 31 (the image holds codes); a 10-bit
        output layer's gain takes gnetmdk.gti.quantize.five_bit_cap of its cap. The output is then
        scaled by cap_last / 31 (float32; cap_last / 1023 for a 10-bit output), the output_scale gain
        editing will store.
        When the caps require gradients (step 3 with ``cap_lr`` > 0) the convs also get them as
        ``gain_tensors`` and the output scale carries their gradient (straight through), so the loss
        reaches every cap: through the gains of the conv before and after it and, for the last one,
        the host scale; the forward values do not change.
        Returns whether gains are set."""
        convs, relus = self.convs(), self.relus()
        on = (self.gain_aware and all(c.fake_quant_enabled for c in convs)
              and all(r.fake_quant_enabled and not r.integer and not r.observer_enabled for r in relus))
        caps = self._cap_values(relus) if on else []
        on = on and all(c > 0 for c in caps)
        learn = on and any(r.cap.requires_grad for r in relus)
        prev, prev_t = 31.0, 31.0
        for i, conv in enumerate(convs):
            codes = relus[i].codes
            conv.gain = (prev, five_bit_cap(caps[i], codes)) if on else None
            conv.gain_tensors = (prev_t, relus[i].cap if codes == ACT_MAX else relus[i].cap * (ACT_MAX / codes)) \
                if learn else None
            relus[i].code_domain = on
            prev = caps[i] if on else prev
            prev_t = relus[i].cap
        # the value fold_requant_multipliers writes into output_scale (a float64 quotient rounded to float32)
        self._code_output_scale = self._cached_scale(five_bit_cap(caps[-1], relus[-1].codes) / 31.0,
                                                     relus[-1].cap.device) if on else None
        self._code_scale_learned = learn     # forward passes the last cap's gradient through that value
        return on

    def _cap_values(self, relus) -> List[float]:
        """The caps as Python floats, read back from their device only when one of them changed since
        the last read (a cap tensor's storage or in-place version counter moved: calibration, loading,
        a learned-cap step): a step-3 forward with fixed caps waits for nothing."""
        key = tuple((id(r.cap), r.cap.data_ptr(), str(r.cap.device), r.cap._version) for r in relus)
        cached = getattr(self, "_caps_cache", None)
        if cached is None or cached[0] != key:
            cached = self._caps_cache = (key, torch.stack([r.cap.detach().float() for r in relus]).tolist())
        return cached[1]

    def _cached_scale(self, value: float, device: torch.device) -> torch.Tensor:
        """0-d float32 tensor of ``value`` on ``device``, copied there once per value."""
        cached = getattr(self, "_scale_cache", None)
        if cached is None or cached[0] != (value, str(device)):
            cached = self._scale_cache = ((value, str(device)),
                                          torch.tensor(value, dtype=torch.float32, device=device))
        return cached[1]

    def features(self, x: torch.Tensor, return_all: bool = False):
        """Run the chain; with ``return_all`` also return every sublayer's output (after pool).

        The outputs are values (steps 1-3 with ``gain_aware`` off) or codes 0..31 (step 4, gain-aware
        step 3), before the host scale that ``forward`` applies."""
        self.set_gains()
        convs = self.convs()
        one_pass = self.batch_weight_quant
        if one_pass is None:
            one_pass = x.device.type != "cpu"
        batched = one_pass and any(getattr(c, "fake_quant_enabled", False) for c in convs)  # a plain Conv2d (the torch.ao peer) has none
        if batched:     # every conv's quantized weights in one pass (bit-equal to each conv's own)
            for conv, params in zip(convs, quantize_convs(convs)):
                conv.batched_params = params
        outs = []
        try:
            for layer in self.layers:
                x = layer(x)
                if return_all:
                    outs.append(x)
        finally:
            if batched:
                for conv in convs:
                    conv.batched_params = None
        return (x, outs) if return_all else x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Predictions for ``x`` (N, 3, H, W) (float, or uint8 codes from a loader): (N, S, S, 10 + C)
        float32, the output codes times the host scale (cap_last / 31) in step 4 and gain-aware step 3."""
        if not x.is_floating_point():           # uint8 codes straight from a loader
            x = x.float()
        if self.channels_last and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        y = self.features(x)
        scale = self._code_output_scale if self._code_output_scale is not None else self.output_scale
        if self._code_output_scale is not None and self._code_scale_learned:
            from gnetmdk.gti.quantize import ste      # learned caps: d scale / d cap_last = 1 / 31 (1 / 1023)
            last = self.layers[-1].relu
            scale = ste(last.cap / float(last.codes), scale.to(last.cap.device))
        y = y * scale.to(device=y.device, dtype=y.dtype)
        return y.permute(0, 2, 3, 1).float().contiguous()

    def loss(self, pred: torch.Tensor, target: torch.Tensor) -> Dict[str, torch.Tensor]:
        """GNetDet loss terms (see gnetmdk.models.gnetdet.loss.gnetdet_loss)."""
        from .loss import gnetdet_loss
        return gnetdet_loss(pred, target, **self.loss_weights)

    def decode(self, pred: torch.Tensor, conf_thresh: float, nms_thresh: float, max_detections: int = 100):
        """Per-image detections (see gnetmdk.models.gnetdet.decode.decode_gnetdet)."""
        from .decode import decode_gnetdet
        from .head import output_head
        return decode_gnetdet(pred, self.num_classes, conf_thresh, nms_thresh, max_detections, **output_head(self))
