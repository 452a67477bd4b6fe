"""Bit-exact integer emulator of the chip: runs a chip model on 8-bit images with integer arithmetic only.

Semantics (docs/chip.md, "What the chip computes"), per sublayer with shift s:

    a_0    = min(((x8 >> 2) + 1) >> 1, 31)                 the chip's 8-bit -> 5-bit input codes
    acc    = sum(W_int * a) + b_int                        3x3, stride 1, zero padding 1 (exact integers)
    R(acc / 2^s) = (acc + 2^(s-1)) >> s                    for acc >= 0
                 = -((-acc + 2^(s-1)) >> s)                for acc < 0  (half away from zero; s = 0: acc)
    out    = clamp(R(acc / 2^s), 0, 31)                    (0..1023 in a 10-bit output layer)
    then, where the sublayer ends its major layer with pooling, a 2x2/2 max pool on the codes.

Every step is an integer tensor operation; nothing passes through floating point. Backends:

* ``"gemm"`` (default): im2col of the int8 codes (NHWC) times int8 weights with torch's integer GEMM
  (``torch._int_mm``, int32 accumulation), vectorised over the batch; the rounding shift and clamp
  in the equivalent form of :func:`activation_codes_from_acc`. Weights wider than int8
  (12-bit registers) are split as W = 128 * Hi + Lo (Lo in 0..127) into two GEMMs. Before first use
  a self-test at the extreme values (codes 31, weights +-127/-128, 9216-long sums) confirms that the
  platform's int8 kernels neither saturate nor overflow; where it fails, or where ``_int_mm`` is
  missing, the emulator falls back to ``"conv"``.
* ``"conv"``: ``torch.nn.functional.conv2d`` on int32 (or int64) tensors, then the rule above literally.
* ``"numpy"``: im2col + int64 einsum in numpy (slow; the independent reference of the tests).

The accumulator is int32 when the layer's bound max_o(sum|W_int[o]| * 31 + |b_int[o]|) fits (always,
for the chips' 8/12-bit weights and at most 1024 channels: 1024 * 9 * 2047 * 31 + 2^19 < 2^31), else
int64 (``"conv"`` then runs that layer).
"""
from __future__ import annotations

import functools
from typing import List, Union

import numpy as np
import torch
import torch.nn.functional as F

from gnetmdk.gti.quantize import ACT_MAX, image_to_codes
from .model_file import ChipLayer, ChipModel

ArrayLike = Union[np.ndarray, torch.Tensor]
_INT32_LIMIT = 2 ** 31 - 2 ** 13      # headroom for the rounding constant
BACKENDS = ("gemm", "conv", "numpy")


def images_to_codes(images: ArrayLike) -> torch.Tensor:
    """8-bit BGR images -> the chip's 5-bit input codes, planar.

    Args:
        images: (N, H, W, 3) uint8 BGR (as OpenCV gives them), numpy or torch.
    Returns:
        (N, 3, H, W) int32 tensor of codes 0..31.
    Raises:
        ValueError: not a uint8 (N, H, W, 3) batch.
    """
    t = torch.as_tensor(images)
    if t.dtype != torch.uint8 or t.dim() != 4 or t.shape[-1] != 3:
        raise ValueError(f"images must be a (N, H, W, 3) uint8 BGR batch, got {tuple(t.shape)} {t.dtype}")
    return image_to_codes(t).permute(0, 3, 1, 2).to(torch.int32).contiguous()


def rounding_shift(acc: torch.Tensor, shift: int) -> torch.Tensor:
    """R(acc / 2^shift) on integers: round half away from zero (R of docs/quantization.md, "Notation"),
    integer ops only.

    Args:
        acc: integer tensor (int32 or int64), any shape.
        shift: s >= 0 (0 returns acc unchanged).
    Returns:
        integer tensor like acc.
    """
    if shift == 0:
        return acc
    half = 1 << (shift - 1)
    mag = (acc.abs() + half) >> shift
    return torch.where(acc < 0, -mag, mag)


def _code_dtype(max_code: int) -> torch.dtype:
    """int8 for 5-bit codes, int16 for a 10-bit output layer's."""
    return torch.int8 if max_code <= 127 else torch.int16


def activation_codes_from_acc(acc: torch.Tensor, shift: int, max_code: int = ACT_MAX) -> torch.Tensor:
    """clamp(R(acc / 2^s), 0, 31) in four in-place integer passes (the fast path of the "gemm" backend;
    31 stands for ``max_code``, 1023 in a 10-bit output layer).

    Computed as ``(clamp(acc, 0, 31 * 2^s) + 2^(s-1)) >> s``, which equals the literal rule: for
    acc < 0, R(acc / 2^s) <= 0 and both give 0; for 0 <= acc <= 31 * 2^s, (acc + 2^(s-1)) >> s is
    R(acc / 2^s) <= 31; above, both give 31. (s = 0: clamp(acc, 0, 31).) The "conv" and "numpy"
    backends apply :func:`rounding_shift` and the clamp literally; the tests compare both.

    Args:
        acc: integer tensor; it is not modified.
        shift: s in 0..12.
        max_code: the largest code, 31 or 1023.
    Returns:
        int8 tensor of codes 0..31 (int16 for max_code 1023), same shape.
    """
    y = torch.clamp(acc, 0, int(max_code) << shift)
    if shift:
        y.add_(1 << (shift - 1)).bitwise_right_shift_(shift)
    return y.to(_code_dtype(max_code))


def accumulator_dtype(layer: ChipLayer) -> torch.dtype:
    """int32 when the layer's accumulation bound (plus the rounding constant) fits, else int64."""
    return torch.int32 if layer.max_abs_acc() + (1 << max(layer.shift - 1, 0)) < _INT32_LIMIT else torch.int64


@functools.lru_cache(maxsize=None)
def int8_gemm_exact() -> bool:
    """Self-test of torch's int8 GEMM at the values the emulator can feed it.

    Codes are 0..31 and weights (after the split) -128..127; sums have up to 1024 x 9 terms. The test
    multiplies the extremes (which maximise any int16 pair-sum saturation or int32 overflow) and random
    values, and compares with int64 matmul. Returns False where ``torch._int_mm`` is absent or inexact.
    """
    if not hasattr(torch, "_int_mm"):
        return False
    try:
        g = torch.Generator().manual_seed(0)
        for m, k, n in ((32, 9216, 8), (17, 27, 3)):
            for a_val, w_val in ((31, 127), (31, -128), (31, -127)):
                a = torch.full((m, k), a_val, dtype=torch.int8)
                w = torch.full((k, n), w_val, dtype=torch.int8)
                if not torch.equal(torch._int_mm(a, w).long(), a.long() @ w.long()):
                    return False
            a = torch.randint(0, 32, (m, k), dtype=torch.int8, generator=g)
            w = torch.randint(-128, 128, (k, n), dtype=torch.int8, generator=g)
            if not torch.equal(torch._int_mm(a, w).long(), a.long() @ w.long()):
                return False
        return True
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def _split_int8(w: np.ndarray) -> List[np.ndarray]:
    """[W] when it fits int8, else [Hi, Lo] with W = 128 * Hi + Lo, Lo in 0..127."""
    if w.size == 0 or (w.min() >= -128 and w.max() <= 127):
        return [w]
    lo = np.mod(w, 128)
    hi = (w - lo) // 128
    if hi.min() < -128 or hi.max() > 127:
        raise ValueError("weights beyond 15 bits cannot be split into two int8 GEMMs")
    return [hi, lo]


class _Prepared:
    """One layer's tensors for a backend (built once per emulator)."""

    def __init__(self, layer: ChipLayer, backend: str):
        self.layer = layer
        self.acc_dtype = accumulator_dtype(layer)
        self.kind = backend
        if backend == "gemm" and (self.acc_dtype != torch.int32 or not int8_gemm_exact()):
            self.kind = "conv"
        o = layer.out_channels
        if self.kind == "gemm":
            # im2col order (dy, dx, c) -> weight matrix (9 C, O)
            self.mats = [torch.from_numpy(np.ascontiguousarray(p.transpose(2, 3, 1, 0).reshape(-1, o)))
                         .to(torch.int8) for p in _split_int8(layer.weight)]
            self.bias = torch.from_numpy(layer.bias.astype(np.int64)).to(torch.int32)
        elif self.kind == "conv":
            self.weight = torch.from_numpy(layer.weight.astype(np.int64)).to(self.acc_dtype)
            self.bias = torch.from_numpy(layer.bias.astype(np.int64)).to(self.acc_dtype)


def _pool2_nhwc(x: torch.Tensor) -> torch.Tensor:
    """2x2/2 max pool of NHWC integer codes (two elementwise maxima over strided views)."""
    n, h, w, c = x.shape
    rows = x.reshape(n, h // 2, 2, w * c)
    y = torch.maximum(rows[:, :, 0], rows[:, :, 1]).reshape(n, h // 2, w // 2, 2, c)
    return torch.maximum(y[:, :, :, 0], y[:, :, :, 1])


def _conv_numpy(a: np.ndarray, weight: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """Reference 3x3 / pad-1 convolution in numpy int64 (im2col + integer einsum), NCHW."""
    n, c, h, w = a.shape
    p = np.zeros((n, c, h + 2, w + 2), dtype=np.int64)
    p[:, :, 1:-1, 1:-1] = a
    cols = np.stack([p[:, :, dy:dy + h, dx:dx + w] for dy in range(3) for dx in range(3)], axis=2)  # N,C,9,H,W
    cols = cols.reshape(n, c * 9, h * w)
    wm = weight.reshape(weight.shape[0], c * 9).astype(np.int64)                                  # O, C*9
    out = np.einsum("ok,nkp->nop", wm, cols, optimize=False) + bias.astype(np.int64)[None, :, None]
    return out.reshape(n, weight.shape[0], h, w)


def _gemm_nhwc(prep: _Prepared, x: torch.Tensor) -> torch.Tensor:
    """int8 NHWC codes -> int32 NHWC accumulators (im2col + integer GEMM)."""
    n, h, w, c = x.shape
    xp = F.pad(x, (0, 0, 1, 1, 1, 1))
    cols = torch.cat([xp[:, dy:dy + h, dx:dx + w] for dy in range(3) for dx in range(3)], dim=3)
    cols = cols.reshape(n * h * w, 9 * c)
    if len(prep.mats) == 1:
        acc = torch._int_mm(cols, prep.mats[0])
    else:
        acc = torch._int_mm(cols, prep.mats[0]).mul_(128).add_(torch._int_mm(cols, prep.mats[1]))
    acc.add_(prep.bias)
    return acc.reshape(n, h, w, -1)


def _layer_nhwc(prep: _Prepared, x: torch.Tensor) -> torch.Tensor:
    """One sublayer on NHWC int8 codes (any backend); returns NHWC int8 codes."""
    layer = prep.layer
    if prep.kind == "gemm":
        out = activation_codes_from_acc(_gemm_nhwc(prep, x), layer.shift, layer.max_code)
    else:
        nchw = x.permute(0, 3, 1, 2)
        if prep.kind == "numpy":
            acc = torch.from_numpy(_conv_numpy(nchw.numpy().astype(np.int64), layer.weight, layer.bias))
        else:
            acc = F.conv2d(nchw.to(prep.acc_dtype), prep.weight, prep.bias, stride=1, padding=1)
        out = (rounding_shift(acc, layer.shift).clamp_(0, layer.max_code).to(_code_dtype(layer.max_code))
               .permute(0, 2, 3, 1).contiguous())
    return _pool2_nhwc(out) if layer.pool_after else out


def sublayer_codes(layer: ChipLayer, codes: torch.Tensor, backend: str = "gemm") -> torch.Tensor:
    """One sublayer on the chip: integer 3x3 conv + bias, rounding shift, clamp to 0..31 (0..1023 in a
    10-bit output layer), optional 2x2 max pool.

    Args:
        layer: the ChipLayer (W_int, b_int, shift, pool_after, max_code).
        codes: (N, in_channels, H, W) integer tensor of codes 0..31.
        backend: "gemm", "conv" or "numpy" (see the module docstring).
    Returns:
        (N, out_channels, H', W') int32 codes 0..max_code (H' = H / 2 after a pool).
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown emulator backend '{backend}': use one of {BACKENDS}")
    x = codes.to(torch.int8).permute(0, 2, 3, 1).contiguous()
    return _layer_nhwc(_Prepared(layer, backend), x).permute(0, 3, 1, 2).to(torch.int32).contiguous()


class ChipEmulator:
    """Integer emulator of one chip model (weights prepared once, then any number of batches).

    Args:
        chip_model: a ChipModel (gnetmdk.chip.load_chip_model).
        backend: "gemm" (default: int8 im2col GEMM, falls back to "conv" where the platform's int8
            GEMM is missing or inexact), "conv" (integer conv2d) or "numpy" (slow int64 reference).
        batch_size: images per internal batch (bounds memory: the im2col buffer of the widest layer
            is batch x H x W x 9 x C bytes).

    Call with 8-bit images (:meth:`run`) or with input codes (:meth:`run_codes`).
    Raises:
        ValueError: unknown backend.
    """

    def __init__(self, chip_model: ChipModel, backend: str = "gemm", batch_size: int = 8):
        if backend not in BACKENDS:
            raise ValueError(f"unknown emulator backend '{backend}': use one of {BACKENDS}")
        self.model = chip_model
        self.backend = backend
        self.batch_size = max(1, int(batch_size))
        self._prep = [_Prepared(layer, backend) for layer in chip_model.layers]

    @property
    def layer_backends(self) -> List[str]:
        """The backend each layer actually runs with (``gemm`` layers may fall back to ``conv``)."""
        return [p.kind for p in self._prep]

    @torch.no_grad()
    def run_codes(self, codes: ArrayLike, return_all: bool = False):
        """Run the network on input codes.

        Args:
            codes: (N, 3, H, W) integer codes 0..31 (numpy or torch), H = W = input size.
            return_all: also return every sublayer's output codes.
        Returns:
            out: (N, C_out, S, S) uint8 numpy codes (C_out includes the padded channels; uint16 codes
            0..1023 from a 10-bit output layer); with ``return_all``, (out, [per-sublayer (N, C_i, H_i,
            W_i) numpy codes, after pool, uint8 or, for a 10-bit layer, uint16]).
        Raises:
            ValueError: wrong shape, or codes outside 0..31.
        """
        x = torch.as_tensor(codes)
        size = self.model.input_size
        if x.dim() != 4 or tuple(x.shape[1:]) != (3, size, size):
            raise ValueError(f"codes must be (N, 3, {size}, {size}), got {tuple(x.shape)}")
        if x.dtype.is_floating_point or x.dtype == torch.bool:
            raise ValueError(f"codes must be an integer tensor, got {x.dtype}")
        if x.numel() and (int(x.min()) < 0 or int(x.max()) > ACT_MAX):
            raise ValueError(f"codes must be 0..{ACT_MAX}, got {int(x.min())}..{int(x.max())}")
        outs: List[List[np.ndarray]] = [[] for _ in self.model.layers]
        finals = []

        def nchw(t):
            if t.dtype == torch.int8:
                return t.permute(0, 3, 1, 2).to(torch.uint8).contiguous().numpy()
            return t.permute(0, 3, 1, 2).contiguous().numpy().astype(np.uint16)
        for start in range(0, x.shape[0], self.batch_size):
            a = x[start:start + self.batch_size].to(torch.int8).permute(0, 2, 3, 1).contiguous()
            for i, prep in enumerate(self._prep):
                a = _layer_nhwc(prep, a)
                if return_all:
                    outs[i].append(nchw(a))
            finals.append(nchw(a))
        g = self.model.grid
        wide = np.uint8 if self.model.output_max_code <= 255 else np.uint16
        out = np.concatenate(finals) if finals else np.zeros((0, self.model.output_channels, g, g), wide)
        if not return_all:
            return out
        return out, [np.concatenate(o) if o else np.zeros((0,), np.uint8) for o in outs]

    def run(self, images: ArrayLike, return_all: bool = False):
        """Run the network on 8-bit images (the chip's input).

        Args:
            images: (N, H, W, 3) uint8 BGR at the network size (gnetmdk.dataset.dataset.preprocess_image).
            return_all: see :meth:`run_codes`.
        Returns:
            as :meth:`run_codes`.
        """
        return self.run_codes(images_to_codes(images), return_all)

    __call__ = run


def emulate(chip_model: ChipModel, images: ArrayLike, return_all: bool = False, batch_size: int = 8,
            backend: str = "gemm"):
    """One-shot helper: ``ChipEmulator(chip_model, backend, batch_size).run(images, return_all)``."""
    return ChipEmulator(chip_model, backend, batch_size).run(images, return_all)
