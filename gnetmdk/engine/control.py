"""The float control of a pipeline run: the float model trained on for as long as the quantized stages
train, so that the cost of quantization is measured against a float model trained as long.

Steps 2, 3 and 4 each fine-tune for their own schedule (``per_step``: learning rate, epochs, warm-up,
EMA, evaluation interval), and a step-4 model that beats step 1 may only have trained longer. The
control runs three float stages (step 1's model: BatchNorm, no quantizer) with exactly those
schedules, each from the previous one's best.pth, the first from step 1's: the same epochs, the same
learning rates, the same EMA, the same loss and augmentation (where a stage sets its own) and the same
choice of best.pth by val mAP. The cost of quantization is then ``step 4 - max(step 1, control)``
(docs/results.md).
"""
from __future__ import annotations

import copy
import os
from typing import List, Optional, Sequence, Tuple

from gnetmdk.config import build_config

#: what a control stage takes from the quantized stage it stands for: its schedule and optimizer
SCHEDULE_FIELDS = ("learning_rate", "num_epochs", "min_steps", "warmup_epochs", "warmup_factor", "lr_scheduler",
                   "min_lr_ratio", "lr_step_size", "lr_milestones", "lr_gamma", "lr_restart_epochs",
                   "lr_restart_mult", "eval_interval", "eval_from", "patience", "ema", "ema_decay", "ema_ramp", "optimizer",
                   "weight_decay", "momentum", "nesterov", "grad_clip", "batch_size", "accumulate")
#: ... and its loss and data augmentation: the fields of a model family's config section that change what a
#: float stage trains towards. A stage that sets one of them (``per_step[3] = dict(l_range=1.0)``) gets a
#: control stage that trains with it too, so the cost compares quantization and nothing else; the model's
#: structure and its quantization settings stay step 1's
TRAINING_SECTION_FIELDS = {
    "gnetdet": ("l_coord", "l_noobj", "l_class", "l_range", "score_loss", "hsv_gain", "scale_range",
                "shift_fraction", "flip_prob", "blur_prob", "mosaic_prob", "rotate_prob", "finetune",
                "freeze_convs", "freeze_at"),
    "ppyolo": ("ignore_thresh", "label_smooth", "iou_loss_weight", "iou_aware_loss_weight", "train_sizes",
               "random_interp", "mixup_epochs", "mixup_alpha", "mixup_beta"),
}
#: the quantized stages whose schedules the control follows, in order
CONTROL_OF = (2, 3, 4)


def control_configs(klass, overrides: Sequence[str] = ()) -> List[object]:
    """The configs of the control's three float stages (step 1 with the schedules of steps 2, 3, 4).

    Each is ``build_config(klass, overrides, step=1)`` with :data:`SCHEDULE_FIELDS` and the config
    sections' :data:`TRAINING_SECTION_FIELDS` taken from the config of the step it stands for, ``load``
    the previous stage's best.pth (the first: step 1's), and its outputs in
    ``<checkpoint_root>/control/as_step<k>`` (logs in ``<log_root>/control/as_step<k>``), so step 1's
    own outputs are never touched.

    Returns:
        a list of 3 resolved configs, run in order.
    """
    first = build_config(klass, overrides, step=1)
    prev = os.path.join(first.checkpoint_dir(1), "best.pth")
    out = []
    for k in CONTROL_OF:
        like = build_config(klass, overrides, step=k)
        cfg = build_config(klass, overrides, step=1)
        for f in SCHEDULE_FIELDS:
            setattr(cfg, f, getattr(like, f))
        for section, fields in TRAINING_SECTION_FIELDS.items():
            if hasattr(cfg, section) and hasattr(like, section):
                for f in fields:
                    setattr(getattr(cfg, section), f, copy.deepcopy(getattr(getattr(like, section), f)))
        cfg.load = prev
        cfg.checkpoint_root = os.path.join(first.checkpoint_root, "control", f"as_step{k}")
        cfg.log_root = os.path.join(first.log_root, "control", f"as_step{k}")
        prev = os.path.join(cfg.checkpoint_dir(1), "best.pth")
        out.append(cfg)
    return out


def quantization_cost(step1: float, control: float, step4: float) -> float:
    """``step4 - max(step1, control)`` (mAP as a fraction): what quantization cost against the better of
    the float model and the float model trained as long as the quantized stages."""
    return step4 - max(step1, control)


#: the share of a stage's epochs, at its end, over which the plateau is judged
PLATEAU_FRACTION = 0.25
#: a float model is at its plateau when its val mAP moved less than this (a fraction) over that share
PLATEAU_SPAN = 0.01


def plateau_span(val_maps: Sequence[Sequence[float]], num_epochs: int,
                 fraction: float = PLATEAU_FRACTION) -> Optional[Tuple[float, int, int]]:
    """How far the val mAP moved over the last ``fraction`` of a stage's epochs: the test of whether a
    float model (step 1, the control) finished training before its epochs ended. Where it had not, the
    quantized stages' further epochs train it on, and step 4 - step 1 credits them with that training
    (docs/pipeline.md, "The float control").

    Args:
        val_maps: [(epoch, val mAP)] in epoch order (epochs counted from 1; mAP as a fraction), as the
            trainer's summary holds them (``val_maps``).
        num_epochs: the stage's epochs; the window is the epochs after ``(1 - fraction) * num_epochs``,
            including the last.
    Returns:
        (max - min of the val mAPs in the window, the window's first evaluated epoch, how many
        evaluations it holds), or None when it holds fewer than two.
    """
    start = (1.0 - fraction) * num_epochs
    window = [(int(e), float(m)) for e, m in val_maps if e > start]
    if len(window) < 2:
        return None
    maps = [m for _, m in window]
    return max(maps) - min(maps), window[0][0], len(window)
