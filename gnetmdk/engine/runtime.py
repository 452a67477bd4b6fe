"""The trainer's runtime helpers: mixed precision, layer freezing, checkpoint-size estimate, freed memory.

See docs/training.md. The trainer (gnetmdk.engine.trainer) owns the loop; this module holds what it
calls per micro-batch / optimizer step so that the loop itself stays short.
"""
from __future__ import annotations

import contextlib
import math
import shutil
from typing import Dict, List, Optional

import torch


class Precision:
    """Autocast + (CUDA fp16 only) GradScaler, from ``cfg.amp`` / ``cfg.amp_dtype``.

    CPU: bfloat16 autocast (CPU autocast has no useful fp16; ``amp_dtype fp16`` is read as bf16 and
    a note says so). CUDA: ``bf16`` autocast without scaling, or ``fp16`` autocast with GradScaler.
    The quantized layers turn autocast off and compute in float32 (gnetmdk.layers.quant), and the loss
    is computed in float32, so only the float (step-1) convolutions run in reduced precision.
    """

    def __init__(self, cfg, device: torch.device):
        self.enabled = bool(cfg.amp)
        self.device_type = device.type
        self.notes: List[str] = []
        want = getattr(cfg, "amp_dtype", "bf16")
        if device.type == "cuda":
            self.dtype = torch.float16 if want == "fp16" else torch.bfloat16
        else:
            self.dtype = torch.bfloat16
            if self.enabled and want == "fp16":
                self.notes.append("amp on CPU: autocast runs in bf16 (amp_dtype fp16 applies to CUDA only)")
        use_scaler = self.enabled and device.type == "cuda" and self.dtype == torch.float16
        self.scaler = torch.amp.GradScaler("cuda", enabled=True) if use_scaler else None
        if self.enabled:
            self.notes.append(f"mixed precision: autocast {str(self.dtype).replace('torch.', '')} on "
                              f"{device.type}{' with GradScaler' if self.scaler else ''}; quantizers in float32")

    def autocast(self):
        """The forward pass's autocast context (``dtype`` on this device), or a no-op context when amp is off."""
        if not self.enabled:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward from ``loss`` (a 0-d tensor), scaled by the GradScaler first when there is one (fp16 on CUDA)."""
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def backward_all(self, losses) -> None:
        """One backward pass from several losses (the virtual ranks' of one process), each scaled as
        :meth:`backward` scales one."""
        torch.autograd.backward([self.scaler.scale(l) if self.scaler is not None else l for l in losses])

    def step(self, optimizer: torch.optim.Optimizer, params, grad_clip: float) -> torch.Tensor:
        """Unscale (fp16), clip the gradient norm, step the optimizer, update the scale.

        Returns the gradient norm before clipping as a 0-d float32 tensor on the parameters' device,
        without reading it back (the trainer reads it with the loss terms, once per iteration, and
        stops the run when it is not finite: such a step's weights are never written). With
        GradScaler (fp16) an overflow is normal: the scaler skips that step and lowers the scale
        (GradScaler itself reads its overflow flag back).
        """
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)
        grads = [p for p in params if p.grad is not None]
        if not grads:
            dev = next(iter(params), torch.zeros(())).device if params else torch.device("cpu")
            norm = torch.zeros((), device=dev)
        elif grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(grads, grad_clip)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in grads])
        if self.scaler is not None:
            self.scaler.step(optimizer)
            self.scaler.update()
        else:
            optimizer.step()
        return norm.detach()

    def state_dict(self) -> Optional[Dict[str, object]]:
        """The GradScaler's state for the checkpoint, or None without a scaler."""
        return self.scaler.state_dict() if self.scaler is not None else None

    def load_state_dict(self, state: Optional[Dict[str, object]]) -> None:
        """Restore the GradScaler's state from a checkpoint (ignored without a scaler or an empty ``state``)."""
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)


def leading_parameters(model: torch.nn.Module, n: int) -> List[torch.nn.Parameter]:
    """Parameters of the first ``n`` sublayers (conv and BatchNorm) of a GNetDet-like model."""
    layers = list(getattr(model, "layers", []))
    return [p for layer in layers[:n] for p in layer.parameters()]


def freeze(params: List[torch.nn.Parameter]) -> List[torch.nn.Parameter]:
    """Set requires_grad False; returns the parameters that were trainable (to unfreeze later)."""
    changed = [p for p in params if p.requires_grad]
    for p in changed:
        p.requires_grad_(False)
    return changed


def unfreeze(params: List[torch.nn.Parameter]) -> None:
    """Set requires_grad True again on the parameters :func:`freeze` returned."""
    for p in params:
        p.requires_grad_(True)


def estimate_checkpoint_bytes(model: torch.nn.Module, optimizer_slots: int, ema: bool) -> int:
    """Bytes the run's checkpoint files need at most at once: last.pth (weights, ``optimizer_slots``
    tensors per trainable parameter, EMA), best.pth (weights, EMA), and the temporary copy of the
    largest file while it is written atomically; plus 64 KiB per file for metadata."""
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    last = weights + optimizer_slots * trainable + (weights if ema else 0)
    best = weights + (weights if ema else 0)
    return last + best + max(last, best) + 3 * 65536


def free_bytes(folder: str) -> int:
    """Free disk space in bytes on the file system holding ``folder``."""
    return shutil.disk_usage(folder).free


def optimizer_slots(name: str) -> int:
    """State tensors per parameter: Adam/AdamW 2 (+ step), SGD with momentum 1."""
    return 1 if name == "sgd" else 2


# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_KEEP_BYTES = 2 ** 31 - 1      # trim threshold (an int): keep up to 2 GiB of free heap top


def keep_freed_memory() -> str:
    """Have glibc's malloc keep freed memory for reuse instead of unmapping it (CPU training speed).

    glibc serves every allocation above its mmap threshold (at most 32 MiB) with a fresh mmap and
    unmaps it on free, so each new large tensor (a 16 x 16 x 224 x 224 float32 activation is 51 MiB)
    is page-faulted in again, 4 KiB at a time, on every step. ``mallopt(M_MMAP_MAX, 0)`` puts all
    allocations on the heap and a huge ``M_TRIM_THRESHOLD`` keeps freed heap memory in the process,
    so the next step reuses it. The arithmetic is unchanged (same values, bit for bit); the process
    holds its peak memory until it exits. Measured on the cards model (batch 16, 2 cores): a bare
    training loop from 32 to 48-50 images/s; the trainer's step 1 from 31-34 to 36-42 images/s, and to
    45-47 with ``num_workers 0`` (docs/training.md, "Memory allocator and data workers on CPU").

    Returns:
        a log line saying what was done, or why nothing was (no glibc, e.g. macOS or musl).
    Process-wide and permanent; the trainer calls it for CPU runs when ``cpu_keep_memory`` is on.
    """
    import ctypes
    import ctypes.util
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return "cpu_keep_memory: this C library has no mallopt (not glibc); allocator left as it is"
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = mallopt(_M_MMAP_MAX, 0) == 1 and mallopt(_M_TRIM_THRESHOLD, _KEEP_BYTES) == 1
    if not ok:
        return "cpu_keep_memory: mallopt refused the settings; allocator left as it is"
    return "cpu_keep_memory: freed memory stays in the process heap (glibc mallopt: no mmap, no trim)"
