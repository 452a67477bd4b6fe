"""Knowledge distillation of the quantized stages from the float model (``distill`` > 0, steps 2-4).

The teacher is the step-1 model (``distill_from``, default ``<checkpoint_root>/step1/best.pth``, its
evaluated weights) in eval mode without gradients. Each forward adds the loss term
``distill * family.distill_loss(student outputs, teacher outputs)`` (gnetmdk.models.base
``DetectorFamily.distill_loss``: the squared difference of the outputs, per image, after Hinton et al.
2015, "Distilling the Knowledge in a Neural Network") to the student's terms, under the same autocast
as the student's forward. The trainer holds one :class:`Distillation` or None and calls it from its
forward; nothing else of the trainer is involved.
"""
from __future__ import annotations

import os
from typing import Dict, Optional

import torch

from gnetmdk.checkpoint.io import CheckpointError, load_checkpoint
from gnetmdk.models.rebuild import build_model_from_checkpoint, check_compatible

from .stages import STAGES, Stage, apply_stage


class Distillation:
    """The teacher and the weight of its loss term.

    Args:
        teacher: the float model, on the training device, in eval mode, its parameters frozen.
        weight: ``cfg.distill`` (> 0), the term's factor.
        family: the model's DetectorFamily (its ``distill_loss``).
        path: the teacher's checkpoint, for messages.
    """

    def __init__(self, teacher: torch.nn.Module, weight: float, family, path: str):
        self.teacher, self.weight, self.family, self.path = teacher, float(weight), family, path

    @classmethod
    def from_config(cls, cfg, stage: Stage, family, device: torch.device) -> Optional["Distillation"]:
        """The stage's distillation, or None (``distill`` 0, step 1, or the calibration pass).

        Raises:
            CheckpointError: the teacher checkpoint is missing, is not a step-1 checkpoint, or does not fit
                the config (one line naming the file and the fix).
        """
        if not cfg.distill or stage.step < 2 or stage.calibration:
            return None
        path = cfg.distill_from or os.path.join(cfg.checkpoint_dir(1), "best.pth")
        ckpt = load_checkpoint(path, f"distill {cfg.distill:g} needs the float model: train step 1 first, or set "
                                     "distill_from to a step-1 checkpoint (or distill 0)")
        if ckpt.get("stage") != STAGES["step1"].name:
            raise CheckpointError(f"distill_from '{path}' is a {ckpt.get('stage')} checkpoint: the teacher is the "
                                  "float (step-1) model")
        check_compatible(ckpt, cfg, path)
        teacher = build_model_from_checkpoint(ckpt, cfg, path)
        apply_stage(teacher, STAGES["step1"])
        teacher.to(device).eval()
        for p in teacher.parameters():
            p.requires_grad_(False)
        return cls(teacher, cfg.distill, family, path)

    def describe(self) -> str:
        """The log line: where the teacher comes from and what the term is."""
        return (f"distillation from {self.path} (weight {self.weight:g}: squared difference of the outputs, "
                "per image)")

    def add_term(self, images: torch.Tensor, pred, terms: Dict[str, torch.Tensor]) -> None:
        """Add the ``distill`` term to ``terms`` and to its ``total``, in place.

        Args:
            images: the batch the student saw, (N, 3, H, W) float, on the device.
            pred: the student's ``forward`` output for ``images``.
            terms: the student's loss terms ({name: 0-d tensor}, "total" among them).
        """
        with torch.no_grad():
            soft = self.teacher(images)
        terms["distill"] = self.weight * self.family.distill_loss(pred, soft)
        terms["total"] = terms["total"] + terms["distill"]
