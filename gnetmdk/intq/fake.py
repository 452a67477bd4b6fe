"""Fake quantization of weights (per output channel, symmetric) and activations (per tensor, uint8
with a zero point), with straight-through gradients. Formulas: gnetmdk.intq (package docstring).
"""
from __future__ import annotations

import weakref
from typing import Tuple

import torch
import torch.nn as nn

__all__ = ["ACT_QMAX", "WEIGHT_SCALES", "round_half_up", "weight_qmax", "weight_scales", "quantize_weight",
           "fake_quant_weight", "act_qparams", "ActQuant"]

#: uint8 activations: codes 0..255
ACT_QMAX = 255
#: per-channel weight scale rules
WEIGHT_SCALES = ("max", "mse")
#: clip ratios tried by the "mse" weight scale rule (of max |W_c|)
WEIGHT_CLIP_RATIOS = tuple(1.0 - 0.025 * i for i in range(17))          # 1.0 .. 0.6


def round_half_up(x: torch.Tensor) -> torch.Tensor:
    """``floor(x + 0.5)``: the rounding of the integer model's requantization (ties up), also used by
    the fake quantizers so both round alike."""
    return torch.floor(x + 0.5)


def weight_qmax(bits: int) -> int:
    """Largest weight code ``2^(bits-1) - 1`` of a symmetric ``bits``-bit weight (127 at 8 bits).

    Raises:
        ValueError: bits outside 2..8.
    """
    if not isinstance(bits, int) or not 2 <= bits <= 8:
        raise ValueError(f"weight bits must be an int in 2..8, got {bits!r}")
    return (1 << (bits - 1)) - 1


@torch.no_grad()
def weight_scales(w: torch.Tensor, bits: int = 8, method: str = "max") -> torch.Tensor:
    """Per-output-channel scales of a conv weight.

    Args:
        w: ``(C_out, ...)`` float weight.
        bits: 2..8; codes are ``-Q..Q``, ``Q = 2^(bits-1) - 1``.
        method: "max" (``max|W_c| / Q``) or "mse" (the clip ratio among :data:`WEIGHT_CLIP_RATIOS` of
            ``max|W_c|`` with the least squared quantization error of the channel).

    Returns:
        ``(C_out,)`` float32, positive (an all-zero channel gets scale 1).

    Raises:
        ValueError: unknown method or bits.
    """
    if method not in WEIGHT_SCALES:
        raise ValueError(f"weight scale method must be one of {WEIGHT_SCALES}, got {method!r}")
    qmax = weight_qmax(bits)
    flat = w.detach().float().reshape(w.shape[0], -1)
    amax = flat.abs().amax(dim=1)
    amax = torch.where(amax > 0, amax, torch.ones_like(amax))
    if method == "max":
        return amax / qmax
    best_err, best = None, None
    for r in WEIGHT_CLIP_RATIOS:
        s = amax * r / qmax
        q = torch.clamp(round_half_up(flat / s[:, None]), -qmax, qmax)
        err = (q * s[:, None] - flat).square().sum(dim=1)
        if best is None:
            best_err, best = err, s
        else:
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best = torch.where(better, s, best)
    return best


def quantize_weight(w: torch.Tensor, scales: torch.Tensor, bits: int) -> torch.Tensor:
    """Integer codes ``clamp(floor(W / s_c + 1/2), -Q, Q)`` of a weight (float tensor of integers,
    W's shape) for per-channel ``scales`` ``(C_out,)``."""
    qmax = weight_qmax(bits)
    view = (-1,) + (1,) * (w.dim() - 1)
    return torch.clamp(round_half_up(w / scales.view(view)), -qmax, qmax)


def fake_quant_weight(w: torch.Tensor, bits: int = 8, method: str = "max") -> torch.Tensor:
    """``s_c W_q`` with the straight-through estimator (the gradient of the result is passed to W
    unchanged, Bengio et al. 2013). Shape and dtype of ``w``."""
    s = weight_scales(w, bits, method).to(w.dtype)
    view = (-1,) + (1,) * (w.dim() - 1)
    wq = quantize_weight(w.detach(), s, bits) * s.view(view)
    return w + (wq - w).detach()


def act_qparams(lo: float, hi: float) -> Tuple[float, int]:
    """(scale, zero point) of a uint8 tensor with range [lo, hi], lo <= 0 <= hi: ``s = (hi - lo) /
    255`` in float32, ``z = clamp(floor(-lo / s + 1/2), 0, 255)``; an empty range gives (1.0, 0)."""
    lo32 = torch.tensor(float(lo), dtype=torch.float32)
    hi32 = torch.tensor(float(hi), dtype=torch.float32)
    s = (hi32 - lo32) / ACT_QMAX
    if not float(s) > 0:
        return 1.0, 0
    z = int(torch.clamp(round_half_up(-lo32 / s), 0, ACT_QMAX))
    return float(s), z


class ActQuant(nn.Module):
    """A per-tensor uint8 fake quantizer of activations, in torch.ao's FakeQuantize vocabulary.

    State (buffers, so that they move with the model and DistributedDataParallel broadcasts them from
    rank 0 with the other buffers):

    * ``min_val``, ``max_val``: the calibrated range (0-d float32; ``min_val <= 0 <= max_val`` once
      calibrated, both 0 before); saved in checkpoints. Checkpoints that name them ``lo`` / ``hi``
      (earlier versions) load too.
    * ``fake_quant_enabled``, ``observer_enabled``: 0-d uint8 switches, 0 by default; not saved (the
      stage sets them: ``PPYOLO.set_quant_mode``). Set them with the ``enable_*`` / ``disable_*``
      methods: these also keep a host copy that the forward reads, so that no forward waits for the
      device to read a switch.

    The (scale, zero point) the forward uses are computed from ``min_val`` / ``max_val`` on the host once
    and kept until either buffer is replaced or changed in place (its version counter moves: calibration,
    ``load_state_dict``, an EMA's copy), so that a forward reads nothing back from the device either.

    ``activation_post_process``: the observer the calibration attaches (an object with
    ``forward(x)`` / ``__call__(x)`` that records ``x``, and ``calculate_qparams()``), or None. With
    ``observer_enabled`` each input is passed to it (detached). With ``fake_quant_enabled`` the input
    is quantized and dequantized with :meth:`calculate_qparams`: ``s (clamp(floor(x / s + 1/2) + z, 0,
    255) - z)``, gradient 1 where the input lies inside ``[s (0 - z), s (255 - z)]`` and 0 outside
    (straight-through estimator); else it passes unchanged.

    Input and output: any shape, float32 (computed in float32 also under autocast).
    """

    def __init__(self):
        super().__init__()
        self.register_buffer("min_val", torch.zeros((), dtype=torch.float32))
        self.register_buffer("max_val", torch.zeros((), dtype=torch.float32))
        self.register_buffer("fake_quant_enabled", torch.zeros((), dtype=torch.uint8), persistent=False)
        self.register_buffer("observer_enabled", torch.zeros((), dtype=torch.uint8), persistent=False)
        self.activation_post_process = None
        self._switches = {"fake_quant": False, "observer": False}     # host copies of the two buffers
        self._qparams = None     # (min_val, its version, max_val, its version, (scale, zero point)); min/max weakly

    def __getstate__(self):
        state = super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__
        return {**state, "_qparams": None}       # weak references are not copied: a copy computes its own

    def enable_fake_quant(self, enabled: bool = True) -> "ActQuant":
        """Switch fake quantization on (or off with ``enabled=False``); returns self."""
        self.fake_quant_enabled.fill_(1 if enabled else 0)
        self._switches["fake_quant"] = bool(enabled)
        return self

    def disable_fake_quant(self) -> "ActQuant":
        """Switch fake quantization off (the input passes unchanged); returns self."""
        return self.enable_fake_quant(False)

    def enable_observer(self, enabled: bool = True) -> "ActQuant":
        """Pass every input to ``activation_post_process`` (or stop with ``enabled=False``); returns self."""
        self.observer_enabled.fill_(1 if enabled else 0)
        self._switches["observer"] = bool(enabled)
        return self

    def disable_observer(self) -> "ActQuant":
        """Stop passing inputs to the observer; returns self."""
        return self.enable_observer(False)

    @property
    def calibrated(self) -> bool:
        """Whether calibration has set a non-empty range (``max_val > min_val``)."""
        return bool(self.max_val > self.min_val)

    def calculate_qparams(self) -> Tuple[float, int]:
        """(scale, zero point) of the current range (:func:`act_qparams`), read from the device only when
        ``min_val`` or ``max_val`` is another tensor or has changed since the last call."""
        lo, hi = self.min_val, self.max_val
        try:
            versions = (lo._version, hi._version)
        except RuntimeError:           # inference tensors keep no version counter: compute every time
            return act_qparams(float(lo), float(hi))
        c = self._qparams
        if c is not None and c[0]() is lo and c[1] == versions[0] and c[2]() is hi and c[3] == versions[1]:
            return c[4]
        q = act_qparams(float(lo), float(hi))
        self._qparams = (weakref.ref(lo), versions[0], weakref.ref(hi), versions[1], q)
        return q

    def qparams(self) -> Tuple[float, int]:
        """The same as :meth:`calculate_qparams` (the integer program's name for it)."""
        return self.calculate_qparams()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # checkpoints of earlier versions name the range lo / hi
        for old, new in (("lo", "min_val"), ("hi", "max_val")):
            if prefix + old in state_dict and prefix + new not in state_dict:
                state_dict[prefix + new] = state_dict.pop(prefix + old)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Observe ``x`` (with ``observer_enabled``) and fake-quantize it (with ``fake_quant_enabled``);
        same shape and dtype."""
        if self._switches["observer"] and self.activation_post_process is not None:
            self.activation_post_process(x.detach())
        if not self._switches["fake_quant"]:
            return x
        s, z = self.calculate_qparams()
        with torch.autocast(x.device.type, enabled=False):
            xf = x.float()
            q = torch.clamp(round_half_up(xf / s) + z, 0, ACT_QMAX)
            y = (q - z) * s
            inside = torch.clamp(xf, (0 - z) * s, (ACT_QMAX - z) * s)
            return (inside + (y - inside).detach()).to(x.dtype)

    def extra_repr(self) -> str:
        """The switches and the calibrated range."""
        return (f"fake_quant_enabled={int(self.fake_quant_enabled)}, observer_enabled={int(self.observer_enabled)}, "
                f"min_val={float(self.min_val):.4g}, max_val={float(self.max_val):.4g}")
