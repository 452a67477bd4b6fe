"""GNetDet as a model family: how the trainer, the dataset and the checkpoints build and feed it."""
from __future__ import annotations

import sys
from typing import Any, Dict, List, Optional

import numpy as np
import torch.nn as nn

from gnetmdk.config.base import ConfigError
from gnetmdk.models.base import ALL_STAGES, DetectorFamily
from gnetmdk.models.stages import fold_hook
from .model import GNetDet, gnetdet_layers, major_weight_formats

#: stages whose weights were fine-tuned under a weight scale rule
QUANTIZED_STAGES = ("step2", "cal", "step3", "step4")
#: stages whose checkpoints hold calibrated activation caps (their output layer's width is fixed)
ACTIVATIONS_QUANTIZED = ("cal", "step3", "step4")


def relayout_mask_bits(mask_bits, from_bits: int, to_bits: int, path: str = "?") -> List[int]:
    """A GNetDet's weight formats per major layer moved from one output layout to the other, every conv
    keeping its format: from ``output_bits`` 5 to 10 the output conv's new major layer takes the format
    of the major layer it leaves; from 10 to 5 the output conv joins the major layer before it, which
    needs the same format (a major layer has one).

    Args:
        mask_bits: the formats of the ``from_bits`` layout (one per major layer).
        from_bits, to_bits: 5 or 10.
        path: the checkpoint, for the message.
    Returns:
        the formats of the ``to_bits`` layout.
    Raises:
        ConfigError: from 10 to 5 with an output conv whose format differs from the head's.
    """
    bits = [int(b) for b in mask_bits]
    if from_bits == to_bits or not bits:
        return bits
    if to_bits == 10:
        return bits + [bits[-1]]
    if len(bits) < 2 or bits[-1] != bits[-2]:
        raise ConfigError(f"checkpoint '{path}' has its output conv at weight format {bits[-1]} in a major layer of "
                          f"its own (output_bits 10, mask_bits {bits}); with output_bits 5 it would share the head's "
                          f"major layer, whose format is {bits[-2] if len(bits) > 1 else '?'}: keep output_bits 10 "
                          f"or start from the step-1 checkpoint")
    return bits[:-1]


class GNetDetFamily(DetectorFamily):
    """GNetDet: every stage of the chip pipeline; the chip's 5-bit input codes; dense 14 x 14 targets
    (gnetmdk.models.gnetdet.loss)."""
    name = "gnetdet"
    stages = ALL_STAGES
    input_kind = "chip_codes"
    target_kind = "dense"

    def output_cap_limit(self, cfg, model=None) -> float:
        """The output layer's cap limit: ``gnetdet.output_cap_max``, or with -1 the rule of
        :func:`gnetmdk.models.gnetdet.head.output_cap_limit` from the score and size heads (``model``'s
        when given: a checkpoint keeps the heads it was trained with)."""
        from .head import output_cap_limit
        return output_cap_limit(cfg.gnetdet, model)

    def calibrate(self, model: nn.Module, batches, cfg, device, progress) -> Dict[str, Any]:
        """The chip's ReLU caps (gnetmdk.models.calibration.calibrate_caps with the section's
        ``cap_method``, the output layer's limit and, with ``equalize`` > 0, the channels' ranges
        equalized first), leaving the model in step 3's mode (training).

        Returns:
            {"caps": one float per ReLU, "how": the method in words (``{batches}``: the number of
            batches), "label": "caps", "file": ("relu_cap.txt", one cap a line)}.
        """
        from gnetmdk.models.calibration import calibrate_caps
        g = cfg.gnetdet
        from gnetmdk.models.calibration import DEAD_LAYER_CAP
        limit = self.output_cap_limit(cfg, model)
        dead: list = []
        caps = calibrate_caps(model, batches, g.cap_method, device, progress, output_cap_max=limit,
                              equalize=float(g.equalize), equalize_max_scale=float(g.equalize_max_scale),
                              bias_correct=bool(g.bias_correct), dead=dead)
        codes = "5-bit codes" + (" (10-bit in the output layer)" if int(getattr(model, "output_bits", 5)) == 10 else "")
        how = {"mse": f"MSE-best for {codes} over a histogram of {{batches}} batches",
               "output": f"MSE-best for {codes}, then searched against the network's output error",
               }.get(g.cap_method, f"{g.cap_percentile:g}th percentile, running max over {{batches}} batches")
        if limit > 0:
            how += f"; the output layer's cap at most {limit:g}"
        if g.equalize > 0:
            how = (f"after equalizing the channels' ranges (exponent {g.equalize:g}, factors at most "
                   f"{g.equalize_max_scale:g}), " + how)
        if g.bias_correct:
            how += "; biases corrected to the float activations' channel means"
        if dead:
            names = ", ".join(f"{model.specs[i].major + 1}.{model.specs[i].index_in_major + 1}" for i in dead)
            how += (f"; no positive value reached layer(s) {names} (dead: their output is 0 whatever the cap), "
                    f"cap {DEAD_LAYER_CAP:g}")
        return {"caps": caps, "how": how, "label": "caps", "file": ("relu_cap.txt", "".join(f"{c:.8g}\n" for c in caps))}

    # ------------------------------------------------------------------ models
    def create(self, **kwargs) -> nn.Module:
        """A GNetDet from its constructor's keyword arguments."""
        return GNetDet(**kwargs)

    @staticmethod
    def training_kwargs(cfg) -> Dict[str, Any]:
        """The constructor arguments that are training settings, not architecture: they come from the
        run's config also when the architecture comes from a checkpoint."""
        g = cfg.gnetdet
        return dict(cap_percentile=g.cap_percentile, l_coord=g.l_coord, l_noobj=g.l_noobj, l_class=g.l_class,
                    score_loss=g.score_loss, l_range=g.l_range, box_slots=g.box_slots,
                    output_cap_percentile=g.output_cap_percentile, channels_last=cfg.channels_last)

    def build(self, cfg, builder=None, **overrides) -> nn.Module:
        """A fresh GNetDet for ``cfg`` (``builder``: a registered variant's constructor)."""
        g = cfg.gnetdet
        kw = dict(num_classes=cfg.num_classes, image_size=cfg.image_size, width_mult=g.width_mult,
                  head_width_mult=g.head_width_mult, use_bn=g.use_bn,
                  chip=str(g.chip), mask_bits=list(g.mask_bits), weight_scale=g.weight_scale,
                  score_head=g.score_head, score_offset=g.score_offset, score_scale=g.score_scale,
                  size_head=g.size_head, size_min=g.size_min, output_bits=int(g.output_bits),
                  gain_aware=g.gain_aware, **self.training_kwargs(cfg))
        kw.update(overrides)
        return (builder or GNetDet)(**kw)

    def rebuild(self, meta: Dict[str, Any], cfg=None, stage: Optional[str] = None, path: str = "?") -> nn.Module:
        """The architecture of a GNetDet checkpoint. With ``cfg``: its training settings apply; the weight
        scale rule (weight_scale) and the weight formats (mask_bits) come from the config for a step-1
        checkpoint, while a checkpoint of a quantized stage keeps those it was trained with (a note on
        stderr when the config differs); a step-3 checkpoint keeps its ``gain_aware`` setting (one from
        before the option: GTI's flow), any other takes the config's. The output layer's activation
        width (``output_bits``) is quantized from calibration on: a step-1 or step-2 checkpoint takes the
        config's (a step-2 one with every conv's weight format kept, :func:`relayout_mask_bits`), a
        checkpoint from cal on keeps its own.

        Raises:
            ConfigError: a step-2 checkpoint whose weight formats the config's output_bits cannot keep."""
        meta = dict(meta)
        meta.pop("name", None)
        extra: Dict[str, Any] = {}
        if cfg is not None:
            g = cfg.gnetdet
            extra = self.training_kwargs(cfg)
            quantized = stage in QUANTIZED_STAGES
            had = int(meta.get("output_bits", 5))
            if stage in ACTIVATIONS_QUANTIZED:
                if had != g.output_bits:
                    print(f"note: checkpoint '{path}' ({stage}) was calibrated with output_bits {had}; keeping it "
                          f"(the config's {g.output_bits} applies to step-1 and step-2 models)", file=sys.stderr)
            elif had != g.output_bits:
                meta["output_bits"] = int(g.output_bits)
                if meta.get("mask_bits"):
                    try:
                        meta["mask_bits"] = relayout_mask_bits(meta["mask_bits"], had, int(g.output_bits), path)
                    except ConfigError:
                        if quantized:
                            raise
                        meta["mask_bits"] = []        # a float model's formats come from the config below
            # the per-kernel scale rule: the run's config decides for a float (step-1) model; weights
            # already fine-tuned under one rule keep it (the other rule would re-quantize them blindly:
            # on cards an MSE-trained step-4 model scores 0.0 under GTI's rule)
            trained = meta.get("weight_scale", g.weight_scale)
            if quantized and trained != g.weight_scale:
                print(f"note: checkpoint '{path}' ({stage}) was trained with weight_scale {trained!r}; keeping it "
                      f"(the config's {g.weight_scale!r} applies to step-1 models)", file=sys.stderr)
            else:
                meta["weight_scale"] = g.weight_scale
            # the weight formats (mask_bits) likewise: a float model takes the config's (its weights do
            # not depend on them; set after step 1, they must not be dropped), a quantized one its own
            recorded = [int(b) for b in meta.get("mask_bits", [])]
            wanted = self._config_mask_bits(cfg, meta)
            if wanted is not None and recorded and wanted != recorded:
                print(f"note: checkpoint '{path}' ({stage}" + (
                      f") was trained with mask_bits {recorded}; keeping them (the config's {wanted} apply to "
                      f"step-1 models)" if quantized else
                      f", float) recorded mask_bits {recorded}; the config's {wanted} apply"), file=sys.stderr)
            if not quantized:
                meta["mask_bits"] = [int(b) for b in g.mask_bits]      # [] = the chip's default
            if stage == "step3":
                meta.setdefault("gain_aware", False)
                if meta["gain_aware"] != g.gain_aware:
                    print(f"note: checkpoint '{path}' (step3) was trained with gain_aware {meta['gain_aware']}; "
                          f"keeping it (the config's {g.gain_aware} applies from a cal checkpoint on)",
                          file=sys.stderr)
            else:
                meta["gain_aware"] = g.gain_aware
            # the output heads say how the trained weights' outputs are read: the checkpoint's stay
            for key in ("score_head", "size_head"):
                had = meta.get(key, "linear")
                if had != getattr(g, key):
                    print(f"note: checkpoint '{path}' ({stage}) was trained with {key} {had!r}; keeping it (the "
                          f"config's {getattr(g, key)!r} applies to a model trained from scratch)", file=sys.stderr)
        return GNetDet(**meta, **extra)

    @staticmethod
    def _config_mask_bits(cfg, meta: Dict[str, Any]):
        """The weight formats per major layer the config asks for, the chip's default filled in for ``[]``
        (in the layout of the meta's ``output_bits``); None when that cannot be worked out (a size the
        table lacks)."""
        if cfg.gnetdet.mask_bits:
            return [int(b) for b in cfg.gnetdet.mask_bits]
        try:
            return major_weight_formats(gnetdet_layers(int(meta["image_size"]), int(meta["num_classes"]),
                                                float(meta["width_mult"]), str(meta["chip"]), (),
                                                output_bits=int(meta.get("output_bits", 5))))
        except Exception:
            return None

    def prepare_stage(self, model: nn.Module, stage, calibrating: bool = False) -> None:
        """The chip's switches, in torch.ao's terms: every QConv2d's weight fake quantization
        (``fake_quant_enabled``), every QReLU's observer (``observer_enabled``, the cal pass) and 5-bit
        fake quantization (``fake_quant_enabled``) and step 4's ``integer`` codes, the model's exact
        step-4 evaluation; the convs' gains are set again (``GNetDet.set_gains``) so that none keeps a
        previous stage's."""
        for conv in model.convs():
            conv.enable_fake_quant(stage.weight_fake_quant)
        for relu in model.relus():
            relu.enable_observer(calibrating)
            relu.enable_fake_quant(stage.act_fake_quant)
            relu.integer = stage.integer
        model.exact_eval = stage.integer
        model.set_gains()         # no conv keeps a previous stage's gain until the next forward
        model.train(model.training)

    def enter_stage(self, model: nn.Module, stage, source_stage: Optional[str], cfg) -> List[str]:
        """The stage table's entry edits (gnetmdk.models.stages), except that with ``gnetdet.step2_bn
        "keep"`` step 2 keeps the BatchNorm layers (each sublayer then quantizes its folded weights,
        Sublayer._quantized_conv_bn) and the cal stage folds them on its entry; with ``step3_bn "keep"``
        as well cal and step 3 keep them (their other edits apply) and step 4 folds them.

        Raises:
            RuntimeError: the model cannot enter the stage (step 3 without caps).
        """
        g = cfg.gnetdet
        kept = sum(1 for layer in model.layers if layer.bn is not None)
        keep = ((stage.name == "step2" and str(g.step2_bn) == "keep")
                or (stage.name in ("cal", "step3") and str(g.step3_bn) == "keep"))
        if not keep:
            return super().enter_stage(model, stage, source_stage, cfg)
        out = [msg for msg in (hook(model, source_stage) for hook in stage.enter if hook is not fold_hook) if msg]
        if kept:
            until = "cal" if stage.name == "step2" and str(g.step3_bn) != "keep" else "step 4"
            option = "step2_bn" if stage.name == "step2" else "step3_bn"
            out.insert(0, f"kept {kept} BatchNorm layers ({option} keep): the convs quantize their folded weights; "
                          f"folded on entry to {until}")
        return out

    def epoch_mode(self, model: nn.Module, stage, epoch: int, cfg) -> Optional[str]:
        """``gnetdet.step3_bn_freeze N`` (with ``step3_bn "keep"``): from step 3's epoch N (0-based: after
        N epochs on batch statistics) every kept BatchNorm layer is put in eval mode while the model
        trains, so it normalizes with its running statistics and no longer updates them: each sublayer
        then trains its folded, gain-edited conv (Sublayer._quantized_conv_bn's evaluation path, with
        straight-through gradients to the conv and the BatchNorm's affine parameters), the model that
        step 4 starts from. This is freezing the BatchNorm statistics in quantization-aware training
        (Krishnamoorthi 2018, arXiv:1806.08342, on BatchNorm folding; torch.ao's ``freeze_bn_stats``);
        docs/quantization.md, "BatchNorm kept through step 3". Returns a log line for every
        epoch it applies to (the same line every such epoch), else None."""
        n = int(cfg.gnetdet.step3_bn_freeze)
        if stage.name != "step3" or n <= 0 or epoch < n:
            return None
        bns = [layer.bn for layer in model.layers if layer.bn is not None]
        for bn in bns:
            bn.eval()
        return (f"{len(bns)} BatchNorm layers normalize with their running statistics, frozen from epoch {n + 1} "
                f"(step3_bn_freeze {n}): step 3 trains the folded model step 4 starts from") if bns else None

    def configure(self, model: nn.Module, cfg) -> List[str]:
        """The chip-memory note (gnetmdk.models.gnetdet.config.gnetdet_memory_note) when the model lies in
        the band docs/chip.md leaves open, else nothing."""
        from .config import gnetdet_memory_note
        g = cfg.gnetdet
        note = gnetdet_memory_note(cfg.image_size, cfg.num_classes, float(g.width_mult), str(g.chip), list(g.mask_bits),
                                   float(g.head_width_mult), int(g.output_bits))
        return [note] if note else []

    def describe(self, cfg) -> str:
        """Input side and width multiplier, e.g. ``448px x1.0`` (``224px x0.25, head x1.0`` with a
        head width of its own)."""
        g = cfg.gnetdet
        head = f", head x{g.head_width_mult}" if g.head_width_mult > 0 else ""
        wide = ", 10-bit output" if int(g.output_bits) == 10 else ""
        return f"{cfg.image_size}px x{g.width_mult}{head}{wide}"

    def meta_defaults(self) -> Dict[str, Any]:
        """``head_width_mult 0.0`` (the head at ``width_mult``) and ``output_bits 5``: what checkpoints from
        before the fields were built with."""
        return {"head_width_mult": 0.0, "output_bits": 5}

    def compat_fields(self, cfg) -> Dict[str, Any]:
        """``image_size``, ``width_mult``, ``head_width_mult`` and ``chip``: a checkpoint must match them."""
        g = cfg.gnetdet
        return {"image_size": cfg.image_size, "width_mult": float(g.width_mult),
                "head_width_mult": float(g.head_width_mult), "chip": str(g.chip)}

    def check_config(self, cfg) -> None:
        """Check the ``gnetdet`` section (check_gnetdet_config).

        Raises:
            ConfigError: a value out of range, naming the field.
        """
        from gnetmdk.models.gnetdet.config import check_gnetdet_config
        check_gnetdet_config(cfg)

    # ------------------------------------------------------------------ data
    def build_dataset(self, cfg, split: str):
        """The GNetDet dataset of ``split`` (chip input codes, dense targets)."""
        from gnetmdk.dataset.dataset import build_gnetdet_dataset
        return build_gnetdet_dataset(cfg, split)

    def encode_targets(self, boxes: np.ndarray, labels: np.ndarray, scores: np.ndarray, cfg) -> np.ndarray:
        """Dense (S, S, 10 + C) float32 targets on the ``grid_size`` grid (``scores`` unused)."""
        from gnetmdk.dataset.dataset import encode_targets
        return encode_targets(boxes, labels, cfg.grid_size, cfg.num_classes)

    # ------------------------------------------------------------------ training
    def leading_parameters(self, model: nn.Module, n: int) -> List[nn.Parameter]:
        """Parameters of the first ``n`` sublayers (conv and BatchNorm)."""
        layers = list(getattr(model, "layers", []))
        return [p for layer in layers[:n] for p in layer.parameters()]

    def loss_line(self, terms: Dict[str, float]) -> str:
        """``loss <total> (<term> <value> ...)`` with GNetDet's terms in a fixed order (loc, conf, noresp,
        noobj, cls, range, distill; those present)."""
        keys = [k for k in ("loc", "conf", "noresp", "noobj", "cls", "range", "distill") if k in terms]
        return (f"loss {terms['total']:.4f} (" + " ".join(f"{k} {terms[k]:.3f}" for k in keys) + ")")
