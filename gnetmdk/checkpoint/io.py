"""Checkpoints: saving (atomic, gnetmdk.utils.atomic), safe loading (weights_only=True).

A model is rebuilt from a checkpoint's metadata by its family: gnetmdk.models.rebuild.

A gnetmdk checkpoint is a dict of tensors and plain Python values only:
    format, version, stage ("step1".."step4", "cal"), step, model_meta, model (state_dict),
    caps (list of floats, one per conv), config (resolved values), epoch, iteration, best_map, map,
    entry_map, eval_weights ("model" or "ema": which weights were evaluated), ema (with ``ema true``:
    ModelEMA.state_dict(), beside the raw weights), environment (what the run computed with: torch,
    CPU kernels, OpenCV, numpy, Python, threads; gnetmdk.utils.environment), and for last.pth the optimizer / scheduler /
    GradScaler / RNG states and the sampler position needed to resume (docs/training.md).
"""
from __future__ import annotations

import json
import os
import warnings
from typing import Any, Dict

import torch

# the atomic writes live in a leaf module every floor may use; re-exported here, their earlier home
from gnetmdk.utils.atomic import atomic_write_bytes, atomic_write_set, atomic_write_text, text_writer  # noqa: F401

FORMAT = "gnetmdk-checkpoint"
VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, unreadable or does not fit the run; the message names the file and the fix."""


def save_checkpoint(path: str, state: Dict[str, Any]) -> None:
    """Atomically save ``state`` (plus format/version tags) with torch.save."""
    payload = {"format": FORMAT, "version": VERSION, **state}
    atomic_write_bytes(path, lambda fh: torch.save(payload, fh))


def save_config_json(folder: str, config: Dict[str, Any], name: str = "config.json") -> str:
    """Write the resolved config beside a checkpoint as JSON; returns the path."""
    path = os.path.join(folder, name)
    atomic_write_text(path, json.dumps(config, indent=2, sort_keys=True, default=str) + "\n")
    return path


def load_checkpoint(path: str, hint: str = "") -> Dict[str, Any]:
    """Load a checkpoint with ``weights_only=True`` (a .pth is a pickle; nothing else is unpickled).

    Args:
        path: the .pth file.
        hint: what to run to produce it (added to the error).
    Raises:
        CheckpointError: missing, unreadable, or not a gnetmdk checkpoint; a file of a stage's output set
            that is not whole (gnetmdk.checkpoint.outputs.check_published).
    """
    if os.path.isdir(path):
        raise CheckpointError(f"'{path}' is a folder, not a checkpoint file: pass the .pth inside it "
                              f"(e.g. {os.path.join(path, 'best.pth')})")
    from .outputs import check_published
    check_published(path)                      # a stage output set that is mixed or half published: refused
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint '{path}' does not exist" + (f": {hint}" if hint else ""))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")        # torch's notes on pickle protocols: the refusal says enough
            ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"checkpoint '{path}' cannot be read: {_read_failure(exc, path)}") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise CheckpointError(f"'{path}' is not a gnetmdk checkpoint (no format tag '{FORMAT}')")
    return ckpt


def weights_sha256(state: Dict[str, torch.Tensor]) -> str:
    """A digest of a model's weights that two runs share exactly when their tensors are equal bit for bit.

    Unlike the checkpoint file's own sha256, it leaves out everything but the tensors (the config with
    its folders, the epoch, timings), so runs in different folders or on different machines compare.

    Args:
        state: a state_dict (name -> tensor of any dtype and shape, on any device).
    Returns:
        The hex sha256 over the entries in sorted name order: name, dtype, shape, and the tensor's bytes
        in C order (the host's byte order; x86-64 and arm64 are both little-endian).
    Raises:
        TypeError: an entry that is not a tensor, named in the message.
    """
    import hashlib
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name]
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"weights_sha256: entry '{name}' is a {type(t).__name__}, not a tensor")
        t = t.detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode("utf-8"))
        # bytes through a uint8 view: numpy has no bfloat16, a uint8 view exists for every dtype
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _read_failure(exc: Exception, path: str = "") -> str:
    """Why torch.load failed, in one line of this project's words (torch's own text runs over many
    lines and advises ``weights_only=False``, which would execute whatever the file asks: never).
    The file's first bytes tell what it is when torch's error does not: empty, a cut zip archive (the
    format torch saves), an ONNX model, or not torch's format at all."""
    text = str(exc)
    low = text.lower()
    if isinstance(exc, PermissionError):
        return "permission denied: fix the file's permissions"
    head = b""
    size = -1
    if path:
        try:
            size = os.path.getsize(path)
            with open(path, "rb") as fh:
                head = fh.read(64)
        except OSError:
            pass
    if size == 0:
        return "the file is empty (a copy or a write that did not finish): use another checkpoint"
    if "unsupported global" in low or (head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05")
                                       and "weights only load failed" in low):
        # a Python pickle (protocol 2-5) that asks for more than tensors and plain data
        return ("it holds objects other than tensors and plain data (a pickle of classes or code), which are "
                "never unpickled here; a gnetmdk checkpoint holds only tensors, numbers, strings, lists and dicts")
    if head.startswith(b"PK\x03\x04"):
        return ("a zip archive (torch's checkpoint format) that is truncated or damaged (a copy or a write that did "
                f"not finish: {size} bytes): use another checkpoint")
    if _looks_like_onnx(head):
        return "an ONNX model, not a checkpoint: pass the .pth the model was exported from"
    if isinstance(exc, OSError) and not isinstance(exc, EOFError) and exc.strerror and "invalid argument" not in low:
        return exc.strerror
    if isinstance(exc, EOFError) or "eof" in low or "truncat" in low:
        return "the file is truncated or empty (a copy or a write that did not finish): use another checkpoint"
    return ("not a checkpoint: its bytes are not torch's format (a zip archive of tensors), so it is another kind of "
            "file or a damaged one: use another checkpoint")


def _looks_like_onnx(head: bytes) -> bool:
    """An ONNX ModelProto starts with field 1 (ir_version, varint: 0x08) and field 2 or 3 (producer name,
    0x12 / 0x1a) soon after; torch's zip starts with PK, legacy pickles with 0x80."""
    return len(head) > 3 and head[0] == 0x08 and (b"\x12" in head[2:12] or b"\x1a" in head[2:12])


def load_matching(model: torch.nn.Module, state: Dict[str, torch.Tensor]) -> Dict[str, list]:
    """Load the tensors of ``state`` whose names and shapes match (a pretrained step0 model with
    another class count, say); returns {"loaded": [...], "skipped": [...]}."""
    own = model.state_dict()
    loaded, skipped = [], []
    for k, v in state.items():
        if k in own and own[k].shape == v.shape:
            own[k] = v
            loaded.append(k)
        else:
            skipped.append(k)
    model.load_state_dict(own)
    return {"loaded": loaded, "skipped": skipped}
