"""PP-YOLO (Long et al., "PP-YOLO: An Effective and Efficient Implementation of Object Detector",
arXiv 2007.12099): ResNet-vd backbone + PP-YOLO FPN + YOLOv3 head, with the loss and the
Matrix-NMS decoder, built from plain keyword arguments.

Presets (PaddleDetection ``configs/ppyolo/_base_/``):

* :data:`PPYOLO_R50VD` / :func:`ppyolo_r50vd` -- ``ppyolo_r50vd_dcn.yml``, the paper's model at 608 px:
  ResNet50-vd with DCNv2 in the last stage, 3 levels (strides 32, 16, 8), CoordConv, SPP, DropBlock,
  IoU loss, IoU-aware branch, grid sensitive 1.05, Matrix NMS.
* :data:`PPYOLO_R18VD` / :func:`ppyolo_r18vd` -- ``ppyolo_r18vd.yml``, the CPU-sized model: ResNet18-vd
  (no DCN), 2 levels (strides 32, 16) with that config's own 6 anchors, light neck (no conv pairs,
  ``conv_block_num=0``), DropBlock, IoU loss, no CoordConv / SPP / IoU-aware. Chosen over a narrowed
  3-level r50vd because it is a model PaddleDetection trains and reports (29.2 COCO AP at 512), and
  at 320 px (10x10 and 20x20 grids, 13.1 M parameters with 80 classes) one training step of a batch
  of 2 (forward, loss, backward, SGD step) took 0.4 s on one CPU thread of the development machine.
  PaddleDetection trains it at 320..608 and evaluates at 512; :data:`PRESET_INPUT_SIZE` holds 320.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence

import torch
from torch import nn

from .config import COCO_ANCHORS
from .head import YOLOv3Head
from .loss import YOLOv3Loss, validate_anchors
from .neck import DropBlock, PPYOLOFPN
from .postprocess import postprocess
from .resnet_vd import ResNetVd

__all__ = ["PPYOLO", "PPYOLO_R50VD", "PPYOLO_R18VD", "PRESET_INPUT_SIZE", "ppyolo_r50vd", "ppyolo_r18vd",
           "IMAGENET_MEAN", "IMAGENET_STD"]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


#: keyword arguments of the paper's PP-YOLO (ppyolo_r50vd_dcn.yml), 80 COCO classes
PPYOLO_R50VD: Dict[str, object] = dict(
    num_classes=80, depth=50, return_idx=[1, 2, 3], dcn_v2_stages=[3], freeze_at=-1, freeze_norm=False,
    coord_conv=True, spp=True, drop_block=True, block_size=3, keep_prob=0.9, conv_block_num=2,
    anchors=COCO_ANCHORS, anchor_masks=[[6, 7, 8], [3, 4, 5], [0, 1, 2]], iou_aware=True,
    iou_aware_factor=0.4, iou_loss_weight=2.5, iou_aware_loss_weight=1.0)

#: keyword arguments of PaddleDetection's ppyolo_r18vd.yml, 80 COCO classes
PPYOLO_R18VD: Dict[str, object] = dict(
    num_classes=80, depth=18, return_idx=[2, 3], dcn_v2_stages=[], freeze_at=-1, freeze_norm=False,
    coord_conv=False, spp=False, drop_block=True, block_size=3, keep_prob=0.9, conv_block_num=0,
    anchors=[[10, 14], [23, 27], [37, 58], [81, 82], [135, 169], [344, 319]],
    anchor_masks=[[3, 4, 5], [0, 1, 2]], iou_aware=False, iou_loss_weight=2.5)

#: training / evaluation input side (pixels) used with each preset here
PRESET_INPUT_SIZE = {"ppyolo_r50vd": 608, "ppyolo_r18vd": 320}


def ppyolo_r50vd(**overrides) -> "PPYOLO":
    """The paper's PP-YOLO (:data:`PPYOLO_R50VD`), keyword overrides applied (e.g. ``num_classes=20``)."""
    return PPYOLO(**{**PPYOLO_R50VD, **overrides})


def ppyolo_r18vd(**overrides) -> "PPYOLO":
    """PaddleDetection's PP-YOLO r18vd (:data:`PPYOLO_R18VD`), keyword overrides applied."""
    return PPYOLO(**{**PPYOLO_R18VD, **overrides})


class PPYOLO(nn.Module):
    """PP-YOLO detector. Defaults are the paper's r50vd model (:data:`PPYOLO_R50VD`).

    Args:
        num_classes: C >= 1.
        depth, return_idx, dcn_v2_stages, freeze_at, freeze_norm: backbone
            (:class:`~.resnet_vd.ResNetVd`); the returned stages are the detection levels.
        coord_conv, spp, drop_block, block_size, keep_prob, conv_block_num, neck_channels,
            route_channels: neck (:class:`~.neck.PPYOLOFPN`; widths deepest first, ``None`` =
            PaddleDetection's formulas).
        anchors: (w, h) pairs in input pixels (608-px COCO anchors by default).
        anchor_masks: anchor indices per level, deepest first; one mask per returned stage.
        iou_aware, iou_aware_factor: IoU-aware branch and its rescoring exponent (0.4).
        obj_prior: initial objectness probability of the head biases (0.01; ``None``: Paddle's 0).
        ignore_thresh, scale_x_y, label_smooth, iou_thresh, iou_loss_weight, iou_loss_square,
            iou_aware_loss_weight: loss (:class:`~.loss.YOLOv3Loss`).
        obj_thresh: decoder objectness threshold (PaddleDetection ``YOLOBox.conf_thresh``, 0.01).
        nms_post_threshold, nms_top_k, use_gaussian, gaussian_sigma: Matrix NMS settings
            (0.01, -1, False, 2.0); the score threshold and keep_top_k come from :meth:`decode`.
        coord_range: CoordConv channel range, "full" [-1, 1] or "paddle" [-1, -0.5] (PaddleDetection's
            ``add_coord`` since 2021; :func:`~.neck.coord_channels`).
        quant: None (float model), or ``{"weight_bits": b, "weight_scale": "max" | "mse"[, "requant":
            "fixed" | "float"]}``: the folded,
            quantizable structure of stages 2..4 (:meth:`prepare_quant` without folding: the layout of
            a quantized checkpoint, whose state dict then gives the weights and ranges).

    Input: ``(N, 3, H, W)`` float RGB pixel values 0..255, H and W multiples of the deepest stride
    (32 for both presets). The model normalises inside: ``(x / 255 - mean) / std`` with ImageNet
    mean/std (non-persistent buffers ``pixel_mean``, ``pixel_std``, shape (1, 3, 1, 1)).

    Initialisation: every conv Paddle-default Normal(0, sqrt(2 / fan_in)) with zero bias, BatchNorm
    1 / 0, DCN offset predictors 0 (PaddleDetection), head objectness bias ``logit(obj_prior)``
    (a departure from PaddleDetection's 0, which starts training from scratch with an objectness
    loss of ~0.69 per slot, 16k slots at 608 px). All draws use torch's global generator, so
    ``torch.manual_seed(s)`` before construction gives the same weights every time.

    Raises:
        ValueError: unknown depth, bad stage indices, anchors and masks that do not match the
            levels, bad neck widths or DropBlock settings (message names the value and the fix).
    """

    def __init__(self, num_classes: int = 80, depth: int = 50, return_idx: Sequence[int] = (1, 2, 3),
                 dcn_v2_stages: Sequence[int] = (3,), freeze_at: int = -1, freeze_norm: bool = False,
                 coord_conv: bool = True, spp: bool = True, drop_block: bool = True, block_size: int = 3,
                 keep_prob: float = 0.9, conv_block_num: int = 2, neck_channels: Optional[Sequence[int]] = None,
                 route_channels: Optional[Sequence[int]] = None,
                 anchors: Sequence[Sequence[float]] = tuple(map(tuple, COCO_ANCHORS)),
                 anchor_masks: Sequence[Sequence[int]] = ((6, 7, 8), (3, 4, 5), (0, 1, 2)),
                 iou_aware: bool = True, iou_aware_factor: float = 0.4, obj_prior: Optional[float] = 0.01,
                 ignore_thresh: float = 0.7, scale_x_y: float = 1.05, label_smooth: bool = False,
                 iou_thresh: float = 1.0, iou_loss_weight: float = 2.5, iou_loss_square: bool = True,
                 iou_aware_loss_weight: float = 1.0, obj_thresh: float = 0.01, nms_post_threshold: float = 0.01,
                 nms_top_k: int = -1, use_gaussian: bool = False, gaussian_sigma: float = 2.0,
                 coord_range: str = "full", quant: Optional[Dict[str, object]] = None):
        super().__init__()
        if not isinstance(num_classes, int) or num_classes < 1:
            raise ValueError(f"num_classes must be a positive int, got {num_classes!r}")
        self.backbone = ResNetVd(depth, return_idx, freeze_at, freeze_norm, dcn_v2_stages)
        n_levels = len(self.backbone.return_idx)
        anchors_l, masks_l = validate_anchors(anchors, anchor_masks, n_levels)
        self.strides = self.backbone.out_strides[::-1]                 # deepest first
        self.neck = PPYOLOFPN(self.backbone.out_channels, coord_conv, spp, drop_block, block_size, keep_prob,
                              conv_block_num, neck_channels, route_channels, coord_range)
        self.head = YOLOv3Head(self.neck.out_channels, [len(m) for m in masks_l], num_classes, iou_aware, obj_prior)
        self.loss_fn = YOLOv3Loss(anchors_l, masks_l, self.strides, num_classes, ignore_thresh, scale_x_y,
                                  label_smooth, iou_loss_weight, iou_loss_square, iou_aware, iou_aware_loss_weight,
                                  iou_thresh)
        self.register_buffer("pixel_mean", torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("pixel_std", torch.tensor(IMAGENET_STD).view(1, 3, 1, 1), persistent=False)
        self.num_classes = num_classes
        self.anchors, self.anchor_masks = anchors_l, masks_l
        self._meta = dict(
            num_classes=int(num_classes), depth=int(depth), return_idx=list(self.backbone.return_idx),
            dcn_v2_stages=list(self.backbone.dcn_v2_stages), freeze_at=int(freeze_at), freeze_norm=bool(freeze_norm),
            coord_conv=bool(coord_conv), spp=bool(spp), drop_block=bool(drop_block), block_size=int(block_size),
            keep_prob=float(keep_prob), conv_block_num=int(conv_block_num),
            neck_channels=list(self.neck.channels), route_channels=list(self.neck.route_channels),
            anchors=[list(a) for a in anchors_l], anchor_masks=[list(m) for m in masks_l], iou_aware=bool(iou_aware),
            iou_aware_factor=float(iou_aware_factor), obj_prior=None if obj_prior is None else float(obj_prior),
            ignore_thresh=float(ignore_thresh), scale_x_y=float(scale_x_y), label_smooth=bool(label_smooth),
            iou_thresh=float(iou_thresh), iou_loss_weight=float(iou_loss_weight),
            iou_loss_square=bool(iou_loss_square), iou_aware_loss_weight=float(iou_aware_loss_weight),
            obj_thresh=float(obj_thresh), nms_post_threshold=float(nms_post_threshold), nms_top_k=int(nms_top_k),
            use_gaussian=bool(use_gaussian), gaussian_sigma=float(gaussian_sigma), coord_range=str(coord_range))
        self.qgraph = None              # the gnetmdk.intq graph once quantizable (stages 2..4)
        self.q_weights = False          # fake-quantize conv weights in the forward
        self.q_integer = False          # evaluation runs the integer program (step 4)
        if quant is not None:
            self.prepare_quant(int(quant["weight_bits"]), str(quant["weight_scale"]), fold=False)
            self.set_requant(str(quant.get("requant", "fixed")))

    # ------------------------------------------------------------------ description
    def meta(self) -> Dict[str, object]:
        """Plain-Python description: ``PPYOLO(**{k: v for k, v in meta.items() if k != "name"})`` rebuilds
        the same architecture and settings. Includes ``"name": "ppyolo"``."""
        out = {"name": "ppyolo"}
        for k, v in self._meta.items():
            out[k] = [list(x) if isinstance(x, list) else x for x in v] if isinstance(v, list) else v
        if "quant" in out:
            out["quant"] = dict(out["quant"])
        return out

    # ------------------------------------------------------------------ quantized stages (gnetmdk.intq)
    def prepare_quant(self, weight_bits: int = 8, weight_scale: str = "max", fold: bool = True) -> int:
        """Make the model quantizable (stage 2 on), in place: fold every BatchNorm into its conv
        (``fold``; else only the folded layout, for loading a quantized checkpoint), build its graph
        (:func:`~.quant.ppyolo_graph`) and one uncalibrated activation quantizer per quantization
        point (``self.quant``, in the state dict). Returns the number of BatchNorms folded.

        Args:
            weight_bits: 2..8 bits per conv weight (symmetric, per output channel).
            weight_scale: "max" or "mse" (gnetmdk.intq.fake.weight_scales).

        Raises:
            ValueError: deformable convs or CoordConv (:func:`~.quant.quant_limits`), bad bits or rule.
        """
        from gnetmdk.intq.fake import WEIGHT_SCALES, weight_qmax
        from gnetmdk.intq.graph import make_quantizers
        from .quant import fold_bn_, ppyolo_graph, quant_limits
        limits = quant_limits(self._meta["dcn_v2_stages"], self._meta["coord_conv"])
        if limits:
            raise ValueError("PP-YOLO cannot be quantized: " + "; ".join(limits))
        weight_qmax(weight_bits)
        if weight_scale not in WEIGHT_SCALES:
            raise ValueError(f"weight_scale must be one of {WEIGHT_SCALES}, got {weight_scale!r}")
        if self.qgraph is not None:
            return 0
        n = fold_bn_(self, structure_only=not fold)
        self.qgraph = ppyolo_graph(self)
        self.quant = make_quantizers(self.qgraph).to(self.pixel_mean.device)
        self._meta["quant"] = {"weight_bits": int(weight_bits), "weight_scale": str(weight_scale)}
        return n

    def set_requant(self, mode: str) -> None:
        """Step 4's conv requantization, "fixed" or "float" (gnetmdk.intq.program.REQUANT_MODES),
        recorded in :meth:`meta` so a checkpoint rebuilds with it.

        Raises:
            RuntimeError: the model is not quantizable yet (:meth:`prepare_quant`).
            ValueError: an unknown mode.
        """
        from gnetmdk.intq.program import REQUANT_MODES
        if self.qgraph is None:
            raise RuntimeError("PPYOLO.set_requant before prepare_quant (the float model has no integer form)")
        if mode not in REQUANT_MODES:
            raise ValueError(f"requant must be one of {REQUANT_MODES}, got {mode!r}")
        self._meta["quant"]["requant"] = mode

    def set_quant_mode(self, weights: bool, acts: str, integer: bool) -> None:
        """The quantized stages' switches: ``weights`` fake-quantized; ``acts`` "off", "observe" or
        "fake" (every activation quantizer); ``integer``: evaluation (eval mode) runs the integer
        program, training the fake-quantized graph.

        Raises:
            RuntimeError: the model is not quantizable yet (:meth:`prepare_quant`).
        """
        if self.qgraph is None:
            raise RuntimeError("PPYOLO.set_quant_mode before prepare_quant (the float model has no quantizers)")
        if acts not in ("off", "observe", "fake"):
            raise ValueError(f"acts must be 'off', 'observe' or 'fake', got {acts!r}")
        self.q_weights, self.q_integer = bool(weights), bool(integer)
        for q in self.quant.values():
            q.enable_observer(acts == "observe")
            q.enable_fake_quant(acts == "fake")

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """``(x / 255 - mean) / std`` (float32): the model's input normalisation."""
        return (x / 255.0 - self.pixel_mean) / self.pixel_std

    def integer_program(self) -> Dict[str, object]:
        """The integer model of the current weights and ranges (gnetmdk.intq.program.build_program).

        Raises:
            ProgramError: uncalibrated ranges or values out of the integer ranges.
        """
        from gnetmdk.intq.program import build_program
        q = self._meta["quant"]
        return build_program(self, self.qgraph, self.quant, q["weight_bits"], q["weight_scale"], self.normalize,
                             q.get("requant", "fixed"))

    @property
    def max_stride(self) -> int:
        """The deepest level's stride in pixels; input sides must be multiples of it."""
        return max(self.strides)

    def drop_blocks(self) -> List[DropBlock]:
        """The neck's DropBlock modules."""
        return self.neck.drop_blocks()

    def set_drop_block(self, enabled: bool) -> None:
        """Switch every DropBlock on or off (off: exact identity even in training, for alignment runs)."""
        for m in self.drop_blocks():
            m.enabled = bool(enabled)

    # ------------------------------------------------------------------ compute
    def forward(self, x: torch.Tensor) -> List[torch.Tensor]:
        """Raw head outputs.

        Args:
            x: ``(N, 3, H, W)`` float RGB pixel values 0..255, H and W multiples of :attr:`max_stride`.

        Returns:
            one tensor per level, deepest first: ``(N, na_l * (5 + C [+ 1 with IoU-aware]), H / s_l, W / s_l)``
            (layout in :mod:`~.head`).

        Raises:
            ValueError: not ``(N, 3, H, W)``, or H / W not multiples of the deepest stride.
        """
        if x.dim() != 4 or x.shape[1] != 3:
            raise ValueError(f"PPYOLO expects (N, 3, H, W) RGB images, got shape {tuple(x.shape)}")
        h, w = x.shape[2], x.shape[3]
        s = self.max_stride
        if h % s or w % s or h == 0 or w == 0:
            raise ValueError(f"input size {h}x{w} is not a multiple of the deepest stride {s}; resize or pad to "
                             f"{max(s, math.ceil(h / s) * s)}x{max(s, math.ceil(w / s) * s)}")
        if self.qgraph is not None:
            if self.q_integer and not self.training:
                from gnetmdk.intq.program import run_program
                return run_program(self.integer_program(), x)[0]
            from gnetmdk.intq.graph import run_graph
            q = self._meta["quant"]
            return run_graph(self, self.qgraph, x, self.quant, q["weight_bits"] if self.q_weights else None,
                             q["weight_scale"], self.normalize)
        x = self.normalize(x)
        return self.head(self.neck(self.backbone(x)))

    def loss(self, outputs: Sequence[torch.Tensor], targets: torch.Tensor) -> Dict[str, torch.Tensor]:
        """Loss dict ``{"xy", "wh", "obj", "cls", "iou", "iou_aware", "total"}`` of 0-d tensors.

        Args:
            outputs: :meth:`forward`'s list.
            targets: ``(N, M, 5)`` float32 ``[class, x1, y1, x2, y2]`` relative to the image, class -1
                for padding rows, optionally ``(N, M, 6)`` with the ground-truth (Mixup) score last.
                The image size is read from the outputs (grid x stride).

        See :class:`~.loss.YOLOv3Loss` for every term (batch mean of per-image sums).
        """
        return self.loss_fn(outputs, targets)

    def decode(self, outputs: Sequence[torch.Tensor], conf_thresh: float = 0.01, nms_thresh: Optional[float] = None,
               max_detections: int = 100) -> List[Dict[str, torch.Tensor]]:
        """Detections per image (:func:`~.postprocess.postprocess`).

        Args:
            outputs: :meth:`forward`'s list.
            conf_thresh: Matrix NMS score threshold (a (box, class) pair needs ``score > conf_thresh``;
                PP-YOLO uses 0.01).
            nms_thresh: unused -- Matrix NMS decays scores instead of cutting at an IoU; accepted for
                the common decoder signature.
            max_detections: keep_top_k over all classes (100).

        Returns:
            list of N dicts on the CPU: ``boxes`` ``(K, 4)`` float32 xyxy relative (0..1), ``scores``
            ``(K,)`` float32, ``labels`` ``(K,)`` int64.
        """
        m = self._meta
        return postprocess(outputs, self.anchors, self.anchor_masks, self.strides, self.num_classes,
                           m["scale_x_y"], m["iou_aware"], m["iou_aware_factor"], m["obj_thresh"],
                           score_threshold=conf_thresh, post_threshold=m["nms_post_threshold"],
                           nms_top_k=m["nms_top_k"], keep_top_k=max_detections, use_gaussian=m["use_gaussian"],
                           gaussian_sigma=m["gaussian_sigma"])
