"""Checkpoint save/load per step (best/last), atomic writes, safe loading (models are rebuilt by gnetmdk.models.rebuild)."""
from .io import (CheckpointError, atomic_write_bytes, atomic_write_text, load_checkpoint, load_matching,
                 save_checkpoint, save_config_json, weights_sha256)

__all__ = ["CheckpointError", "atomic_write_bytes", "atomic_write_text", "load_checkpoint", "load_matching",
           "save_checkpoint", "save_config_json", "weights_sha256"]
