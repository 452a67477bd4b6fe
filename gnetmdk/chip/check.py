"""Bit-exactness check: the step-4 model (eval mode) against a chip runner, code by code, layer by layer.

The step-4 model computes every conv in float64 (QConv2d.exact: exact while partial sums stay below
2^53, and the chip's stay below 2^31), then R(clip(x, 0, 31)) and the 2x2 max pool, so each of its
activations is an integer code; ``model.features(x, return_all=True)`` returns them per sublayer.
The check compares those with the runner's codes (the emulator's or onnxruntime's) on every image,
and also checks that the padded output channels are 0.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, List, Optional

import numpy as np
import torch

from gnetmdk.gti.quantize import image_to_codes
from .model_file import ChipModel, ChipModelError


@dataclass
class CheckReport:
    """Result of a bit-exactness check.

    Attributes:
        mismatches: per sublayer, the number of activation codes that differ.
        elements: per sublayer, the number of codes compared.
        padded_nonzero: codes of the padded output channels that are not 0 (must be 0).
        max_output_diff: max |pred_model - pred_chip| of the host-scaled outputs.
        num_images: images compared.
    """
    mismatches: List[int]
    elements: List[int]
    padded_nonzero: int = 0
    max_output_diff: float = 0.0
    num_images: int = 0
    layer_names: List[str] = field(default_factory=list)

    @property
    def total_mismatches(self) -> int:
        """Mismatching codes over all layers plus non-zero padded output codes."""
        return int(sum(self.mismatches)) + int(self.padded_nonzero)

    @property
    def ok(self) -> bool:
        """True when nothing differs: no mismatching code, no non-zero padding, equal outputs."""
        return self.total_mismatches == 0 and self.max_output_diff == 0.0

    def format(self) -> str:
        """A table: layer, codes compared, mismatches; then the verdict."""
        lines = [f"{'layer':<8} {'codes compared':>15} {'mismatches':>11}", "-" * 36]
        for name, n, m in zip(self.layer_names, self.elements, self.mismatches):
            lines.append(f"{name:<8} {n:>15} {m:>11}")
        lines.append("-" * 36)
        lines.append(f"{'total':<8} {sum(self.elements):>15} {sum(self.mismatches):>11}")
        lines.append(f"padded output channels non-zero: {self.padded_nonzero}; max |output difference|: "
                     f"{self.max_output_diff:g}; images: {self.num_images}")
        lines.append("bit-exact: every activation code of every layer agrees" if self.ok else
                     f"NOT bit-exact: {self.total_mismatches} mismatching codes")
        return "\n".join(lines)


@torch.no_grad()
def model_layer_codes(model, images: np.ndarray, with_predictions: bool = False):
    """Every sublayer's codes of the step-4 model on 8-bit images.

    Args:
        model: GNetDet in step-4 eval mode (apply_stage(model, STAGES["step4"]); model.eval()), on
            any device (the images follow it; codes and predictions come back on the CPU).
        images: (N, H, W, 3) uint8 BGR at network size.
        with_predictions: also return the model's forward output (N, S, S, 10 + C) float32, computed
            from the same pass as GNetDet.forward does (last codes x output_scale, NHWC).
    Returns:
        per sublayer (N, C_i, H_i, W_i) int64 codes (after pool) [, predictions].
    Raises:
        ValueError: an activation is not an integer in 0..31 (0..1023 in a 10-bit output layer; the model
            is not in step-4 mode).
    """
    device = next(model.parameters()).device          # CPU or CUDA: the exact path is float64 on both
    x = image_to_codes(torch.from_numpy(np.ascontiguousarray(images))).permute(0, 3, 1, 2).float().to(device)
    y, outs = model.features(x, return_all=True)
    pred = (y * model.output_scale.to(y.dtype)).permute(0, 2, 3, 1).float().contiguous().cpu()
    res = []
    for i, (o, relu) in enumerate(zip(outs, model.relus())):
        o = o.double().cpu()
        top = int(getattr(relu, "codes", 31))
        if not torch.equal(o, torch.round(o)) or (o.numel() and (o.min() < 0 or o.max() > top)):
            raise ValueError(f"sublayer {i + 1} of the model does not output integer codes 0..{top}: put the model "
                             "in step-4 eval mode (apply_stage(model, STAGES['step4']); model.eval())")
        res.append(o.to(torch.int64).numpy())
    return (res, pred) if with_predictions else res


def check_bit_exact(model, runner: Callable, chip_model: ChipModel, dataset=None, images: Optional[np.ndarray] = None,
                    batch_size: int = 8, all_layers: bool = True) -> CheckReport:
    """Compare the step-4 model with a chip runner on every layer of every image.

    Args:
        model: GNetDet in step-4 eval mode.
        runner: ``runner(images, return_all=True)`` -> (codes, per-layer codes), e.g. ChipEmulator.run or
            OnnxChipRunner.run (exported with all_layers=True); with ``all_layers=False``,
            ``runner(images)`` -> codes, and only the output layer is compared.
        chip_model: the converted model (for the padding and output scale).
        dataset / images: a GNetDetDataset (all its images, evaluation preprocessing) or a
            (N, H, W, 3) uint8 batch.
    Returns:
        CheckReport.
    Raises:
        ValueError: neither ``dataset`` nor ``images`` given.
    """
    from .host import codes_to_predictions, iter_dataset_batches
    if dataset is None and images is None:
        raise ValueError("check_bit_exact needs the images to compare on: pass dataset or images")
    n_layers = len(chip_model.layers)
    mism = [0] * n_layers
    elems = [0] * n_layers
    padded_nonzero = 0
    max_diff = 0.0
    count = 0
    used = chip_model.used_channels
    if dataset is not None:
        batches = (imgs for _, imgs, _ in iter_dataset_batches(dataset, batch_size))
    else:
        batches = (images[i:i + batch_size] for i in range(0, len(images), batch_size))
    was_training = model.training
    model.eval()
    try:
        for imgs in batches:
            ref, pm = model_layer_codes(model, imgs, with_predictions=True)
            if all_layers:
                out, layers = runner(imgs, return_all=True)
                pairs = list(enumerate(zip(ref, layers)))
            else:
                out = runner(imgs)
                pairs = [(n_layers - 1, (ref[-1], out))]
            for i, (r, c) in pairs:
                c = np.asarray(c).astype(np.int64)
                if i == n_layers - 1:
                    padded_nonzero += int(np.count_nonzero(c[:, used:]))
                    c = c[:, :used]
                if r.shape != c.shape:
                    raise ChipModelError(f"layer {i + 1}: the model gives codes of shape {r.shape}, the chip runner "
                                         f"{c.shape}: the chip model was converted from another checkpoint; pass "
                                         "that one to --check")
                mism[i] += int(np.count_nonzero(r != c))
                elems[i] += int(r.size)
            pc = codes_to_predictions(np.asarray(out), chip_model)
            max_diff = max(max_diff, float((pm - pc).abs().max()) if pm.numel() else 0.0)
            count += len(imgs)
    finally:
        model.train(was_training)
    names = [f"conv{i + 1}" for i in range(n_layers)]
    if not all_layers:
        mism, elems, names = mism[-1:], elems[-1:], names[-1:]
    return CheckReport(mism, elems, padded_nonzero, max_diff, count, names)
