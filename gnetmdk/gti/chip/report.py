"""Stage alignment report: mAP and output differences along step1 -> step2 -> step3 -> step4 -> chip.

Every stage is run on the same images (evaluation preprocessing, 5-bit codes) and its predictions
(N, S, S, 10 + C), in host units (step 4 and the chip: codes x cap_last / 31), are decoded with the
same thresholds. For each stage the report gives its mAP, the change of mAP from the stage before,
and the mean and max |prediction difference| from the stage before, and the mean from the first stage
of the table (step 1, the float model, when present), so a user sees where accuracy went. Step 4 and the chip must show a difference of exactly 0.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch

from gnetmdk.config.base import BaseConfig
from gnetmdk.gti.quantize import image_to_codes
from .host import codes_to_predictions, decode_predictions, iter_dataset_batches


@dataclass
class StageRow:
    """One line of the report (differences are None for the first stage present)."""
    name: str
    source: str
    map: float
    d_map: Optional[float] = None
    mean_diff_prev: Optional[float] = None
    max_diff_prev: Optional[float] = None
    mean_diff_float: Optional[float] = None


@torch.no_grad()
def _model_predictions(model, dataset, batch_size: int) -> torch.Tensor:
    preds = []
    device = next(model.parameters()).device
    for _, imgs, _ in iter_dataset_batches(dataset, batch_size):
        x = image_to_codes(torch.from_numpy(imgs)).permute(0, 3, 1, 2).float().to(device)
        preds.append(model(x).float().cpu())
    return torch.cat(preds)


def _map_of(pred: torch.Tensor, dataset, conf, nms, maxd, chip_like) -> float:
    from gnetmdk.evaluation.voc import evaluate_detections
    sizes = [tuple(dataset.original_size(i)) for i in range(len(dataset))]
    dets = decode_predictions(pred, chip_like, sizes, conf, nms, maxd)
    truths = [dataset.ground_truth(i) for i in range(len(dataset))]
    return float(evaluate_detections(dets, truths, dataset.num_classes)["map"])


class _Decode:
    """Minimal stand-in with what decode_predictions reads: class count, thresholds, score head."""

    def __init__(self, n, conf, nms, maxd, score_head="linear", score_offset=4.0, score_scale=1.0):
        self.num_classes, self.conf_thresh, self.nms_thresh, self.max_detections = n, conf, nms, maxd
        self.score_head, self.score_offset, self.score_scale = score_head, score_offset, score_scale


def stage_report(dataset, checkpoints: Dict[str, Optional[str]], chip_model=None, conf_thresh: float = BaseConfig.conf_thresh,
                 nms_thresh: float = 0.5, max_detections: int = 100, batch_size: int = 16, cfg=None) -> List[StageRow]:
    """Compute the report rows.

    Args:
        dataset: a DetectionDataset (no augmentation is applied).
        checkpoints: stage name ("step1".."step4") -> checkpoint path or None (missing stages are skipped).
        chip_model: a ChipModel for the "chip" row (run with the integer emulator), or None.
        conf_thresh, nms_thresh, max_detections: one decode setting for every stage (each stage's
            score head is its own model's).
        cfg: a config the checkpoints must fit (optional).
    Returns:
        a StageRow per stage present, in pipeline order.
    Raises:
        CheckpointError: a checkpoint that cannot be read or does not fit ``cfg``.
    """
    from .cli_util import eval_device, load_eval_model
    from .emulator import ChipEmulator
    rows: List[StageRow] = []
    prev = None
    first = None
    runs = [(k, checkpoints.get(k)) for k in ("step1", "step2", "step3", "step4")]
    if chip_model is not None:
        runs.append(("chip", chip_model))
    for name, src in runs:
        if src is None:
            continue
        if name == "chip":
            emu = ChipEmulator(src)
            pred = torch.cat([codes_to_predictions(emu.run(imgs), src)
                              for _, imgs, _ in iter_dataset_batches(dataset, batch_size)])
            label = "integer emulator"
            head = (src.score_head, src.score_offset, src.score_scale)
        else:
            model, ckpt = load_eval_model(src, cfg)
            model.to(eval_device(cfg))             # the GPU when the config allows one and it is there
            pred = _model_predictions(model, dataset, batch_size)
            label = src
            head = (model.score_head, model.score_offset, model.score_scale)
        dec = _Decode(dataset.num_classes, conf_thresh, nms_thresh, max_detections, *head)
        row = StageRow(name, label, _map_of(pred, dataset, conf_thresh, nms_thresh, max_detections, dec))
        if prev is not None:
            d = (pred.double() - prev[1].double()).abs()
            row.d_map = row.map - prev[0].map
            row.mean_diff_prev = float(d.mean())
            row.max_diff_prev = float(d.max())
        if first is not None:
            row.mean_diff_float = float((pred.double() - first.double()).abs().mean())
        else:
            first = pred
        rows.append(row)
        prev = (row, pred)
    return rows


def format_report(rows: Sequence[StageRow]) -> str:
    """The report as a table."""
    def f(v, fmt):
        return "-" if v is None else format(v, fmt)
    head = f"{'stage':<6} {'mAP@0.5':>8} {'d mAP':>8} {'mean|d out| prev':>16} {'max|d out| prev':>15} " \
           f"{'mean|d out| 1st':>17}  source"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.name:<6} {r.map:>8.4f} {f(r.d_map, '+.4f'):>8} {f(r.mean_diff_prev, '.3g'):>16} "
                     f"{f(r.max_diff_prev, '.3g'):>15} {f(r.mean_diff_float, '.3g'):>17}  {r.source}")
    return "\n".join(lines)
