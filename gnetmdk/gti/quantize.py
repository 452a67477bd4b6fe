"""The chip's quantization math as pure functions with straight-through gradients.

Every formula here is written out in docs/quantization.md ("Notation", "Weight formats (mask bits)",
"Activations", "Straight-through estimator"); their source is GTI's PyTorch MDK (gnetmdk/gti/quantize.py
there). Notation:

    R(x)   = round half away from zero ("chip rounding")
    Q_s(x) = R(x * 2^s) / 2^s

Training layers, the converter and the integer emulator all call these functions, so the weights
the chip stores are the weights training used.

Gradients: every rounding is a straight-through estimator (the gradient passes unchanged), the
activation clip passes it on the open interval (0, cap) only.
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import torch

#: weight formats (mask bits) this module knows
WEIGHT_FORMATS = (1, 2, 3, 5, 8, 12)
#: the largest shift the chip accepts
MAX_SHIFT = 12
#: 5-bit activation codes are 0..ACT_MAX
ACT_MAX = 31
#: activation widths the chip has: 5 bits (every layer) and 10 bits (the last layer only, in a major layer of
#: its own: GTI's "ten_bits_enable"; docs/quantization.md, "The 10-bit output mode")
ACTIVATION_BITS = (5, 10)


def max_code(bits: int) -> int:
    """The largest activation code of a ``bits``-wide activation: 31 for 5 bits, 1023 for 10.

    Raises:
        ValueError: ``bits`` is not one of ACTIVATION_BITS.
    """
    if bits not in ACTIVATION_BITS:
        raise ValueError(f"activations are {ACTIVATION_BITS[0]} or {ACTIVATION_BITS[1]} bits wide, not {bits!r}")
    return (1 << int(bits)) - 1


def five_bit_cap(cap: float, codes: int = ACT_MAX) -> float:
    """The cap a 5-bit layer with the same code step as a layer of ``codes`` levels would have:
    ``cap * 31 / codes`` (float64), and ``cap`` itself, untouched, for ``codes`` = 31.

    Gain editing and gain-aware step 3 use it for the cap of a layer's output (docs/quantization.md,
    "The 10-bit output mode"): a code of a 10-bit layer stands for ``cap / 1023``, which is the step
    ``five_bit_cap(cap, 1023) / 31`` of the 5-bit formulas, so those formulas serve both widths and the
    5-bit arithmetic stays bit for bit what it was.

    Args:
        cap: the layer's calibrated cap (> 0), in the units of its pre-activation.
        codes: the layer's largest code (31 or 1023).
    Returns:
        a Python float.
    """
    return float(cap) if codes == ACT_MAX else float(cap) * ACT_MAX / int(codes)


def chip_round(x: torch.Tensor) -> torch.Tensor:
    """R(x): round half away from zero, elementwise, no gradient handling.

    Args:
        x: any float tensor.
    Returns:
        a tensor of the same shape and dtype holding integers.
    """
    # Not sign(x) * floor(|x| + 0.5): that sum is itself rounded, giving R(0.49999997) = 1 and
    # R(2^23 + 1) = 2^23 + 2 in float32. Here the fraction x - trunc(x) is exact, and
    # trunc(2 * fraction) is +-1 exactly when |fraction| >= 0.5 (same cost: five elementwise ops).
    t = torch.trunc(x)
    return torch.sub(x, t).mul_(2).trunc_().add_(t)


def _chip_round_nonneg_(x: torch.Tensor) -> torch.Tensor:
    """In-place chip_round of a tensor >= 0 this module owns: t + floor(2 (x - t)), t = floor(x).

    Equal to chip_round for every x >= 0 (the fraction x - t in [0, 1) and its double are exact), and
    several times faster on CPU, where torch's trunc is not vectorised (7.3 ms against 0.7 ms for
    floor on a 16 x 16 x 224 x 224 float32 tensor)."""
    t = torch.floor(x)
    return x.sub_(t).mul_(2).floor_().add_(t)


class _PassThrough(torch.autograd.Function):
    """Forward returns ``value`` exactly; backward hands the gradient to ``x`` unchanged."""

    @staticmethod
    def forward(ctx, x, value):  # noqa: D401
        return value

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def ste(x: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Straight-through estimator: the forward value is ``value`` (bit for bit), d/dx is identity.

    Unlike ``x + (value - x).detach()`` this returns ``value`` exactly, so quantized weights stay
    exact multiples of 2^-s in float32.
    """
    return _PassThrough.apply(x, value.detach())


class _GroupPassThrough(torch.autograd.Function):
    """Many straight-through estimators in one autograd node: forward returns the values exactly;
    backward hands each input its gradient times its factor (a Python float), all factors in one
    ``torch._foreach_mul`` (one kernel launch on an accelerator instead of one per tensor)."""

    @staticmethod
    def forward(ctx, factors, *xs_and_values):  # noqa: D401
        n = len(xs_and_values) // 2
        ctx.factors = factors
        return tuple(xs_and_values[n:])

    @staticmethod
    def backward(ctx, *grads):
        grads = list(grads)
        if ctx.factors is not None:
            grads = list(torch._foreach_mul(grads, list(ctx.factors)))
        return (None, *grads, *([None] * len(grads)))


def ste_many(xs: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
             factors: Optional[Sequence[float]] = None) -> Tuple[torch.Tensor, ...]:
    """``tuple(ste(x * f, v) for x, v, f in zip(xs, values, factors))`` in one autograd node: the
    forward values are ``values`` bit for bit, and the gradient reaching ``xs[i]`` is the gradient of
    its output times ``factors[i]`` (identity where ``factors`` is None). The products are float32
    products with the factor rounded to float32 once, as ``x * f`` with a Python float computes them,
    so the gradients equal the per-tensor form's bit for bit (tests/gti/test_quantize.py).

    Args:
        xs: tensors that receive the gradients (parameters); values: tensors of the same shapes
            (read detached); factors: Python floats, one per tensor, or None.
    Returns:
        a tuple of ``len(xs)`` tensors.
    """
    if len(xs) != len(values) or (factors is not None and len(factors) != len(xs)):
        raise ValueError("ste_many: give one value (and one factor) per tensor")
    if not xs:
        return ()
    return _GroupPassThrough.apply(None if factors is None else tuple(float(f) for f in factors),
                                   *xs, *[v.detach() for v in values])


def round_ste(x: torch.Tensor) -> torch.Tensor:
    """R(x) with a straight-through gradient."""
    return ste(x, chip_round(x.detach()))


def device_path(t: torch.Tensor) -> bool:
    """Whether quantizers working on ``t`` take the device path: shifts and scales stay 0-d tensors
    on ``t``'s device, so a training step never waits for the accelerator (no ``.item()``, no tensor
    built from a Python list). True for every device but the CPU (and on the CPU inside
    :func:`force_device_path`, which tests use to check that both paths give the same numbers).
    On the CPU the host path is kept: reading a CPU scalar costs nothing there."""
    return t.device.type != "cpu" or _FORCE_DEVICE_PATH[0]


_FORCE_DEVICE_PATH = [False]


class force_device_path:
    """Context manager: quantizers take the device path on the CPU too (tests of the two paths)."""

    def __enter__(self):
        self._old = _FORCE_DEVICE_PATH[0]
        _FORCE_DEVICE_PATH[0] = True
        return self

    def __exit__(self, *exc):
        _FORCE_DEVICE_PATH[0] = self._old
        return False


_CONSTANTS: dict = {}


def _constant(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A cached tensor of Python numbers on ``device`` (built once per device and dtype: a tensor made
    from a Python list on a CUDA device is a host-to-device copy that waits for the device's queue)."""
    key = (tuple(values), dtype, str(device))
    t = _CONSTANTS.get(key)
    if t is None:
        t = _CONSTANTS[key] = torch.tensor(list(values), dtype=dtype, device=device)
    return t


def scalar(value: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A cached 0-d tensor holding ``value`` (built once per value, dtype and device; do not write into
    it): a constant a forward needs, such as the cap 31 of the code domain, without a fill per step."""
    return _constant([float(value)], dtype, device).reshape(())


def shift_scale(shift, like: torch.Tensor):
    """2^s as the multiplier of Q_s: a Python float for an int shift, a 0-d tensor of ``like``'s dtype
    and device for a tensor shift (looked up in a table of the exact powers 2^0..2^12, no rounding)."""
    if isinstance(shift, torch.Tensor):
        table = _constant([float(2 ** k) for k in range(MAX_SHIFT + 1)], like.dtype, like.device)
        # index_select, not table[shift]: indexing with a 0-d tensor reads it back to the host
        return table.index_select(0, shift.to(device=like.device, dtype=torch.long).reshape(1)).reshape(())
    return float(2 ** shift)


def quantize_shift(x: torch.Tensor, shift) -> torch.Tensor:
    """Q_s(x) = R(x * 2^s) / 2^s (no gradient handling; exact in float32 for |x| * 2^s < 2^24).

    ``shift``: an int, or a 0-d integer tensor (the device path, see compute_shift)."""
    scale = shift_scale(shift, x)
    return chip_round(x * scale) / scale


def compute_shift(weight: torch.Tensor, bias: torch.Tensor | None, weight_bits: int, bias_bits: int,
                  as_tensor: bool = False):
    """Shift s of one sublayer (docs/quantization.md, "Shift"):

        s = clip(min(floor(log2((2^(Bw-1) - 1) / max|W|)), floor(log2((2^(Bb-1) - 1) / max|b|))), 0, 12)

    A zero tensor does not constrain s.

    Args:
        weight: (O, I, 3, 3) float weights of the sublayer (before quantization).
        bias: (O,) float bias or None.
        weight_bits / bias_bits: register widths Bw / Bb of the weight format (gnetmdk.gti.spec).
        as_tensor: return s as a 0-d int64 tensor on the weights' device, computed there without
            reading anything back to the host: s = the number of k in 1..12 with 2^k <= r, where
            r = min((2^(Bw-1) - 1) / max|W|, (2^(Bb-1) - 1) / max|b|) in float64 (that count is
            clip(floor(log2 r), 0, 12) with no logarithm to round; r is infinite for zero tensors).
            The host path rounds log2(r) in float64 first, so the two can differ only when r lies
            within a few float64 ulps below a power of two, where the count is the exact answer.
    Returns:
        the shift, an int in 0..12 (or a 0-d int64 tensor with ``as_tensor``).
    """
    if as_tensor:
        w = weight.detach()
        wmax = w.abs().amax().double() if w.numel() else w.new_zeros((), dtype=torch.float64)
        r = (2 ** (weight_bits - 1) - 1) / wmax                     # inf for an all-zero tensor
        if bias is not None and bias.numel():
            r = torch.minimum(r, (2 ** (bias_bits - 1) - 1) / bias.detach().abs().amax().double())
        powers = _constant([float(2 ** k) for k in range(1, MAX_SHIFT + 1)], torch.float64, w.device)
        return (r >= powers).sum()
    wmax = float(weight.detach().abs().max()) if weight.numel() else 0.0
    bmax = float(bias.detach().abs().max()) if bias is not None and bias.numel() else 0.0
    return _shift_from_max(wmax, bmax, weight_bits, bias_bits)


def _shift_from_max(wmax: float, bmax: float, weight_bits: int, bias_bits: int) -> int:
    """compute_shift's host path from max|W| and max|b| (Python floats; 0 for a zero or absent tensor,
    which does not constrain s)."""
    limits = []
    if wmax > 0:
        limits.append(math.floor(math.log2((2 ** (weight_bits - 1) - 1) / wmax)))
    if bmax > 0:
        limits.append(math.floor(math.log2((2 ** (bias_bits - 1) - 1) / bmax)))
    s = min(limits) if limits else MAX_SHIFT
    return int(min(max(s, 0), MAX_SHIFT))


# ------------------------------------------------------------------ weight formats
_LEVELS = {1: (1.0,), 2: (0.0, 1.0), 3: (0.0, 1.0, 2.0, 4.0), 5: tuple(float(i) for i in range(16))}


def _nearest_level(r: torch.Tensor, levels: Tuple[float, ...], inplace: bool = False) -> torch.Tensor:
    """Map |w|/d (>= 0) to the nearest of ``levels`` (ascending); a tie goes to the lower level.

    The level is levels[0] plus one step for every midpoint strictly below r: one comparison per
    midpoint, or for the 16 uniform 5-bit levels 0..15 one ceil(r - 1/2) (exact for r >= 0). Equal to
    an argmin over |r - level| and much cheaper. With ``inplace`` the uniform path overwrites r.
    """
    steps = [hi - lo for lo, hi in zip(levels[:-1], levels[1:])]
    if len(levels) > 4 and levels[0] == 0.0 and all(st == 1.0 for st in steps):
        return (r if inplace else r.clone()).sub_(0.5).ceil_().clamp_(0, levels[-1])
    q = torch.full_like(r, levels[0])
    for lo, hi in zip(levels[:-1], levels[1:]):
        q.add_(r > (lo + hi) / 2, alpha=hi - lo)
    return q


def _prefix_sum(x: torch.Tensor) -> torch.Tensor:
    """Running sums along dim 1 of a (K, C) float64 tensor. CPU: torch.cumsum (sequential). Other
    devices: a product with the (C, C) upper-triangular matrix of ones: deterministic (CUDA's float
    cumsum has no deterministic kernel and raises under torch.use_deterministic_algorithms) and one
    kernel; float64 sums in another order, so a near-tie of two candidates' errors (float64 rounding,
    see _mse_scale) may resolve differently from the CPU's."""
    if x.device.type == "cpu":
        return x.cumsum(1)
    c = x.shape[1]
    tri = torch.ones(c, c, dtype=x.dtype, device=x.device).triu_()
    return x @ tri


#: midpoint crossings searched per pass of _mse_scale's sweep (bounds its temporaries on wide layers)
_SWEEP_CHUNK_VALUES = 1 << 20


def _mse_scale(w: torch.Tensor, weight_format: int, shift: int, candidates: int = 32) -> torch.Tensor:
    """Per-kernel d in {Q_s(f * max|w| / top level)}, f = 0.15..1 (``candidates`` values), minimising
    ||w - w_q||^2 with every weight at its nearest level (a tie goes to the lower one; a zero weight
    stays 0). The first d wins a tie.

    Runs once per conv per training step, so it is written for speed. The error of candidate d is
    d (d sum q^2 - 2 sum q |w|) plus the constant sum |w|^2 (the sign cancels), formed in float64 from
    two sums per candidate:
      * weight formats with at most three midpoints (1, 2, 3-bit): the candidates ascend, so a weight is above
        midpoint m for exactly the first t of them, t = the count of d < |w| / m (one searchsorted).
        A weight adds its level steps to the sums of those t candidates: one scatter per kernel and a
        prefix sum, (K, M * 9) values instead of (K, C, 9). 2-4x faster than the direct form below.
      * 5-bit (15 midpoints, where the sweep is slower): every (kernel, candidate, weight) level from
        _nearest_level, in chunks.
    The errors are float64 (rounded, not exact); on the test kernels the chosen d equal those of the
    definition in exact rational arithmetic (tests/gti/test_quantize.py,
    test_mse_scale_matches_the_definition). The sweep compares d < |w| / m in float64 while the final
    assignment rounds |w| / d in the weights' dtype; they can differ only for a quotient within one
    float32 ulp of a midpoint, where the two levels' errors are equal to that precision.

    Args:
        w: (O, I, 3, 3) float weights; weight format: 1, 2, 3 or 5; shift: the sublayer's shift.
    Returns:
        (O, I, 1, 1) scales of w's dtype, already quantized to multiples of 2^-shift.
    """
    o, i = w.shape[:2]
    a = _kernel_rows(w).abs()
    return _mse_scale_rows(a, weight_format, shift_scale(shift, a), candidates).reshape(o, i, 1, 1)


def _kernel_rows(w: torch.Tensor) -> torch.Tensor:
    """(O, I, kh, kw) weights as (O * I, kh * kw) rows, one kernel per row, in row-major order (a view
    of a contiguous tensor; a copy of any other layout, so every kernel's statistics sum in one order)."""
    return w.reshape(w.shape[0] * w.shape[1], -1)


_FRACTIONS: dict = {}


def _candidate_fractions(candidates: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.linspace(0.15, 1.0, candidates) in ``dtype`` on ``device``, made once per key (a step
    then launches no kernel for it)."""
    key = (candidates, dtype, str(device))
    t = _FRACTIONS.get(key)
    if t is None:
        t = _FRACTIONS[key] = torch.linspace(0.15, 1.0, candidates, dtype=dtype, device=device)
    return t


def _mse_scale_rows(a: torch.Tensor, weight_format: int, scale, candidates: int = 32) -> torch.Tensor:
    """_mse_scale on kernels as rows: a (K, n) = |w| per kernel, ``scale`` = 2^s as a Python float, a
    0-d tensor or a (K, 1) tensor (each row's sublayer shift: several sublayers in one pass, see
    quantize_conv_values). Every row is computed on its own (the result of a row does not depend on the
    other rows). Returns (K, 1) scales of a's dtype."""
    levels = _LEVELS[weight_format]
    k, n = a.shape
    dev = a.device
    f = _candidate_fractions(candidates, a.dtype, dev)
    # quantize_shift for values >= 0, without torch's slow trunc
    d = _chip_round_nonneg_(a.amax(1, keepdim=True) / levels[-1] * f * scale).div_(scale)  # (K, C) ascending
    dd = d.double()
    lows, highs = levels[:-1], levels[1:]
    if levels[0] != 0.0:                # 1-bit: every nonzero weight is at level 1 for every d
        p2 = (a > 0).sum(1, keepdim=True).double().expand(k, candidates)
        pa = a.double().sum(1, keepdim=True).expand(k, candidates)
    elif len(highs) <= 3:
        inv_mid = _constant([2.0 / (lo + hi) for lo, hi in zip(lows, highs)], torch.float64, dev)
        step = _constant([hi - lo for lo, hi in zip(lows, highs)], torch.float64, dev)
        step_sq = _constant([hi * hi - lo * lo for lo, hi in zip(lows, highs)], torch.float64,
                            dev).repeat_interleave(n)
        p2 = torch.empty(k, candidates, dtype=torch.float64, device=dev)
        pa = torch.empty_like(p2)
        chunk = max(1, _SWEEP_CHUNK_VALUES // (len(highs) * n))     # kernels per pass: a few MB of temporaries
        for start in range(0, k, chunk):
            a64 = a[start:start + chunk].double().unsqueeze(1)                         # (k, 1, n)
            kk = a64.shape[0]
            t = torch.searchsorted(dd[start:start + chunk], (inv_mid.view(1, -1, 1) * a64).reshape(kk, -1))
            s2 = torch.zeros(kk, candidates + 1, dtype=torch.float64, device=dev)
            s2.scatter_add_(1, t, step_sq.expand(kk, -1))
            sa = torch.zeros(kk, candidates + 1, dtype=torch.float64, device=dev)
            sa.scatter_add_(1, t, (step.view(1, -1, 1) * a64).reshape(kk, -1))
            # candidate c takes the weights with t > c: all of them less those with t <= c
            p2[start:start + chunk] = s2.sum(1, keepdim=True) - _prefix_sum(s2[:, :candidates])
            pa[start:start + chunk] = sa.sum(1, keepdim=True) - _prefix_sum(sa[:, :candidates])
    else:
        p2 = torch.empty(k, candidates, dtype=torch.float64, device=dev)
        pa = torch.empty_like(p2)
        safe = torch.where(d > 0, d, torch.ones_like(d))
        chunk = max(1, (1 << 22) // (candidates * n))
        for start in range(0, k, chunk):
            ax = a[start:start + chunk].unsqueeze(1)                         # (k, 1, n)
            q = _nearest_level(ax / safe[start:start + chunk].unsqueeze(-1), levels, inplace=True)  # (k, C, n)
            p2[start:start + chunk] = q.square().sum(-1)                    # integers: exact
            pa[start:start + chunk] = torch.matmul(q.double(), ax.double().transpose(1, 2)).squeeze(-1)
    err = dd * (dd * p2 - 2.0 * pa)          # sum (q d - |w|)^2 - sum |w|^2; 0 for d = 0
    return d.gather(1, err.argmin(dim=1, keepdim=True))


def quantize_weight_value(w: torch.Tensor, weight_format: int, shift: int, weight_bits: int,
                          method: str = "gti") -> torch.Tensor:
    """Quantized weights w_q (no gradient handling): every value is an integer multiple of 2^-shift.

    Weight formats (docs/quantization.md, "Per-kernel levels"), statistics per 3x3 kernel:
      * 1-bit:  w_q = sign(w) * Q_s(mean|w|)
      * 2-bit:  m = Q_s(mean|w|), w_q = sign(w) * m * [|w| >= m/4]
      * 3-bit:  d = mean|w|/4, c = floor(|w|/d), c >= 3 -> 4, w_q = sign(w) * c * Q_s(d)
      * 5-bit:  d = max|w|/15, w_q = R(w/d) * Q_s(d)
      * 8, 12-bit: w_q = Q_s(w)
    ``method="mse"`` keeps the same levels ({0, 1, 2, 4} x d for 3-bit, ...) but assigns each weight
    to its nearest level and picks the per-kernel d (a multiple of 2^-s, so the chip can store it)
    with the least squared error; for 8/12-bit it changes nothing.
    The integer codes w_q * 2^s are finally clamped to the weight register, +-(2^(Bw-1) - 1).

    Args:
        w: (O, I, kh, kw) float weights.
        weight_format: mask bits, one of WEIGHT_FORMATS.
        shift: the sublayer's shift s (compute_shift): an int, or a 0-d integer tensor on w's device.
        weight_bits: Bw of the weight format on the chip.
        method: "gti" or "mse".
    Raises:
        ValueError: unknown weight format or method.
    """
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weight format {weight_format}: use one of {WEIGHT_FORMATS}")
    if method not in ("gti", "mse"):
        raise ValueError(f"unknown weight scale method '{method}': use 'gti' or 'mse'")
    rows = _kernel_rows(w.detach())
    return _quantize_weight_rows(rows, weight_format, shift_scale(shift, rows), weight_bits, method).reshape(w.shape)


def _quantize_weight_rows(w: torch.Tensor, weight_format: int, scale, weight_bits: int, method: str) -> torch.Tensor:
    """quantize_weight_value on kernels as rows: w (K, n) float, one kernel per row (_kernel_rows);
    ``scale`` = 2^s as a Python float, a 0-d tensor, or a (K, 1) tensor holding each row's sublayer
    shift (several sublayers in one pass: quantize_conv_values). Every operation is elementwise or a
    reduction within a row, so a row's result does not depend on the rows beside it. Returns (K, n)."""
    sign = torch.sign(w)
    absw = w.abs()
    if weight_format in (8, 12):
        wq = _scaled_round(w, scale)
    elif method == "mse":
        d = _mse_scale_rows(absw, weight_format, scale)
        safe = torch.where(d > 0, d, torch.ones_like(d))
        wq = sign * _nearest_level(absw / safe, _LEVELS[weight_format]) * d
    else:
        if weight_format == 1:
            wq = sign * _scaled_round(absw.mean(1, keepdim=True), scale)
        elif weight_format == 2:
            m = _scaled_round(absw.mean(1, keepdim=True), scale)
            wq = sign * m * (absw >= m / 4).to(w.dtype)
        elif weight_format == 3:
            d = absw.mean(1, keepdim=True) / 4
            safe = torch.where(d > 0, d, torch.ones_like(d))
            c = torch.floor(absw / safe)
            c = torch.where(c >= 3, torch.full_like(c, 4.0), c)
            wq = sign * c * _scaled_round(d, scale)
        else:  # 5-bit
            d = absw.amax(1, keepdim=True) / 15
            safe = torch.where(d > 0, d, torch.ones_like(d))
            wq = chip_round(w / safe) * _scaled_round(d, scale)
    limit = float(2 ** (weight_bits - 1) - 1)
    return torch.clamp(chip_round(wq * scale), -limit, limit) / scale


def _scaled_round(x: torch.Tensor, scale) -> torch.Tensor:
    """Q_s(x) = R(x 2^s) / 2^s with ``scale`` = 2^s (a Python float or a tensor that broadcasts to x)."""
    return chip_round(x * scale) / scale


def quantize_bias_value(b: torch.Tensor, shift, bias_bits: int) -> torch.Tensor:
    """b_q = Q_s(b), clamped to the bias register +-(2^(Bb-1) - 1) / 2^s (no gradient handling).
    ``shift``: an int or a 0-d integer tensor (compute_shift)."""
    limit = float(2 ** (bias_bits - 1) - 1)
    scale = shift_scale(shift, b)
    return torch.clamp(chip_round(b.detach() * scale), -limit, limit) / scale


def quantize_conv_params(weight: torch.Tensor, bias: torch.Tensor | None, weight_format: int, weight_bits: int,
                         bias_bits: int, method: str = "gti"):
    """Quantize one sublayer's conv parameters with straight-through gradients.

    Args:
        weight: (O, I, 3, 3) float32 parameter.
        bias: (O,) float32 parameter or None.
        weight_format, weight_bits, bias_bits: the weight format and its registers (gnetmdk.gti.spec.register_bits).
        method: "gti" (GTI's rule) or "mse" (MSE-best per-kernel scale), see quantize_weight_value.
    Returns:
        (w_q, b_q, shift): w_q and b_q carry identity gradients to weight and bias; shift is an int,
        or, on the device path (device_path: weights on an accelerator), a 0-d int64 tensor on the
        weights' device, so that no step waits for the device; ``int(shift)`` reads it.
    """
    shift = compute_shift(weight, bias, weight_bits, bias_bits, as_tensor=device_path(weight))
    w_q = ste(weight, quantize_weight_value(weight, weight_format, shift, weight_bits, method))
    b_q = None if bias is None else ste(bias, quantize_bias_value(bias, shift, bias_bits))
    return w_q, b_q, shift


def quantize_conv_values(weights: Sequence[torch.Tensor], biases: Sequence[Optional[torch.Tensor]], weight_format: int,
                         weight_bits: int, bias_bits: int, method: str = "gti",
                         gains: Optional[Sequence[Tuple[float, float]]] = None):
    """Quantize several sublayers of one weight format in one pass: the values of quantize_conv_params
    for each, bit for bit, with a fixed number of operations however many sublayers there are.

    A training step quantizes every conv's weights; one pass per conv costs about sixty small
    operations each (shift, statistics, rounding), which on an accelerator means as many kernel
    launches. Here the kernels of all the sublayers are rows of one (K, n) tensor (_kernel_rows), the
    shifts come from per-sublayer maxima (scatter_reduce, an exact max), each row is scaled by its own
    sublayer's 2^s, and every other operation is elementwise or a reduction within a row, so each value
    is the same computation as in quantize_conv_params (tests/gti/test_quantize.py checks the equality).

    Args:
        weights: L float tensors (O_l, I_l, kh, kw) of one dtype, device and kernel size (read detached).
        biases: L tensors (O_l,) or None, of the weights' dtype.
        weight_format, weight_bits, bias_bits, method: the format shared by the L sublayers (see
            quantize_weight_value).
        gains: None, or L pairs (cap_in, cap_out) of Python floats: quantize the gain-edited values
            W cap_in / cap_out and b 31 / cap_out (float64 products, then the weights' dtype), as
            gnetmdk.layers.quant.QConv2d does in gain-aware step 3.
    Returns:
        (w_values, b_values, shifts): lists of L detached tensors (O_l, I_l, kh, kw) and (O_l,) (None
        where the bias is None), and L shifts: ints, or on the device path (device_path) 0-d int64
        tensors on the weights' device.
    Raises:
        ValueError: unknown weight format or method, or sublayers that differ in dtype, device or kernel size.
    """
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weight format {weight_format}: use one of {WEIGHT_FORMATS}")
    if method not in ("gti", "mse"):
        raise ValueError(f"unknown weight scale method '{method}': use 'gti' or 'mse'")
    n_layers = len(weights)
    if n_layers == 0:
        return [], [], []
    first = weights[0]
    if any(w.dtype != first.dtype or w.device != first.device or w.shape[2:] != first.shape[2:] for w in weights):
        raise ValueError("quantize_conv_values: the sublayers differ in dtype, device or kernel size")
    with_bias = biases[0] is not None
    if len(biases) != n_layers or any((b is not None) != with_bias for b in biases):
        raise ValueError("quantize_conv_values: give a bias for every sublayer or for none")
    dtype, dev = first.dtype, first.device
    rows = [_kernel_rows(w.detach()) for w in weights]
    kernels = [r.shape[0] for r in rows]
    kidx = _row_index(kernels, dev)
    w_all = torch.cat(rows) if n_layers > 1 else rows[0]                                 # (K, n)
    if with_bias:
        channels = [b.shape[0] for b in biases]
        cidx = _row_index(channels, dev)
        b_all = torch.cat([b.detach() for b in biases]) if n_layers > 1 else biases[0].detach()   # (C,)
    if gains is not None:       # gain editing's values (gnetmdk.gti.transforms.fold_requant_multipliers, float64)
        cin_rows, cout_rows, cout_channels = _gain_tensors(gains, dev, kernels, channels if with_bias else None)
        w_all = (w_all.double() * cin_rows / cout_rows).to(dtype)
        if with_bias:
            b_all = (b_all.double() * ACT_MAX / cout_channels).to(dtype)
    # per-sublayer max|W| and max|b| (0 for none): a max is exact in any order
    w_abs = w_all.abs()
    wmax = torch.zeros(n_layers, dtype=dtype, device=dev).scatter_reduce_(0, kidx, w_abs.amax(1), "amax")
    bmax = (torch.zeros(n_layers, dtype=dtype, device=dev).scatter_reduce_(0, cidx, b_all.abs(), "amax")
            if with_bias else None)
    if device_path(first):      # compute_shift(as_tensor=True) for all sublayers: nothing read back
        r = (2 ** (weight_bits - 1) - 1) / wmax.double()
        if with_bias:
            r = torch.minimum(r, (2 ** (bias_bits - 1) - 1) / bmax.double())
        powers = _constant([float(2 ** k) for k in range(1, MAX_SHIFT + 1)], torch.float64, dev)
        shift_t = (r.unsqueeze(1) >= powers).sum(1)                                         # (L,) int64
        layer_scale = _constant([float(2 ** k) for k in range(MAX_SHIFT + 1)], dtype, dev).index_select(0, shift_t)
        shifts = list(shift_t.unbind(0))
    else:
        maxima = (torch.stack([wmax, bmax]) if with_bias else wmax.unsqueeze(0)).tolist()
        bm = maxima[1] if with_bias else [0.0] * n_layers
        shifts = [_shift_from_max(a, b, weight_bits, bias_bits) for a, b in zip(maxima[0], bm)]
        layer_scale = torch.tensor([float(2 ** s) for s in shifts], dtype=dtype, device=dev)
    wq = _quantize_weight_rows(w_all, weight_format, layer_scale.index_select(0, kidx).unsqueeze(1), weight_bits,
                               method)
    w_out = [q.reshape(w.shape) for q, w in zip(wq.split(kernels), weights)]
    b_out: List[Optional[torch.Tensor]] = [None] * n_layers
    if with_bias:
        limit = float(2 ** (bias_bits - 1) - 1)
        bs = layer_scale.index_select(0, cidx)
        b_out = list((torch.clamp(chip_round(b_all * bs), -limit, limit) / bs).split(channels))
    return w_out, b_out, shifts


_GAINS: dict = {}


def _gain_tensors(gains: Sequence[Tuple[float, float]], device: torch.device, kernels: Sequence[int],
                  channels: Optional[Sequence[int]]):
    """The gains as float64 tensors on ``device``, spread to rows: (cap_in per kernel row (K, 1),
    cap_out per kernel row (K, 1), cap_out per output channel (C,) or None without ``channels``),
    sublayer l owning ``kernels[l]`` kernel rows and ``channels[l]`` channels (_row_index). Cached per
    value and layout (at most 16 kept), so fixed caps are copied to an accelerator and spread once,
    not every step."""
    key = (tuple((float(a), float(b)) for a, b in gains), str(device), tuple(kernels),
           None if channels is None else tuple(channels))
    t = _GAINS.get(key)
    if t is None:
        if len(_GAINS) >= 16:                  # learned caps change every step: keep the newest
            _GAINS.pop(next(iter(_GAINS)))
        cin, cout = torch.tensor(key[0], dtype=torch.float64).t().contiguous().to(device)
        kidx = _row_index(kernels, device)
        t = _GAINS[key] = (cin.index_select(0, kidx).unsqueeze(1), cout.index_select(0, kidx).unsqueeze(1),
                           None if channels is None else cout.index_select(0, _row_index(channels, device)))
    return t


_ROW_INDEX: dict = {}


def _row_index(counts: Sequence[int], device: torch.device) -> torch.Tensor:
    """int64 tensor (sum(counts),) holding l counts[l] times: the sublayer of every row (cached per
    layout and device, so a step builds none)."""
    key = (tuple(counts), str(device))
    t = _ROW_INDEX.get(key)
    if t is None:
        t = _ROW_INDEX[key] = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(list(counts),
                                                                                          dtype=torch.long)).to(device)
    return t


def integer_conv_params(weight: torch.Tensor, bias: torch.Tensor | None, weight_format: int, weight_bits: int,
                        bias_bits: int, method: str = "gti"):
    """The integers the chip stores for one sublayer: (W_int int64 (O,I,3,3), b_int int64 (O,), shift)."""
    w_q, b_q, shift = quantize_conv_params(weight.detach(), None if bias is None else bias.detach(),
                                           weight_format, weight_bits, bias_bits, method)
    shift = int(shift)
    scale = float(2 ** shift)
    w_int = torch.round(w_q.detach().double() * scale).to(torch.int64)
    if b_q is None:
        b_int = torch.zeros(weight.shape[0], dtype=torch.int64, device=weight.device)
    else:
        b_int = torch.round(b_q.detach().double() * scale).to(torch.int64)
    return w_int, b_int, shift


# ------------------------------------------------------------------ activations
class _CappedQuant(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cap, quantize, integer, revive, training=False, codes=ACT_MAX):
        ctx.save_for_backward(x, cap)
        ctx.revive = revive
        # the code domain's cap is the constant largest code, known on the host: its mask needs no cap tensor
        ctx.const_cap = float(codes) if quantize and integer else None
        if not quantize:
            return torch.minimum(torch.clamp(x, min=0), cap)
        if integer:  # cap == codes: the codes are R(clip(x)) themselves, no multiply that could round
            if training:   # three passes; floor(v + 0.5) = R(v) but for the float32 corner noted below
                return torch.clamp(x, 0, codes).add_(0.5).floor_()
            return _chip_round_nonneg_(torch.clamp(x, 0, codes))
        # R(clip(x, 0, cap) * 31 / cap) * cap / 31 in five passes over one buffer: v = clip(x * 31/cap,
        # 0, 31) >= 0, so R(v) = floor(v + 0.5) (the sum is exact except for v in [0.5 - 2^-25, 0.5),
        # a float32 corner; the integer path above rounds exactly outside training); 1023 for 31 in
        # the 10-bit output layer
        v = torch.mul(x, codes / cap).clamp_(0, codes)
        return v.add_(0.5).floor_().mul_(cap / codes)

    @staticmethod
    def backward(ctx, grad):
        x, cap = ctx.saved_tensors
        none = (None,) * 6
        if not ctx.revive:
            # grad where 0 < x < cap, else 0, in one fused pass (aten's hardtanh backward has exactly
            # this strict-interval mask; cap is a float32 value, so the comparison is unchanged). On the
            # device path the cap is read only where the host knows it (the code domain's 31) ...
            if ctx.const_cap is not None or not device_path(x):
                bound = ctx.const_cap if ctx.const_cap is not None else float(cap)
                return (torch.ops.aten.hardtanh_backward(grad, x, 0.0, bound),) + none
            # ... else the same mask from the cap tensor: nothing read back to the host
            inside = torch.gt(x, 0).logical_and_(torch.lt(x, cap))
            return (torch.where(inside, grad, 0.0),) + none
        mask = torch.gt(x, 0).logical_and_(torch.lt(x, cap))
        # revive: outside (0, cap) let through only the gradients that lead back inside
        mask = mask | ((x <= 0) & (grad < 0)) | ((x >= cap) & (grad > 0))
        return (grad.masked_fill(mask.logical_not_(), 0),) + none


def capped_relu(x: torch.Tensor, cap: torch.Tensor, quantize: bool = True, integer: bool = False,
                revive: bool = False, codes: int = ACT_MAX) -> torch.Tensor:
    """Capped ReLU with optional 5-bit quantization (docs/quantization.md, "Activations"):

        y = clip(x, 0, cap),  y_q = R(y * 31 / cap) * cap / 31

    (1023 for 31 with ``codes`` 1023: the 10-bit output mode, docs/quantization.md, "The 10-bit output
    mode").

    Args:
        x: float tensor, any shape (pre-activation).
        cap: 0-d float tensor (> 0), same dtype/device as x.
        quantize: False gives the clip alone.
        integer: step-4 semantics, cap must be ``codes``: returns the codes R(clip(x, 0, codes)) exactly.
            In a training forward (grad enabled and x requiring it) the codes are floor(clip(x) + 0.5),
            three passes instead of six: equal to R except for float32 values in [0.5 - 2^-25, 0.5),
            which give 1; evaluation, the chip comparison and the emulator never take that path.
        revive: training-only gradient choice for the output layer: outside (0, cap) the gradient
            also passes when it points back inside (x <= 0 with a gradient that raises x, x >= cap
            with one that lowers it), so an output unit whose pre-activation went negative for an
            object cell is not dead for good. The forward value is unchanged.
        codes: the largest code, 31 (5-bit activations) or 1023 (the 10-bit output layer).
    Returns:
        tensor like x; the gradient passes where 0 < x < cap (straight-through on the rounding).
    """
    cap = cap.to(dtype=x.dtype, device=x.device)
    return _CappedQuant.apply(x, cap, quantize, integer, revive, torch.is_grad_enabled() and x.requires_grad,
                              int(codes))


def activation_codes(y: torch.Tensor, cap: float | torch.Tensor, codes: int = ACT_MAX) -> torch.Tensor:
    """Codes 0..``codes`` (int64) of quantized activations y_q (inverse of y_q = code * cap / codes;
    ``codes`` 31, or 1023 for the 10-bit output layer)."""
    return torch.clamp(chip_round(y.detach().double() * codes / float(cap)), 0, codes).to(torch.int64)


def image_to_codes(img_u8):
    """The chip's input conversion, 8-bit pixels -> 5-bit codes: x5 = min(((x8 >> 2) + 1) >> 1, 31).

    Args:
        img_u8: numpy uint8 array or torch uint8 tensor, any shape.
    Returns:
        the same container type, dtype uint8, values 0..31.
    """
    if isinstance(img_u8, torch.Tensor):
        x = img_u8.to(torch.int32)
        return torch.clamp(((x >> 2) + 1) >> 1, max=ACT_MAX).to(torch.uint8)
    import numpy as np
    x = np.asarray(img_u8)
    if x.dtype == np.uint8:       # one table lookup per pixel (the same formula, tabulated once)
        return _CODE_TABLE[x]
    x = x.astype(np.int32)
    return np.minimum(((x >> 2) + 1) >> 1, ACT_MAX).astype(np.uint8)


def _code_table():
    import numpy as np
    x = np.arange(256, dtype=np.int32)
    return np.minimum(((x >> 2) + 1) >> 1, ACT_MAX).astype(np.uint8)


_CODE_TABLE = _code_table()


def value_histogram(x: torch.Tensor, bins: int, vmax: float, vmin: float = 0.0,
                    outside: str = "drop") -> torch.Tensor:
    """The histogram both calibrations count: ``bins`` equal bins over [vmin, vmax], as float64 counts.

    A value v goes to bin trunc((v - vmin) * bins / (vmax - vmin)) in float32 arithmetic (vmin, vmax
    and their difference rounded to float32), the last bin also holding vmax itself. What happens to
    the other values depends on ``outside``:

    * "drop" (the chip's caps, vmin = 0): only vmin < v <= vmax is counted; zeros, negatives, values
      above vmax and NaN are left out (the ReLU maps v <= 0 to 0 exactly, whatever the cap). With
      vmin = 0 the bins are torch.histc's (bins, min=0, max=vmax) on the CPU, value for value.
    * "clamp" (the int8 ranges, over the range pass's [min, max]): every value but NaN is counted,
      those below vmin in the first bin and those above vmax in the last.

    Written out rather than calling histc because histc on CUDA has no deterministic kernel (it
    raises under torch.use_deterministic_algorithms) and because selecting the values first would read
    their count back to the host; here the counting is a float64 scatter-add (exact for counts below
    2^53, so its order does not matter, and all-reducing the counts over processes is exact too) and
    nothing waits for the device.

    Args:
        x: float tensor, any shape, any device.
        bins: number of bins (>= 1); vmin < vmax: the edges (Python floats).
        outside: "drop" or "clamp" (above).
    Returns:
        (bins,) float64 counts on x's device.
    Raises:
        ValueError: ``outside`` not "drop" or "clamp", or vmax <= vmin.
    """
    if outside not in ("drop", "clamp"):
        raise ValueError(f"value_histogram: outside must be 'drop' or 'clamp', not {outside!r}")
    if not float(vmax) > float(vmin):
        raise ValueError(f"value_histogram: vmax ({vmax}) must be above vmin ({vmin})")
    v = x.detach().float().reshape(-1)
    lo = torch.tensor(float(vmin), dtype=torch.float32)
    hi = torch.tensor(float(vmax), dtype=torch.float32)            # histc's edge: vmax as float32
    pos = torch.sub(v, lo).mul_(float(bins)).div_(hi - lo).clamp_(0, bins - 1).to(torch.int64)
    if outside == "drop":
        keep = torch.gt(v, lo).logical_and_(torch.le(v, hi))
    else:
        keep = torch.isnan(v).logical_not_()
    pos = torch.where(keep, pos, torch.full((), bins, dtype=torch.int64, device=v.device))  # bin `bins`: dropped
    counts = torch.zeros(bins + 1, dtype=torch.float64, device=v.device)
    counts.scatter_add_(0, pos, torch.ones((), dtype=torch.float64, device=v.device).expand(pos.shape))
    return counts[:bins]


def histogram_mse_argmin(counts: torch.Tensor, centres: torch.Tensor, dequantized: torch.Tensor) -> int:
    """MSE calibration's choice, shared by both targets: the candidate fake quantizer whose output is
    nearest the histogram's values in squared error.

    err_j = sum_k counts_k (centres_k - dequantized_jk)^2; the smallest wins, the lowest j on a tie.
    The chip's 5-bit caps (:func:`mse_cap_from_histogram`) and the int8 ranges
    (gnetmdk.intq.calibrate.range_from_histogram) both call it, each with its own grid of candidates and
    its own rounding (docs/quantization.md, "Calibration").

    Args:
        counts: (K,) float64 bin counts.
        centres: (K,) float64, the value each bin stands for (its centre).
        dequantized: (J, K) float64, candidate j's fake-quantized (quantized, then dequantized) centres.
    Returns:
        j, a Python int.
    Raises:
        ValueError: shapes that do not fit (K differs, or ``dequantized`` is not 2-d).
    """
    if counts.dim() != 1 or centres.shape != counts.shape or dequantized.dim() != 2 \
            or dequantized.shape[1] != counts.numel():
        raise ValueError(f"histogram_mse_argmin: counts (K,), centres (K,) and dequantized (J, K), got "
                         f"{tuple(counts.shape)}, {tuple(centres.shape)}, {tuple(dequantized.shape)}")
    err = ((centres.unsqueeze(0) - dequantized) ** 2 * counts.unsqueeze(0)).sum(1)      # (J,)
    return int(torch.argmin(err))


def mse_cap_from_histogram(counts: torch.Tensor, vmax: float, candidates: int = 400, codes: int = ACT_MAX) -> float:
    """The activation cap that minimises the squared error of the 5-bit capped ReLU over a histogram
    (of the 10-bit one with ``codes`` 1023).

    For a cap c the chip computes y_q = R(clip(v, 0, c) * 31 / c) * c / 31 (docs/quantization.md,
    "Activations"; R rounds half away from zero). Each of the K bins of ``counts`` stands for its centre
    v_k = (k + 1/2) vmax / K; the error of a cap is sum_k counts_k (v_k - y_q(v_k))^2: the rounding
    error below c and the clipping error v_k - c above it. The caps tried are vmax * j / candidates,
    j = 1..candidates; the smallest error wins (the lower cap on a tie). This is MSE calibration as in
    TensorRT / AIMET, with the chip's rounding and 31 levels.

    Args:
        counts: (K,) histogram of the positive pre-ReLU values over [0, vmax] (value_histogram, any
            device; values <= 0 are left out: the ReLU maps them to 0 exactly, whatever the cap).
        vmax: the largest value (> 0), the histogram's upper edge.
        candidates: how many caps to try.
        codes: the largest code: 31, or 1023 for the 10-bit output layer (y_q on 1023 steps of c / 1023).
    Returns:
        the cap (a Python float, 0 < cap <= vmax).
    Raises:
        ValueError: vmax is not positive, or counts is not 1-d.
    """
    if not vmax > 0:
        raise ValueError(f"mse_cap_from_histogram: vmax must be positive, not {vmax}")
    if counts.dim() != 1:
        raise ValueError(f"mse_cap_from_histogram: counts must be 1-d, got shape {tuple(counts.shape)}")
    counts = counts.detach().to("cpu", torch.float64)     # a few thousand numbers: the search runs on the host
    k = counts.numel()
    centers = (torch.arange(k, dtype=torch.float64) + 0.5) * (vmax / k)
    caps = torch.arange(1, candidates + 1, dtype=torch.float64) * (vmax / candidates)     # (J,)
    c = caps.unsqueeze(1)                                                                  # (J, 1)
    y = chip_round(torch.clamp(centers.unsqueeze(0), max=c) * codes / c) * c / codes      # (J, K)
    return float(caps[histogram_mse_argmin(counts, centers, y)])
