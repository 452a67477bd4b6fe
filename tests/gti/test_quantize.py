"""Property and hand-worked tests for gnetmdk.gti.quantize (docs/quantization.md)."""

import contextlib
import copy
import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gnetmdk.gti import quantize as Q
from gnetmdk.gti.spec import CHIPS

SETTINGS = settings(max_examples=50, deadline=None)
FEW = settings(max_examples=25, deadline=None)

# every (weight format, Bw, Bb) some chip has, plus the 2-bit/5-bit/12-bit weight formats with 8-bit registers
REGISTERS = sorted({(fmt, bw, bb) for spec in CHIPS.values() for fmt, (bw, bb) in spec.weight_formats.items()})
WEIGHT_FORMATS = (1, 2, 3, 5, 8, 12)


def exact_round(v: float) -> int:
    """R(v) in exact rational arithmetic: round half away from zero."""
    f = Fraction(v)
    r = math.floor(abs(f) + Fraction(1, 2))
    return r if f >= 0 else -r


def weights(seed, o, i, log_std, zero_frac, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(o, i, 3, 3, generator=g, dtype=torch.float64) * (10.0 ** log_std)
    if zero_frac > 0:
        w = w * (torch.rand(o, i, 3, 3, generator=g, dtype=torch.float64) >= zero_frac)
    return w.to(dtype)


weight_args = dict(
    seed=st.integers(0, 2 ** 31 - 1),
    o=st.integers(1, 4),
    i=st.integers(1, 4),
    log_std=st.floats(-3.5, 0.5),
    zero_frac=st.sampled_from([0.0, 0.0, 0.3]),
)


# ------------------------------------------------------------------ chip_round
def test_chip_round_hand_cases():
    x = torch.tensor([0.5, -0.5, 1.5, 2.5, -2.5, -1.5, 0.49, -0.51, 3.0, 0.0, 2.4999, 7.5])
    assert Q.chip_round(x).tolist() == [1, -1, 2, 3, -3, -2, 0, -1, 3, 0, 2, 8]
    assert Q.chip_round(x).dtype == torch.float32
    assert Q.chip_round(x.double()).tolist() == [1, -1, 2, 3, -3, -2, 0, -1, 3, 0, 2, 8]


def test_chip_round_does_not_round_the_sum():
    # the largest float32 below 0.5: |x| + 0.5 rounds up to 1.0 in float32, R(x) must still be 0
    below_half = float(np.nextafter(np.float32(0.5), np.float32(0)))
    x = torch.tensor([below_half, -below_half, 2.0 ** 23 + 1, -(2.0 ** 23 + 1)], dtype=torch.float32)
    assert Q.chip_round(x).tolist() == [0, 0, 2.0 ** 23 + 1, -(2.0 ** 23 + 1)]
    xd = torch.tensor([0.5 - 2.0 ** -54, 2.0 ** 52 + 1], dtype=torch.float64)
    assert Q.chip_round(xd).tolist() == [0, 2.0 ** 52 + 1]


@SETTINGS
@given(st.lists(st.floats(-1e6, 1e6, width=32), min_size=1, max_size=40))
def test_chip_round_float32_property(values):
    x = torch.tensor(values, dtype=torch.float32)
    assert Q.chip_round(x).tolist() == [exact_round(v) for v in x.tolist()]


@SETTINGS
@given(st.lists(st.floats(0, 1e7, width=32), min_size=1, max_size=40),
       st.lists(st.integers(0, 1000), min_size=1, max_size=10),
       st.sampled_from([torch.float32, torch.float64]))
def test_chip_round_nonneg_inplace_property(values, halves, dtype):
    """The in-place rounding of the integer activation path (x >= 0, floor-based) equals R."""
    below_half = float(np.nextafter(np.float32(0.5), np.float32(0)))
    values = values + [h + 0.5 for h in halves] + [below_half, 0.0, 2.0 ** 23 + 1, 30.5, 31.0]
    x = torch.tensor(values, dtype=dtype)
    expected = [exact_round(v) for v in x.tolist()]
    y = x.clone()
    out = Q._chip_round_nonneg_(y)
    assert out.data_ptr() == y.data_ptr() and out.dtype == dtype       # in place
    assert out.tolist() == expected


def test_integer_capped_relu_is_chip_round_of_the_clip():
    """Step-4 / code-domain activations: R(clip(x, 0, 31)), ties away from zero, the float32 value
    just below 0.5 to 0, in float32 and float64."""
    below_half = float(np.nextafter(np.float32(0.5), np.float32(0)))
    vals = [-3.0, -0.5, 0.0, below_half, 0.5, 1.5, 2.5, 2.4999, 30.49, 30.5, 31.0, 31.7, 100.0]
    for dtype in (torch.float32, torch.float64):
        x = torch.tensor(vals, dtype=dtype)
        y = Q.capped_relu(x, torch.tensor(31.0), quantize=True, integer=True)
        assert y.tolist() == [0, 0, 0, 0, 1, 2, 3, 2, 30, 31, 31, 31, 31]
        assert y.dtype == dtype
        # a training forward (autograd recording) rounds as floor(v + 0.5): the same codes but for
        # the float32 value just below 0.5 (the documented corner), and the gradient passes on (0, 31)
        xg = x.clone().requires_grad_(True)
        yg = Q.capped_relu(xg, torch.tensor(31.0), quantize=True, integer=True)
        corner = [1] if dtype == torch.float32 else [0]
        assert yg.tolist() == [0, 0, 0] + corner + [1, 2, 3, 2, 30, 31, 31, 31, 31]
        yg.sum().backward()
        assert xg.grad.tolist() == [0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0]


@SETTINGS
@given(st.lists(st.floats(-1e9, 1e9), min_size=1, max_size=40),
       st.lists(st.integers(-1000, 1000), min_size=1, max_size=10))
def test_chip_round_float64_property(values, halves):
    values = values + [h + 0.5 for h in halves]          # make sure ties are exercised
    x = torch.tensor(values, dtype=torch.float64)
    r = Q.chip_round(x)
    assert r.tolist() == [exact_round(v) for v in values]
    assert torch.equal(Q.chip_round(-x), -r)


def test_round_ste_gradient_identity():
    x = torch.tensor([0.4, 1.5, -2.5, 3.7], requires_grad=True)
    y = Q.round_ste(x)
    assert y.tolist() == [0, 2, -3, 4]
    g = torch.tensor([1.0, -2.0, 3.0, 0.5])
    y.backward(g)
    assert torch.equal(x.grad, g)


# ------------------------------------------------------------------ compute_shift
def test_compute_shift_hand_cases():
    w = torch.zeros(2, 1, 3, 3)
    w[0, 0, 1, 1] = -0.9
    w[1, 0, 0, 0] = 0.3
    # floor(log2(127 / 0.9)) = floor(7.14) = 7
    assert Q.compute_shift(w, None, 8, 20) == 7
    # Bw = 12: floor(log2(2047 / 0.9)) = floor(11.15) = 11
    assert Q.compute_shift(w, None, 12, 20) == 11
    # a zero bias does not constrain
    assert Q.compute_shift(w, torch.zeros(2), 8, 20) == 7
    assert Q.compute_shift(w, torch.zeros(2), 8, 2) == 7
    # bias limits: floor(log2(2047 / 10)) = floor(7.68) = 7 < floor(log2(2047 / 0.9)) = 11
    assert Q.compute_shift(w, torch.tensor([10.0, -1.0]), 12, 12) == 7
    # bias limits: floor(log2(2047 / 40)) = floor(5.68) = 5
    assert Q.compute_shift(w, torch.tensor([1.0, -40.0]), 12, 12) == 5
    # bias not limiting: floor(log2(524287 / 40)) = 13 > 7
    assert Q.compute_shift(w, torch.tensor([1.0, -40.0]), 8, 20) == 7
    # exact power of 2: 127 / (127/128) = 128 = 2^7 -> 7 (not 6)
    w2 = torch.full((1, 1, 3, 3), 127.0 / 128.0)
    assert Q.compute_shift(w2, None, 8, 20) == 7
    # clipped to 12 from above
    assert Q.compute_shift(torch.full((1, 1, 3, 3), 1e-4), None, 8, 20) == 12
    assert Q.compute_shift(torch.zeros(1, 1, 3, 3), None, 8, 20) == 12
    assert Q.compute_shift(torch.zeros(1, 1, 3, 3), torch.zeros(1), 8, 20) == 12
    # clipped to 0 from below
    assert Q.compute_shift(torch.full((1, 1, 3, 3), 1000.0), None, 8, 20) == 0
    assert Q.compute_shift(w, torch.tensor([1e9]), 8, 20) == 0


@SETTINGS
@given(**weight_args, bias_log=st.floats(-4, 4), bias_zero=st.booleans(),
       regs=st.sampled_from([(8, 20), (12, 12), (12, 18), (12, 16)]))
def test_compute_shift_formula(seed, o, i, log_std, zero_frac, bias_log, bias_zero, regs):
    w = weights(seed, o, i, log_std, zero_frac)
    bw, bb = regs
    b = torch.randn(o, generator=torch.Generator().manual_seed(seed + 1)) * 10.0 ** bias_log
    if bias_zero:
        b = torch.zeros(o)
    limits = []
    wmax = float(w.abs().max())
    if wmax > 0:
        limits.append(math.floor(math.log2((2 ** (bw - 1) - 1) / wmax)))
    bmax = float(b.abs().max())
    if bmax > 0:
        limits.append(math.floor(math.log2((2 ** (bb - 1) - 1) / bmax)))
    expected = min(max(min(limits), 0), 12) if limits else 12
    s = Q.compute_shift(w, b, bw, bb)
    assert s == expected
    # the shift fits max|W| and max|b| into the registers (unless clipped at 0)
    if s > 0:
        assert wmax * 2 ** s <= 2 ** (bw - 1) - 1 and bmax * 2 ** s <= 2 ** (bb - 1) - 1


# ------------------------------------------------------------------ weight formats
def _int_codes(wq: torch.Tensor, shift: int) -> np.ndarray:
    return (wq.double() * 2.0 ** shift).numpy()


def _check_levels(weight_format, method, w, wint, shift, bw):
    """Per-kernel level structure of the integer codes ``wint`` (O, I, 3, 3) int64 numpy."""
    limit = 2 ** (bw - 1) - 1
    scale = 2.0 ** shift
    w64 = w.double().numpy()
    absw = np.abs(w.numpy())                                     # float32, as the library sees it
    mean = w.abs().mean(dim=(2, 3)).numpy()                      # float32 per-kernel statistics
    amax = w.abs().amax(dim=(2, 3)).numpy()
    o, i = w.shape[:2]
    for a in range(o):
        for b in range(i):
            k = wint[a, b].reshape(-1)
            mags = np.abs(k)
            nz = sorted(set(mags[mags > 0].tolist()))
            # the sign of every nonzero code is the sign of its weight
            assert np.all(np.sign(k[mags > 0]) == np.sign(w64[a, b].reshape(-1)[mags > 0]))
            if weight_format == 1:
                assert len(nz) <= 1
                if method == "gti":
                    m = min(exact_round(float(np.float32(mean[a, b]) * np.float32(scale))), limit)
                    expect = np.where(w64[a, b].reshape(-1) != 0, m, 0)
                    assert np.array_equal(mags, expect)
            elif weight_format == 2:
                assert len(nz) <= 1
                if method == "gti":
                    m = exact_round(float(np.float32(mean[a, b]) * np.float32(scale)))
                    mf = np.float32(m / scale)
                    keep = absw[a, b].reshape(-1) >= mf / np.float32(4)
                    assert np.array_equal(mags, np.where(keep, min(m, limit), 0))
            elif weight_format == 3:
                assert len(nz) <= 3
                if method == "gti":
                    d = np.float32(mean[a, b]) / np.float32(4)
                    ds = [exact_round(float(d * np.float32(scale)))]
                else:
                    ds = sorted({m // f for m in nz for f in (1, 2, 4) if m % f == 0} | {1})
                ok = any(set(nz) <= {D, 2 * D, min(4 * D, limit)} for D in ds if D > 0) or not nz
                assert ok, (nz, ds)
            elif weight_format == 5:
                assert len(nz) <= 15
                if method == "gti":
                    d = np.float32(amax[a, b]) / np.float32(15)
                    ds = [exact_round(float(d * np.float32(scale)))]
                else:
                    top = max([m for m in nz if m != limit], default=0)
                    ds = [D for D in range(max(1, -(-top // 15)), top + 1)]
                ok = (not nz) or any(all((m % D == 0 and m // D <= 15) or m == limit for m in nz)
                                     for D in ds if D > 0)
                assert ok, (nz, ds)
            else:  # 8, 12: W_int = clamp(R(w * 2^s))
                expect = [max(-limit, min(limit, exact_round(float(v * np.float32(scale)))))
                          for v in w.numpy()[a, b].reshape(-1)]
                assert k.tolist() == expect


@pytest.mark.parametrize("method", ["gti", "mse"])
@pytest.mark.parametrize("weight_format", WEIGHT_FORMATS)
@FEW
@given(**weight_args, bw=st.sampled_from([8, 12]))
def test_weight_quantization_properties(weight_format, method, seed, o, i, log_std, zero_frac, bw):
    w = weights(seed, o, i, log_std, zero_frac)
    shift = Q.compute_shift(w, None, bw, 20)
    wq = Q.quantize_weight_value(w, weight_format, shift, bw, method)
    assert wq.dtype == torch.float32 and wq.shape == w.shape
    scaled32 = wq * 2.0 ** shift
    # every w_q * 2^s is an integer, in float32 and in float64
    assert torch.equal(scaled32, torch.round(scaled32))
    scaled64 = wq.double() * 2.0 ** shift
    assert torch.equal(scaled64, torch.round(scaled64))
    assert torch.equal(scaled64, scaled32.double())
    wint = scaled64.numpy().astype(np.int64)
    limit = 2 ** (bw - 1) - 1
    assert np.abs(wint).max() <= limit
    _check_levels(weight_format, method, w, wint, shift, bw)


# a kernel worked by hand: mean|w| = 1.9 / 9, max|w| = 0.45, Bw = 8 -> s = floor(log2(127/0.45)) = 8
HAND_KERNEL = [0.1, -0.2, 0.05, 0.3, -0.4, 0.0, 0.15, -0.25, 0.45]
HAND_EXPECTED = {
    # Q_8(mean) = R(54.04) / 256 = 54 / 256, signs of w, 0 stays 0
    1: [54, -54, 54, 54, -54, 0, 54, -54, 54],
    # m = 54/256 = 0.2109, keep |w| >= m/4 = 0.0527: 0.05 and 0 drop out
    2: [54, -54, 0, 54, -54, 0, 54, -54, 54],
    # d = mean/4 = 0.05278, c = floor(|w|/d) = 1, 3, 0, 5, 7, 0, 2, 4, 8 -> c >= 3 -> 4;
    # Q_8(d) = R(13.51) = 14
    3: [14, -56, 0, 56, -56, 0, 28, -56, 56],
    # d = 0.45 / 15 = 0.03, codes R(w/d) = 3, -7, 2, 10, -13, 0, 5, -8, 15; Q_8(d) = R(7.68) = 8
    5: [24, -56, 16, 80, -104, 0, 40, -64, 120],
    # R(w * 256) = R(25.6), R(-51.2), R(12.8), R(76.8), R(-102.4), 0, R(38.4), R(-64), R(115.2)
    8: [26, -51, 13, 77, -102, 0, 38, -64, 115],
}


@pytest.mark.parametrize("weight_format", sorted(HAND_EXPECTED))
def test_weight_formats_by_hand(weight_format):
    w = torch.tensor(HAND_KERNEL).reshape(1, 1, 3, 3)
    b = torch.tensor([0.3])
    wq, bq, shift = Q.quantize_conv_params(w, b, weight_format, 8, 20, "gti")
    assert shift == 8
    assert (wq.detach().double() * 256).reshape(-1).tolist() == HAND_EXPECTED[weight_format]
    assert float(bq) * 256 == 77                      # R(0.3 * 256) = R(76.8)
    wint, bint, s2 = Q.integer_conv_params(w, b, weight_format, 8, 20, "gti")
    assert s2 == 8 and wint.reshape(-1).tolist() == HAND_EXPECTED[weight_format] and bint.tolist() == [77]


def test_3bit_gti_rule_on_one_kernel_generic():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(1, 1, 3, 3, generator=g) * 0.2
    shift = Q.compute_shift(w, None, 8, 20)
    wq = Q.quantize_weight_value(w, 3, shift, 8, "gti")
    flat = w.reshape(-1).tolist()
    mean = sum(abs(v) for v in flat) / 9
    d = mean / 4
    dq = exact_round(d * 2 ** shift) / 2 ** shift
    expect = []
    for v in flat:
        c = math.floor(abs(v) / d)
        c = 4 if c >= 3 else c
        expect.append(math.copysign(c * dq, v) if c else 0.0)
    assert wq.reshape(-1).tolist() == pytest.approx(expect, abs=0)


@pytest.mark.parametrize("method", ["gti", "mse"])
def test_codes_clamped_to_weight_register(method):
    # all |w| = 0.99, Bw = 8: s = floor(log2(127 / 0.99)) = 7; 3-bit d = 0.99 / 4, Q_7(d) * 2^7 =
    # R(31.68) = 32, c = 4 -> 4 * 32 = 128 does not fit the 8-bit register: clamped to 127
    w = torch.tensor([0.99, -0.99] * 4 + [0.99]).reshape(1, 1, 3, 3)
    wq, _, shift = Q.quantize_conv_params(w, None, 3, 8, 20, method)
    assert shift == 7
    assert (wq.double() * 128).reshape(-1).tolist() == [127.0, -127.0] * 4 + [127.0]
    wint, _, _ = Q.integer_conv_params(w, None, 3, 8, 20, method)
    assert int(wint.abs().max()) == 127


def test_bias_clamped_to_bias_register():
    # s is 12 from the tiny weights; the bias 0.6 * 2^12 = 2457.6 > 2047 is held at the 12-bit limit
    # only if the bias did not limit s: pass it to quantize_bias_value directly
    assert (Q.quantize_bias_value(torch.tensor([0.6, -0.6, 0.1]), 12, 12) * 4096).tolist() == [2047, -2047, 410]


def test_weight_format_refusals():
    w = torch.randn(1, 1, 3, 3)
    with pytest.raises(ValueError, match="unknown weight format 4"):
        Q.quantize_weight_value(w, 4, 8, 8)
    with pytest.raises(ValueError, match="method"):
        Q.quantize_weight_value(w, 3, 8, 8, method="l1")


def _definition_mse_scale(kernel, weight_format, shift, candidates=32):
    """The MSE-best d of one 3x3 kernel, straight from its definition: for each candidate
    d = Q_s(f max|w| / top), f = linspace(0.15, 1, candidates), every weight takes the level of
    weight format's set nearest to |w| / d (the lower one on a tie; a zero weight is 0), and the first d with
    the least sum of (sign(w) level d - w)^2 wins. Plain Python: d and |w| / d in the kernel's dtype,
    the errors in exact rational arithmetic."""
    dt = kernel.dtype
    levels = {1: [1.0], 2: [0.0, 1.0], 3: [0.0, 1.0, 2.0, 4.0], 5: [float(k) for k in range(16)]}[weight_format]
    ws = kernel.reshape(-1).tolist()
    amax = torch.tensor(max(abs(v) for v in ws), dtype=dt)
    base = amax / levels[-1]
    best_d, best_err = None, None
    for f in torch.linspace(0.15, 1.0, candidates, dtype=dt):
        d = Q.quantize_shift(base * f, shift)
        safe = d if float(d) > 0 else torch.ones((), dtype=dt)
        err = Fraction(0)
        for v in ws:
            vt = torch.tensor(v, dtype=dt)
            r = float(vt.abs() / safe)
            if v == 0:
                lvl = 0.0
            else:
                lvl = levels[0]
                for lo, hi in zip(levels[:-1], levels[1:]):
                    if r > (lo + hi) / 2:
                        lvl = hi
            err += (Fraction(math.copysign(lvl, v)) * Fraction(float(d)) - Fraction(v)) ** 2
        if best_err is None or err < best_err:
            best_d, best_err = d, err
    return float(best_d)


@pytest.mark.parametrize("weight_format", [1, 2, 3, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shift", [2, 4, 10])
def test_mse_scale_matches_the_definition(weight_format, dtype, shift):
    """The vectorised per-kernel MSE scale picks the d of the definition for every kernel: random
    kernels over three decades, kernels on a coarse grid (ties between levels and between
    candidates), and all-zero and one-nonzero kernels; small shifts give many d = 0 candidates."""
    g = torch.Generator().manual_seed(weight_format)
    w = torch.randn(12, 12, 3, 3, generator=g, dtype=torch.float64)
    w = w * torch.logspace(-2, 1, 12, dtype=torch.float64).view(12, 1, 1, 1)
    w[10] = torch.round(w[10] * 4) / 4
    w[11, 0] = 0.0
    w[11, 1] = 0.0
    w[11, 1, 1, 1] = 0.75
    w = w.to(dtype)
    got = Q._mse_scale(w, weight_format, shift)
    assert got.shape == (12, 12, 1, 1) and got.dtype == dtype
    for o in range(12):
        for i in range(12):
            assert float(got[o, i]) == _definition_mse_scale(w[o, i], weight_format, shift), (o, i)
    assert float(got[11, 0]) == 0.0                  # an all-zero kernel gets d = 0
    assert len(torch.unique(got)) > (50 if shift == 10 else 5)     # the kernels do get different scales


def test_mse_scale_picks_the_exact_optimum_in_a_near_tie():
    """A 1-bit kernel of a trained cards model whose two best candidates differ in error by 2.4 parts
    in 10^8: a search with float32 sums picked the worse d = 8/1024; the exact
    definition and the search pick 7/1024."""
    kernel = torch.tensor([-0.015428667888045311, 0.0017884544795379043, -0.004013287369161844,
                           0.0076685440726578236, -0.0008466049912385643, 0.008302348665893078,
                           0.006059699691832066, 0.012518329545855522, 0.009292029775679111]).view(1, 1, 3, 3)
    want = _definition_mse_scale(kernel[0, 0], 1, 10)
    assert want == 7 / 1024
    assert float(Q._mse_scale(kernel, 1, 10)) == want
    # an exact tie: |w| = 7.5/1024 everywhere, so d = 7/1024 and 8/1024 have equal errors; the first wins
    tie = torch.full((1, 1, 3, 3), 7.5 / 1024) * torch.tensor([1.0, -1.0, 1.0]).view(1, 1, 1, 3)
    assert _definition_mse_scale(tie[0, 0], 1, 10) == 7 / 1024
    assert float(Q._mse_scale(tie, 1, 10)) == 7 / 1024
    # the same through the midpoint sweep (3-bit): d = 5/64 and 6/64 have equal exact errors
    tie3 = torch.tensor([0.296875, 0.046875, 0.34375, 0.1875, 0.09375, 0.125, 0.171875, 0.359375,
                         0.234375]).view(1, 1, 3, 3)
    assert _definition_mse_scale(tie3[0, 0], 3, 6) == 5 / 64
    assert float(Q._mse_scale(tie3, 3, 6)) == 5 / 64


def test_mse_scale_sweep_in_chunks_equals_one_pass(monkeypatch):
    """Wide layers are swept a few thousand kernels at a time; the chunks change nothing."""
    w = torch.randn(40, 24, 3, 3, generator=torch.Generator().manual_seed(3)) * 0.1
    whole = {s: Q._mse_scale(w, s, 7) for s in (2, 3)}
    monkeypatch.setattr(Q, "_SWEEP_CHUNK_VALUES", 7 * 27)          # 7 kernels per pass, 138 passes
    for s in (2, 3):
        assert torch.equal(Q._mse_scale(w, s, 7), whole[s])


@SETTINGS
@given(seed=st.integers(0, 2 ** 31 - 1), o=st.integers(1, 6), i=st.integers(1, 6),
       log_std=st.floats(-3, 0), bw=st.sampled_from([8, 12]))
def test_mse_error_not_above_gti_for_3bit(seed, o, i, log_std, bw):
    w = weights(seed, o, i, log_std, 0.0)
    shift = Q.compute_shift(w, None, bw, 20)
    e_gti = float(((Q.quantize_weight_value(w, 3, shift, bw, "gti").double() - w.double()) ** 2).sum())
    e_mse = float(((Q.quantize_weight_value(w, 3, shift, bw, "mse").double() - w.double()) ** 2).sum())
    assert e_mse <= e_gti * (1 + 1e-6)


@pytest.mark.parametrize("method", ["gti", "mse"])
@pytest.mark.parametrize("regs", REGISTERS)
@FEW
@given(**weight_args, bias_log=st.floats(-3, 2), with_bias=st.booleans())
def test_integer_params_agree_with_quantized(regs, method, seed, o, i, log_std, zero_frac, bias_log, with_bias):
    weight_format, bw, bb = regs
    w = weights(seed, o, i, log_std, zero_frac)
    b = (torch.randn(o, generator=torch.Generator().manual_seed(seed ^ 5)) * 10.0 ** bias_log
         if with_bias else None)
    wq, bq, shift = Q.quantize_conv_params(w, b, weight_format, bw, bb, method)
    wint, bint, s2 = Q.integer_conv_params(w, b, weight_format, bw, bb, method)
    assert s2 == shift
    assert wint.dtype == torch.int64 and bint.dtype == torch.int64 and bint.shape == (o,)
    assert torch.equal(wint.double() / 2.0 ** shift, wq.double())
    assert int(wint.abs().max()) <= 2 ** (bw - 1) - 1
    assert int(bint.abs().max()) <= 2 ** (bb - 1) - 1
    if b is None:
        assert bq is None and int(bint.abs().max()) == 0
    else:
        assert torch.equal(bint.double() / 2.0 ** shift, bq.double())
        # b_int = R(b * 2^s), clamped to the bias register
        lim = 2 ** (bb - 1) - 1
        assert bint.tolist() == [max(-lim, min(lim, exact_round(float(v) * 2 ** shift))) for v in b.tolist()]


@pytest.mark.parametrize("method", ["gti", "mse"])
@pytest.mark.parametrize("weight_format", WEIGHT_FORMATS)
def test_quantize_conv_params_gradient_is_identity(weight_format, method):
    g = torch.Generator().manual_seed(weight_format)
    w = (torch.randn(3, 2, 3, 3, generator=g) * 0.1).requires_grad_()
    b = (torch.randn(3, generator=g) * 0.1).requires_grad_()
    wq, bq, shift = Q.quantize_conv_params(w, b, weight_format, 12, 20, method)
    assert not torch.equal(wq.detach(), w.detach())              # it did quantize
    gw = torch.randn(3, 2, 3, 3, generator=g)
    gb = torch.randn(3, generator=g)
    ((wq * gw).sum() + (bq * gb).sum()).backward()
    assert torch.equal(w.grad, gw)
    assert torch.equal(b.grad, gb)


# ------------------------------------------------------------------ activations
@SETTINGS
@given(seed=st.integers(0, 2 ** 31 - 1), cap=st.floats(0.05, 40.0), n=st.integers(1, 64))
def test_capped_relu_forward_and_codes(seed, cap, n):
    g = torch.Generator().manual_seed(seed)
    x = (torch.rand(n, generator=g) * 1.6 - 0.3) * cap
    x[0] = -1.0
    capt = torch.tensor(cap, dtype=torch.float32)
    y = Q.capped_relu(x, capt)
    c32 = float(capt)
    # y_q = R(clip(x, 0, cap) * 31 / cap) * cap / 31, computed independently in float32 + exact rounding
    t = (torch.clamp(x, 0, c32) * 31 / c32).tolist()
    codes_ref = [exact_round(v) for v in t]
    assert all(0 <= c <= 31 for c in codes_ref)
    expect = torch.tensor(codes_ref, dtype=torch.float32) * c32 / 31
    assert torch.allclose(y, expect, rtol=1e-6, atol=0)
    codes = Q.activation_codes(y, capt)
    assert codes.dtype == torch.int64
    assert codes.tolist() == codes_ref
    assert int(codes.min()) >= 0 and int(codes.max()) <= 31
    # unquantized: the clip alone
    assert torch.equal(Q.capped_relu(x, capt, quantize=False), torch.clamp(x, 0, c32))


def test_capped_relu_hand_values():
    cap = torch.tensor(6.2)
    x = torch.tensor([-1.0, 0.0, 0.1, 0.3, 3.1, 6.2, 9.0])
    # codes R(clip(x) * 31 / 6.2) = R(5 * clip(x)): 0, 0, R(0.5)=1, R(1.5)=2, R(15.5)=16, 31, 31
    assert Q.activation_codes(Q.capped_relu(x, cap), cap).tolist() == [0, 0, 1, 2, 16, 31, 31]


@SETTINGS
@given(seed=st.integers(0, 2 ** 31 - 1), cap=st.floats(0.5, 40.0))
def test_capped_relu_gradient(seed, cap):
    g = torch.Generator().manual_seed(seed)
    x = (torch.rand(40, generator=g) * 2 - 0.5) * cap
    capt = torch.tensor(cap, dtype=torch.float32)
    x[:3] = torch.tensor([0.0, float(capt), -0.0])
    x.requires_grad_()
    up = torch.randn(40, generator=g)
    Q.capped_relu(x, capt).backward(up)
    inside = (x.detach() > 0) & (x.detach() < capt)
    assert torch.equal(x.grad, torch.where(inside, up, torch.zeros_like(up)))
    assert x.grad[0] == 0 and x.grad[1] == 0


@pytest.mark.parametrize("integer", [False, True])
@pytest.mark.parametrize("forced", [False, True])
def test_capped_relu_gradient_on_both_paths_device_cpu(integer, forced):
    """The straight-through mask 0 < x < cap on the host path and on the device path (cap tensor, or
    the code domain's constant 31), boundaries included: the gradient of a reference where()."""
    g = torch.Generator().manual_seed(3)
    cap = torch.tensor(31.0 if integer else 2.7182817)
    x = (torch.rand(500, generator=g) * 1.4 - 0.2) * cap
    x[:4] = torch.tensor([0.0, -0.0, float(cap), float(torch.nextafter(cap, torch.tensor(0.0)))])
    x.requires_grad_()
    up = torch.randn(500, generator=g)
    with (Q.force_device_path() if forced else contextlib.nullcontext()):
        Q.capped_relu(x, cap, integer=integer).backward(up)
    inside = (x.detach() > 0) & (x.detach() < cap)
    assert torch.equal(x.grad, torch.where(inside, up, torch.zeros_like(up)))
    assert x.grad[:3].tolist() == [0.0, 0.0, 0.0] and x.grad[3] == up[3]


def test_ste_many_equals_one_ste_per_tensor_device_cpu():
    """ste_many: the values bit for bit, and each parameter's gradient equal to ste(x * f, v)'s (f a
    Python float, the gain-aware step 3's gains) bit for bit; identity without factors; refusals."""
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(5, 3, generator=g, requires_grad=True), torch.randn(7, generator=g, requires_grad=True)]
    vs = [torch.randn(5, 3, generator=g), torch.randn(7, generator=g)]
    ups = [torch.randn(5, 3, generator=g), torch.randn(7, generator=g)]
    factors = [1.0 / 3.0, 31.0 / 2.7182817]
    for fs in (factors, None):
        outs = Q.ste_many(xs, vs, fs)
        assert all(torch.equal(o, v) for o, v in zip(outs, vs))
        torch.autograd.backward(list(outs), ups)
        got = [x.grad.clone() for x in xs]
        for x in xs:
            x.grad = None
        ref = [Q.ste(x * f, v) if fs else Q.ste(x, v) for x, v, f in zip(xs, vs, factors)]
        torch.autograd.backward(ref, ups)
        for a, x in zip(got, xs):
            assert torch.equal(a, x.grad)
            x.grad = None
    assert torch.equal(got[0], ups[0])                     # no factors: the gradient itself
    assert Q.ste_many([], []) == ()
    with pytest.raises(ValueError, match="one value"):
        Q.ste_many(xs, vs[:1])


@SETTINGS
@given(seed=st.integers(0, 2 ** 31 - 1))
def test_capped_relu_integer_mode(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(64, generator=g) * 50 - 10
    x[:4] = torch.tensor([0.5, 1.5, 30.5, 31.4999])
    y = Q.capped_relu(x, torch.tensor(31.0), integer=True)
    expect = torch.tensor([float(exact_round(v)) for v in torch.clamp(x, 0, 31).tolist()])
    assert torch.equal(y, expect)
    assert y[:4].tolist() == [1, 2, 31, 31]


@SETTINGS
@given(seed=st.integers(0, 2 ** 31 - 1), cap=st.floats(0.5, 40.0))
def test_capped_relu_revive(seed, cap):
    g = torch.Generator().manual_seed(seed)
    capt = torch.tensor(cap, dtype=torch.float32)
    x = ((torch.rand(60, generator=g) * 2 - 0.5) * capt).requires_grad_()
    up = torch.randn(60, generator=g)
    y = Q.capped_relu(x, capt, revive=True)
    assert torch.equal(y, Q.capped_relu(x.detach(), capt))       # forward unchanged
    y.backward(up)
    xd = x.detach()
    inside = (xd > 0) & (xd < capt)
    # below 0 only a gradient that raises x (negative, for descent) passes; above cap only one that lowers it
    passes = inside | ((xd <= 0) & (up < 0)) | ((xd >= capt) & (up > 0))
    assert torch.equal(x.grad, torch.where(passes, up, torch.zeros_like(up)))
    below = xd <= 0
    assert torch.all(x.grad[below & (up > 0)] == 0)


def test_capped_relu_revive_hand():
    x = torch.tensor([-1.0, -1.0, 2.0, 5.0, 5.0], requires_grad=True)
    up = torch.tensor([-1.0, 1.0, 3.0, 1.0, -1.0])
    Q.capped_relu(x, torch.tensor(4.0), revive=True).backward(up)
    assert x.grad.tolist() == [-1.0, 0.0, 3.0, 1.0, 0.0]


# ------------------------------------------------------------------ image input
def test_image_to_codes_all_values():
    v = np.arange(256, dtype=np.uint8)
    expect = np.array([min(((x >> 2) + 1) >> 1, 31) for x in range(256)], dtype=np.uint8)
    out = Q.image_to_codes(v)
    assert isinstance(out, np.ndarray) and out.dtype == np.uint8
    assert np.array_equal(out, expect)
    assert np.array_equal(Q.image_to_codes(v.astype(np.int64)), expect)   # the non-table path agrees
    tout = Q.image_to_codes(torch.arange(256, dtype=torch.int64).to(torch.uint8))
    assert isinstance(tout, torch.Tensor) and tout.dtype == torch.uint8
    assert tout.tolist() == expect.tolist()
    # a few by hand: 0..3 -> 0, 4 -> 1, 11 -> 1, 12 -> 2, 243 -> 30, 244..255 -> 31
    assert out[[0, 3, 4, 11, 12, 243, 244, 255]].tolist() == [0, 0, 1, 1, 2, 30, 31, 31]
    img = np.arange(256, dtype=np.uint8).reshape(16, 16)[None].repeat(3, 0)
    assert Q.image_to_codes(img).shape == (3, 16, 16)
    assert np.array_equal(Q.image_to_codes(img)[2], expect.reshape(16, 16))


@pytest.mark.parametrize("weight_format", [1, 2, 3, 5])
def test_nearest_level_matches_brute_force_with_ties_to_the_lower_level(weight_format):
    levels = Q._LEVELS[weight_format]
    g = torch.Generator().manual_seed(weight_format)
    r = torch.cat([torch.rand(20000, generator=g) * (levels[-1] + 3),
                   torch.tensor([(a + b) / 2 for a, b in zip(levels[:-1], levels[1:])] + list(levels) + [0.0])])
    lv = torch.tensor(levels)
    brute = lv[(r.unsqueeze(-1) - lv).abs().argmin(dim=-1)]       # argmin keeps the first (lower) level
    got = Q._nearest_level(r, levels)
    assert torch.equal(got, brute)
    if len(levels) > 1:   # exact midpoints go down
        mids = torch.tensor([(a + b) / 2 for a, b in zip(levels[:-1], levels[1:])])
        assert torch.equal(Q._nearest_level(mids, levels), lv[:-1])


# ---------------------------------------------------------------------------------------------- MSE caps
def _brute_cap_error(counts, vmax, c):
    """The histogram's squared error with cap ``c``, one bin at a time, in Python floats."""
    k = len(counts)
    err = 0.0
    for b, n in enumerate(counts):
        v = (b + 0.5) * vmax / k
        y = min(v, c)
        code = math.floor(y * 31 / c + 0.5)       # R for y >= 0: half away from zero
        err += n * (v - code * c / 31) ** 2
    return err


def _brute_mse_cap(counts, vmax, candidates):
    """The definition, one cap and one bin at a time, in Python floats (the lowest cap on a tie)."""
    best = None
    for j in range(1, candidates + 1):
        c = vmax * j / candidates
        err = _brute_cap_error(counts, vmax, c)
        if best is None or err < best[0] - 1e-18:
            best = (err, c)
    return best[1]


def test_mse_cap_hand_cases():
    # all mass at one value that is also a candidate: that cap represents it exactly (code 31), error 0,
    # and every lower cap clips it
    counts = torch.zeros(200, dtype=torch.float64)
    counts[50] = 7.0                                     # bin centre (50 + 0.5) * 4 / 200 = 1.01
    assert Q.mse_cap_from_histogram(counts, 4.0, candidates=400) == pytest.approx(1.01, abs=1e-12)
    # 100,000 values spread evenly over [0, 1] and one at ~4: clipping the one value costs (4 - 1)^2 = 9,
    # while a cap of 4 (the max, or a high percentile) makes the rounding error of every value 16x
    # larger (100,000 x (4/31)^2 / 12 = 139 against 8.7): the cap is 1
    counts = torch.zeros(400, dtype=torch.float64)
    counts[:100] = 1000.0
    counts[399] = 1.0
    assert Q.mse_cap_from_histogram(counts, 4.0, candidates=100) == pytest.approx(1.0, abs=1e-12)
    # with 100x fewer values the outlier weighs more: the cap moves up, as the definition says
    counts[:100] = 10.0
    cap = Q.mse_cap_from_histogram(counts, 4.0, candidates=100)
    assert cap > 1.5
    assert cap == pytest.approx(_brute_mse_cap(counts.tolist(), 4.0, 100), abs=1e-12)


@settings(max_examples=15, deadline=None)
@given(st.integers(0, 10_000), st.integers(5, 60), st.integers(3, 40))
def test_mse_cap_matches_the_definition(seed, bins, candidates):
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 50, (bins,), generator=g).double() * (torch.rand(bins, generator=g) < 0.7)
    counts[int(torch.randint(0, bins, (1,), generator=g))] += 1          # never all zero
    vmax = float(torch.rand(1, generator=g)) * 10 + 0.1
    got = Q.mse_cap_from_histogram(counts, vmax, candidates)
    want = _brute_mse_cap(counts.tolist(), vmax, candidates)
    # caps whose errors tie (equal up to rounding: e.g. several caps that put every bin centre on a
    # code) may be picked in either order, so the property is the error: got's is the minimum
    assert any(got == pytest.approx(vmax * j / candidates, abs=1e-12) for j in range(1, candidates + 1))
    e_got, e_min = (_brute_cap_error(counts.tolist(), vmax, c) for c in (got, want))
    assert e_got <= e_min * (1 + 1e-9) + 1e-12
    assert 0 < got <= vmax * (1 + 1e-12)


def test_histogram_mse_argmin_is_the_least_weighted_squared_error_device_cpu():
    """The shared MSE choice: the candidate whose dequantized centres are nearest in counts-weighted
    squared error, the first on a tie; shapes that do not fit are refused."""
    counts = torch.tensor([3.0, 1.0, 0.0, 2.0], dtype=torch.float64)
    centres = torch.tensor([0.5, 1.5, 2.5, 3.5], dtype=torch.float64)
    deq = torch.tensor([[0.0, 1.0, 2.0, 3.0],          # 3*.25 + .25 + 2*.25 = 1.5
                        [0.5, 1.5, 9.0, 3.5],          # 0: the empty bin costs nothing
                        [0.5, 1.5, 2.5, 3.5]], dtype=torch.float64)   # 0 as well: the first wins
    assert Q.histogram_mse_argmin(counts, centres, deq) == 1
    assert Q.histogram_mse_argmin(counts, centres, deq[[0, 0]]) == 0
    for bad in ((counts, centres, deq[:, :3]), (counts, centres[:3], deq), (counts, centres, deq[0])):
        with pytest.raises(ValueError, match="dequantized"):
            Q.histogram_mse_argmin(*bad)


def test_mse_cap_refusals():
    with pytest.raises(ValueError, match="vmax must be positive"):
        Q.mse_cap_from_histogram(torch.ones(4, dtype=torch.float64), 0.0)
    with pytest.raises(ValueError, match="1-d"):
        Q.mse_cap_from_histogram(torch.ones(2, 2, dtype=torch.float64), 1.0)


def test_calibration_observers_statistics():
    """The observers watch a QReLU's input (a plain ReLU while calibrating) and keep the running max,
    the running max of the batch percentiles, and torch.histc's counts (device cpu)."""
    from gnetmdk.layers.observers import (HistogramObserver, MaxObserver, PercentileObserver, batch_percentile,
                                          observe_inputs)
    from gnetmdk.layers.quant import QReLU
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(2, 3, 5, 5, generator=g) * 2 for _ in range(3)]
    r = QReLU()
    r.enable_observer()
    obs = [MaxObserver(), PercentileObserver(99.0)]
    with observe_inputs([r, r], obs):
        for b in batches:
            assert torch.equal(r(b), torch.relu(b))          # a plain ReLU while observed
    allv = torch.cat([b.reshape(-1) for b in batches])
    assert float(obs[0].value) == float(allv.max())
    assert float(obs[1].value) == max(float(batch_percentile(b, 99.0)) for b in batches)
    hist = HistogramObserver(float(allv.max()))
    with observe_inputs([r], [hist]):
        for b in batches:
            r(b)
    ref = torch.histc(allv[allv > 0], bins=4096, min=0.0, max=float(allv.max())).double()
    assert hist.value.dtype == torch.float64 and torch.equal(hist.value, ref)
    assert float(hist.value.sum()) == float((allv > 0).sum())
    r(batches[0])                                            # hooks removed: nothing observed any more
    assert float(hist.value.sum()) == float((allv > 0).sum())
    # the nearest-rank percentile, and the largest value when the percentile is not positive
    assert float(batch_percentile(torch.arange(1.0, 101.0), 99.0)) == 99.0
    assert float(batch_percentile(torch.tensor([-3.0, -1.0, 0.0, 2.0]), 50.0)) == 2.0

@pytest.mark.parametrize("method", ["percentile", "mse", "output"])
def test_output_cap_max_limits_the_output_layer_only_device_cpu(method):
    """``output_cap_max``: the output layer's cap is min(measured, limit) (float32), every other cap
    is what calibration measures without the limit, and the limit holds after the output-error
    search too (device cpu)."""
    from gnetmdk.engine.calibration import calibrate_caps
    from gnetmdk.models.gnetdet.model import GNetDet
    torch.manual_seed(0)
    base = GNetDet(3, 224, 0.0625, use_bn=False)
    with torch.no_grad():
        base.layers[-1].conv.bias.fill_(3.0)                 # output values well above 1
    x = torch.randint(0, 32, (2, 3, 224, 224), generator=torch.Generator().manual_seed(1)).float()
    caps = {}
    for limit in (0.0, 1.5):
        m = copy.deepcopy(base)
        caps[limit] = calibrate_caps(m, lambda: [x], method, output_cap_max=limit)
        assert [float(r.cap) for r in m.relus()] == caps[limit]
    free, held = caps[0.0], caps[1.5]
    assert free[-1] > 1.5 and held[-1] == 1.5
    if method != "output":                                   # the search may move the others
        assert held[:-1] == free[:-1]
    else:
        assert held[-1] <= 1.5


def test_output_cap_max_is_checked_device_cpu():
    from gnetmdk.config import ConfigError, build_config
    from gnetmdk.config.base import BaseConfig
    for bad in ("-2", "-0.5", "nan", "inf"):
        with pytest.raises(ConfigError, match="output_cap_max"):
            build_config(BaseConfig, ["gnetdet.output_cap_max", bad])


@pytest.mark.parametrize("over, limit", [
    ([], 2.0),                                                          # linear head: outputs trained in [0, 1]
    (["score_head", "logit", "score_offset", "0.5", "score_scale", "10"], 2 * max(1.0, 0.5 + math.log(99) / 10)),
    (["score_head", "logit", "score_offset", "4", "score_scale", "1"], 2 * (4 + math.log(99))),
    (["score_head", "logit", "score_offset", "0.2", "score_scale", "20"], 2.0),   # saturates below 1: boxes decide
    (["output_cap_max", "0"], 0.0),
    (["output_cap_max", "1.25"], 1.25),
    (["size_head", "log"], 1.25),                                       # log size head: 1.25 x the top
    (["size_head", "log", "score_head", "logit", "score_offset", "4", "score_scale", "1"], 1.25 * (4 + math.log(99))),
    (["size_head", "log", "output_cap_max", "0"], 0.0),
])
def test_output_cap_limit_rule_from_the_score_head_device_cpu(over, limit):
    """The default ``output_cap_max -1``: the top of the trained output range (1 for boxes and linear
    scores; the logit head's 0.99 point ``offset + ln(99)/scale``) times 2, or 1.25 with the log size head;
    a value >= 0 is kept. The family's calibration uses that limit (device cpu)."""
    from gnetmdk.config import build_config
    from gnetmdk.config.base import BaseConfig
    from gnetmdk.models import get_family
    from gnetmdk.models.gnetdet.head import output_cap_limit
    cfg = build_config(BaseConfig, over)
    assert output_cap_limit(cfg.gnetdet) == pytest.approx(limit, rel=1e-12)
    assert get_family("gnetdet").output_cap_limit(cfg) == pytest.approx(limit, rel=1e-12)
    # a model's heads (a checkpoint keeps the ones it was trained with) take the place of the config's
    from gnetmdk.models.gnetdet.model import GNetDet
    if cfg.gnetdet.output_cap_max == -1:
        log_model = GNetDet(2, 224, 0.0625, score_head=cfg.gnetdet.score_head, score_offset=cfg.gnetdet.score_offset,
                            score_scale=cfg.gnetdet.score_scale, size_head="log")
        assert get_family("gnetdet").output_cap_limit(cfg, log_model) == pytest.approx(limit * 1.25 / (
            1.25 if cfg.gnetdet.size_head == "log" else 2.0), rel=1e-12)
    # the 0.99 point: the logit head's score there is 0.99
    g = cfg.gnetdet
    if g.score_head == "logit":
        top = g.score_offset + math.log(99) / g.score_scale
        assert 1 / (1 + math.exp(-g.score_scale * (top - g.score_offset))) == pytest.approx(0.99, abs=1e-12)


# ------------------------------------------------------------------ several sublayers in one pass
def _sublayers(seed, n, dtype=torch.float32, channels_last=False):
    """n sublayers of random shapes and magnitudes (some all-zero kernels, one all-zero bias)."""
    g = torch.Generator().manual_seed(seed)
    ws, bs = [], []
    for k in range(n):
        o, i = int(torch.randint(1, 9, (1,), generator=g)), int(torch.randint(1, 7, (1,), generator=g))
        w = torch.randn(o, i, 3, 3, generator=g, dtype=torch.float64) * 10.0 ** float(-3 * torch.rand(1, generator=g))
        w = w * (torch.rand(o, i, 1, 1, generator=g, dtype=torch.float64) >= 0.15)
        b = torch.randn(o, generator=g, dtype=torch.float64) * 10.0 ** float(2 * torch.rand(1, generator=g) - 1)
        if k == 1:
            b.zero_()
        w = w.to(dtype)
        ws.append(w.contiguous(memory_format=torch.channels_last) if channels_last and k % 2 else w)
        bs.append(b.to(dtype))
    return ws, bs


@pytest.mark.parametrize("device_path", [False, True])
@pytest.mark.parametrize("method", ["gti", "mse"])
@pytest.mark.parametrize("weight_format", WEIGHT_FORMATS)
def test_quantize_conv_values_equals_each_sublayer_alone(weight_format, method, device_path, monkeypatch):
    """Several sublayers in one pass give each one's quantize_conv_params values bit for bit: weights,
    bias and shift, on the host and the device path, with gain-edited values, float32 and float64,
    channels_last kernels beside contiguous ones, and the MSE sweep's chunks straddling sublayers
    (device cpu)."""
    monkeypatch.setattr(Q, "_SWEEP_CHUNK_VALUES", 5 * 27)          # 5 kernels per pass
    bw, bb = (12, 20) if weight_format != 8 else (8, 12)
    for seed, dtype, gains in ((0, torch.float32, None), (1, torch.float64, None),
                               (2, torch.float32, [(31.0, 2.5), (2.5, 0.75), (0.75, 3.1), (3.1, 1.3), (1.3, 7.0)])):
        ws, bs = _sublayers(seed, 5, dtype, channels_last=seed == 0)
        with (Q.force_device_path() if device_path else torch.no_grad()):
            got_w, got_b, got_s = Q.quantize_conv_values(ws, bs, weight_format, bw, bb, method, gains)
            for k, (w, b) in enumerate(zip(ws, bs)):
                if gains is not None:     # QConv2d's gain-edited values (float64 products)
                    w = (w.double() * gains[k][0] / gains[k][1]).to(dtype)
                    b = (b.double() * Q.ACT_MAX / gains[k][1]).to(dtype)
                wq, bq, s = Q.quantize_conv_params(w, b, weight_format, bw, bb, method)
                assert isinstance(got_s[k], torch.Tensor) == device_path
                assert int(got_s[k]) == int(s), (seed, k)
                assert got_w[k].shape == w.shape and got_w[k].dtype == dtype
                assert torch.equal(got_w[k], wq), (seed, k)
                assert torch.equal(got_b[k], bq), (seed, k)
        assert any(not torch.equal(q, w) for q, w in zip(got_w, ws))      # it did quantize


def test_quantize_conv_values_without_bias_and_refusals():
    """Sublayers without a bias; one sublayer alone; mixed inputs refused with the reason (device cpu)."""
    ws, _ = _sublayers(3, 3)
    got_w, got_b, got_s = Q.quantize_conv_values(ws, [None] * 3, 3, 8, 20, "mse")
    assert got_b == [None] * 3
    for w, gw, gs in zip(ws, got_w, got_s):
        wq, bq, s = Q.quantize_conv_params(w, None, 3, 8, 20, "mse")
        assert gs == s and torch.equal(gw, wq) and bq is None
    one = Q.quantize_conv_values(ws[:1], [None], 5, 8, 20, "gti")
    assert torch.equal(one[0][0], Q.quantize_conv_params(ws[0], None, 5, 8, 20, "gti")[0])
    assert Q.quantize_conv_values([], [], 3, 8, 20) == ([], [], [])
    with pytest.raises(ValueError, match="bias for every sublayer or for none"):
        Q.quantize_conv_values(ws[:2], [torch.zeros(ws[0].shape[0]), None], 3, 8, 20)
    with pytest.raises(ValueError, match="differ in dtype"):
        Q.quantize_conv_values([ws[0], ws[1].double()], [None, None], 3, 8, 20)
    with pytest.raises(ValueError, match="unknown weight format 4"):
        Q.quantize_conv_values(ws, [None] * 3, 4, 8, 20)


@pytest.mark.parametrize("method", ["percentile", "mse", "output"])
def test_a_dead_layer_gets_a_positive_cap_and_is_reported_device_cpu(method):
    """A layer whose pre-activations are never positive over the calibration set (here all exactly 0:
    zero weights and bias) is dead: its measured cap is 0, which would make its 5-bit codes 0 * 31 / 0
    (NaN) and gain editing divide by 0. It gets DEAD_LAYER_CAP instead, the model's values stay finite
    and equal to those with any other positive cap there, step 4's gain editing goes through, and the
    family's calibration names the layer (major.sub) in what it reports (device cpu)."""
    from gnetmdk.config import build_config
    from gnetmdk.config.base import BaseConfig
    from gnetmdk.engine.calibration import calibrate_caps
    from gnetmdk.gti.transforms import fold_requant_multipliers
    from gnetmdk.models import get_family
    from gnetmdk.models.calibration import DEAD_LAYER_CAP
    from gnetmdk.models.gnetdet.model import GNetDet
    torch.manual_seed(0)
    base = GNetDet(3, 224, 0.0625, use_bn=False)
    with torch.no_grad():
        base.layers[2].conv.weight.zero_()
        base.layers[2].conv.bias.zero_()
    x = torch.randint(0, 32, (2, 3, 224, 224), generator=torch.Generator().manual_seed(1)).float()
    m, dead = copy.deepcopy(base), []
    caps = calibrate_caps(m, lambda: [x], method, dead=dead)
    assert dead == [2] and caps[2] == DEAD_LAYER_CAP and all(c > 0 for c in caps)
    m.eval()
    with torch.no_grad():
        y = m(x)
        m.layers[2].relu.cap.fill_(7.0)
        assert torch.isfinite(y).all() and torch.equal(m(x), y)
    fold_requant_multipliers(m)                              # step 4's edit: no cap of 0 to divide by
    cfg = build_config(BaseConfig, ["gnetdet.cap_method", method, "gnetdet.width_mult", "0.0625",
                                    "gnetdet.use_bn", "false", "VOC_CLASSES", "a,b,c"])
    out = get_family("gnetdet").calibrate(copy.deepcopy(base), lambda: [x], cfg, torch.device("cpu"),
                                          lambda it, desc: it)
    spec = base.specs[2]
    assert f"layer(s) {spec.major + 1}.{spec.index_in_major + 1} (dead" in out["how"]
    assert out["caps"][2] == DEAD_LAYER_CAP
