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

import numpy as np
import torch

from gnetmdk.config.base import BaseConfig
from gnetmdk.models.gnetdet.head import output_head
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

    def __init__(self, n, conf, nms, maxd, head):
        self.num_classes, self.conf_thresh, self.nms_thresh, self.max_detections = n, conf, nms, maxd
        for key, value in head.items():      # output_head: score head and size head
            setattr(self, key, value)


def stage_report(dataset, checkpoints: Dict[str, Optional[str]], chip_model=None, conf_thresh: float = BaseConfig.conf_thresh,
                 nms_thresh: float = 0.5, max_detections: int = 100, batch_size: int = 16, cfg=None) -> List[StageRow]:
    """Compute the report rows.

    Args:
        dataset: a GNetDetDataset (no augmentation is applied).
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
            head = output_head(src)
        else:
            model, ckpt = load_eval_model(src, cfg)
            model.to(eval_device(cfg))             # the GPU when the config allows one and it is there
            pred = _model_predictions(model, dataset, batch_size)
            label = src
            head = output_head(model)
        dec = _Decode(dataset.num_classes, conf_thresh, nms_thresh, max_detections, head)
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


def float_activation_map(dataset, checkpoint: str, conf_thresh: float = BaseConfig.conf_thresh, nms_thresh: float = 0.5,
                         max_detections: int = 100, batch_size: int = 16, cfg=None) -> float:
    """mAP@0.5 of a quantized checkpoint's weights with every activation a plain ReLU: the checkpoint
    (step 2, cal or step 3) evaluated under step 2's switches (weights quantized by the chip's rule
    from the model's unedited weights, no cap, no rounding, no gains), decoded like
    :func:`stage_report`'s rows.
    Set against the checkpoint's own mAP it splits the checkpoint's cost in two: what its 5-bit
    activations cost at inference, and what is left, the weights (docs/chip.md, "Where accuracy went").

    Args:
        dataset: a GNetDetDataset (no augmentation is applied).
        checkpoint: path of a step-2, cal or step-3 checkpoint.
        cfg: a config the checkpoint must fit (optional).
    Returns:
        the mAP in [0, 1].
    Raises:
        CheckpointError: a checkpoint that cannot be read, does not fit ``cfg``, is a float (step-1)
        model (it has no quantized weights to read) or a step-4 one (gain-edited weights).
    """
    from gnetmdk.checkpoint.io import CheckpointError
    from gnetmdk.models.stages import STAGES, apply_stage
    from .cli_util import eval_device, load_eval_model
    model, ckpt = load_eval_model(checkpoint, cfg)
    if ckpt.get("stage") == "step1":
        raise CheckpointError(f"checkpoint '{checkpoint}' is a step-1 (float) model: its activations are float "
                              "already; pass a step-3 or step-4 checkpoint")
    if ckpt.get("stage") == "step4":
        raise CheckpointError(f"checkpoint '{checkpoint}' is a step-4 model, whose weights are gain-edited for "
                              "integer codes: pass the step-3 checkpoint it came from")
    apply_stage(model, STAGES["step2"])
    model.eval()
    model.to(eval_device(cfg))
    pred = _model_predictions(model, dataset, batch_size)
    dec = _Decode(dataset.num_classes, conf_thresh, nms_thresh, max_detections, output_head(model))
    return _map_of(pred, dataset, conf_thresh, nms_thresh, max_detections, dec)


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


# ------------------------------------------------------------------------------ per-layer drift
@dataclass
class LayerDrift:
    """Per-sublayer output drift of the stages from a reference stage (the float model, step 1).

    Attributes:
        layers: sublayer names ("conv1".."convN"), outputs after the pool.
        reference: the stage the others are compared with.
        stages: stage name -> per-sublayer relative error ||a - a_ref||_2 / ||a_ref||_2 over every
            element of the images used (a float; 0 for the reference itself). Activations are compared
            as values: the code-domain stages (step 4, gain-aware step 3, the chip model) are scaled
            back by cap / 31 (cap / 1023 in a 10-bit output layer) with each conv's calibrated cap
            (docs/quantization.md, "Activations"),
            the others are taken as they are. The relative error is 1 / sqrt(SQNR), the usual measure
            of quantization noise.
        num_images: images used.
        skipped: stage -> why it has no drift (e.g. a chip model without calibrated caps).
    """
    layers: List[str]
    reference: str
    stages: Dict[str, List[float]]
    num_images: int
    skipped: Dict[str, str]


def _stage_value_outputs(model, x: torch.Tensor, caps: Optional[Sequence[float]]) -> List[torch.Tensor]:
    """Sublayer outputs of a GNetDet as values (float64, CPU): code-domain layers times cap / 31 (cap / 1023
    in a 10-bit output layer)."""
    _, outs = model.features(x, return_all=True)
    res = []
    for i, (o, relu) in enumerate(zip(outs, model.relus())):
        o = o.double().cpu().contiguous()
        if relu.integer or relu.code_domain:
            if caps is None:
                raise ValueError("code-domain outputs without calibrated caps")
            o = o * (float(caps[i]) / float(relu.codes))
        res.append(o)
    return res


@torch.no_grad()
def layer_drift(dataset, checkpoints: Dict[str, Optional[str]], chip_model=None, batch_size: int = 4, cfg=None,
                max_images: Optional[int] = 64) -> LayerDrift:
    """How far each sublayer's output moves from the float model's along step1 -> ... -> chip.

    Args:
        dataset: a GNetDetDataset (evaluation preprocessing, no augmentation).
        checkpoints: "step1".."step4" -> GNetDet checkpoint path or None (missing stages are skipped;
            the first present one is the reference, step 1 when there is one).
        chip_model: a ChipModel for the "chip" row (integer emulator), or None. It needs its
            calibrated caps (written by the converter) to be put in value units.
        batch_size: images per forward pass (every stage holds its sublayer outputs for a batch).
        cfg: a config the checkpoints must fit (optional; also picks the device).
        max_images: use the first ``max_images`` images of the dataset (None: all).
    Returns:
        LayerDrift.
    Raises:
        CheckpointError: a checkpoint cannot be read or does not fit ``cfg``, or the stages' layer
            shapes differ (checkpoints of different models).
        ValueError: no stage present.
    """
    from .cli_util import eval_device, load_eval_model
    from .convert import _calibrated_caps_from
    from .emulator import ChipEmulator
    runs = []                       # (name, kind, object, caps)
    skipped: Dict[str, str] = {}
    device = eval_device(cfg)
    for name in ("step1", "step2", "step3", "step4"):
        src = checkpoints.get(name)
        if src is None:
            continue
        model, ckpt = load_eval_model(src, cfg)
        model.to(device)
        if any(r.integer for r in model.relus()):      # step 4: the caps before gain editing
            caps = _calibrated_caps_from(ckpt, float(model.output_scale), len(model.relus()))
        else:                                          # step 3: its caps are the calibrated ones
            caps = [float(r.cap.detach()) for r in model.relus()]
        if any(r.integer for r in model.relus()) and not caps:
            skipped[name] = "the checkpoint does not record its calibrated caps (codes cannot be scaled back)"
            continue
        runs.append((name, "model", model, caps))
    if chip_model is not None:
        caps = chip_model.calibrated_caps()
        if caps is None:
            skipped["chip"] = "the chip model does not record its calibrated caps (codes cannot be scaled back)"
        else:
            runs.append(("chip", "chip", ChipEmulator(chip_model, batch_size=batch_size), caps))
    if not runs:
        raise ValueError("no stage to compare: pass at least one checkpoint or a chip model")
    n_img = len(dataset) if max_images is None else min(len(dataset), int(max_images))
    sq_err: Dict[str, Optional[List[float]]] = {r[0]: None for r in runs}
    sq_ref: Optional[List[float]] = None
    names: List[str] = []
    done = 0
    for _, imgs, _ in iter_dataset_batches(dataset, batch_size):
        imgs = imgs[:n_img - done]
        if len(imgs) == 0:
            break
        x = image_to_codes(torch.from_numpy(imgs)).permute(0, 3, 1, 2).float().to(device)
        ref = None
        for name, kind, obj, caps in runs:
            if kind == "chip":
                _, layers = obj.run(imgs, return_all=True)
                used = chip_model.used_channels
                outs = [torch.from_numpy(np.ascontiguousarray(c)).double()
                        * (float(caps[i]) / float(obj.model.layers[i].max_code)) for i, c in enumerate(layers)]
                outs[-1] = outs[-1][:, :used].contiguous()
            else:
                outs = _stage_value_outputs(obj, x, caps)
            if ref is None:
                ref = outs
                names = [f"conv{i + 1}" for i in range(len(outs))]
                if sq_ref is None:
                    sq_ref = [0.0] * len(outs)
                for i, o in enumerate(outs):
                    sq_ref[i] += float((o * o).sum())
            if len(outs) != len(ref) or any(a.shape != b.shape for a, b in zip(outs, ref)):
                from gnetmdk.checkpoint.io import CheckpointError
                raise CheckpointError(f"stage {name}'s sublayer outputs have other shapes than {runs[0][0]}'s: "
                                      "the checkpoints are of different models; pass one pipeline's checkpoints")
            acc = sq_err[name] or [0.0] * len(outs)
            for i, (o, r) in enumerate(zip(outs, ref)):
                acc[i] += float(((o - r) ** 2).sum())
            sq_err[name] = acc
        done += len(imgs)
    stages = {name: [float(np.sqrt(e / r)) if r > 0 else (0.0 if e == 0 else float("inf"))
                     for e, r in zip(sq_err[name], sq_ref)] for name, *_ in runs}
    return LayerDrift(names, runs[0][0], stages, done, skipped)


def format_drift(drift: LayerDrift) -> str:
    """The drift as a table: one row per sublayer, one column per stage, relative error in percent."""
    cols = list(drift.stages)
    head = f"{'layer':<7}" + "".join(f" {c:>9}" for c in cols)
    lines = [f"per-layer output drift from {drift.reference} (relative L2 error, %), {drift.num_images} images",
             head, "-" * len(head)]
    for i, layer in enumerate(drift.layers):
        lines.append(f"{layer:<7}" + "".join(f" {100.0 * drift.stages[c][i]:>9.2f}" for c in cols))
    for name, why in drift.skipped.items():
        lines.append(f"{name}: left out: {why}")
    return "\n".join(lines)
