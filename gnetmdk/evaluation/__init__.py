"""Detection evaluation: box ops, NMS and PASCAL VOC mAP."""

from .boxes import batched_nms, box_area, box_iou, nms
from .voc import bootstrap_map, evaluate_detections, format_ap_table, resampled_map, voc_ap

__all__ = [
    "box_area",
    "box_iou",
    "nms",
    "batched_nms",
    "voc_ap",
    "evaluate_detections",
    "resampled_map",
    "bootstrap_map",
    "format_ap_table",
]
