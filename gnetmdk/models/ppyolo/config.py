"""PP-YOLO's config section (``cfg.ppyolo``): architecture, loss, decoding and its data pipeline. Plain
typed fields, no torch. The defaults are the paper's model (PaddleDetection ``ppyolo_r50vd_dcn``);
:data:`R18VD` holds the CPU-sized model's architecture (PaddleDetection ``ppyolo_r18vd``)::

    from gnetmdk.models.ppyolo.config import R18VD

    class Config(BaseConfig):
        model_name = "ppyolo"
        image_size = 320                      # the evaluation size; training draws train_sizes
        ppyolo = dict(R18VD, train_sizes=[256, 288, 320, 352, 384])
"""
from __future__ import annotations

from typing import List

from gnetmdk.config.base import ConfigError, ConfigSection, register_section

#: YOLOv3's nine COCO anchors, (w, h) in input pixels of 608-px training (the PP-YOLO default)
COCO_ANCHORS = [[10, 13], [16, 30], [33, 23], [30, 61], [62, 45], [59, 119], [116, 90], [156, 198], [373, 326]]


class PPYOLOConfig(ConfigSection):
    """PP-YOLO's fields (gnetmdk.models.ppyolo; PaddleDetection configs/ppyolo)."""

    # ---------------------------------------------------------------- architecture (gnetmdk.models.ppyolo.model.PPYOLO)
    depth: int = 50                          # ResNet-vd depth: 18, 34 or 50
    return_idx: List[int] = [1, 2, 3]        # backbone stages feeding the neck (the detection levels)
    dcn_v2_stages: List[int] = [3]           # stages whose 3x3 convs are deformable (DCNv2)
    freeze_at: int = -1                      # -1: nothing frozen; k: the stem and stages 0..k frozen
    freeze_norm: bool = False                # BatchNorm statistics and affine parameters frozen
    coord_conv: bool = True
    coord_range: str = "full"                # CoordConv channels: "full" [-1, 1] (the paper), "paddle"
                                             # [-1, -0.5] (PaddleDetection's add_coord since 2021)
    spp: bool = True
    drop_block: bool = True                  # DropBlock in the neck (off in --deterministic runs)
    block_size: int = 3
    keep_prob: float = 0.9
    conv_block_num: int = 2
    anchors: List[List[int]] = COCO_ANCHORS  # (w, h) in input pixels (of 608-px training)
    anchor_masks: List[List[int]] = [[6, 7, 8], [3, 4, 5], [0, 1, 2]]   # per level, deepest first
    iou_aware: bool = True
    iou_aware_factor: float = 0.4

    # ---------------------------------------------------------------- loss and decoding
    ignore_thresh: float = 0.7
    scale_x_y: float = 1.05                  # grid sensitive
    label_smooth: bool = False
    iou_loss_weight: float = 2.5
    iou_aware_loss_weight: float = 1.0
    obj_prior: float = 0.01                  # initial objectness probability of the head's bias
    nms_post_threshold: float = 0.01         # Matrix NMS: score after decay

    # ---------------------------------------------------------------- data (gnetmdk.dataset.ppyolo_dataset)
    train_sizes: List[int] = [320, 352, 384, 416, 448, 480, 512, 544, 576, 608]   # one drawn per global batch
    random_interp: bool = True               # an interpolation drawn per global batch, as PaddleDetection
    mixup_epochs: int = 1000000              # Mixup for the first N epochs (PaddleDetection: always)
    mixup_alpha: float = 1.5
    mixup_beta: float = 1.5
    max_boxes: int = 50                      # padded ground truth rows per image
    # ---------------------------------------------------------------- quantized stages (gnetmdk.intq)
    weight_bits: int = 8                     # conv weights from step 2: symmetric, per output channel, 4..8
    weight_scale: str = "max"                # per-channel scale: "max" (max |W|) or "mse" (least squared error)
    act_method: str = "mse"                  # cal: activation ranges by "mse", "percentile" or "minmax"
    act_percentile: float = 99.99            # for act_method "percentile"
    requant: str = "fixed"                   # step 4's conv requantization: "fixed" (integer multiplier and shift)
                                             # or "float" (as onnxruntime's QLinearConv; docs/ppyolo.md, QDQ export)


register_section("ppyolo", PPYOLOConfig)

#: the CPU-sized model: PaddleDetection's ppyolo_r18vd (2 levels with its own 6 anchors, a light neck)
R18VD = dict(depth=18, return_idx=[2, 3], dcn_v2_stages=[], coord_conv=False, spp=False, drop_block=True,
             conv_block_num=0, anchors=[[10, 14], [23, 27], [37, 58], [81, 82], [135, 169], [344, 319]],
             anchor_masks=[[3, 4, 5], [0, 1, 2]], iou_aware=False)


def check_ppyolo_config(cfg) -> None:
    """Refuse PP-YOLO values out of range, naming the field (``ppyolo.<field>``) and the fix.

    Raises:
        ConfigError
    """
    p = cfg.ppyolo

    def bad(field: str, msg: str) -> None:
        raise ConfigError(f"config field 'ppyolo.{field}' = {getattr(p, field)!r}: {msg}")

    if p.coord_range not in ("full", "paddle"):
        bad("coord_range", '"full" ([-1, 1], the paper) or "paddle" ([-1, -0.5], PaddleDetection since 2021)')
    if p.depth not in (18, 34, 50):
        bad("depth", "ResNet-vd depth must be 18, 34 or 50")
    if not p.return_idx or any(i not in (0, 1, 2, 3) for i in p.return_idx) or sorted(p.return_idx) != p.return_idx:
        bad("return_idx", "backbone stages in 0..3, ascending (e.g. [1, 2, 3])")
    if len(p.anchor_masks) != len(p.return_idx):
        bad("anchor_masks", f"one mask per detection level: {len(p.return_idx)} levels (return_idx)")
    flat = sorted(i for m in p.anchor_masks for i in m)
    if flat != list(range(len(p.anchors))):
        bad("anchor_masks", f"the masks must use each of the {len(p.anchors)} anchors once")
    if any(len(a) != 2 or min(a) <= 0 for a in p.anchors):
        bad("anchors", "(w, h) pairs of positive pixels")
    stride = 2 ** (max(p.return_idx) + 2)
    for size in list(p.train_sizes) + [cfg.image_size]:
        if size % stride or size < stride:
            raise ConfigError(f"config field 'image_size' / 'ppyolo.train_sizes' holds {size}: PP-YOLO sizes must be "
                              f"multiples of the deepest stride {stride}")
    if not p.train_sizes:
        bad("train_sizes", "at least one training size (pixels)")
    if not 0 < p.keep_prob <= 1:
        bad("keep_prob", "must be in (0, 1]")
    if not 0 < p.ignore_thresh <= 1:
        bad("ignore_thresh", "must be in (0, 1]")
    if p.max_boxes < 1:
        bad("max_boxes", "must be at least 1")
    if p.freeze_at < -1 or p.freeze_at > 3:
        bad("freeze_at", "-1 (nothing) or a stage 0..3")
    if not isinstance(p.weight_bits, int) or not 4 <= p.weight_bits <= 8:
        bad("weight_bits", "an int in 4..8 (bits per conv weight from step 2)")
    if p.weight_scale not in ("max", "mse"):
        bad("weight_scale", '"max" or "mse"')
    if p.requant not in ("fixed", "float"):
        bad("requant", '"fixed" (integer multiplier and shift) or "float" (the QDQ runtimes\' float32 multiplier)')
    if p.act_method not in ("mse", "percentile", "minmax"):
        bad("act_method", '"mse", "percentile" or "minmax"')
    if not 50.0 < p.act_percentile <= 100.0:
        bad("act_percentile", "a percentile in (50, 100]")
    if cfg.stage_name != "step1":
        from .quant import quant_limits
        limits = quant_limits(p.dcn_v2_stages, p.coord_conv)
        if limits:
            raise ConfigError(f"PP-YOLO {cfg.stage_name} quantizes the model to integers, which this architecture "
                              "cannot take: " + "; ".join(limits))
