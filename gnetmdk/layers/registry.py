"""A small model registry: the trainer knows models only through forward, loss and decode."""
from __future__ import annotations

import difflib
from typing import Callable, Dict

import torch.nn as nn

from gnetmdk.config.base import ConfigError

MODELS: Dict[str, Callable[..., nn.Module]] = {}


def register_model(name: str):
    """Decorator: register a builder ``fn(**kwargs) -> nn.Module`` under ``name``."""
    def deco(fn):
        MODELS[name] = fn
        return fn
    return deco


def create_model(name: str, **kwargs) -> nn.Module:
    """Build a registered model.

    Raises:
        ConfigError: unknown name, with the closest registered names.
    """
    if name not in MODELS:
        close = difflib.get_close_matches(name, list(MODELS), n=3, cutoff=0.4)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ConfigError(f"unknown model '{name}'{hint} (registered: {', '.join(sorted(MODELS))})")
    return MODELS[name](**kwargs)


@register_model("gnetdet")
def _gnetdet(**kwargs) -> nn.Module:
    from .gnetdet import GNetDet
    return GNetDet(**kwargs)


def model_from_config(cfg, use_bn: bool | None = None) -> nn.Module:
    """The model a resolved config describes (``use_bn`` overrides cfg.use_bn, e.g. for folded checkpoints)."""
    return create_model(cfg.model_name, num_classes=cfg.num_classes, image_size=cfg.image_size,
                        width_mult=cfg.width_mult, use_bn=cfg.use_bn if use_bn is None else use_bn,
                        chip=str(cfg.chip), mask_bits=list(cfg.mask_bits), weight_scale=cfg.weight_scale,
                        cap_percentile=cfg.cap_percentile, l_coord=cfg.l_coord, l_noobj=cfg.l_noobj,
                        l_class=cfg.l_class, score_loss=cfg.score_loss, score_head=cfg.score_head,
                        score_offset=cfg.score_offset, score_scale=cfg.score_scale, l_range=cfg.l_range, output_cap_percentile=cfg.output_cap_percentile,
                        channels_last=cfg.channels_last, gain_aware=cfg.gain_aware, box_slots=cfg.box_slots)
