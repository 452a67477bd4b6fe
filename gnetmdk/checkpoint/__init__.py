"""Checkpoint save/load per step (best/last), atomic writes, safe loading."""
from .io import (CheckpointError, atomic_write_bytes, atomic_write_text, build_model_from_checkpoint,
                 check_compatible, load_checkpoint, load_matching, save_checkpoint, save_config_json)

__all__ = ["CheckpointError", "atomic_write_bytes", "atomic_write_text", "build_model_from_checkpoint",
           "check_compatible", "load_checkpoint", "load_matching", "save_checkpoint", "save_config_json"]
