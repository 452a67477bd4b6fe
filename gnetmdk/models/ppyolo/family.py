"""PP-YOLO as a model family: RGB images with padded ground truth, every stage of the pipeline; from
step 2 on the stages target the standard integer model of gnetmdk.intq (the chip cannot run PP-YOLO;
gnetmdk.models.ppyolo.quant)."""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch.nn as nn

from gnetmdk.models.base import ALL_STAGES, DetectorFamily

#: the section fields that are the architecture (a checkpoint must share them with the config)
ARCH_FIELDS = ("depth", "return_idx", "dcn_v2_stages", "coord_conv", "coord_range", "spp", "conv_block_num", "anchors",
               "anchor_masks", "iou_aware")
#: the section fields that are training settings (from the run's config, also for a checkpoint's model)
TRAIN_FIELDS = ("freeze_at", "freeze_norm", "drop_block", "block_size", "keep_prob", "iou_aware_factor",
                "ignore_thresh", "scale_x_y", "label_smooth", "iou_loss_weight", "iou_aware_loss_weight",
                "nms_post_threshold")


class PPYOLOFamily(DetectorFamily):
    """PP-YOLO (gnetmdk.models.ppyolo): RGB pixels in, padded targets; step 1 float, steps 2..4 toward
    the integer model of gnetmdk.intq (per-channel int8 weights, uint8 activations)."""
    name = "ppyolo"
    stages = ALL_STAGES
    input_kind = "rgb"
    target_kind = "padded"

    def create(self, **kwargs) -> nn.Module:
        """A PPYOLO from its constructor's keyword arguments."""
        from .model import PPYOLO
        return PPYOLO(**kwargs)

    @staticmethod
    def _kwargs(cfg, fields) -> Dict[str, Any]:
        p = cfg.ppyolo
        return {f: (list(getattr(p, f)) if isinstance(getattr(p, f), (list, tuple)) else getattr(p, f))
                for f in fields}

    def build(self, cfg, builder=None, **overrides) -> nn.Module:
        """A fresh PPYOLO from the ``ppyolo`` section's architecture and training fields, the class count and
        ``obj_prior`` (``builder``: a registered variant's constructor)."""
        from .model import PPYOLO
        kw = dict(num_classes=cfg.num_classes, obj_prior=cfg.ppyolo.obj_prior,
                  **self._kwargs(cfg, ARCH_FIELDS + TRAIN_FIELDS))
        kw.update(overrides)
        return (builder or PPYOLO)(**kw)

    def rebuild(self, meta: Dict[str, Any], cfg=None, stage: Optional[str] = None, path: str = "?") -> nn.Module:
        """The PPYOLO a checkpoint's ``model_meta`` describes (:meth:`meta_defaults` for keys it lacks); with
        ``cfg`` the run's training fields (freeze_at, DropBlock, loss settings, ...) replace the checkpoint's."""
        from .model import PPYOLO
        kw = {**self.meta_defaults(), **{k: v for k, v in meta.items() if k != "name"}}
        if cfg is not None:
            kw.update(self._kwargs(cfg, TRAIN_FIELDS))
        return PPYOLO(**kw)

    def meta_defaults(self) -> Dict[str, Any]:
        """``coord_range "full"``: the CoordConv range checkpoints used before the field existed."""
        return {"coord_range": "full"}          # the only CoordConv range before the field existed

    def describe(self, cfg) -> str:
        """Depth, FPN levels, evaluation size and the training sizes' span, e.g.
        ``r50vd, 3 levels, eval 608px, train 320-608px``."""
        p = cfg.ppyolo
        return (f"r{p.depth}vd, {len(p.return_idx)} levels, eval {cfg.image_size}px, train "
                f"{min(p.train_sizes)}-{max(p.train_sizes)}px")

    def compat_fields(self, cfg) -> Dict[str, Any]:
        """The ``ppyolo`` section's architecture fields (ARCH_FIELDS): a checkpoint must match them."""
        return self._kwargs(cfg, ARCH_FIELDS)

    def check_config(self, cfg) -> None:
        """Check the ``ppyolo`` section (check_ppyolo_config).

        Raises:
            ConfigError: a value out of range, naming the field.
        """
        from .config import check_ppyolo_config
        check_ppyolo_config(cfg)

    def build_dataset(self, cfg, split: str):
        """The PP-YOLO dataset of ``split`` (RGB pixels, padded targets)."""
        from gnetmdk.dataset.ppyolo_dataset import build_ppyolo_dataset
        return build_ppyolo_dataset(cfg, split)

    def configure(self, model: nn.Module, cfg) -> List[str]:
        """Refuse a deterministic CUDA run through trained deformable convs, and turn DropBlock off in
        deterministic runs (the log line says so).

        Raises:
            ConfigError: from check_deterministic_dcn.
        """
        param = next(model.parameters(), None)
        check_deterministic_dcn(cfg, param.device.type if param is not None else "cpu")
        if cfg.deterministic and cfg.ppyolo.drop_block:
            model.set_drop_block(False)
            return ["deterministic mode: DropBlock off (the identity)"]
        return []

    def prepare_stage(self, model: nn.Module, stage, calibrating: bool = False) -> None:
        """From step 2 (a model with its quantizers, ``qgraph``): weights fake-quantized per the stage,
        activations fake-quantized in steps 3 and 4, the integer program in step 4's evaluation
        (``PPYOLO.set_quant_mode``); calibration enables the observers itself
        (gnetmdk.intq.calibrate). The float model (step 1) has no switches."""
        if model.qgraph is not None:
            model.set_quant_mode(stage.weight_fake_quant, "fake" if stage.act_fake_quant else "off", stage.integer)
        model.train(model.training)

    def enter_stage(self, model: nn.Module, stage, source_stage: Optional[str], cfg) -> List[str]:
        """Step 2 and later from a float checkpoint: fold BatchNorm and add the quantizers
        (PPYOLO.prepare_quant with ``ppyolo.weight_bits`` / ``weight_scale``); step 3 and 4 need
        calibrated ranges.

        Raises:
            CheckpointError: step 3 / 4 from a checkpoint without calibrated ranges.
        """
        from gnetmdk.checkpoint.io import CheckpointError
        out = []
        if not stage.weight_fake_quant:      # the float stage: nothing to prepare
            return out
        p = cfg.ppyolo
        if model.qgraph is None:
            n = model.prepare_quant(p.weight_bits, p.weight_scale)
            out.append(f"folded {n} BatchNorm layers into their convs; conv weights quantized to {p.weight_bits} bits "
                       f"per output channel ({p.weight_scale} scales), {len(model.quant)} activation quantizers")
        if stage.act_fake_quant:
            missing = [k for k, q in model.quant.items() if not q.calibrated]
            if missing:
                raise CheckpointError(f"{stage.name} needs calibrated activation ranges, and {len(missing)} of "
                                      f"{len(model.quant)} quantizers have none (e.g. {missing[0]}): run calibration "
                                      "first (train.py --cal), or load its checkpoint/step2/cal.pth")
        if model.meta()["quant"].get("requant", "fixed") != p.requant:
            model.set_requant(p.requant)
            out.append(f"step 4's conv requantization: {p.requant} (ppyolo.requant)")
        if stage.integer:
            out.append("evaluation runs the integer model (int8 weights, uint8 activations, int32 accumulators; "
                       "gnetmdk.intq.program); training runs step 3's fake quantization")
        return out

    def calibrate(self, model: nn.Module, batches, cfg, device, progress) -> Dict[str, Any]:
        """uint8 activation ranges (gnetmdk.intq.calibrate, ``ppyolo.act_method``) with the weights
        quantized and the model in eval mode; leaves the model in step 3's mode (training)."""
        from gnetmdk.intq.calibrate import calibrate_ranges
        p = cfg.ppyolo
        model.set_quant_mode(True, "off", False)
        model.eval()
        ranges = calibrate_ranges(model, model.quant, batches, p.act_method, p.act_percentile, device, progress)
        model.set_quant_mode(True, "fake", False)
        model.train()
        how = {"mse": "least squared uint8 error over a histogram of {batches} batches",
               "percentile": f"{p.act_percentile:g}th percentile of a histogram of {{batches}} batches",
               "minmax": "minimum and maximum over {batches} batches"}[p.act_method]
        text = "".join(f"{k} {lo:.8g} {hi:.8g}\n" for k, (lo, hi) in ranges.items())
        return {"caps": [hi - lo for lo, hi in ranges.values()], "how": how, "label": "range widths",
                "file": ("act_ranges.txt", text)}

    def loss_line(self, terms: Dict[str, float]) -> str:
        """``loss <total> (<term> <value> ...)`` with PP-YOLO's terms in a fixed order (xy, wh, obj, cls, iou,
        iou_aware, distill; those present)."""
        keys = [k for k in ("xy", "wh", "obj", "cls", "iou", "iou_aware", "distill") if k in terms]
        return f"loss {terms['total']:.4f} (" + " ".join(f"{k} {terms[k]:.3f}" for k in keys) + ")"


def check_deterministic_dcn(cfg, device_type: str) -> None:
    """Refuse a deterministic run on CUDA whose backward pass goes through a deformable conv.

    The DCNv2 layers sample through ``F.grid_sample``, whose CUDA backward accumulates with atomic
    adds and has no deterministic implementation: under ``torch.use_deterministic_algorithms`` torch
    stops in the first backward pass. No gradient reaches those layers when the backbone is frozen up
    to the last DCN stage (``freeze_at`` >= that stage, as the PP-YOLO alignment recipe does), and
    the CPU kernel is deterministic.

    Raises:
        ConfigError: naming ``ppyolo.freeze_at`` / ``ppyolo.dcn_v2_stages`` and the fixes.
    """
    from gnetmdk.config import ConfigError
    p = cfg.ppyolo
    live = [s for s in p.dcn_v2_stages if s > p.freeze_at]
    if cfg.deterministic and device_type == "cuda" and live:
        raise ConfigError(
            f"--deterministic on CUDA with deformable convs in trained stage(s) {live} (ppyolo.dcn_v2_stages "
            f"{list(p.dcn_v2_stages)}, ppyolo.freeze_at {p.freeze_at}): grid_sample's CUDA backward has no "
            f"deterministic kernel; freeze the backbone through stage {max(live)} (ppyolo.freeze_at {max(live)}), "
            "or train without DCN (ppyolo.dcn_v2_stages []), or align on the CPU")
