"""Quantized conv and capped-ReLU layers whose quantizers switch on per step.

Both layers keep their state (weight format, cap) as attributes/buffers and are fake quantizers in torch.ao's
terms: ``fake_quant_enabled`` (and, for the ReLU, ``observer_enabled``) with ``enable_*`` / ``disable_*``
methods, as intq's ActQuant and torch.ao's FakeQuantize have. The family's ``prepare_stage`` sets them
from the stage table (gnetmdk.models.stages) on every process alike, so they agree across DDP ranks;
they are host booleans, read in every forward without a device sync. The math itself is in
gnetmdk.gti.quantize.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from gnetmdk.gti.quantize import (ACT_MAX, capped_relu, device_path, integer_conv_params, quantize_conv_params,
                                  quantize_conv_values, scalar, ste, ste_many)


class QConv2d(nn.Conv2d):
    """3x3 / stride 1 / padding 1 convolution with bias, optionally with chip-quantized weights.

    Args:
        in_channels, out_channels: channel counts.
        weight_format: mask bits of the major layer (1, 2, 3, 5, 8, 12).
        weight_bits, bias_bits: the registers of that weight format on the chip (Bw, Bb).
        method: "gti" or "mse" per-kernel scale (see gnetmdk.gti.quantize.quantize_weight_value).

    Switches:
        fake_quant_enabled: compute with the fake-quantized w_q, b_q (steps 2..4; the chip's
            power-of-two shift and per-kernel scale, gnetmdk.gti.quantize); set with
            :meth:`enable_fake_quant` / :meth:`disable_fake_quant`.
        gain: None, or (cap_in, cap_out) in step 3 when the model quantizes "gain-aware": the layer
            then computes in the code domain of step 4. The weights and bias are quantized as gain
            editing will leave them, W cap_in / cap_out and b 31 / cap_out (docs/quantization.md,
            "Requantization and gain editing"; gnetmdk.gti.transforms.fold_requant_multipliers, the same float64
            formula), the input is the previous layer's codes 0..31 (the image's for the first conv),
            and the output is the pre-activation in codes (the value divided by cap_out / 31). Gradients reach the
            unedited weights through the gain (straight-through on the rounding). So step 3 computes
            exactly what step 4 and the chip compute, and the step 3 -> step 4 transition changes
            nothing. For a 10-bit output layer cap_out is gnetmdk.gti.quantize.five_bit_cap(cap, 1023),
            whose cap_out / 31 is that layer's code step cap / 1023.
        gain_tensors: None, or (cap_in, cap_out) as the ReLUs' cap tensors (cap_in the float 31 for
            the first conv) when step 3 learns the caps (``cap_lr``): the gain is then computed from
            them, so gradients reach the caps as well (the forward value is the same).
        exact: compute exactly: float32 when every partial sum is an integer below 2^24 (CPU), else
            float64 (exact while partial sums < 2^53), so the result equals the chip's integer
            accumulation (docs/quantization.md, "Integer semantics"). Set for step-4 evaluation; a
            conv with a gain computes exactly in eval mode as well.

    Input (N, in_channels, H, W) float; output (N, out_channels, H, W) of the same dtype.
    """

    def __init__(self, in_channels: int, out_channels: int, weight_format: int = 8, weight_bits: int = 12,
                 bias_bits: int = 20, method: str = "gti"):
        super().__init__(in_channels, out_channels, kernel_size=3, stride=1, padding=1, bias=True)
        self.weight_format = int(weight_format)
        self.weight_bits = int(weight_bits)
        self.bias_bits = int(bias_bits)
        self.method = method
        self.fake_quant_enabled = False
        self.gain: Optional[tuple] = None
        self.gain_tensors: Optional[tuple] = None
        self.exact = False
        #: (w_q, b_q, shift) computed for this forward by quantize_convs (one pass over all convs), or None
        self.batched_params: Optional[tuple] = None

    def quantized_params(self, weight: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None):
        """(w_q, b_q, shift): the weights this layer computes with now (straight-through gradients).

        w_q and b_q are integer multiples of 2^-shift. Without a gain they are what integer_params
        stores. With a gain (gain-aware step 3) they are the gain-edited weights quantized as step 4
        will hold them (code domain), with the gradient passed to the unedited parameters times the
        gain (d w_q / d W = cap_in / cap_out, d b_q / d b = 31 / cap_out); integer_params ignores the
        gain (it describes the parameters as they are now).

        ``weight`` (O, I, 3, 3) and ``bias`` (O,), when given, stand for the layer's own parameters
        (a BatchNorm-kept sublayer passes its folded weight and bias; gnetmdk.models.gnetdet.model.Sublayer).
        """
        weight = self.weight if weight is None else weight
        bias = self.bias if bias is None else bias
        if not self.fake_quant_enabled:
            return weight, bias, None
        if self.gain is not None:
            cap_in, cap_out = (float(g) for g in self.gain)
            if self.gain_tensors is not None:          # learned caps: the gain carries their gradient
                ci, co = self.gain_tensors
                gw, gb = ci / co, ACT_MAX / co
            else:
                gw, gb = cap_in / cap_out, ACT_MAX / cap_out
            # the values fold_requant_multipliers will write (float64 product, then the parameter dtype) ...
            w_val = (weight.detach().double() * cap_in / cap_out).to(weight.dtype)
            b_val = (bias.detach().double() * ACT_MAX / cap_out).to(bias.dtype)
            # ... quantized as in step 4 (the gradient reaches weight and bias through the gain)
            return quantize_conv_params(ste(weight * gw, w_val), ste(bias * gb, b_val),
                                        self.weight_format, self.weight_bits, self.bias_bits, self.method)
        return quantize_conv_params(weight, bias, self.weight_format, self.weight_bits,
                                    self.bias_bits, self.method)

    def integer_params(self):
        """(W_int int64 (O,I,3,3), b_int int64 (O,), shift): what the chip stores."""
        return integer_conv_params(self.weight, self.bias, self.weight_format, self.weight_bits,
                                   self.bias_bits, self.method)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Convolve with the weights of the current mode (float, or fake-quantized; with ``exact``, in a
        precision equal to the chip's integer accumulation); a quantized layer turns autocast off."""
        if self.fake_quant_enabled and torch.is_autocast_enabled(x.device.type):
            # mixed precision: quantized layers always compute in float32, so their codes do not
            # change under amp (docs/training.md); only step-1 float convs run in bf16 / fp16
            with torch.autocast(x.device.type, enabled=False):
                return self._forward(x.float())
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b, shift = self.batched_params if self.batched_params is not None else self.quantized_params()
        return self.convolve(x, w, b, shift)

    def convolve(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, shift: Optional[int]) -> torch.Tensor:
        """3x3 / stride 1 / padding 1 convolution of ``x`` (N, I, H, W) with ``w`` (O, I, 3, 3) and ``b`` (O,)
        in this layer's precision: with ``exact``, or a gain in eval mode, exactly (float32 where
        :meth:`float32_exact` holds for ``shift``, on CPU; else float64), otherwise in ``x``'s dtype."""
        if self.exact or (self.gain is not None and not self.training):
            # float32 only on CPU (direct convolution); on CUDA TF32 and algorithm choice could round
            if shift is not None and x.device.type == "cpu" and self.float32_exact(w, b, shift):
                return F.conv2d(x.float(), w.float(), b.float(), 1, 1)
            return F.conv2d(x.double(), w.double(), b.double(), 1, 1)
        return F.conv2d(x, w, b, 1, 1)

    def enable_fake_quant(self, enabled: bool = True) -> "QConv2d":
        """Switch the weights' fake quantization on (or off with ``enabled`` False); returns self."""
        self.fake_quant_enabled = bool(enabled)
        return self

    def disable_fake_quant(self) -> "QConv2d":
        """Switch the weights' fake quantization off (float weights); returns self."""
        return self.enable_fake_quant(False)

    def calculate_qparams(self):
        """(scale, zero point) of the stored integer weights, as torch.ao's fake quantizers give them:
        scale 2^-shift (0-d float32; one per layer: the per-kernel scale and the weight format only
        decide which integers a kernel may hold, docs/quantization.md, "Weight formats"), zero point 0
        (0-d int32). The weights the chip stores are W_int = w_q / scale (:meth:`integer_params`)."""
        _, _, shift = self.integer_params()
        return (torch.tensor(2.0 ** -shift, dtype=torch.float32, device=self.weight.device),
                torch.zeros((), dtype=torch.int32, device=self.weight.device))

    @staticmethod
    def float32_exact(w: torch.Tensor, b: torch.Tensor, shift: int, max_code: int = 31) -> bool:
        """True when float32 convolution is exact for integer inputs 0..max_code: every partial sum
        of W_int * a + b_int is then an integer below 2^24 in magnitude (docs/quantization.md, "Integer
        semantics"), whatever the summation order, so the float32 result equals the integer
        accumulation."""
        scale = float(2 ** shift)
        bound = (w.detach().abs().sum(dim=(1, 2, 3)) * scale * max_code + b.detach().abs() * scale).max()
        return bool(bound < 2 ** 24)

    def extra_repr(self) -> str:
        """Conv2d's fields plus the weight format, weight and bias bits (Bw, Bb) and method."""
        return (f"{super().extra_repr()}, weight_format={self.weight_format}, Bw={self.weight_bits}, "
                f"Bb={self.bias_bits}, method={self.method}")


class QReLU(nn.Module):
    """ReLU with a calibrated cap and 5-bit activation quantization (the fake quantizer of the
    activations; its calibration statistics are observers': gnetmdk.layers.observers,
    gnetmdk.engine.calibration).

    Args:
        percentile: the percentile this layer's calibration observer takes of each batch (``cap_method
            percentile``); GNetDet gives its output layer ``output_cap_percentile``.
        codes: the largest code: 31 (5-bit activations), or 1023 for a 10-bit output layer
            (docs/quantization.md, "The 10-bit output mode"); below, "31" stands for it.

    Buffers:
        cap: 0-d float32, the clip value (0 until calibrated; 31 in step 4).

    Switches (torch.ao's names; set with ``enable_*`` / ``disable_*``):
        fake_quant_enabled: clip at ``cap`` and round to the 5-bit codes, scale ``cap / 31`` and zero
            point 0 (:meth:`calculate_qparams`; steps 3, 4), with the straight-through estimator.
        observer_enabled: the calibration pass: a plain ReLU while observers watch the input
            (gnetmdk.layers.observers); it overrides ``fake_quant_enabled``.
        integer: step 4, cap = 31: outputs are the integer codes.
        code_domain: gain-aware step 3 (set by GNetDet.set_gains with the convs' gains): the input is
            the pre-activation in codes (QConv2d.gain) and the output is the codes 0..31, as with
            ``integer`` in step 4, while ``cap`` keeps the calibrated value.

    Input and output: any shape, float.
    """

    def __init__(self, percentile: float = 99.0, codes: int = ACT_MAX):
        super().__init__()
        self.register_buffer("cap", torch.zeros((), dtype=torch.float32))
        self.percentile = float(percentile)
        self.codes = int(codes)
        self.fake_quant_enabled = False
        self.observer_enabled = False
        self.integer = False
        self.code_domain = False
        #: output layer only: let gradients revive units stuck outside (0, cap) (capped_relu's ``revive``)
        self.revive = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the ReLU of the current switches: plain while observing or without fake quantization,
        else the ReLU clipped at the cap and rounded to 5-bit codes, computed in float32 under autocast.

        Raises:
            RuntimeError: fake quantization is on but the cap is still 0 (no calibration before step 3).
        """
        if self.observer_enabled:
            return F.relu(x)
        if not self.fake_quant_enabled:
            if self.revive and torch.is_grad_enabled():
                return capped_relu(x, scalar(float("inf"), x.dtype, x.device), quantize=False, revive=True)
            return F.relu(x)
        if not device_path(self.cap) and self.cap <= 0:   # on a device the stage's entry checks the caps
            raise RuntimeError("QReLU cap is 0: run calibration (--cal) before step 3")
        if self.code_domain:        # gain-aware step 3: the codes, exactly as step 4 computes them
            cap, integer = scalar(self.codes, self.cap.dtype, self.cap.device), True
        else:
            cap, integer = self.cap, self.integer
        if torch.is_autocast_enabled(x.device.type):
            with torch.autocast(x.device.type, enabled=False):   # amp: the activation quantizer in float32
                return capped_relu(x.float(), cap, quantize=True, integer=integer,
                                   revive=self.revive and torch.is_grad_enabled(), codes=self.codes)
        return capped_relu(x, cap, quantize=True, integer=integer, revive=self.revive and torch.is_grad_enabled(),
                           codes=self.codes)

    def enable_fake_quant(self, enabled: bool = True) -> "QReLU":
        """Switch the 5-bit fake quantization on (or off with ``enabled`` False); returns self."""
        self.fake_quant_enabled = bool(enabled)
        return self

    def disable_fake_quant(self) -> "QReLU":
        """Switch the fake quantization off (a plain ReLU); returns self."""
        return self.enable_fake_quant(False)

    def enable_observer(self, enabled: bool = True) -> "QReLU":
        """Put the layer in the calibration pass (a plain ReLU while observers watch its input), or
        out of it with ``enabled`` False; returns self."""
        self.observer_enabled = bool(enabled)
        return self

    def disable_observer(self) -> "QReLU":
        """Leave the calibration pass; returns self."""
        return self.enable_observer(False)

    def calculate_qparams(self):
        """(scale, zero_point) of the 5-bit activation codes, as torch.ao's fake quantizers give them:
        scale = cap / 31 (cap / 1023 for a 10-bit layer; 0-d float32, on the cap's device; 0 before
        calibration), zero point 0 (0-d int32): a code q stands for q * scale (docs/quantization.md,
        "Activations")."""
        return (self.cap.detach() / self.codes).to(torch.float32), torch.zeros((), dtype=torch.int32,
                                                                               device=self.cap.device)

    def extra_repr(self) -> str:
        """The cap, the largest code (when not 31) and the switches."""
        wide = f", codes={self.codes}" if self.codes != ACT_MAX else ""
        return (f"cap={float(self.cap):.4g}{wide}, fake_quant_enabled={self.fake_quant_enabled}, "
                f"observer_enabled={self.observer_enabled}, integer={self.integer}, code_domain={self.code_domain}")


def quantize_convs(convs: Sequence[QConv2d]) -> List[tuple]:
    """``[conv.quantized_params() for conv in convs]``, equal bit for bit in values and gradients, in
    one pass per weight format (gnetmdk.gti.quantize.quantize_conv_values) instead of one per conv: a
    training step of a quantized model then costs a fixed number of quantizer operations however many
    convs it has (on an accelerator, kernel launches).

    Convs are grouped by (weight format, registers, method, dtype, device, kernel size, bias or not, gain or
    not); a conv without ``fake_quant_enabled`` gets (weight, bias, None) as quantized_params gives it. The
    straight-through gradients are the per-conv ones: identity to weight and bias, times the gain where
    there is one (QConv2d.quantized_params). Runs with autocast off, as QConv2d.forward runs them.

    Returns:
        one (w_q, b_q, shift) per conv, in order.
    """
    out: List[Optional[tuple]] = [None] * len(convs)
    groups: dict = {}
    for i, c in enumerate(convs):
        if not c.fake_quant_enabled:
            out[i] = (c.weight, c.bias, None)
            continue
        key = (c.weight_format, c.weight_bits, c.bias_bits, c.method, c.weight.dtype, c.weight.device,
               tuple(c.weight.shape[2:]), c.bias is None, c.gain is None)
        groups.setdefault(key, []).append(i)
    if not groups:
        return out
    dev_type = convs[next(iter(groups.values()))[0]].weight.device.type
    with torch.autocast(dev_type, enabled=False):
        for (weight_format, bw, bb, method, *_rest), idx in groups.items():
            members = [convs[i] for i in idx]
            gains = None if members[0].gain is None else [tuple(float(g) for g in c.gain) for c in members]
            w_vals, b_vals, shifts = quantize_conv_values([c.weight for c in members], [c.bias for c in members],
                                                          weight_format, bw, bb, method, gains)
            if not any(c.gain_tensors is not None for c in members):
                # fixed gains (or none): every straight-through estimator of the group in one autograd
                # node, the gains applied to the gradients in one _foreach_mul (ste_many: the same
                # float32 products as ``weight * gain``)
                params = [c.weight for c in members] + [c.bias for c in members if c.bias is not None]
                values = list(w_vals) + [bv for bv in b_vals if bv is not None]
                factors = None
                if members[0].gain is not None:
                    pairs = [tuple(float(g) for g in c.gain) for c in members]
                    factors = [ci / co for ci, co in pairs] + [ACT_MAX / co for (ci, co), c in zip(pairs, members)
                                                               if c.bias is not None]
                outs = iter(ste_many(params, values, factors))
                ws = [next(outs) for _ in members]
                for i, c, w_q, s in zip(idx, members, ws, shifts):
                    out[i] = (w_q, None if c.bias is None else next(outs), s)
                continue
            for i, c, wv, bv, s in zip(idx, members, w_vals, b_vals, shifts):
                # learned caps: the gradient reaches the parameters and the caps through the gain tensors
                ci, co = c.gain_tensors
                src_w, src_b = c.weight * (ci / co), None if c.bias is None else c.bias * (ACT_MAX / co)
                out[i] = (ste(src_w, wv), None if src_b is None else ste(src_b, bv), s)
    return out
