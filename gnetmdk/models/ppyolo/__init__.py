"""PP-YOLO model family (Long et al. 2020, arXiv 2007.12099), after PaddleDetection's implementation.

Modules: :mod:`.resnet_vd` (ResNet-vd backbone), :mod:`.dcn` (DCNv2 through ``grid_sample``),
:mod:`.neck` (PP-YOLO FPN, CoordConv, SPP, DropBlock), :mod:`.head` (YOLOv3 head, IoU-aware branch,
box decoding), :mod:`.loss` (YOLOv3 + IoU + IoU-aware loss from padded boxes), :mod:`.postprocess`
(decoding and Matrix NMS), :mod:`.model` (:class:`PPYOLO` and the r50vd / r18vd presets).
"""
from .dcn import DeformConv2d, deform_conv2d
from .head import YOLOv3Head, decode_level_boxes, split_level
from .loss import LOSS_KEYS, YOLOv3Loss, validate_anchors
from .model import (IMAGENET_MEAN, IMAGENET_STD, PPYOLO, PPYOLO_R18VD, PPYOLO_R50VD, PRESET_INPUT_SIZE,
                    ppyolo_r18vd, ppyolo_r50vd)
from .neck import SPP, CoordConv, DropBlock, PPYOLOFPN, coord_channels
from .postprocess import decode_outputs, matrix_nms, matrix_nms_decay, postprocess
from .resnet_vd import BasicBlock, BottleneckBlock, ResNetVd

__all__ = ["DeformConv2d", "deform_conv2d", "YOLOv3Head", "decode_level_boxes", "split_level", "LOSS_KEYS",
           "YOLOv3Loss", "validate_anchors", "IMAGENET_MEAN", "IMAGENET_STD", "PPYOLO", "PPYOLO_R18VD",
           "PPYOLO_R50VD", "PRESET_INPUT_SIZE", "ppyolo_r18vd", "ppyolo_r50vd", "SPP", "CoordConv", "DropBlock",
           "PPYOLOFPN", "coord_channels", "decode_outputs", "matrix_nms", "matrix_nms_decay", "postprocess",
           "BasicBlock", "BottleneckBlock", "ResNetVd"]

from . import config as _config  # noqa: E402,F401  (registers the ppyolo config section)
from .family import PPYOLOFamily  # noqa: E402
from gnetmdk.models import register_family as _register_family  # noqa: E402

_register_family(PPYOLOFamily())
