"""GNetDet, the chip's detector (docs/quantization.md, "GNetDet on the chip"): the model, its loss and
decoding, and the family object the trainer, dataset and checkpoints use
(gnetmdk.models.base.DetectorFamily)."""
from . import config  # noqa: F401  (registers the gnetdet config section)
from .model import ChipLimitError, GNetDet, check_chip_limits, gnetdet_layers, major_weight_formats
from .loss import gnetdet_loss
from .family import GNetDetFamily

__all__ = ["ChipLimitError", "GNetDet", "GNetDetFamily", "check_chip_limits", "gnetdet_layers", "gnetdet_loss",
           "major_weight_formats"]

from gnetmdk.models import register_family as _register_family  # noqa: E402

_register_family(GNetDetFamily())
