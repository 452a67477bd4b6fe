"""The alignment check against PaddleDetection (docs/alignment.md, "Against PaddleDetection"): PP-YOLO
r18vd as tools/paddle_reference.py builds it in PaddleDetection, replayed on its recorded batches.

    python3 tools/xml_2_txt.py --config examples/ppyolo_align.py
    bash tools/align_paddle.sh paddle-env/bin/python align-out       # reference, convert, replay, verdict

Only what an iteration computes matters here: the model (ppyolo_r18vd, DropBlock off, backbone frozen
as in the PP-YOLO alignment notes), batch 8, momentum SGD with L2 on the conv weights, a constant
learning rate, no EMA. The data come from the recording; the train meta files are read only to build
the trainer.
"""
from gnetmdk.config import BaseConfig
from gnetmdk.models.ppyolo.config import R18VD


class Config(BaseConfig):
    model_name = "ppyolo"
    DEFAULT_STEP = 1
    DS_NAME = "cards"
    VOC_CLASSES = ["nine", "ten", "jack", "queen", "king", "ace"]
    dataset_path = "../shared/data/cards"
    checkpoint_root = "checkpoint/align"
    log_root = "log/align"
    image_size = 320
    ppyolo = dict(R18VD, freeze_at=3, drop_block=False, train_sizes=[320], mixup_epochs=0)
    batch_size = 8
    num_workers = 0
    threads = 2
    num_epochs = 1
    optimizer = "sgd"
    learning_rate = 0.0004
    momentum = 0.9
    nesterov = False                     # PaddleDetection's Momentum optimizer is plain momentum
    weight_decay = 5e-4
    grad_clip = 0.0
    lr_scheduler = "constant"
    warmup_epochs = 0
    bn_running_var = "biased"            # PaddlePaddle's BatchNorm running variance
    ema = False
    eval_before = False
    progress = False
