"""Shared pieces of the chip tools' command lines (tools/convert_to_chip.py, chip_eval.py, predict.py,
eval_voc.py, stage_report.py): how models are loaded for evaluation. Which errors are the user's is one
list for every tool, gnetmdk.engine.cli.user_errors."""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch


def stage_of(ckpt: Dict[str, Any], path: str):
    """The Stage whose layer switches evaluate a checkpoint: STAGES[stage], and cal checkpoints as step 3.

    Raises:
        CheckpointError: the checkpoint names no known stage.
    """
    from gnetmdk.checkpoint.io import CheckpointError
    from gnetmdk.models.stages import STAGES
    name = ckpt.get("stage")
    if name == "cal":
        return STAGES["step3"]
    if name not in STAGES:
        raise CheckpointError(f"checkpoint '{path}' has stage {name!r}; expected one of {', '.join(STAGES)}")
    return STAGES[name]


def load_eval_model(path: str, cfg=None, require_stage: Optional[str] = None, check_config: bool = True):
    """Rebuild a checkpoint's model with its stage's switches, in eval mode.

    Args:
        path: checkpoint .pth.
        cfg: resolved config; when given (and ``check_config``), the checkpoint must fit it
            (class count, input size, width, chip).
        require_stage: refuse other stages (e.g. "step4").
    Returns:
        (model, ckpt).
    Raises:
        CheckpointError: missing/unreadable, wrong stage, does not fit the config.
    """
    from gnetmdk.checkpoint.io import CheckpointError, load_checkpoint
    from gnetmdk.models.rebuild import build_model_from_checkpoint, check_compatible
    from gnetmdk.models.stages import apply_stage
    ckpt = load_checkpoint(path)
    if require_stage and ckpt.get("stage") != require_stage:
        raise CheckpointError(f"checkpoint '{path}' is a {ckpt.get('stage')!r} checkpoint, not {require_stage}: "
                              f"pass checkpoint/{require_stage}/best.pth")
    if cfg is not None and check_config:
        check_compatible(ckpt, cfg, path)
    stage = stage_of(ckpt, path)
    model = build_model_from_checkpoint(ckpt, cfg, path)
    apply_stage(model, stage)
    model.eval()
    return model, ckpt


def eval_device(cfg=None) -> torch.device:
    """cuda when the config allows it (device auto/cuda) and a GPU is present, else cpu; on CUDA the
    backends are set as for the quantized stages (TF32 only with ``tf32 on``: gnetmdk.dist.device)."""
    from gnetmdk.config.base import cuda_wanted
    if cfg is not None and cuda_wanted(cfg.device) and torch.cuda.is_available():
        from gnetmdk.dist.device import set_tf32, tf32_wanted
        set_tf32(tf32_wanted(cfg, float_stage=False))
        return torch.device("cuda")
    return torch.device("cpu")
