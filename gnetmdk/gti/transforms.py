"""Model edits between stages: BN folding (entry to step 2) and gain editing (entry to step 4).

Formulas: docs/quantization.md, "BN folding" and "Requantization and gain editing".
"""
from __future__ import annotations

from typing import List

import torch


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
        sd = torch.sqrt(bn.running_var.double() + bn.eps)
        g = bn.weight.double() / sd
        w = conv.weight.double() * g.view(-1, 1, 1, 1)
        b = (conv.bias.double() - bn.running_mean.double()) * g + bn.bias.double()
        conv.weight.copy_(w.to(conv.weight.dtype))
        conv.bias.copy_(b.to(conv.bias.dtype))
        layer.bn = None
        n += 1
    return n


@torch.no_grad()
def fold_requant_multipliers(model, input_cap: float = 31.0) -> List[float]:
    """Fold each layer's requantization multiplier into its weights so every activation becomes its
    integer code (step 4), in place: GTI's "gain editing" (docs/quantization.md, "Requantization and
    gain editing").

    With cap_{-1} = 31 for the input (the image already holds codes 0..31):
        W_i <- W_i * cap_{i-1} / cap_i,   b_i <- b_i * 31 / cap_i,   cap_i <- 31
    and the model's output_scale becomes cap_last / 31 (the host multiplies the chip output by it).

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
        conv = layer.conv
        conv.weight.copy_((conv.weight.double() * prev / cap).to(conv.weight.dtype))
        conv.bias.copy_((conv.bias.double() * 31.0 / cap).to(conv.bias.dtype))
        layer.relu.cap.fill_(31.0)
        if getattr(conv, "gain", None) is not None:
            conv.gain = None      # the weights are now the edited ones: no step-3 gain applies
        prev = cap
    model.output_scale.fill_(caps[-1] / 31.0)
    return caps
