"""Step 3's learned activation caps (``gnetdet.cap_lr`` > 0): the calibrated caps train with the weights.

A QReLU's cap is a buffer, not a parameter: gradients reach it through the gains of the convs before
and after it and, for the output layer, through the host scale (gnetmdk.layers.quant, ``gain_tensors``;
docs/quantization.md, "Straight-through estimator"), as LSQ learns a step size (Esser et al. 2020,
"Learned Step Size Quantization"). This part of the stage

- makes the caps require gradients and hands them to the optimizer in their own group (learning rate
  ``cap_lr``, no weight decay: gnetmdk.engine.schedule.build_optimizer);
- averages their gradients over the processes before each optimizer step, because DDP averages only the
  parameters' gradients (in rank order, by gnetmdk.dist.comm.all_reduce, so N processes equal one);
- keeps every cap at least :data:`CAP_FLOOR` after each step (a cap divides the gains).

The trainer holds one :class:`LearnedCaps` (empty when the stage does not learn caps).
"""
from __future__ import annotations

from typing import List

import torch

from gnetmdk.dist.comm import all_reduce, is_dist

#: learned caps are kept at least this large after every optimizer step (value units; a cap divides the
#: gains, so it must stay positive)
CAP_FLOOR = 1e-3


class LearnedCaps:
    """The caps a stage learns, and what the optimizer step does to them.

    Args:
        caps: the QReLUs' cap buffers (0-d float32 tensors), in the model's order; [] for none.
        lr: their learning rate (``cap_lr``).
    """

    def __init__(self, caps: List[torch.Tensor], lr: float = 0.0):
        self.caps, self.lr = list(caps), float(lr)
        for c in self.caps:
            c.requires_grad_(True)

    @classmethod
    def for_stage(cls, model: torch.nn.Module, stage, section) -> "LearnedCaps":
        """The caps of ``model.relus()`` when ``stage.trainable_caps`` and the family section's ``cap_lr``
        is positive, else none (a family without ``cap_lr`` learns none)."""
        lr = getattr(section, "cap_lr", 0.0)
        if stage.trainable_caps and lr > 0:
            return cls([r.cap for r in model.relus()], lr)
        return cls([], lr)

    def __bool__(self) -> bool:
        return bool(self.caps)

    def __len__(self) -> int:
        return len(self.caps)

    def describe(self) -> str:
        """The log line of a stage that learns caps."""
        return (f"learning the {len(self.caps)} activation caps (cap_lr {self.lr:g}, no weight decay, at least "
                f"{CAP_FLOOR:g}); model/relu_cap.txt follows best.pth")

    def average_gradients(self) -> None:
        """Under torch.distributed, replace each cap's gradient by its mean over the processes (a missing
        gradient counts as 0); one all-reduce of the stacked gradients. Nothing without a process group."""
        if not self.caps or not is_dist():
            return
        g = torch.stack([c.grad if c.grad is not None else torch.zeros_like(c) for c in self.caps])
        all_reduce(g, "mean")
        for c, gi in zip(self.caps, g):
            c.grad = gi.clone()

    @torch.no_grad()
    def clamp_(self) -> None:
        """Keep every cap at least :data:`CAP_FLOOR` (after the optimizer step)."""
        for c in self.caps:
            c.clamp_(min=CAP_FLOOR)
