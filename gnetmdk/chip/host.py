"""Host side of the chip: images in, output codes -> predictions -> detections, datasets -> mAP.

The arithmetic mirrors the step-4 model exactly: ``pred = float32(float64(codes) * float64(scale))``
with ``scale = float32(cap_last / 31)`` (``/ 1023`` with a 10-bit output layer), permuted to
(N, S, S, 10 + C); decoding is the training
decoder (gnetmdk.models.gnetdet.decode.decode_gnetdet), and boxes go to original-image pixels as in
gnetmdk.evaluation.evaluator.predict_loader. So equal codes give equal detections and equal mAP.
"""
from __future__ import annotations

import time
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

from gnetmdk.models.gnetdet.decode import decode_gnetdet
from gnetmdk.models.gnetdet.head import output_head
from .model_file import ChipModel

#: a runner maps (N, H, W, 3) uint8 BGR images to (N, C_out, S, S) uint8 codes (uint16 from a 10-bit output)
Runner = Callable[[np.ndarray], np.ndarray]


def codes_to_predictions(codes: np.ndarray, chip_model: ChipModel) -> torch.Tensor:
    """Output codes -> GNetDet predictions (the host-side rescale by cap_last / 31, or / 1023).

    Args:
        codes: (N, C_out, S, S) uint8 codes 0..31, or uint16 codes 0..1023 from a 10-bit output layer
            (padded channels are dropped here).
        chip_model: the ChipModel (used_channels, output_scale).
    Returns:
        (N, S, S, 10 + C) float32 tensor, bit-identical to the step-4 model's forward output.
    """
    c = torch.from_numpy(np.ascontiguousarray(codes[:, :chip_model.used_channels])).to(torch.float64)
    scale = torch.tensor(float(np.float32(chip_model.output_scale)), dtype=torch.float32).to(torch.float64)
    return (c * scale).permute(0, 2, 3, 1).float().contiguous()


def decode_predictions(pred: torch.Tensor, chip_model: ChipModel, sizes: Sequence[Tuple[int, int]],
                       conf_thresh: Optional[float] = None, nms_thresh: Optional[float] = None,
                       max_detections: Optional[int] = None) -> List[Dict[str, torch.Tensor]]:
    """Decode predictions into detections in original-image pixels.

    Args:
        pred: (N, S, S, 10 + C) float32 (codes_to_predictions).
        sizes: N (width, height) pixel sizes of the original images.
        conf_thresh, nms_thresh, max_detections: default to the chip model's decode settings; the score
            head (linear / logit) and size head (linear / log) are always the chip model's.
    Returns:
        N dicts: "boxes" (K, 4) float32 xyxy pixels, "scores" (K,) float32, "labels" (K,) int64.
    """
    conf = chip_model.conf_thresh if conf_thresh is None else conf_thresh
    nms = chip_model.nms_thresh if nms_thresh is None else nms_thresh
    maxd = chip_model.max_detections if max_detections is None else max_detections
    out = decode_gnetdet(pred, chip_model.num_classes, conf, nms, maxd, **output_head(chip_model))
    dets = []
    for d, (w, h) in zip(out, sizes):
        scale = torch.tensor([w, h, w, h], dtype=torch.float32)
        dets.append({"boxes": d["boxes"] * scale, "scores": d["scores"], "labels": d["labels"]})
    return dets


def iter_dataset_batches(dataset, batch_size: int = 16) -> Iterator[Tuple[List[int], np.ndarray, List[Tuple[int, int]]]]:
    """Yield (indices, images, sizes) over a GNetDetDataset without augmentation.

    Images are exactly what evaluation feeds the model: ``dataset.prepare(i)`` (decode, downscale to
    at most 2 x image_size, INTER_AREA resize), (B, S, S, 3) uint8 BGR; sizes are (width, height) of
    the original files.
    """
    n = len(dataset)
    for start in range(0, n, batch_size):
        idx = list(range(start, min(n, start + batch_size)))
        imgs = np.stack([dataset.prepare(i)[0] for i in idx])
        yield idx, imgs, [tuple(dataset.original_size(i)) for i in idx]


def evaluate_chip(runner: Runner, chip_model: ChipModel, dataset, batch_size: int = 16,
                  conf_thresh: Optional[float] = None, nms_thresh: Optional[float] = None,
                  max_detections: Optional[int] = None, keep_predictions: bool = False) -> Dict[str, object]:
    """VOC mAP@0.5 of a chip runner (emulator or onnxruntime) on a dataset.

    Args:
        runner: images (N, H, W, 3) uint8 -> codes (N, C_out, S, S) uint8.
        chip_model: for the host-side decode.
        dataset: a GNetDetDataset (augmentation is not used).
        conf_thresh, nms_thresh, max_detections: default to the chip model's.
        keep_predictions: also return "predictions", (N, S, S, 10 + C) float32 in dataset order.
    Returns:
        evaluate_detections' dict ("map", "ap", "num_gt", "num_det") plus "num_images", "seconds",
        "images_per_s" (runner time only) and optionally "predictions".
    """
    from gnetmdk.evaluation.voc import evaluate_detections
    dets: List[Dict[str, torch.Tensor]] = []
    preds = []
    t_run = 0.0
    for idx, imgs, sizes in iter_dataset_batches(dataset, batch_size):
        t0 = time.perf_counter()
        codes = runner(imgs)
        t_run += time.perf_counter() - t0
        pred = codes_to_predictions(codes, chip_model)
        if keep_predictions:
            preds.append(pred)
        dets += decode_predictions(pred, chip_model, sizes, conf_thresh, nms_thresh, max_detections)
    truths = [dataset.ground_truth(i) for i in range(len(dataset))]
    res = evaluate_detections(dets, truths, dataset.num_classes)
    res["num_images"] = len(dataset)
    res["seconds"] = t_run
    res["images_per_s"] = len(dataset) / max(t_run, 1e-9)
    if keep_predictions:
        res["predictions"] = torch.cat(preds) if preds else torch.zeros(0)
    return res
