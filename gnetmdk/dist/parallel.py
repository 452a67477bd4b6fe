"""What a model needs to compute under data parallelism what it computes in one process.

Called by the trainer once the model is built:
  - BatchNorm -> synchronised BatchNorm (``cfg.sync_bn``; torch.nn.SyncBatchNorm on CUDA when world
    size > 1, our DistBatchNorm2d on CPU for every world size): statistics of the global batch.
  - every QReLU gets ``percentile_fn = global_percentile``: in calibration the per-batch percentile
    is that of the global batch (exact distributed selection, no gathering of activations), so the
    running maximum, and after the final all-reduce MAX the caps, equal one process's.
Gradient averaging is DistributedDataParallel's (Trainer.wrap_model).

And for alignment runs, :func:`configure_determinism` (``cfg.deterministic``).
"""
from __future__ import annotations

import os
from typing import List

import torch

from .comm import get_world_size, global_percentile
from .syncbn import convert_sync_batchnorm, count_sync_batchnorm


def prepare_model(model: torch.nn.Module, cfg, device: torch.device) -> List[str]:
    """Make ``model`` compute under data parallelism what one process computes; returns log lines.

    BatchNorm (``cfg.sync_bn``): on CPU every run, a single process included, uses DistBatchNorm2d,
    so that 1 and N processes share one arithmetic (float64 statistics; torch's CPU BatchNorm
    accumulates channels-last statistics in float32 and would differ from N processes by ~1e-4);
    on CUDA, world size > 1 converts to torch.nn.SyncBatchNorm. Calibration percentiles of the global
    batch when world size > 1.
    """
    notes: List[str] = []
    world = get_world_size()
    has_bn = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())
    if getattr(cfg, "sync_bn", True) and has_bn and (device.type != "cuda" or world > 1):
        convert_sync_batchnorm(model, use_cuda=device.type == "cuda")
        kind = "torch.nn.SyncBatchNorm" if device.type == "cuda" else "DistBatchNorm2d, float64 statistics"
        notes.append(f"BatchNorm: {count_sync_batchnorm(model)} layers synchronised over {world} process(es) ({kind})")
    if os.environ.get("XFREEZE"):
        for layer in getattr(model, "layers", []):
            if getattr(layer, "bn", None) is not None:
                layer.conv.bias.requires_grad_(False)
    if world > 1:
        for r in (m for m in model.modules() if hasattr(m, "percentile_fn")):
            r.percentile_fn = global_percentile
    return notes


def configure_determinism(cfg) -> List[str]:
    """Deterministic mode for alignment runs (``cfg.deterministic``); returns log lines.

    Turns augmentation off (``cfg.augment = False``; the input size is fixed in this toolkit, and
    GNetDet has no dropout-like layers), sets ``torch.use_deterministic_algorithms(True)``, cuDNN
    deterministic without benchmarking, and CUBLAS_WORKSPACE_CONFIG for deterministic cuBLAS.
    """
    if not getattr(cfg, "deterministic", False):
        return []
    cfg.augment = False
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    return ["deterministic mode: augmentation off, torch deterministic algorithms on"]
