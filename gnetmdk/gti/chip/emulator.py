"""Bit-exact integer emulator of the chip: runs a chip model on 8-bit images with integer arithmetic only.

Semantics (gti-chip.md, "What the chip computes"), per sublayer with shift s:

    a_0    = min(((x8 >> 2) + 1) >> 1, 31)                 the chip's 8-bit -> 5-bit input codes
    acc    = sum(W_int * a) + b_int                        3x3, stride 1, zero padding 1 (exact integers)
    R(acc / 2^s) = (acc + 2^(s-1)) >> s                    for acc >= 0
                 = -((-acc + 2^(s-1)) >> s)                for acc < 0  (half away from zero; s = 0: acc)
    out    = clamp(R(acc / 2^s), 0, 31)
    then, where the sublayer ends its major layer with pooling, a 2x2/2 max pool on the codes.

Every step is an integer tensor operation (torch int32 or int64, or numpy int64 for the reference
backend); nothing passes through floating point. The accumulator is int32 when the layer's bound
max_o(sum|W_int[o]| * 31 + |b_int[o]|) fits (always, for the chips' 8/12-bit weights and at most 1024
channels: 1024 * 9 * 2047 * 31 + 2^19 < 2^31), otherwise int64.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
import torch.nn.functional as F

from gnetmdk.gti.quantize import ACT_MAX, image_to_codes
from .model_file import ChipLayer, ChipModel

ArrayLike = Union[np.ndarray, torch.Tensor]
_INT32_LIMIT = 2 ** 31 - 2 ** 13      # headroom for the rounding constant


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
    """R(acc / 2^shift) on integers: round half away from zero (gti-chip.md R), integer ops only.

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


def _pool2(x: torch.Tensor) -> torch.Tensor:
    n, c, h, w = x.shape
    return x.reshape(n, c, h // 2, 2, w // 2, 2).amax(dim=(3, 5))


def _conv_numpy(a: np.ndarray, weight: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """Reference 3x3 / pad-1 convolution in numpy int64 (im2col + integer matmul)."""
    n, c, h, w = a.shape
    p = np.zeros((n, c, h + 2, w + 2), dtype=np.int64)
    p[:, :, 1:-1, 1:-1] = a
    cols = np.stack([p[:, :, dy:dy + h, dx:dx + w] for dy in range(3) for dx in range(3)], axis=2)  # N,C,9,H,W
    cols = cols.reshape(n, c * 9, h * w)
    wm = weight.reshape(weight.shape[0], c * 9).astype(np.int64)                                  # O, C*9
    out = np.einsum("ok,nkp->nop", wm, cols, optimize=False) + bias.astype(np.int64)[None, :, None]
    return out.reshape(n, weight.shape[0], h, w)


def accumulator_dtype(layer: ChipLayer) -> torch.dtype:
    """int32 when the layer's accumulation bound (plus the rounding constant) fits, else int64."""
    return torch.int32 if layer.max_abs_acc() + (1 << max(layer.shift - 1, 0)) < _INT32_LIMIT else torch.int64


def sublayer_codes(layer: ChipLayer, codes: torch.Tensor, backend: str = "torch",
                   params: Optional[Tuple[torch.dtype, torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
    """One sublayer on the chip: integer 3x3 conv + bias, rounding shift, clamp to 0..31, optional 2x2 max pool.

    Args:
        layer: the ChipLayer (W_int, b_int, shift, pool_after).
        codes: (N, in_channels, H, W) integer tensor of codes 0..31.
        backend: "torch" (F.conv2d on int32/int64 tensors) or "numpy" (im2col + int64 einsum reference).
        params: prepared (dtype, weight, bias) tensors (ChipEmulator caches them); None builds them.
    Returns:
        (N, out_channels, H', W') int32 codes 0..31 (H' = H / 2 after a pool).
    """
    if backend == "numpy":
        acc = torch.from_numpy(_conv_numpy(codes.numpy().astype(np.int64), layer.weight, layer.bias))
    else:
        if params is None:
            dtype = accumulator_dtype(layer)
            params = (dtype, torch.from_numpy(layer.weight.astype(np.int64)).to(dtype),
                      torch.from_numpy(layer.bias.astype(np.int64)).to(dtype))
        dtype, w, b = params
        acc = F.conv2d(codes.to(dtype), w, b, stride=1, padding=1)
    out = rounding_shift(acc, layer.shift).clamp_(0, ACT_MAX).to(torch.int32)
    return _pool2(out) if layer.pool_after else out


class ChipEmulator:
    """Integer emulator of one chip model (weights prepared once, then any number of batches).

    Args:
        chip_model: a ChipModel (gnetmdk.gti.chip.load_chip_model).
        backend: "torch" (vectorised integer convolution, int32/int64 tensors; the default) or
            "numpy" (im2col + int64 einsum, slow; an independent reference for tests).
        batch_size: images per internal batch (bounds memory).

    Call with 8-bit images (:meth:`run`) or with input codes (:meth:`run_codes`).
    """

    def __init__(self, chip_model: ChipModel, backend: str = "torch", batch_size: int = 16):
        if backend not in ("torch", "numpy"):
            raise ValueError(f"unknown emulator backend '{backend}': use 'torch' or 'numpy'")
        self.model = chip_model
        self.backend = backend
        self.batch_size = max(1, int(batch_size))
        self._params: List[Tuple[torch.dtype, torch.Tensor, torch.Tensor]] = []
        for layer in chip_model.layers:
            dtype = accumulator_dtype(layer)
            self._params.append((dtype, torch.from_numpy(layer.weight.astype(np.int64)).to(dtype),
                                 torch.from_numpy(layer.bias.astype(np.int64)).to(dtype)))

    # -------------------------------------------------------------- one layer
    def layer(self, index: int, codes: torch.Tensor) -> torch.Tensor:
        """Run sublayer ``index`` on codes.

        Args:
            index: 0-based sublayer.
            codes: (N, in_channels, H, W) integer tensor of codes 0..31.
        Returns:
            (N, out_channels, H', W') int32 codes 0..31 (H' = H/2 after a pool).
        """
        return sublayer_codes(self.model.layers[index], codes, self.backend, self._params[index])

    # -------------------------------------------------------------- whole network
    @torch.no_grad()
    def run_codes(self, codes: ArrayLike, return_all: bool = False):
        """Run the network on input codes.

        Args:
            codes: (N, 3, H, W) integer codes 0..31 (numpy or torch), H = W = input size.
            return_all: also return every sublayer's output codes.
        Returns:
            out: (N, C_out, S, S) uint8 numpy codes (C_out includes the padded channels);
            with ``return_all``, (out, [per-sublayer (N, C_i, H_i, W_i) uint8 numpy codes, after pool]).
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
        for start in range(0, x.shape[0], self.batch_size):
            a = x[start:start + self.batch_size].to(torch.int32)
            for i in range(len(self.model.layers)):
                a = self.layer(i, a)
                if return_all:
                    outs[i].append(a.to(torch.uint8).numpy())
            finals.append(a.to(torch.uint8).numpy())
        n_out = self.model.output_channels
        g = self.model.grid
        out = np.concatenate(finals) if finals else np.zeros((0, n_out, g, g), np.uint8)
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


def emulate(chip_model: ChipModel, images: ArrayLike, return_all: bool = False, batch_size: int = 16,
            backend: str = "torch"):
    """One-shot helper: ``ChipEmulator(chip_model, backend, batch_size).run(images, return_all)``."""
    return ChipEmulator(chip_model, backend, batch_size).run(images, return_all)
