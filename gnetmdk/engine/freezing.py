"""Freezing the leading sublayers: ``freeze_at`` for the whole run, ``finetune`` for the first epochs.

Both take the family's ``leading_parameters(model, n)`` (the parameters of the first ``n`` trainable
units; a family without such units freezes nothing) and set ``requires_grad`` False, so the frozen
parameters get no gradient and the optimizer keeps no state for them. ``freeze_at`` parameters are left
out of the optimizer entirely (gnetmdk.engine.schedule.build_optimizer takes the trainable ones).
Under DDP the trainer wraps the model again after ``finetune`` changes what is trainable: DDP registers
the trainable parameters when it wraps.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from gnetmdk.config import ConfigError

from .runtime import freeze, unfreeze


def freeze_leading(model: torch.nn.Module, family, section) -> List[torch.nn.Parameter]:
    """``freeze_at N``: freeze the first N sublayers for the whole run (a family without leading units
    freezes nothing).

    Returns:
        the parameters frozen (they were trainable), [] for none.
    Raises:
        ConfigError: ``freeze_at``, or ``freeze_convs`` with ``finetune``, exceeds the model's sublayer
            count (one line naming the field).
    """
    if not family.leading_parameters(model, 1):
        return []
    n_layers = len(getattr(model, "layers", []))
    finetune = getattr(section, "finetune", 0)
    for name in ("freeze_at",) + (("freeze_convs",) if finetune else ()):
        if getattr(section, name) > n_layers:
            raise ConfigError(f"config field '{family.name}.{name}' = {getattr(section, name)}: the model "
                              f"has {n_layers} sublayers")
    return freeze(family.leading_parameters(model, getattr(section, "freeze_at", 0)))


class Finetune:
    """``finetune N``: the first ``freeze_convs`` sublayers are frozen during epochs 0..N-1 and trainable
    after.

    Args:
        family: the model's DetectorFamily (its ``leading_parameters``).
        section: the family's config section (``finetune``, ``freeze_convs``; absent fields mean 0).
    """

    def __init__(self, family, section):
        self.family = family
        self.epochs = int(getattr(section, "finetune", 0) or 0)
        self.convs = int(getattr(section, "freeze_convs", 0) or 0)
        #: the parameters frozen now (to unfreeze later); [] when none are
        self.frozen: List[torch.nn.Parameter] = []

    def apply(self, model: torch.nn.Module, epoch: int) -> Tuple[Optional[str], bool]:
        """Freeze or unfreeze for ``epoch`` (0-based).

        Returns:
            (the log line, or None when nothing changed; whether what is trainable changed, so that a
            DDP model must be wrapped again).
        """
        want = epoch < self.epochs
        if want == bool(self.frozen):
            return None, False
        if want:
            self.frozen = freeze(self.family.leading_parameters(model, self.convs))
            return f"finetune: first {self.convs} sublayers frozen until epoch {self.epochs}", bool(self.frozen)
        unfreeze(self.frozen)
        self.frozen = []
        return f"finetune: sublayers unfrozen from epoch {epoch + 1}", True
