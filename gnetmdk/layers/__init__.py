"""Quantized layers, GNetDet, its loss and decoding, and the model registry."""
from .gnetdet import GNetDet, ChipLimitError, check_chip_limits, gnetdet_layers
from .loss import gnetdet_loss
from .quant import QConv2d, QReLU
from .registry import create_model, model_from_config, register_model

__all__ = ["GNetDet", "ChipLimitError", "check_chip_limits", "gnetdet_layers", "gnetdet_loss", "QConv2d",
           "QReLU", "create_model", "model_from_config", "register_model"]
