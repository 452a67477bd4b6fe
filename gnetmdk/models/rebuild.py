"""Models rebuilt from a checkpoint, and the check that a checkpoint fits a config.

A checkpoint (gnetmdk.checkpoint.io) is plain data; which network it holds is the ``name`` of its
``model_meta``, and that network's family (gnetmdk.config.registry) rebuilds it. These functions sit
with the models, above the checkpoint code, so that reading and writing checkpoints needs no network.
"""
from __future__ import annotations

from typing import Any, Dict

from gnetmdk.checkpoint.io import CheckpointError
from gnetmdk.config.registry import get_family


def build_model_from_checkpoint(ckpt: Dict[str, Any], cfg=None, path: str = "?", weights: str = "eval"):
    """Rebuild the model a checkpoint describes (through its family, looked up by the name in its
    ``model_meta`` in gnetmdk.config.registry) and load its weights (strict).

    The architecture comes from ``ckpt["model_meta"]``; with ``cfg`` the run's training settings apply
    as the family decides (DetectorFamily.rebuild: e.g. GNetDet's loss weights from the config, its
    weight formats from the checkpoint once quantized). ``weights``: "eval" loads the weights the
    checkpoint was evaluated with, the EMA (``ckpt["ema"]["model"]``) when ``ckpt["eval_weights"] ==
    "ema"`` (a run with ``ema true``), else the raw weights; "model" always loads the raw weights (resume).

    Raises:
        CheckpointError: the checkpoint's model cannot be rebuilt or its tensors do not fit.
    """
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
