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

    def current_decay(self) -> float:
        return self.decay * (1 - math.exp(-self.updates / self.ramp)) if self.ramp > 0 else self.decay

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        """Fold the model's current weights into the average (call after each optimizer step)."""
        self.updates += 1
        d = self.current_decay()
        src = model.state_dict()
        # caps are copied (calibrated, fixed) unless they train (cap_lr): then averaged like weights
        learned = {k for k, b in model.named_buffers() if b.requires_grad}
        avg, new = [], []
        for k, v in self.module.state_dict().items():
            w = src[k]
            fixed = k.endswith(".cap") or k.startswith("quant.") or k.endswith("output_scale")   # calibrated ranges
            if v.dtype.is_floating_point and (not fixed or k in learned):
                avg.append(v)
                new.append(w.detach().to(v.dtype))
            else:
                v.copy_(w)
        if avg:   # one multi-tensor kernel per op on CUDA (the same per-element arithmetic as v * d + (1 - d) w)
            torch._foreach_mul_(avg, d)
            torch._foreach_add_(avg, new, alpha=1 - d)

    def sync_switches(self, model: torch.nn.Module) -> None:
        """Copy layer switches (quantization on/off, caps mode) from the trained model."""
        for a, b in zip(self.module.modules(), model.modules()):
            for attr in ("quant_weight", "use_cap", "quant_act", "integer", "calibrating", "exact_eval", "q_weights",
                         "q_integer", "qmode"):
                if hasattr(b, attr):
                    setattr(a, attr, getattr(b, attr))

    def state_dict(self) -> Dict[str, object]:
        return {"model": {k: v.detach().cpu() for k, v in self.module.state_dict().items()},
                "updates": self.updates, "decay": self.decay, "ramp": self.ramp}

    def load_state_dict(self, state: Dict[str, object]) -> None:
        self.module.load_state_dict(state["model"])
        self.updates = int(state["updates"])
