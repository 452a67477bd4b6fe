"""Checkpoints: atomic writes, safe loading (weights_only=True), models rebuilt from their metadata.

A gnetmdk checkpoint is a dict of tensors and plain Python values only:
    format, version, stage ("step1".."step4", "cal"), step, model_meta, model (state_dict),
    caps (list of floats, one per conv), config (resolved values), epoch, iteration, best_map, map,
    entry_map, eval_weights ("model" or "ema": which weights were evaluated), ema (with ``ema true``:
    ModelEMA.state_dict(), beside the raw weights), and for last.pth the optimizer / scheduler /
    GradScaler / RNG states and the sampler position needed to resume (docs/training.md).
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import warnings
from typing import Any, Dict, List, Optional, Sequence

import torch

FORMAT = "gnetmdk-checkpoint"
VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, unreadable or does not fit the run; the message names the file and the fix."""


def _write_temp(path: str, write_fn) -> str:
    """Write ``write_fn(fileobj)`` into a new temporary file beside ``path`` (flushed, fsynced, with the
    permissions a plain ``open`` would give); returns its name. Removes it on any failure."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-" + os.path.basename(path) + "-", dir=folder)
    try:
        with os.fdopen(fd, "wb") as fh:
            write_fn(fh)
            fh.flush()
            os.fsync(fh.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)      # mkstemp makes 0600; give the file the usual permissions
        return tmp
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_bytes(path: str, write_fn) -> None:
    """Write a file through ``write_fn(fileobj)`` to a temporary file in the same folder, fsync, rename.

    A crash at any point leaves either the old file or the new one, never a partial file.
    """
    atomic_write_set({path: write_fn})


def atomic_write_text(path: str, text: str) -> None:
    """Atomically write a text file (UTF-8)."""
    atomic_write_bytes(path, lambda fh: fh.write(text.encode("utf-8")))


def text_writer(text: str):
    """A ``write_fn`` for :func:`atomic_write_set` writing ``text`` as UTF-8."""
    data = text.encode("utf-8")
    return lambda fh: fh.write(data)


def atomic_write_set(writers: Dict[str, Any], remove: Sequence[str] = ()) -> List[str]:
    """Write several files as one set: each first to a temporary file beside its destination (written,
    flushed, fsynced), and only when every one of them is complete are they renamed into place;
    then the files of ``remove`` (a previous set's members this one no longer has) are deleted.

    A failure while writing (a full disk, a read-only folder, an exception in a writer) or a kill
    before the renames leaves every destination as it was and no temporary file behind; the renames
    themselves only replace directory entries. Used for the stages' outputs, the chip-model files and
    the meta files, so that no set is ever half new.

    Args:
        writers: {destination path: write_fn(binary file object)} (see :func:`text_writer`).
        remove: paths to delete after the renames (missing ones are ignored).
    Returns:
        the destination paths, in the order given.
    Raises:
        OSError (and whatever a writer raises): nothing was replaced.
    """
    temps: Dict[str, str] = {}
    try:
        for path, fn in writers.items():
            temps[path] = _write_temp(path, fn)
        for path, tmp in temps.items():
            os.replace(tmp, path)
    finally:
        for tmp in temps.values():
            if os.path.exists(tmp):
                os.unlink(tmp)
    for path in remove:
        if path not in writers and os.path.lexists(path):
            os.unlink(path)
    return list(writers)


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
        CheckpointError: missing, unreadable, or not a gnetmdk checkpoint.
    """
    if os.path.isdir(path):
        raise CheckpointError(f"'{path}' is a folder, not a checkpoint file: pass the .pth inside it "
                              f"(e.g. {os.path.join(path, 'best.pth')})")
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint '{path}' does not exist" + (f": {hint}" if hint else ""))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")        # torch's notes on pickle protocols: the refusal says enough
            ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"checkpoint '{path}' cannot be read: {_read_failure(exc)}") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise CheckpointError(f"'{path}' is not a gnetmdk checkpoint (no format tag '{FORMAT}')")
    return ckpt


def _read_failure(exc: Exception) -> str:
    """Why torch.load failed, in one line of this project's words (torch's own text runs over many
    lines and advises ``weights_only=False``, which would execute whatever the file asks: never)."""
    text = str(exc)
    low = text.lower()
    if isinstance(exc, PermissionError):
        return "permission denied: fix the file's permissions"
    if isinstance(exc, OSError) and not isinstance(exc, EOFError):
        return exc.strerror or (text.splitlines()[0] if text else type(exc).__name__)
    if "weights only load failed" in low or "unsupported global" in low or "weights_only" in low:
        return ("it holds objects other than tensors and plain data (a pickle of classes or code), which are "
                "never unpickled here; a gnetmdk checkpoint holds only tensors, numbers, strings, lists and dicts")
    if isinstance(exc, EOFError) or "eof" in low or "truncat" in low or "central directory" in low or \
            "failed finding central directory" in low:
        return "the file is truncated or empty (a copy or a write that did not finish): use another checkpoint"
    return "not a checkpoint torch can read (truncated, corrupted, or another format): use another checkpoint"


def build_model_from_checkpoint(ckpt: Dict[str, Any], cfg=None, path: str = "?", weights: str = "eval"):
    """Rebuild the model a checkpoint describes (through its family: gnetmdk.models) and load its
    weights (strict).

    The architecture comes from ``ckpt["model_meta"]``; with ``cfg`` the run's training settings apply
    as the family decides (DetectorFamily.rebuild: e.g. GNetDet's loss weights from the config, its
    weight schemes from the checkpoint once quantized). ``weights``: "eval" loads the weights the
    checkpoint was evaluated with, the EMA (``ckpt["ema"]["model"]``) when ``ckpt["eval_weights"] ==
    "ema"`` (a run with ``ema true``), else the raw weights; "model" always loads the raw weights (resume).

    Raises:
        CheckpointError: the checkpoint's model cannot be rebuilt or its tensors do not fit.
    """
    from gnetmdk.models import get_family
    meta = dict(ckpt.get("model_meta") or {})
    name = meta.get("name", "?")
    try:
        family = get_family(name)
        model = family.rebuild(meta, cfg, ckpt.get("stage"), path)
        use_ema = weights == "eval" and ckpt.get("eval_weights") == "ema" and isinstance(ckpt.get("ema"), dict)
        model.load_state_dict(ckpt["ema"]["model"] if use_ema else ckpt["model"], strict=True)
    except Exception as exc:
        raise CheckpointError(f"checkpoint '{path}': cannot rebuild model {name} {meta}: {exc}") from None
    if ckpt.get("calibrated_caps"):          # a step-4 model: its caps before gain editing travel with it
        model.calibrated_caps = [float(c) for c in ckpt["calibrated_caps"]]
    return model


def check_compatible(ckpt: Dict[str, Any], cfg, path: str) -> None:
    """Refuse a checkpoint whose model differs from the config (model family, class count, and what the
    family names: GNetDet's input size, width and chip) or whose class names differ from the config's
    VOC_CLASSES (names or order).

    Raises:
        CheckpointError: naming each difference and the fix.
    """
    from gnetmdk.models import get_family
    family = get_family(cfg.model_name)
    meta = {**family.meta_defaults(), **ckpt.get("model_meta", {})}
    want = {"name": family.name, "num_classes": cfg.num_classes, **family.compat_fields(cfg)}
    diffs = [f"{k}: checkpoint {meta.get(k)!r} vs config {v!r}" for k, v in want.items() if meta.get(k) != v]
    names = (ckpt.get("config") or {}).get("VOC_CLASSES")
    if not diffs and names is not None and list(names) != list(cfg.VOC_CLASSES):
        # the same count in another order (or other names) would train and report AP under wrong names
        diffs.append(f"VOC_CLASSES: checkpoint {list(names)} vs config {list(cfg.VOC_CLASSES)} (label i of the "
                     "model is the name at i: the names must be the same, in the same order)")
    if diffs:
        raise CheckpointError(f"checkpoint '{path}' does not fit this config ({'; '.join(diffs)}): set the "
                              "config to match, or start from another checkpoint with 'load PATH'")


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
