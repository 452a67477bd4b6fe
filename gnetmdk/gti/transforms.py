"""Model edits between stages: BN folding (entry to step 2), range equalization (before calibration,
optional) and gain editing (entry to step 4).

Formulas: docs/quantization.md, "BN folding" and "Requantization and gain editing".
"""
from __future__ import annotations

from typing import List

import torch

from gnetmdk.gti.quantize import ACT_MAX, five_bit_cap


def folded_conv_params(conv, bn):
    """The weight and bias of ``conv`` with ``bn`` folded in (docs/quantization.md, "BN folding"):

        s = gamma / sqrt(running_var + eps),   W' = W s,   b' = (b - running_mean) s + beta

    computed in float64 and returned in the conv's dtype, with gradients to the conv's and the
    BatchNorm's parameters (no gradient is taken inside :func:`fold_bn`). The one expression behind
    both :func:`fold_bn` and the BatchNorm-kept step 2 (gnetmdk.models.gnetdet.model.Sublayer), so the
    two give the same bits.

    Args:
        conv: an ``nn.Conv2d`` with bias, weight (O, I, kh, kw).
        bn: an ``nn.BatchNorm2d`` (or subclass) over O channels, with affine parameters.
    Returns:
        (W' (O, I, kh, kw), b' (O,)) in the conv's dtype, and s (O,) float64.
    """
    s = bn.weight.double() / torch.sqrt(bn.running_var.double() + bn.eps)
    w = (conv.weight.double() * s.view(-1, 1, 1, 1)).to(conv.weight.dtype)
    b = ((conv.bias.double() - bn.running_mean.double()) * s + bn.bias.double()).to(conv.bias.dtype)
    return w, b, s


@torch.no_grad()
def fold_bn(model) -> int:
    """Fold every BatchNorm into the conv before it and remove it (in place).

        W' = W * g / sd,   b' = (b - running_mean) * g / sd + beta,   sd = sqrt(running_var + eps)

    Computed in float64, stored in the conv's dtype. In eval mode the folded model gives the same
    outputs as the unfolded one (to float rounding).

    Args:
        model: a GNetDet (any module with ``.layers`` of Sublayer: conv, bn, relu).
    Returns:
        the number of BatchNorm layers folded (0 if none).
    """
    n = 0
    for layer in model.layers:
        bn = layer.bn
        if bn is None:
            continue
        conv = layer.conv
        w, b, _ = folded_conv_params(conv, bn)
        conv.weight.copy_(w)
        conv.bias.copy_(b)
        layer.bn = None
        n += 1
    return n


@torch.no_grad()
def equalize_channel_ranges(convs, ranges, alpha: float = 0.5, max_scale: float = 8.0) -> List[torch.Tensor]:
    """Scale each conv's output channels so that their activation ranges come closer to the layer's
    largest, and undo the scale in the next conv's input channels (in place).

    For consecutive convs i, i+1 of a chain (conv -> ReLU -> optional max pool -> conv) and channel c
    with measured range r_c > 0 (its largest pre-ReLU value) in layer i, whose largest is R:

        s_c = clip((R / r_c) ** alpha, 1, max_scale)
        W_i[c] <- s_c W_i[c],   b_i[c] <- s_c b_i[c],   W_{i+1}[:, c] <- W_{i+1}[:, c] / s_c

    ReLU and max pooling commute with a positive per-channel scale, so in float the network's
    outputs do not change; channel c's range becomes r_c s_c <= R, so the layer's one 5-bit cap
    (per-tensor, docs/quantization.md "Activations") spends more of its codes on the smaller
    channels. The weights keep their quantizers: per-kernel scales absorb a channel's factor in the
    3- and 5-bit weight formats. This is the cross-layer equalization of Nagel et al. 2019 ("Data-Free
    Quantization Through Weight Equalization and Bias Correction", ICCV), whose factor sqrt(r1 / r2)
    balances two weight ranges; here the factor balances activation ranges within a layer, ``alpha``
    sets how far (0: none, 1: every channel to R), and ``max_scale`` bounds it. The last conv's outputs
    (the network's) are never scaled. The factors are computed in float64 and rounded once to the
    weights' dtype; each product and quotient is rounded once.

    Args:
        convs: the chain's convs in order (modules with ``weight`` (O, I, kh, kw) and ``bias`` (O,)),
            conv i+1's input channels being conv i's outputs.
        ranges: per conv, the (O,) largest pre-ReLU value of each output channel (any float dtype;
            only the first len(convs) - 1 are used).
        alpha: in [0, 1]. max_scale: >= 1.
    Returns:
        the (O,) float64 scales applied to convs[0..n-2] (on the ranges' device).
    Raises:
        ValueError: alpha or max_scale out of range, or a range's length is not its conv's outputs.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"equalize_channel_ranges: alpha must be in [0, 1], not {alpha}")
    if not max_scale >= 1.0:
        raise ValueError(f"equalize_channel_ranges: max_scale must be >= 1, not {max_scale}")
    scales = []
    for i in range(len(convs) - 1):
        a, b = convs[i], convs[i + 1]
        r = torch.as_tensor(ranges[i]).double().clamp_min(0.0)
        if r.shape != (a.weight.shape[0],):
            raise ValueError(f"equalize_channel_ranges: conv {i} has {a.weight.shape[0]} outputs, its range "
                             f"{tuple(r.shape)}")
        top = float(r.max()) if r.numel() else 0.0
        s = torch.ones_like(r)
        live = r > 0
        if top > 0:
            s[live] = (top / r[live]).pow(alpha).clamp(1.0, max_scale)
        # the scale rounded once to the weights' dtype; each product and quotient rounded once
        sw = s.to(device=a.weight.device, dtype=a.weight.dtype)
        a.weight.mul_(sw.view(-1, 1, 1, 1))
        if a.bias is not None:
            a.bias.mul_(sw.to(a.bias.dtype))
        b.weight.div_(sw.to(b.weight.dtype).view(1, -1, 1, 1))
        scales.append(s)
    return scales


@torch.no_grad()
def fold_requant_multipliers(model, input_cap: float = 31.0) -> List[float]:
    """Fold each layer's requantization multiplier into its weights so every activation becomes its
    integer code (step 4), in place: GTI's "gain editing" (docs/quantization.md, "Requantization and
    gain editing").

    With cap_{-1} = 31 for the input (the image already holds codes 0..31):
        W_i <- W_i * cap_{i-1} / cap_i,   b_i <- b_i * 31 / cap_i,   cap_i <- 31
    and the model's output_scale becomes cap_last / 31 (the host multiplies the chip output by it).
    A 10-bit output layer (its QReLU's ``codes`` 1023) takes cap_i' = five_bit_cap(cap_i, 1023) =
    cap_i * 31 / 1023 in place of cap_i in both products and in output_scale (= cap_last / 1023), and
    its cap becomes 1023 (docs/quantization.md, "The 10-bit output mode").

    Args:
        model: a calibrated GNetDet (every QReLU cap > 0) without BatchNorm.
    Returns:
        the caps before the edit (one per conv).
    Raises:
        RuntimeError: a cap is not positive (calibration missing) or BatchNorm is still present.
    """
    caps = [float(l.relu.cap) for l in model.layers]
    if any(c <= 0 for c in caps):
        raise RuntimeError(f"gain editing needs calibrated caps (run --cal and step 3 first); caps: {caps}")
    if any(l.bn is not None for l in model.layers):
        raise RuntimeError("gain editing needs a model without BatchNorm (fold it on entry to step 2)")
    prev = float(input_cap)
    for layer, cap in zip(model.layers, caps):
        conv, codes = layer.conv, int(getattr(layer.relu, "codes", ACT_MAX))
        out_cap = five_bit_cap(cap, codes)
        conv.weight.copy_((conv.weight.double() * prev / out_cap).to(conv.weight.dtype))
        conv.bias.copy_((conv.bias.double() * 31.0 / out_cap).to(conv.bias.dtype))
        layer.relu.cap.fill_(float(codes))
        if getattr(conv, "gain", None) is not None:
            conv.gain = None      # the weights are now the edited ones: no step-3 gain applies
        prev = cap
    model.output_scale.fill_(five_bit_cap(caps[-1], int(getattr(model.layers[-1].relu, "codes", ACT_MAX))) / 31.0)
    return caps
