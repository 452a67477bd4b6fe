"""Detection evaluation: box ops, NMS and PASCAL VOC mAP."""

from .boxes import batched_nms, box_area, box_iou, nms
from .voc import evaluate_detections, format_ap_table, voc_ap

__all__ = [
    "box_area",
    "box_iou",
    "nms",
    "batched_nms",
    "voc_ap",
    "evaluate_detections",
    "format_ap_table",
]
