"""The conv -> BatchNorm -> activation blocks the layer conversions recognise, as base classes.

A family's block inherits one of these to say what it is; the conversions of this package
(:func:`gnetmdk.layers.inplace_abn.convert_inplace_abn`, :func:`gnetmdk.layers.stem.convert_recompute_stem`)
test for these classes and so never name a family's model. The bases hold no state and add no
method: a block computes exactly what it computed without them.

    ConvBNUnit     any block with ``conv`` (an ``nn.Conv2d`` or a subclass) and ``bn`` (a BatchNorm2d,
                   or None once folded), computing conv -> bn -> activation; its ``recompute_stem``
                   attribute is what convert_recompute_stem sets
    ConvBNQReLU    the activation is the chip's capped ReLU, ``relu`` (gnetmdk.layers.quant.QReLU);
                   GNetDet's sublayer
    ConvBNAct      the activation is named by ``act``: "relu", "leaky" (slope 0.1) or None (identity);
                   PP-YOLO's ConvBNLayer
"""
from __future__ import annotations

import torch.nn as nn


class ConvBNUnit(nn.Module):
    """Base of the conv -> BatchNorm -> activation blocks (attributes ``conv`` and ``bn``)."""


class ConvBNQReLU(ConvBNUnit):
    """conv -> BatchNorm (``bn``, None once folded) -> capped ReLU (``relu``, a QReLU)."""


class ConvBNAct(ConvBNUnit):
    """conv -> BatchNorm (``bn``) -> the activation named by ``act`` ("relu", "leaky" or None)."""
