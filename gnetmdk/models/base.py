"""The protocol a model family implements; the trainer, evaluator, dataset and checkpoint code know a
model only through it (docs/architecture.md, "Families are plug-ins").

A family is one object (a subclass of :class:`DetectorFamily`, registered under its name in
gnetmdk.models) that says how to build its model from a resolved config or from a checkpoint's
``model_meta``, what its images and targets look like in the data pipeline, and which stages of the
pipeline it supports. Its model is an ``nn.Module`` with:

    forward(images)          images (N, 3, H, W) float32 as the family's ``input_kind`` says
                             -> predictions (any structure the loss and decode understand)
    loss(pred, targets)      -> dict of 0-d tensors, one per named term and "total"; every term a
                             per-image sum averaged over the batch, so N processes x B/N equal 1 x B
    decode(pred, conf_thresh, nms_thresh, max_detections)
                             -> list of N dicts: boxes (K, 4) float32 xyxy relative to the image
                             (0..1), scores (K,) float32, labels (K,) int64, on the CPU
    meta()                   -> plain dict from which the family rebuilds the architecture ("name" included)
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch.nn as nn

#: every stage of the pipeline, in order
ALL_STAGES = ("step1", "step2", "cal", "step3", "step4")


class DetectorFamily:
    """One model family. Subclasses set the class attributes and implement the methods.

    Attributes:
        name: the family's name: ``model_name`` in configs, ``model_meta["name"]`` in checkpoints.
        stages: the pipeline stages it supports (the trainer refuses the others, naming them).
        input_kind: what the data pipeline feeds the model: "chip_codes" (the chip's 5-bit codes
            0..31 of a BGR image, gnetmdk.gti.quantize.image_to_codes) or "rgb" (RGB pixels 0..255);
            either travels from the loader as uint8 and becomes float32 on the device.
        target_kind: "dense" (the family's own per-image target tensor, from :meth:`encode_targets`) or
            "padded" (``(max_boxes, 6)`` rows ``[class, x1, y1, x2, y2, score]`` relative to the image,
            class -1 for padding; the loss assigns them itself).
    """
    name: str = ""
    stages: Tuple[str, ...] = ("step1",)
    input_kind: str = "rgb"
    target_kind: str = "padded"

    # ------------------------------------------------------------------ models
    def create(self, **kwargs) -> nn.Module:
        """The family's model from its constructor's keyword arguments (``model_meta`` without "name")."""
        raise NotImplementedError

    def build(self, cfg, **overrides) -> nn.Module:
        """A fresh model for a resolved config (``overrides`` replace config-derived arguments)."""
        raise NotImplementedError

    def rebuild(self, meta: Dict[str, Any], cfg=None, stage: Optional[str] = None, path: str = "?") -> nn.Module:
        """The architecture a checkpoint's ``model_meta`` describes (weights not loaded). ``cfg`` gives
        the run's training settings (loss weights, ...), ``stage`` the checkpoint's stage."""
        raise NotImplementedError

    def meta_defaults(self) -> Dict[str, Any]:
        """``model_meta`` keys added after checkpoints were first written, with the value those older
        checkpoints' models computed with (read where a checkpoint lacks the key)."""
        return {}

    def describe(self, cfg) -> str:
        """A few words on the model for the start-up log line (e.g. ``224px x0.25``)."""
        return f"{cfg.image_size}px"

    def compat_fields(self, cfg) -> Dict[str, Any]:
        """``model_meta`` keys a checkpoint must share with ``cfg`` to be trained or evaluated with it
        (beyond name and class count), with the config's values."""
        return {}

    def check_config(self, cfg) -> None:
        """Refuse config values this family cannot use (ConfigError naming the field and the fix)."""

    # ------------------------------------------------------------------ data
    def build_dataset(self, cfg, split: str):
        """The dataset of ``split`` ("train" or "valid"): items (image (3, H, W) uint8 as ``input_kind``
        says, targets as ``target_kind`` says, index, (width, height) of the file); ``set_epoch``,
        ``ground_truth(i)``, ``original_size(i)``, ``num_classes`` and ``augment`` as
        gnetmdk.dataset.dataset.GNetDetDataset has them."""
        raise NotImplementedError

    def configure(self, model: nn.Module, cfg) -> List[str]:
        """Settings the run applies to a built model (e.g. randomness off in ``--deterministic`` runs);
        returns log lines."""
        return []

    def encode_targets(self, boxes: np.ndarray, labels: np.ndarray, scores: np.ndarray, cfg) -> np.ndarray:
        """Dense targets of one sample (``target_kind`` "dense" only): boxes (K, 4) float32 xyxy relative
        to the image, labels (K,) int64, scores (K,) float32 (1 but after MixUp)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ training
    def leading_parameters(self, model: nn.Module, n: int) -> List[nn.Parameter]:
        """Parameters of the first ``n`` trainable units (``freeze_at`` / ``finetune``); [] if the family
        has no such notion."""
        return []

    def prepare_stage(self, model: nn.Module, stage, calibrating: bool = False) -> None:
        """Set the switches of ``model``'s quantizers for ``stage`` (a gnetmdk.models.stages.Stage: its
        ``weight_fake_quant``, ``act_fake_quant``, ``integer`` columns), keeping its train / eval
        mode. ``calibrating``: the cal stage's measuring pass. By default a family without quantizers
        (float stages only): nothing to set."""
        model.train(model.training)

    def epoch_mode(self, model: nn.Module, stage, epoch: int, cfg) -> Optional[str]:
        """Adjust ``model``, just put in train mode, for training epoch ``epoch`` (0-based) of ``stage``
        (e.g. BatchNorm layers that normalize with frozen running statistics); returns a log line while
        such a change applies (the trainer logs it when it differs from the previous epoch's), else
        None. It must depend on the epoch alone, so that a resumed run trains as an uninterrupted one.
        By default: nothing."""
        return None

    def enter_stage(self, model: nn.Module, stage, source_stage: Optional[str], cfg) -> List[str]:
        """The stage's entry edits on a model loaded from an earlier stage's checkpoint (not on
        resume): by default the stage table's hooks (gnetmdk.models.stages: BatchNorm folding, the
        caps check, gain editing). Returns log lines.

        Raises:
            CheckpointError / RuntimeError: the model cannot enter the stage (e.g. uncalibrated).
        """
        out = []
        for hook in stage.enter:
            msg = hook(model, source_stage)
            if msg:
                out.append(msg)
        return out

    def output_cap_limit(self, cfg, model=None) -> float:
        """The upper limit on the output layer's calibrated cap (0 = none) for ``model`` (None: from the
        config alone): by default the section's ``output_cap_max`` when it has one, else 0."""
        return max(0.0, float(getattr(cfg.section(), "output_cap_max", 0.0)))

    def calibrate(self, model: nn.Module, batches, cfg, device, progress) -> Dict[str, Any]:
        """The cal stage's measurement on ``model`` (weights quantized), which it leaves in step 3's
        mode (training); each family with a cal stage provides it (GNetDet: the chip's ReLU caps;
        PP-YOLO: the uint8 ranges).

        Returns:
            {"caps": list of floats (logged, in the summary), "how": words for the log line
            (``{batches}`` is replaced by the number of batches), "label": what the values are ("caps"),
            "file": (name under model_root, text) written beside cal.pth}.
        Raises:
            NotImplementedError: the family has no calibration.
        """
        raise NotImplementedError(f"model family {self.name!r} has no calibration stage")

    def distill_loss(self, student, teacher):
        """The distillation term (``distill`` > 0, steps 2-4): the squared difference between the
        quantized model's outputs and the float (step-1) model's on the same images, summed per image
        and averaged over the batch like every loss term (Hinton et al. 2015, "Distilling the
        Knowledge in a Neural Network", with the teacher's outputs as regression targets; the
        outputs here are GNetDet's values, boxes and scores on the 0..1 scale).

        Args:
            student, teacher: ``forward`` outputs (a tensor (N, ...) or a list of them), float.
        Returns:
            0-d tensor (differentiable in the student).
        """
        import torch
        s_list = student if isinstance(student, (list, tuple)) else [student]
        t_list = teacher if isinstance(teacher, (list, tuple)) else [teacher]
        n = s_list[0].shape[0]
        total = sum((s.float() - t.float().detach()).square().sum() for s, t in zip(s_list, t_list))
        return total / max(n, 1) if torch.is_tensor(total) else torch.zeros(())

    def loss_line(self, terms: Dict[str, float]) -> str:
        """The epoch log line's loss part, e.g. ``loss 1.23 (loc 0.5 cls 0.2)``."""
        parts = " ".join(f"{k} {v:.3f}" for k, v in sorted(terms.items()) if k != "total")
        return f"loss {terms.get('total', float('nan')):.4f}" + (f" ({parts})" if parts else "")


def default_loss_order(terms: Dict[str, float], order: Sequence[str]) -> List[str]:
    """The keys of ``terms`` in ``order`` first, then the rest sorted (for stable log lines)."""
    first = [k for k in order if k in terms]
    return first + sorted(k for k in terms if k not in first)
