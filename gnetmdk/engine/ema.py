"""Exponential moving average of the weights (kept beside the raw weights, never in their place)."""
from __future__ import annotations

import copy
import math
from typing import Dict

import torch


class ModelEMA:
    """EMA of a model's floating-point parameters and buffers.

        ema <- d * ema + (1 - d) * weights,   d = decay * (1 - exp(-updates / ramp))

    (the ramp keeps early averages from being dominated by the random initial weights; the form is
    the one used by YOLOv5/timm.) Integer buffers and the layer switches are copied, not averaged.

    Args:
        model: the model being trained (its current weights start the average).
        decay: the asymptotic decay d (e.g. 0.999).
        ramp: updates over which d ramps up (e.g. 200).
    """

    def __init__(self, model: torch.nn.Module, decay: float = 0.999, ramp: float = 200.0):
        self.module = copy.deepcopy(model).eval()
        for p in self.module.parameters():
            p.requires_grad_(False)
        for b in self.module.buffers():       # learned caps (step 3, cap_lr) are buffers that train
            b.requires_grad_(False)
        self.decay = float(decay)
        self.ramp = float(ramp)
        self.updates = 0
        self._plan = None       # update's plan, rebuilt when the model's tensors change

    def current_decay(self) -> float:
        """The decay of the next update: ``decay * (1 - exp(-updates / ramp))``, or ``decay`` with ``ramp`` 0."""
        return self.decay * (1 - math.exp(-self.updates / self.ramp)) if self.ramp > 0 else self.decay

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        """Fold the model's current weights into the average (call after each optimizer step).

        Which tensors are averaged and which copied is worked out once and reused while the model
        holds the same tensors (same objects, same requires_grad): an iteration then costs two
        multi-tensor ops for the average and one for the copies (one kernel each on CUDA), not a walk
        over both state dicts with a copy launched per integer buffer."""
        self.updates += 1
        d = self.current_decay()
        src = model.state_dict(keep_vars=True)
        mine = self.module.state_dict(keep_vars=True)
        key = [(id(w), w.requires_grad) for w in src.values()] + [id(v) for v in mine.values()]
        if self._plan is None or self._plan[0] != key:
            self._plan = (key,) + self._make_plan(model, src, mine)
        _, avg, new, convert, dst, copied = self._plan
        if avg:   # one multi-tensor kernel per op on CUDA (the same per-element arithmetic as v * d + (1 - d) w)
            news = [w.to(v.dtype) for v, w in zip(avg, new)] if convert else new
            torch._foreach_mul_(avg, d)
            torch._foreach_add_(avg, news, alpha=1 - d)
        if dst:
            torch._foreach_copy_(dst, copied)

    def _make_plan(self, model: torch.nn.Module, src: Dict[str, torch.Tensor], mine: Dict[str, torch.Tensor]):
        """(averaged EMA tensors, the model's tensors they average, whether any dtype differs, copied
        EMA tensors, the model's tensors copied into them): floating tensors are averaged except the
        calibrated ranges (caps, int8 ranges, output scales), which are copied unless they train
        (learned caps: buffers with requires_grad). The lists hold the tensors themselves (parameters
        and buffers as registered, not detached views), so a parameter whose ``.data`` is replaced (a
        move or a memory-format change) is read where it now lives."""
        avg, new, dst, copied = [], [], [], []
        learned = {k for k, b in model.named_buffers() if b.requires_grad}
        for k, v in mine.items():
            w = src[k]
            fixed = k.endswith(".cap") or k.startswith("quant.") or k.endswith("output_scale")   # calibrated ranges
            if v.dtype.is_floating_point and (not fixed or k in learned):
                avg.append(v)
                new.append(w)
            else:
                dst.append(v)
                copied.append(w)
        return avg, new, any(v.dtype != w.dtype for v, w in zip(avg, new)), dst, copied

    def sync_switches(self, model: torch.nn.Module) -> None:
        """Copy layer switches (quantization on/off, caps mode) from the trained model."""
        for a, b in zip(self.module.modules(), model.modules()):
            # fake quantizers of both families (QConv2d, QReLU, intq's ActQuant), through their methods
            if hasattr(b, "enable_fake_quant") and hasattr(a, "enable_fake_quant"):
                a.enable_fake_quant(bool(b.fake_quant_enabled))
            if hasattr(b, "enable_observer") and hasattr(a, "enable_observer"):
                a.enable_observer(bool(b.observer_enabled))
            for attr in ("integer", "exact_eval", "q_weights", "q_integer"):
                if hasattr(b, attr):
                    setattr(a, attr, getattr(b, attr))

    def state_dict(self) -> Dict[str, object]:
        """The averaged weights (on CPU), ``updates``, ``decay`` and ``ramp``, for the checkpoint."""
        return {"model": {k: v.detach().cpu() for k, v in self.module.state_dict().items()},
                "updates": self.updates, "decay": self.decay, "ramp": self.ramp}

    def load_state_dict(self, state: Dict[str, object]) -> None:
        """Restore the averaged weights and the update count from :meth:`state_dict`'s dict (``decay`` and
        ``ramp`` stay this object's)."""
        self.module.load_state_dict(state["model"])
        self.updates = int(state["updates"])
