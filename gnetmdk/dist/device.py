"""Which device a run uses and how torch's backends are set for it (CUDA and CPU alike).

One place decides, for the trainer and the tools: ``device`` auto / cpu / cuda, TF32, cuDNN's
algorithm search, and the deterministic mode of alignment runs (``--deterministic``). It sits low (it
needs only the config), so that the chip tools (gnetmdk.chip.cli_util) set the backends as
training does; gnetmdk.engine.device re-exports it.
"""
from __future__ import annotations

import os
from typing import List

import torch


def resolve_device(cfg) -> torch.device:
    """cfg.device "auto" -> the current CUDA device if torch sees one, else cpu; "cpu" / "cuda" as asked.

    Raises:
        ConfigError: "cuda" asked for but torch sees no GPU (the message names the fix), or "auto"
            refused (gnetmdk.config.base.cuda_wanted).
    """
    from gnetmdk.config.base import ConfigError, cuda_wanted
    if cuda_wanted(cfg.device):
        if not torch.cuda.is_available():
            raise ConfigError("device 'cuda' asked for but torch sees no GPU (a CPU build of torch, or "
                              "CUDA_VISIBLE_DEVICES hides them): set device cpu or auto")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def set_tf32(enabled: bool) -> None:
    """TF32 for float32 matrix products and convolutions on CUDA on (``enabled``) or off ("ieee").

    Uses the per-backend ``fp32_precision`` settings where torch has them (2.9 and later; mixing them
    with the older ``allow_tf32`` flags is an error there), else the ``allow_tf32`` flags. TF32 never
    touches float64, so the exact (float64 / integer) paths of step 4 and the chip check are the same
    either way; it changes float32 training and the evaluation of steps 1-3 on Ampere and later GPUs.
    """
    mode = "tf32" if enabled else "ieee"
    b = torch.backends
    if hasattr(b.cuda.matmul, "fp32_precision") and hasattr(b.cudnn, "conv"):
        b.cuda.matmul.fp32_precision = mode
        b.cudnn.conv.fp32_precision = mode
        b.cudnn.rnn.fp32_precision = mode
    else:  # pragma: no cover - torch before 2.9
        b.cuda.matmul.allow_tf32 = enabled
        b.cudnn.allow_tf32 = enabled


def tf32_enabled() -> bool:
    """Whether float32 convolutions on CUDA may use TF32 now."""
    b = torch.backends
    if hasattr(b.cudnn, "conv") and hasattr(b.cudnn.conv, "fp32_precision"):
        return b.cudnn.conv.fp32_precision == "tf32"
    return bool(b.cudnn.allow_tf32)  # pragma: no cover - torch before 2.9


def tf32_wanted(cfg, float_stage: bool) -> bool:
    """Whether float32 convolutions and products on CUDA may use TF32 for this run: ``tf32 on``, or
    ``auto`` in a float stage (``float_stage``: step 1 or the float control); never in deterministic
    mode. A config without the field (an old checkpoint's) reads as off."""
    if bool(getattr(cfg, "deterministic", False)):
        return False
    from gnetmdk.config.base import tf32_mode
    mode = tf32_mode(getattr(cfg, "tf32", "off"))
    return mode == "on" or (mode == "auto" and float_stage)


def is_float_stage(cfg) -> bool:
    """Step 1 (and the float control, which trains as step 1): no quantizer in the model."""
    return int(getattr(cfg, "step", 1)) == 1 and not bool(getattr(cfg, "cal", False))


def configure_backends(cfg, device: torch.device) -> List[str]:
    """Set torch's global switches for a run on ``device``; returns log lines.

    * TF32 (``cfg.tf32``, :func:`tf32_wanted`): by default in step 1 only; steps 2-4 and calibration
      keep float32 products in full precision, so a GPU run of them computes what the CPU computes up
      to the order of float32 sums.
    * cuDNN algorithm search (``benchmark``) on CUDA, unless deterministic.
    * ``cfg.deterministic`` (alignment runs): augmentation off (``cfg.augment = False``; the input
      size is fixed in this toolkit and GNetDet has no dropout-like layers),
      ``torch.use_deterministic_algorithms(True)``, cuDNN deterministic without search,
      CUBLAS_WORKSPACE_CONFIG=:4096:8 for deterministic cuBLAS, TF32 off whatever ``cfg.tf32`` says.
      Call it before the datasets are built (it may turn augmentation off) and before any CUDA work
      (cuBLAS reads its workspace setting when it starts).
    """
    notes: List[str] = []
    deterministic = bool(getattr(cfg, "deterministic", False))
    tf32 = tf32_wanted(cfg, is_float_stage(cfg))
    set_tf32(tf32)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = not deterministic
        if tf32:
            notes.append("tf32: float32 convolutions and matrix products in TF32 (exact paths stay float64)")
    if deterministic:
        cfg.augment = False
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        notes.append("deterministic mode: augmentation off, torch deterministic algorithms on"
                     + (", cuDNN search off, TF32 off" if device.type == "cuda" else ""))
    return notes
