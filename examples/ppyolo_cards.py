"""PP-YOLO at CPU size (ResNet18-vd, PaddleDetection's ppyolo_r18vd) trained from scratch on the real
cards dataset (../shared/data/cards: 6 classes, 296 train / 67 val), then through the quantized stages
to the integer model (gnetmdk.intq: int8 weights per output channel, uint8 activations).

    python3 tools/xml_2_txt.py --config examples/ppyolo_cards.py
    python3 train.py --config examples/ppyolo_cards.py --step 1
    python3 tools/eval_voc.py checkpoint/step1/best.pth --config examples/ppyolo_cards.py --coco
    python3 train.py --config examples/ppyolo_cards.py --step 2
    python3 train.py --config examples/ppyolo_cards.py --cal
    python3 train.py --config examples/ppyolo_cards.py --step 3
    python3 train.py --config examples/ppyolo_cards.py --step 4
    python3 tools/export_int.py --config examples/ppyolo_cards.py --check
Results and wall time: docs/results/ppyolo-cards.md.
"""
from gnetmdk.config import BaseConfig
from gnetmdk.models.ppyolo.config import R18VD


class Config(BaseConfig):
    model_name = "ppyolo"
    DEFAULT_STEP = 1
    DS_NAME = "cards"
    VOC_CLASSES = ["nine", "ten", "jack", "queen", "king", "ace"]
    dataset_path = "../shared/data/cards"
    image_size = 256                     # evaluation size; training draws one of train_sizes per batch
    # Mixup off: with 296 images and no pretrained backbone it slowed the start of training
    ppyolo = dict(R18VD, train_sizes=[224, 256, 288], mixup_epochs=0)
    batch_size = 16
    num_workers = 0                      # 2 cores: augmentation in the main process (docs/training.md)
    threads = 2
    num_epochs = 100                     # 40 epochs: 0.38 mAP@0.5; 100: 0.57 (docs/results.md)
    eval_interval = 10
    eval_coco = True                     # COCO mAP@[.5:.95] beside VOC mAP@0.5
    optimizer = "adamw"
    learning_rate = 1e-3
    weight_decay = 5e-4
    warmup_epochs = 2
    ema = True
    ema_decay = 0.995
    progress = False
    per_step = {
        # the quantized stages fine-tune at a tenth of step 1's rate, without warm-up; step 4 trains as
        # step 3 does (fake quantization), so it only converts: its evaluation is the integer model
        2: dict(learning_rate=1e-4, num_epochs=8, warmup_epochs=0, eval_interval=2),
        3: dict(learning_rate=1e-4, num_epochs=8, warmup_epochs=0, eval_interval=2),
        4: dict(num_epochs=0),
    }
