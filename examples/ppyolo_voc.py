"""PP-YOLO ResNet50-vd (PaddleDetection's ppyolo_r50vd_dcn) on Pascal VOC 2012 in COCO json, the recipe
of the PP-YOLO alignment notes: batch 8, learning rate 0.0004 (0.00005 per image), momentum SGD with
L2 5e-4, 714 warm-up steps (one epoch of voc2012_train.json at batch 8) from half the rate.

    # PaddleDetection's voc2012_train.json / voc2012_val.json as they are, or written from the VOC
    # folder (then: train_json data/meta/voc2012_train.json val_json data/meta/voc2012_valid.json)
    python3 tools/xml_2_json.py --config examples/ppyolo_voc.py
    python3 tools/convert_weights.py -f examples/ppyolo_voc.py -c ppyolo_r50vd_dcn_2x_coco.pdparams \
        -oc checkpoint/ppyolo_r50vd.pth -nc 20
    python3 train.py --config examples/ppyolo_voc.py --step 1 load checkpoint/ppyolo_r50vd.pth
    python3 train-dist.py --config examples/ppyolo_voc.py --gpus 2 --step 1 load checkpoint/ppyolo_r50vd.pth

For alignment runs (one process against many, a run against its replay) add ``--deterministic``
(augmentation and DropBlock off, one training size) and ``ppyolo.freeze_at 3`` (the whole backbone
frozen, as the notes do). The number of epochs and the decay milestones are ours: the notes do not
give them (PaddleDetection's COCO schedule decays at 77% and 93% of training).

This model stays float: its deformable convs and CoordConv have no integer form here, so steps 2-4
are refused (docs/ppyolo.md, "Quantized stages"); r18vd (examples/ppyolo_cards.py) goes through them.
"""
from gnetmdk.config import BaseConfig


class Config(BaseConfig):
    model_name = "ppyolo"
    DEFAULT_STEP = 1
    DS_NAME = "voc2012"
    VOC_CLASSES = ["aeroplane", "bicycle", "bird", "boat", "bottle", "bus", "car", "cat", "chair", "cow",
                   "diningtable", "dog", "horse", "motorbike", "person", "pottedplant", "sheep", "sofa",
                   "train", "tvmonitor"]
    dataset_path = "data/voc2012"        # the VOC folder: JPEGImages/ and Annotations/
    train_json = "data/voc2012/voc2012_train.json"
    val_json = "data/voc2012/voc2012_val.json"
    image_size = 608
    ppyolo = dict(depth=50)              # the section's defaults are ppyolo_r50vd_dcn (sizes 320..608, Mixup)
    batch_size = 8
    optimizer = "sgd"
    learning_rate = 0.0004
    momentum = 0.9
    nesterov = False                     # PaddleDetection's Momentum optimizer is plain momentum
    weight_decay = 5e-4
    grad_clip = 0.0                      # PaddleDetection's PP-YOLO clips nothing
    lr_scheduler = "multistep"
    num_epochs = 40
    lr_milestones = [31, 37]
    lr_gamma = 0.1
    warmup_epochs = 1.0                  # 714 steps of batch 8 on voc2012_train.json (5717 images)
    warmup_factor = 0.5
    ema = True
    ema_decay = 0.9998                   # PaddleDetection's PP-YOLO EMA decay
    eval_coco = True
    eval_interval = 5
    num_workers = 4
