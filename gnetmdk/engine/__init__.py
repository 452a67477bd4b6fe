"""Trainer, stage table and schedules."""
from .stages import STAGES, Stage, apply_stage, get_stage
from .trainer import Trainer, TrainingError

__all__ = ["STAGES", "Stage", "apply_stage", "get_stage", "Trainer", "TrainingError"]
