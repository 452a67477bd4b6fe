"""PaddleDetection PP-YOLO weights -> :class:`~.model.PPYOLO` state dict: the name mapping, shape checks,
the class-count surgery of the head and a report for the command-line tool.

The Paddle names are derived from our model's structure with PaddleDetection's own naming rules
(never by guessing from strings), in PaddleDetection 2.x (``ppdet/``) terms:

* Detector (``ppdet/modeling/architectures/yolo.py`` ``YOLOv3``): sublayers ``backbone``, ``neck``,
  ``yolo_head``; the loss and post-process have no parameters.
* Backbone (``ppdet/modeling/backbones/resnet.py`` ``ResNet(variant='d')`` with ``NameAdapter`` of
  ``name_adapter.py``): stem ``conv1.conv1_1`` .. ``conv1_3``; stage ``s`` (0..3) is ``res{s+2}``, its
  block ``b`` is ``res{s+2}`` + ``a, b, c, ...`` (``fix_layer_warp_name``; ``a, b1, b2, ...`` for
  a 4th stage of more than 10 blocks); inside a block ``branch2a``, ``branch2b``, ``branch2c``
  (bottleneck) and the projection ``short`` (a ``ConvNormLayer``) or, when strided in the "d"
  variant, ``short.conv`` (``Sequential(pool, conv)``). A ``ConvNormLayer`` holds ``conv`` (a
  ``Conv2D`` or, with DCNv2, ``paddle.vision.ops.DeformConv2D``) and ``norm`` (``BatchNorm2D``); with
  DCNv2 the offset/mask predictor is ``conv_offset`` beside ``conv`` (since PaddleDetection
  commit 480c12d, 2021-04-12; before it, from 2021-01, ``conv`` was ``layers.py``
  ``DeformableConvV2`` holding ``conv_offset`` and ``conv_dcn``, also read here).
* Neck (``ppdet/modeling/necks/yolo_fpn.py`` ``PPYOLOFPN``): level ``i`` is ``yolo_block.{i}``
  (``PPYOLODetBlock``: ``conv_module.<conv0|conv1|conv2|conv3|spp|dropblock|route>`` and ``tip``), the
  route transitions ``yolo_transition.{i}``. Units are ``darknet.py`` ``ConvBNLayer`` (``conv``,
  ``batch_norm``); a ``CoordConv`` wraps one as ``conv``; ``SPP`` holds one as ``conv``;
  ``DropBlock`` has no parameters. The layer order per level is checked against ``PPYOLOFPN``'s
  ``cfg`` construction before anything is mapped.
* Head (``ppdet/modeling/heads/yolo_head.py`` ``YOLOv3Head``): ``yolo_output.{i}`` (a 1x1 ``Conv2D``
  with bias). Its output channels per level: with ``iou_aware`` first the ``na`` IoU logits (anchors
  0..na-1), then per anchor ``[x, y, w, h, objectness, C class logits]`` (``forward``: ``ioup =
  out[:, 0:na]``, ``x = out[:, na:]`` reshaped ``(b, na, 5 + C, h*w)``), the layout of our
  :mod:`~.head`.
* BatchNorm (``paddle.nn.BatchNorm2D`` / ``SyncBatchNorm``): ``weight``, ``bias``, ``_mean`` ->
  ``running_mean``, ``_variance`` -> ``running_var``; eps 1e-5 as torch. torch's
  ``num_batches_tracked`` has no Paddle counterpart: it keeps the model's value.
* DCNv2 offset/mask conv: PaddleDetection splits its ``3 k k`` output channels as ``[2 k k offsets, k k
  mask]`` (``ConvNormLayer.forward``, ``paddle.split``), and Paddle's kernel reads offset channel ``2 t``
  as dy and ``2 t + 1`` as dx of tap ``t = i k + j`` (``paddle/phi/kernels/funcs/deformable_conv_functor.cc``
  ``ModulatedDeformableIm2colCPUKernel``), the layout of our :mod:`~.dcn`; the rows copy one to one.
* Conv weights are ``(out, in, kh, kw)`` in both frameworks and copied as they are. Paddle's Linear
  weights are ``(in, out)`` (transposed); PP-YOLO has no Linear layer and :func:`convert_paddle_state`
  refuses a model that has one rather than copy one untransposed.

Naming eras read (``report.naming``):

* ``"dygraph"`` -- PaddleDetection 2.x structured names, e.g. ``backbone.res5.res5a.branch2b.conv_offset.weight``,
  ``neck.yolo_block.0.conv_module.spp.conv.batch_norm._mean``, ``yolo_head.yolo_output.0.bias``: the
  detector files (``ppyolo_r50vd_dcn_2x_coco.pdparams``, ``ppyolo_r18vd_coco.pdparams``, their
  ``.pdema``).
* ``"dygraph-backbone"`` -- the same names relative to the backbone (no ``backbone.`` prefix, e.g.
  ``res2.res2a.branch2a.norm._mean``): PaddleDetection's ImageNet files since March 2021
  (``paddledet.bj.bcebos.com/models/pretrained/ResNet50_vd_ssld_pretrained.pdparams``,
  ``ResNet18_vd_pretrained.pdparams``), which ``ppdet/utils/checkpoint.py`` first loaded with
  ``model.backbone.set_dict`` and now matches by name suffix (``match_state_dict``).
* ``"dygraph-dcn-2021q1"`` -- the ``conv.conv_offset`` / ``conv.conv_dcn`` DCN names of early-2021 files.
* ``"fluid"`` -- static-graph parameter names of the fluid era (``ppdet`` 0.x ``resnet.py`` and
  ``NameAdapter``): ``conv1_1_weights``, ``bnv1_1_scale`` / ``_offset`` / ``_mean`` / ``_variance``,
  ``res2a_branch2a_weights``, ``bn2a_branch2a_mean``, shortcut ``res3a_branch1_weights``, DCN
  ``res5a_branch2b_conv_offset.w_0`` / ``.b_0``: backbone only (the fluid-era PP-YOLO neck / head
  names ``yolo_block.0.0.0.conv.weights`` ... are not mapped).

Classifier tensors of ImageNet files (``fc.*``, ``fc_0.w_0``, ``out.*``) are never mapped.
"""
from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Tuple

import numpy as np
import torch
from torch import nn

from .common import ConvBNLayer
from .dcn import DeformConv2d
from .neck import SPP, CoordConv, DropBlock

__all__ = ["ConversionReport", "convert_paddle_state", "paddle_names", "rebuild_class_rows"]

_BN_DYGRAPH = (("weight", "weight"), ("bias", "bias"), ("running_mean", "_mean"), ("running_var", "_variance"))
_BN_FLUID = (("weight", "scale"), ("bias", "offset"), ("running_mean", "mean"), ("running_var", "variance"))
_CLASS_ROWS = ("keep", "init")


@dataclass
class _Slot:
    """One tensor of our state dict and the Paddle names it may come from, in preference order."""
    key: str
    candidates: List[Tuple[str, str]]            # (paddle name, naming era)
    part: str                                    # "backbone" | "neck" | "head"
    kind: str = "param"                          # "param" | "dcn_offset" | "head"
    level: int = -1


@dataclass
class ConversionReport:
    """Outcome of :func:`convert_paddle_state`.

    Attributes:
        matched: ``(paddle name, model key)`` pairs copied (class surgery included), model order.
        unmatched: Paddle names used nowhere and not an intended leftover (an error).
        missing: model keys that should have come from the file but did not (an error); torch's
            ``num_batches_tracked`` buffers are never listed (no Paddle counterpart).
        mismatched: ``(paddle name, model key, paddle shape, model shape)`` of names that match but
            whose shapes (or a non-float dtype) do not (an error; the model's tensor is kept).
        ignored: Paddle names left out on purpose: with ``only_backbone`` the detector's neck / head,
            classifier tensors, and stages the model does not build.
        kept_init: model keys that keep the model's initialisation on purpose: with ``only_backbone``
            the neck and head, and DCN offset/mask convs that an ImageNet file does not have
            (PaddleDetection also starts them at 0).
        naming: the naming eras met (module docstring), sorted.
        class_surgery: ``None``, or with ``num_classes`` given: ``{"paddle_classes", "num_classes",
            "class_rows", "copied_class_rows"}``.
        only_backbone: the mode used.
        nonfinite: ``(paddle name, count)`` of mapped arrays holding NaN or infinite values (an error:
            such weights would train or evaluate as NaN).
    """
    matched: List[Tuple[str, str]] = field(default_factory=list)
    unmatched: List[str] = field(default_factory=list)
    missing: List[str] = field(default_factory=list)
    mismatched: List[Tuple[str, str, Tuple[int, ...], Tuple[int, ...]]] = field(default_factory=list)
    ignored: List[str] = field(default_factory=list)
    kept_init: List[str] = field(default_factory=list)
    naming: List[str] = field(default_factory=list)
    class_surgery: Optional[Dict[str, object]] = None
    only_backbone: bool = False
    nonfinite: List[Tuple[str, int]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when nothing is unmatched, missing, mis-shaped or non-finite (the tool exits non-zero otherwise)."""
        return not (self.unmatched or self.missing or self.mismatched or self.nonfinite)

    def format(self, limit: int = 4) -> str:
        """One paragraph for a log or the terminal: counts, up to ``limit`` names per problem, verdict."""
        def few(names):
            names = list(names)
            shown = ", ".join(names[:limit])
            return shown + (f" (+{len(names) - limit} more)" if len(names) > limit else "")

        parts = [f"Paddle -> PPYOLO: {len(self.matched)} tensors mapped"
                 + (f" (naming: {', '.join(self.naming)})" if self.naming else "")
                 + (", backbone only" if self.only_backbone else "")]
        parts.append(f"{len(self.unmatched)} Paddle keys unmatched" + (f" [{few(self.unmatched)}]" if self.unmatched
                                                                       else ""))
        parts.append(f"{len(self.missing)} model keys left unset" + (f" [{few(self.missing)}]" if self.missing
                                                                      else ""))
        mis = [f"{p} {tuple(ps)}{' (not a float array)' if tuple(ps) == tuple(ks) else ''} vs {k} {tuple(ks)}"
               for p, k, ps, ks in self.mismatched]
        parts.append(f"{len(self.mismatched)} shape/dtype mismatches" + (f" [{few(mis)}]" if mis else ""))
        if self.nonfinite:
            bad = [f"{n} ({c} values)" for n, c in self.nonfinite]
            parts.append(f"{len(self.nonfinite)} arrays with NaN or infinite values [{few(bad)}]")
        if self.ignored:
            parts.append(f"{len(self.ignored)} Paddle keys ignored on purpose [{few(self.ignored)}]")
        if self.kept_init:
            parts.append(f"{len(self.kept_init)} model keys keep their initialisation on purpose")
        if self.class_surgery:
            cs = self.class_surgery
            c, n, k = cs["paddle_classes"], cs["num_classes"], cs["copied_class_rows"]
            if k == 0:
                cls = "class rows initialised as the model's head"
            elif k == n:
                cls = f"class rows of the file's first {n} of {c} classes kept (they stand for the file's classes)"
            else:
                cls = f"class rows of all {c} file classes kept, classes {c}..{n - 1} initialised as the model's head"
            parts.append(f"head rebuilt from {c} to {n} classes (box, objectness and IoU rows copied, {cls})")
        hint = ""
        if any(k.startswith("head.") for _, k, _, _ in self.mismatched) and not self.class_surgery:
            hint += " The head's class count differs: pass num_classes (-nc) to rebuild the class rows."
        if self.missing and not self.only_backbone and all(k.startswith(("neck.", "head.")) for k in self.missing):
            hint += (" The file has no neck / head tensors (an ImageNet backbone file?): convert with only_backbone "
                     "(--only-backbone).")
        if self.nonfinite:
            hint += " Non-finite weights come from a diverged or damaged training run: convert another file."
        verdict = "OK." if self.ok else "NOT OK: the weights do not fit this model." + hint
        return "; ".join(parts) + ". " + verdict


# ---------------------------------------------------------------------------------------------- names
def _block_name(stage_num: int, count: int, i: int) -> str:
    """PaddleDetection ``NameAdapter.fix_layer_warp_name`` (ResNet, not SEResNeXt)."""
    name = f"res{stage_num}"
    if count > 10 and stage_num == 4:
        return name + ("a" if i == 0 else f"b{i}")
    return name + chr(ord("a") + i)


def _fluid_bn_name(conv_name: str) -> str:
    """PaddleDetection ``NameAdapter.fix_conv_norm_name``: ``conv1`` -> ``bn_conv1``, else ``bn`` + name[3:]
    (``conv1_1`` -> ``bnv1_1``, ``res2a_branch2a`` -> ``bn2a_branch2a``)."""
    return "bn_" + conv_name if conv_name == "conv1" else "bn" + conv_name[3:]


def _dyg(name: str) -> List[Tuple[str, str]]:
    """A backbone structured name as a detector file (``backbone.`` prefix) and an ImageNet file hold it."""
    return [("backbone." + name, "dygraph"), (name, "dygraph-backbone")]


def _backbone_unit(slots: List[_Slot], ours: str, dyn: str, fluid: str, unit: nn.Module) -> None:
    """Slots of one ``ConvBNLayer`` = PaddleDetection ``resnet.py`` ``ConvNormLayer`` named ``dyn``
    (structured) / ``fluid`` (static-graph conv name)."""
    if not isinstance(unit, ConvBNLayer):
        raise ValueError(f"{ours} is a {type(unit).__name__}, expected ConvBNLayer (PaddleDetection ConvNormLayer)")
    conv = unit.conv
    if isinstance(conv, DeformConv2d):
        slots.append(_Slot(f"{ours}.conv.weight", _dyg(f"{dyn}.conv.weight")
                           + [(n, "dygraph-dcn-2021q1") for n, _ in _dyg(f"{dyn}.conv.conv_dcn.weight")]
                           + [(f"{fluid}_weights", "fluid")], "backbone"))
        for p, fp in (("weight", "w_0"), ("bias", "b_0")):
            slots.append(_Slot(f"{ours}.conv.offset_conv.{p}", _dyg(f"{dyn}.conv_offset.{p}")
                               + [(n, "dygraph-dcn-2021q1") for n, _ in _dyg(f"{dyn}.conv.conv_offset.{p}")]
                               + [(f"{fluid}_conv_offset.{fp}", "fluid")], "backbone", kind="dcn_offset"))
        if conv.bias is not None:
            slots.append(_Slot(f"{ours}.conv.bias", _dyg(f"{dyn}.conv.bias"), "backbone"))
    elif isinstance(conv, nn.Conv2d) and conv.bias is None:
        slots.append(_Slot(f"{ours}.conv.weight", _dyg(f"{dyn}.conv.weight") + [(f"{fluid}_weights", "fluid")],
                           "backbone"))
    else:
        raise ValueError(f"{ours}.conv is a {type(conv).__name__} (bias={getattr(conv, 'bias', None) is not None}); "
                         f"PaddleDetection's ConvNormLayer has a bias-free Conv2D or a DeformConv2D")
    fbn = _fluid_bn_name(fluid)
    for (p, dp), (_, fp) in zip(_BN_DYGRAPH, _BN_FLUID):
        slots.append(_Slot(f"{ours}.bn.{p}", _dyg(f"{dyn}.norm.{dp}") + [(f"{fbn}_{fp}", "fluid")], "backbone"))


def _darknet_unit(slots: List[_Slot], ours: str, pd: str, unit: nn.Module) -> None:
    """Slots of one ``ConvBNLayer`` = PaddleDetection ``darknet.py`` ``ConvBNLayer`` (``conv``, ``batch_norm``)."""
    if not isinstance(unit, ConvBNLayer) or not isinstance(unit.conv, nn.Conv2d) or unit.conv.bias is not None:
        raise ValueError(f"{ours} is not a bias-free conv + BatchNorm unit (PaddleDetection darknet ConvBNLayer)")
    slots.append(_Slot(f"{ours}.conv.weight", [(f"{pd}.conv.weight", "dygraph")], "neck"))
    for p, dp in _BN_DYGRAPH:
        slots.append(_Slot(f"{ours}.bn.{p}", [(f"{pd}.batch_norm.{dp}", "dygraph")], "neck"))


def _ppyolofpn_cfg(i: int, conv_block_num: int, spp: bool, drop_block: bool, coord_conv: bool) -> List[Tuple[str, str]]:
    """``(name, kind)`` of level ``i``'s layers as PaddleDetection ``PPYOLOFPN.__init__`` builds its ``cfg``
    (``conv_module`` layers, then the tip last); kind is ``coord``, ``conv``, ``spp`` or ``dropblock``."""
    layer = "coord" if coord_conv else "conv"      # ConvLayer = CoordConv if coord_conv else ConvBNLayer
    base: List[Tuple[str, str]] = []
    for j in range(conv_block_num):
        base += [(f"conv{2 * j}", layer), (f"conv{2 * j + 1}", "conv")]
    base += [("route", layer), ("tip", layer)]
    drop = [("dropblock", "dropblock")] if drop_block else []
    if conv_block_num == 2:
        if i == 0:
            return base[0:3] + ([("spp", "spp")] if spp else []) + base[3:4] + drop + base[4:6]
        return base[0:2] + drop + base[2:6]
    if conv_block_num == 0:
        return ([("spp", "spp")] if spp and i == 0 else []) + drop + base
    raise ValueError(f"PaddleDetection's PPYOLOFPN layout is known for conv_block_num 0 and 2, got {conv_block_num}")


def _kind(m: nn.Module) -> str:
    if isinstance(m, CoordConv):
        return "coord"
    if isinstance(m, SPP):
        return "spp"
    if isinstance(m, DropBlock):
        return "dropblock"
    if isinstance(m, ConvBNLayer):
        return "conv"
    return type(m).__name__


def _neck_unit(slots: List[_Slot], ours: str, pd: str, m: nn.Module) -> None:
    k = _kind(m)
    if k == "coord":                                   # CoordConv.conv = darknet ConvBNLayer(ch_in + 2, ...)
        _darknet_unit(slots, ours + ".conv", pd + ".conv", m.conv)
    elif k == "spp":                                   # SPP.conv = darknet ConvBNLayer(4 ch_in, ch_out, 1)
        _darknet_unit(slots, ours + ".conv", pd + ".conv", m.conv)
    elif k == "conv":
        _darknet_unit(slots, ours, pd, m)
    elif k == "dropblock":
        if any(True for _ in m.parameters()) or any(True for _ in m.buffers()):
            raise ValueError(f"{ours} (DropBlock) has tensors; PaddleDetection's DropBlock has none")
    else:
        raise ValueError(f"{ours} is a {k}, which PaddleDetection's PPYOLOFPN does not have")


def _check_model(model: nn.Module) -> None:
    from .head import YOLOv3Head
    from .neck import PPYOLOFPN
    from .resnet_vd import ResNetVd
    if not (isinstance(getattr(model, "backbone", None), ResNetVd)
            and isinstance(getattr(model, "neck", None), PPYOLOFPN)
            and isinstance(getattr(model, "head", None), YOLOv3Head) and hasattr(model, "meta")):
        raise TypeError(f"expected a gnetmdk PPYOLO (ResNetVd backbone, PPYOLOFPN neck, YOLOv3Head), got "
                        f"{type(model).__name__}")
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    if linears:
        raise ValueError(f"the model has Linear layers ({linears[:3]}); Paddle stores Linear weights transposed "
                         f"((in, out)) and this mapping copies conv weights only, so it refuses rather than copy "
                         f"them untransposed")


def _slots(model: nn.Module) -> List[_Slot]:
    _check_model(model)
    meta = model.meta()
    slots: List[_Slot] = []
    bb = model.backbone
    if len(bb.stem) != 3:
        raise ValueError("the backbone stem is not the ResNet-vd 3-conv stem (PaddleDetection conv1.conv1_1..3)")
    for i, unit in enumerate(bb.stem):                 # ResNet(variant='d') conv_def: conv1_1, conv1_2, conv1_3
        _backbone_unit(slots, f"backbone.stem.{i}", f"conv1.conv1_{i + 1}", f"conv1_{i + 1}", unit)
    for s, stage in enumerate(bb.stages):
        n = s + 2
        count = len(stage)
        for b, block in enumerate(stage):
            blk = _block_name(n, count, b)
            ours, dyn = f"backbone.stages.{s}.{b}", f"res{n}.{blk}"
            for br in ("branch2a", "branch2b", "branch2c"):
                if hasattr(block, br):
                    _backbone_unit(slots, f"{ours}.{br}", f"{dyn}.{br}", f"{blk}_{br}", getattr(block, br))
            short = block.short
            if short is None:
                continue
            if isinstance(short, nn.Sequential):       # ResNet-D: Sequential(pool, conv) -> short.conv
                if len(short) != 2 or not isinstance(short[0], nn.AvgPool2d):
                    raise ValueError(f"{ours}.short is not (AvgPool2d, ConvBNLayer) as PaddleDetection's 'd' shortcut")
                _backbone_unit(slots, f"{ours}.short.1", f"{dyn}.short.conv", f"{blk}_branch1", short[1])
            else:
                _backbone_unit(slots, f"{ours}.short", f"{dyn}.short", f"{blk}_branch1", short)
    neck = model.neck
    for i, block in enumerate(neck.blocks):
        cfg = _ppyolofpn_cfg(i, meta["conv_block_num"], meta["spp"], meta["drop_block"], meta["coord_conv"])
        ours_layers = [(name, _kind(m)) for name, m in block.body.named_children()] + [("tip", _kind(block.tip))]
        if ours_layers != cfg:
            raise ValueError(f"neck level {i}: our layers {ours_layers} differ from PaddleDetection PPYOLOFPN's "
                             f"{cfg}; the weights cannot be mapped by structure")
        for name, m in block.body.named_children():
            _neck_unit(slots, f"neck.blocks.{i}.body.{name}", f"neck.yolo_block.{i}.conv_module.{name}", m)
        _neck_unit(slots, f"neck.blocks.{i}.tip", f"neck.yolo_block.{i}.tip", block.tip)
    for i, tr in enumerate(neck.transitions):
        _darknet_unit(slots, f"neck.transitions.{i}", f"neck.yolo_transition.{i}", tr)
    for i, conv in enumerate(model.head.outputs):
        if not isinstance(conv, nn.Conv2d) or conv.kernel_size != (1, 1) or conv.bias is None:
            raise ValueError(f"head.outputs.{i} is not a 1x1 conv with bias (PaddleDetection yolo_output.{i})")
        for p in ("weight", "bias"):
            slots.append(_Slot(f"head.outputs.{i}.{p}", [(f"yolo_head.yolo_output.{i}.{p}", "dygraph")], "head",
                               kind="head", level=i))
    return slots


def paddle_names(model: nn.Module) -> Dict[str, List[str]]:
    """For every tensor of ``model.state_dict()`` but ``num_batches_tracked``: the Paddle names it is read
    from, in preference order (PaddleDetection 2.x name first; module docstring for the rules).

    Args:
        model: a :class:`~.model.PPYOLO`.

    Returns:
        ``{model key: [paddle name, ...]}`` in model order.

    Raises:
        TypeError: not a PPYOLO. ValueError: a module layout PaddleDetection does not have (the
            mapping would be a guess), or a Linear layer.
    """
    return OrderedDict((s.key, [n for n, _ in s.candidates]) for s in _slots(model))


# --------------------------------------------------------------------------------------- class surgery
def rebuild_class_rows(src: np.ndarray, dst: torch.Tensor, num_anchors: int, iou_aware: bool,
                       class_rows: str = "keep") -> Tuple[torch.Tensor, int, int]:
    """Rebuild one level of PaddleDetection ``YOLOv3Head`` output rows for another class count.

    Row layout (``yolo_head.py`` ``YOLOv3Head``; our :mod:`~.head`): ``[iou_0 .. iou_{na-1}]`` (with
    ``iou_aware``), then per anchor ``a``: ``[x, y, w, h, obj, cls_0 .. cls_{C-1}]``.

    Args:
        src: Paddle ``yolo_output.{i}.weight`` ``(na * (5 + C [+ 1]), cin, 1, 1)`` or ``.bias`` ``(rows,)``.
        dst: the model's tensor of the same level, ``(na * (5 + N [+ 1]), ...)``; it supplies the
            initial values of every row not copied (not modified).
        num_anchors: ``na``; iou_aware: whether the IoU rows lead.
        class_rows: ``"keep"`` (default): the class rows of the first ``min(C, N)`` classes are copied and
            classes ``C .. N-1`` keep ``dst``'s (the model head's) initialisation. ``"init"``: no class
            row is copied. Kept rows are trained COCO (or source-dataset) classifiers: on another
            dataset they stand for *other* classes and have no meaning for its classes (miemiedetection's
            converter re-initialises them instead); they only start the class logits at trained
            magnitudes on features the rest of the detector already uses. Box, objectness and IoU rows
            are always copied.

    Returns:
        ``(tensor of dst's shape and dtype, C, number of class rows copied per anchor)``.

    Raises:
        ValueError: rows that are not ``na * (5 + C [+ 1])`` with ``C >= 1``, other dimensions that
            differ, or an unknown ``class_rows``.
    """
    if class_rows not in _CLASS_ROWS:
        raise ValueError(f"class_rows must be one of {_CLASS_ROWS}, got {class_rows!r}")
    extra = 1 if iou_aware else 0
    rows, rows_t = int(src.shape[0]), int(dst.shape[0])
    if rows % num_anchors or rows // num_anchors - 5 - extra < 1:
        raise ValueError(f"{rows} output rows cannot be {num_anchors} anchors x (5 + C{' + 1' if extra else ''})")
    if rows_t % num_anchors or rows_t // num_anchors - 5 - extra < 1:
        raise ValueError(f"model rows {rows_t} are not {num_anchors} anchors x (5 + N{' + 1' if extra else ''})")
    if tuple(src.shape[1:]) != tuple(dst.shape[1:]):
        raise ValueError(f"input dimensions differ: Paddle {tuple(src.shape)} vs model {tuple(dst.shape)}")
    c_src = rows // num_anchors - 5 - extra
    c_dst = rows_t // num_anchors - 5 - extra
    k = min(c_src, c_dst) if class_rows == "keep" else 0
    s = torch.as_tensor(np.ascontiguousarray(src)).to(dst.dtype)
    out = dst.detach().clone()
    off = num_anchors if iou_aware else 0
    out[:off] = s[:off]
    for a in range(num_anchors):
        bs, bd = off + a * (5 + c_src), off + a * (5 + c_dst)
        out[bd: bd + 5] = s[bs: bs + 5]
        out[bd + 5: bd + 5 + k] = s[bs + 5: bs + 5 + k]
    return out, c_src, k


# ------------------------------------------------------------------------------------------- convert
def _unbuilt_stage_patterns(n_built: int) -> List["re.Pattern"]:
    stages = "".join(str(n) for n in range(n_built + 2, 6))
    if not stages:
        return []
    return [re.compile(rf"^(backbone\.)?res[{stages}]\."), re.compile(rf"^(res|bn)[{stages}][a-z]")]


_CLASSIFIER = re.compile(r"^(backbone\.)?(fc|out)([._]|$)")


def convert_paddle_state(params: Mapping[str, np.ndarray], model: nn.Module, num_classes: Optional[int] = None,
                         only_backbone: bool = False, *, class_rows: str = "keep"
                         ) -> Tuple["OrderedDict[str, torch.Tensor]", ConversionReport]:
    """Map Paddle PP-YOLO weights onto ``model``'s state dict (module docstring for the names).

    Args:
        params: ``{paddle name: numpy array}`` (:func:`gnetmdk.checkpoint.paddle.read_paddle_params`).
        model: a :class:`~.model.PPYOLO` built with the architecture of the weights (``ppyolo_r50vd()``
            for ``ppyolo_r50vd_dcn_*``, ``ppyolo_r18vd()`` for ``ppyolo_r18vd_coco``) and, with
            ``num_classes``, that many classes. It is not modified.
        num_classes: ``None``: the head must have the file's class count (else its tensors are
            reported as mismatched). ``N``: the head's class-dependent rows are rebuilt for N classes
            (:func:`rebuild_class_rows`; ``model.num_classes`` must be N).
        only_backbone: take the backbone only (ImageNet-pretrained or detector files): the neck and
            head keep the model's initialisation (``report.kept_init``); the file's neck / head /
            classifier tensors and stages the model does not build are ``report.ignored``; DCN offset
            convs absent from the file keep their zero initialisation.
        class_rows: used with ``num_classes``: ``"keep"`` (the choice here: class rows of the first
            ``min(C, N)`` file classes copied, which mean the *file's* classes, not the new dataset's)
            or ``"init"`` (all class rows from the model head's initialisation); :func:`rebuild_class_rows`.

    Returns:
        ``(state_dict, report)``: ``state_dict`` has every key of ``model.state_dict()`` in its order
        (mapped tensors as new tensors of the model's dtype, the rest the model's own tensors,
        ``num_batches_tracked`` included), ready for ``model.load_state_dict(state_dict, strict=True)``;
        :class:`ConversionReport` (``report.ok``, ``report.format()``).

    Raises:
        TypeError: not a PPYOLO. ValueError: ``num_classes`` differs from ``model.num_classes``, an
            unknown ``class_rows``, a Linear layer in the model, or a module layout that differs from
            PaddleDetection's (no mapping by structure possible).
    """
    if class_rows not in _CLASS_ROWS:
        raise ValueError(f"class_rows must be one of {_CLASS_ROWS}, got {class_rows!r}")
    slots = _slots(model)
    if num_classes is not None and int(num_classes) != int(model.num_classes):
        raise ValueError(f"num_classes={num_classes} but the model has {model.num_classes} classes; build the "
                         f"model with num_classes={num_classes} (e.g. ppyolo_r50vd(num_classes={num_classes}))")
    current = model.state_dict()
    out: "OrderedDict[str, torch.Tensor]" = OrderedDict(current.items())
    report = ConversionReport(only_backbone=bool(only_backbone))
    covered = {s.key for s in slots}
    unknown = [k for k in covered if k not in current]
    if unknown:
        raise ValueError(f"internal: mapped keys {unknown[:3]} are not in the model's state dict")
    used: Dict[str, str] = {}
    eras = set()
    surgery = {"paddle_classes": set(), "copied": set()}
    iou_aware = bool(model.head.iou_aware)
    for slot in slots:
        if only_backbone and slot.part != "backbone":
            report.kept_init.append(slot.key)
            continue
        found = [(n, era) for n, era in slot.candidates if n in params]
        if not found:
            if only_backbone and slot.kind == "dcn_offset":
                report.kept_init.append(slot.key)
            else:
                report.missing.append(slot.key)
            continue
        name, era = found[0]
        used[name] = slot.key               # matched by name; shape / dtype checked next
        arr = params[name]
        target = current[slot.key]
        arr_shape = tuple(int(d) for d in np.shape(arr))
        if not isinstance(arr, np.ndarray) or arr.dtype.kind != "f":
            report.mismatched.append((name, slot.key, arr_shape, tuple(target.shape)))
            continue
        bad = int(arr.size - np.isfinite(arr).sum())
        if bad:
            report.nonfinite.append((name, bad))
        if slot.kind == "head" and num_classes is not None:
            try:
                tensor, c_src, k = rebuild_class_rows(arr, target, model.head.num_anchors[slot.level], iou_aware,
                                                      class_rows)
            except ValueError:
                report.mismatched.append((name, slot.key, arr_shape, tuple(target.shape)))
                continue
            surgery["paddle_classes"].add(c_src)
            surgery["copied"].add(k)
        elif arr_shape != tuple(target.shape):
            report.mismatched.append((name, slot.key, arr_shape, tuple(target.shape)))
            continue
        else:
            tensor = torch.tensor(np.ascontiguousarray(arr), dtype=target.dtype)
        out[slot.key] = tensor
        report.matched.append((name, slot.key))
        eras.add(era)
    # model tensors no slot covers (a module the mapping does not know): reported, never silently kept
    for k in current:
        if k not in covered and not k.endswith("num_batches_tracked"):
            (report.kept_init if only_backbone and not k.startswith("backbone.") else report.missing).append(k)
    stage_pats = _unbuilt_stage_patterns(len(model.backbone.stages)) if only_backbone else []
    for name in params:
        if name in used:
            continue
        leftover = only_backbone and (name.startswith(("neck.", "yolo_head.")) or _CLASSIFIER.match(name)
                                      or any(p.match(name) for p in stage_pats))
        (report.ignored if leftover else report.unmatched).append(name)
    report.naming = sorted(eras)
    if num_classes is not None and surgery["paddle_classes"]:
        pc = sorted(surgery["paddle_classes"])
        if len(pc) > 1:                  # levels disagree on the class count: not one head, keep none of it
            for name, key in [mk for mk in report.matched if mk[1].startswith("head.")]:
                report.matched.remove((name, key))
                report.mismatched.append((name, key, tuple(np.shape(params[name])), tuple(current[key].shape)))
                out[key] = current[key]
        else:
            report.class_surgery = {"paddle_classes": pc[0], "num_classes": int(num_classes),
                                    "class_rows": class_rows, "copied_class_rows": max(surgery["copied"])}
    return out, report
