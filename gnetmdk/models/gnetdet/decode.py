"""Decoding GNetDet outputs into detections: score threshold, then per-class NMS (torch only)."""
from __future__ import annotations

from typing import Dict, List

import torch

from gnetmdk.evaluation.boxes import batched_nms
from .head import SIZE_MIN, cell_boxes_to_xyxy, output_boxes, output_head, output_scores  # noqa: F401


def decode_gnetdet(pred: torch.Tensor, num_classes: int, conf_thresh: float = 0.05, nms_thresh: float = 0.5,
                   max_detections: int = 100, score_head: str = "linear",
                   score_offset: float = 4.0, pre_nms_top: int = 1000,
                   score_scale: float = 1.0, size_head: str = "linear",
                   size_min: float = SIZE_MIN) -> List[Dict[str, torch.Tensor]]:
    """Turn predictions into per-image detections.

    Every one of the 2 x S x S boxes is scored against every class: score = conf x class score;
    (box, class) pairs with score > conf_thresh are kept, then per-class NMS at ``nms_thresh`` IoU,
    then the ``max_detections`` best.

    Args:
        pred: (N, S, S, 10 + C) float predictions (host-side: already multiplied by cap_last / 31).
        num_classes: C.
        score_head, score_offset, score_scale: how scores come from the outputs (output_scores; the
            model's meta).
        size_head, size_min: how the w, h outputs give box sizes (gnetmdk.models.gnetdet.head.output_sizes).
        pre_nms_top: at most this many (box, class) candidates per image enter NMS (the best scores).
    Raises:
        ConfigError (a ValueError): an unknown score or size head.
    Returns:
        a list of N dicts: ``boxes`` (K, 4) float32 xyxy relative to the image (0..1, clipped),
        ``scores`` (K,) float32, ``labels`` (K,) int64.
    """
    pred = pred.detach().float().cpu()
    n, s = pred.shape[0], pred.shape[1]
    boxes = torch.stack([pred[..., 0:4], pred[..., 5:9]], dim=3)            # (N, S, S, 2, 4)
    conf = torch.stack([pred[..., 4], pred[..., 9]], dim=3)                 # (N, S, S, 2)
    cls = pred[..., 10:10 + num_classes]                                    # (N, S, S, C)
    conf, cls = output_scores(conf, cls, score_head, score_offset, score_scale)
    boxes = output_boxes(boxes, size_head, size_min)
    xyxy = cell_boxes_to_xyxy(boxes, s).clamp(0, 1).reshape(n, -1, 4)      # (N, 2SS, 4)
    scores = (conf.unsqueeze(-1) * cls.unsqueeze(3)).reshape(n, -1, num_classes)  # (N, 2SS, C)
    out = []
    for i in range(n):
        idx, lab = torch.nonzero(scores[i] > conf_thresh, as_tuple=True)
        b = xyxy[i][idx]
        sc = scores[i][idx, lab]
        valid = (b[:, 2] > b[:, 0]) & (b[:, 3] > b[:, 1])
        b, sc, lab = b[valid], sc[valid], lab[valid]
        if sc.numel() > pre_nms_top:   # NMS is quadratic: only the best candidates can survive anyway
            top = sc.topk(pre_nms_top).indices
            b, sc, lab = b[top], sc[top], lab[top]
        keep = batched_nms(b, sc, lab, nms_thresh)[:max_detections]
        out.append({"boxes": b[keep], "scores": sc[keep], "labels": lab[keep].long()})
    return out
