"""What makes each stage of the pipeline different: one table plus entry hooks.

| stage | weights q. | activations q. | caps      | starts from            | on entry                     |
|-------|------------|----------------|-----------|------------------------|------------------------------|
| step1 | no         | no             | -         | step0/best.pth if any  | -                            |
| step2 | yes        | no             | -         | step1/best.pth         | fold BatchNorm               |
| cal   | yes        | no (measured)  | measured  | step2/best.pth         | (calibration pass)           |
| step3 | yes        | yes            | from cal  | step2/cal.pth          | require caps                 |
| step4 | yes        | yes, integer   | 31        | step3/best.pth         | gain editing                 |

(docs/quantization.md, "Stages"; docs/pipeline.md.) The trainer reads the table; no ``if step == 3`` elsewhere.
The table sits with the models, below the chip model (gnetmdk.chip), which sets a step-4
checkpoint's switches with it; gnetmdk.engine.stages re-exports it for the trainer and its hooks.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, Optional

from gnetmdk.gti.transforms import fold_bn, fold_requant_multipliers


@dataclass(frozen=True)
class Stage:
    """One row of the stage table.

    Attributes:
        name: "step1".."step4" or "cal".
        step: the step number (cal is 2).
        weight_fake_quant: the conv weights are fake-quantized (steps 2-4).
        act_fake_quant: the activations are fake-quantized: clipped at the calibrated cap and rounded
            to 5-bit codes for GNetDet, to uint8 with a scale and zero point for PP-YOLO (steps 3, 4).
        integer: step 4: the layers output integer codes (GNetDet), the integer program evaluates
            (PP-YOLO).
        source: (folder step, file) of the default starting checkpoint; None = fresh model.
        source_required: refuse to start without it.
        output_step: checkpoint/step<N> this stage writes into.
        enter: hooks (model, source_stage) -> message, run once when the stage starts from an
            earlier stage's checkpoint (not on resume).
        fresh_hint: what to run to produce the source.
        calibration: the stage is the calibration pass (one pass over the train set in order, without
            augmentation or accumulation; no training, no resume, no distillation).
        partial_source: its default source is a pretrained model loaded tensor by tensor where the
            shapes fit (another class count keeps the backbone); an explicit ``load`` is loaded whole.
        trainable_caps: the activation caps may train with the weights (``cap_lr`` > 0).
    """
    name: str
    step: int
    weight_fake_quant: bool
    act_fake_quant: bool
    integer: bool
    source: Optional[tuple]
    source_required: bool
    output_step: int
    enter: tuple = ()
    fresh_hint: str = ""
    calibration: bool = False
    partial_source: bool = False
    trainable_caps: bool = False


def fold_hook(model, source_stage: str) -> str:
    """The entry edit that folds every BatchNorm into its conv (gnetmdk.gti.transforms.fold_bn);
    returns its log line ("" when there was none)."""
    n = fold_bn(model)
    return f"folded {n} BatchNorm layers into their convs" if n else ""


def _require_caps(model, source_stage: str) -> str:
    caps = [float(r.cap) for r in model.relus()]
    if any(c <= 0 for c in caps):
        raise RuntimeError("step 3 needs calibrated ReLU caps: run 'train.py --cal' first "
                           "(or load a checkpoint that has them)")
    return ""


def _gain(model, source_stage: str) -> str:
    if source_stage == "step4":
        return ""
    _require_caps(model, source_stage)
    caps = fold_requant_multipliers(model)
    model.calibrated_caps = list(caps)   # saved in every step-4 checkpoint (the chip files' relu_cap.txt)
    codes = int(getattr(model.relus()[-1], "codes", 31))
    return f"gain-edited {len(caps)} convs; host output scale cap_last/{codes} = {caps[-1] / codes:.5g}"


STAGES: Dict[str, Stage] = {
    "step1": Stage("step1", 1, False, False, False, (0, "best.pth"), False, 1,
                   fresh_hint="(optional pretrained model)", partial_source=True),
    "step2": Stage("step2", 2, True, False, False, (1, "best.pth"), True, 2, (fold_hook,),
                   "run step 1 first: python3 train.py --step 1"),
    "cal": Stage("cal", 2, True, False, False, (2, "best.pth"), True, 2, (fold_hook,),
                 "run step 2 first: python3 train.py --step 2", calibration=True),
    "step3": Stage("step3", 3, True, True, False, (2, "cal.pth"), True, 3, (fold_hook, _require_caps),
                   "run calibration first: python3 train.py --cal", trainable_caps=True),
    "step4": Stage("step4", 4, True, True, True, (3, "best.pth"), True, 4, (fold_hook, _gain),
                   "run step 3 first: python3 train.py --step 3"),
}


def get_stage(cfg) -> Stage:
    """The Stage of a resolved config (cfg.cal -> "cal", else "step<N>")."""
    return STAGES[cfg.stage_name]


def apply_stage(model, stage: Stage, calibrating: bool = False) -> None:
    """Set every layer switch of ``model`` for ``stage``: its family does it
    (``DetectorFamily.prepare_stage``, the family named by ``model.meta()["name"]``).

    ``calibrating`` puts the chip's ReLUs in measuring mode (cal pass); afterwards call again with False
    and the step-3 switches (see Trainer.calibrate).

    Raises:
        ConfigError: the model's family is not registered.
    """
    from gnetmdk.config.registry import get_family
    get_family(model.meta()["name"]).prepare_stage(model, stage, calibrating)


def source_path(cfg, stage: Stage) -> Optional[str]:
    """The checkpoint a stage starts from: ``cfg.load`` if set, else the table's default."""
    if cfg.load:
        return cfg.load
    if stage.source is None:
        return None
    step, name = stage.source
    return os.path.join(cfg.checkpoint_dir(step), name)
