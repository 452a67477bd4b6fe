"""Layers shared by the model families: the chip's quantized conv and capped ReLU (gnetmdk.layers.quant)."""
from .quant import QConv2d, QReLU

__all__ = ["QConv2d", "QReLU"]
