#!/usr/bin/env python3
"""PaddleDetection reference run for the alignment check against PaddleDetection (docs/alignment.md,
"Against PaddleDetection"): PP-YOLO built by PaddleDetection itself, trained for a few SGD iterations
on fixed batches, written as a gnetmdk recording that `train.py --replay-npz` replays.

This script runs in its own environment with paddlepaddle and paddledet; gnetmdk never imports it and
neither package is a gnetmdk dependency. It imports neither torch nor gnetmdk.

    python3.11 -m venv paddle-env
    paddle-env/bin/pip install -r tools/paddle-requirements.txt
    paddle-env/bin/python tools/paddle_reference.py --out paddle-ref          # cards, r18vd, 10 iterations

(Python 3.11 or older: paddledet 2.6 needs numpy below 1.24, which has no wheels for 3.12, and imports
scikit-learn; tools/paddle-requirements.txt pins the measured set, paddlepaddle 3.3.1 and paddledet
2.6.0, run on CPU.) It writes into --out:

    before.pdparams, after.pdparams   the model's weights before the first and after the last iteration
                                      (a pickle of {name: numpy array}, the layout of PaddleDetection's
                                      released .pdparams files)
    iter_<k>_rank0.npz, meta.json     per iteration: the batch as uint8 RGB images (B, 3, S, S), its
                                      ground truth as gnetmdk's PP-YOLO targets (B, M, 6) [class, x1, y1,
                                      x2, y2 relative, score], and PaddleDetection's loss terms: the
                                      format of gnetmdk's `--save-npz` recordings

Then, with gnetmdk (`bash tools/align_paddle.sh paddle-env/bin/python OUT` runs all of it and prints the
verdict):

    python3 tools/convert_weights.py -f examples/ppyolo_align.py -c paddle-ref/before.pdparams -oc paddle-ref/start.pth
    python3 tools/convert_weights.py -f examples/ppyolo_align.py -c paddle-ref/after.pdparams -oc paddle-ref/after.pth
    python3 train.py --config examples/ppyolo_align.py --step 1 --replay-npz paddle-ref --deterministic
    python3 tools/diff_weights.py paddle-ref/after.pth checkpoint/align/step1/last.pth --d-value 0.0005

The model is PaddleDetection's ppyolo_r18vd (configs/ppyolo/ppyolo_r18vd_coco.yml) with DropBlock off
and the backbone frozen (`freeze_at 3` as in the PP-YOLO alignment notes; `--freeze-at -1` trains it
too); the optimizer is PaddleDetection's for PP-YOLO: momentum SGD with L2 decay on the conv weights
(BatchNorm parameters and the head's biases carry L2Decay(0) in PaddleDetection's layers) at a
constant learning rate. Batches are the first --iters x --batch images of the dataset's train list,
resized to --size without keeping the aspect ratio, in list order; no augmentation.
Exit status: 0 written; 2 a user error (missing dataset, paddle not importable).
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import xml.etree.ElementTree as ET

import numpy as np

IMAGENET_MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32).reshape(1, 3, 1, 1)
IMAGENET_STD = np.array([0.229, 0.224, 0.225], dtype=np.float32).reshape(1, 3, 1, 1)
# configs/ppyolo/ppyolo_r18vd_coco.yml
ANCHORS = [[10, 14], [23, 27], [37, 58], [81, 82], [135, 169], [344, 319]]
ANCHOR_MASKS = [[3, 4, 5], [0, 1, 2]]
DOWNSAMPLE = [32, 16]
CARDS = ["nine", "ten", "jack", "queen", "king", "ace"]


def fail(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return 2


def read_voc_batches(dataset: str, classes, size: int, count: int, max_boxes: int):
    """The first ``count`` images of ``dataset``/ImageSets/Main/train.txt: (count, 3, size, size) uint8 RGB
    and (count, max_boxes, 6) float32 targets [class, x1, y1, x2, y2 relative to the image, score 1],
    class -1 on padding rows. Objects marked difficult are dropped, as gnetmdk's meta files drop them."""
    import cv2
    with open(os.path.join(dataset, "ImageSets", "Main", "train.txt")) as fh:
        names = [line.split()[0] for line in fh if line.strip()][:count]
    if len(names) < count:
        raise ValueError(f"{dataset} lists {len(names)} train images, {count} are needed (--iters x --batch)")
    images = np.zeros((count, 3, size, size), np.uint8)
    targets = np.full((count, max_boxes, 6), 0.0, np.float32)
    targets[:, :, 0] = -1.0
    for i, name in enumerate(names):
        bgr = cv2.imread(os.path.join(dataset, "JPEGImages", name + ".jpg"), cv2.IMREAD_COLOR)
        if bgr is None:
            raise ValueError(f"{dataset}/JPEGImages/{name}.jpg cannot be read")
        h, w = bgr.shape[:2]
        rgb = cv2.cvtColor(cv2.resize(bgr, (size, size), interpolation=cv2.INTER_LINEAR), cv2.COLOR_BGR2RGB)
        images[i] = rgb.transpose(2, 0, 1)
        rows = []
        for obj in ET.parse(os.path.join(dataset, "Annotations", name + ".xml")).getroot().iter("object"):
            if int(obj.findtext("difficult", "0") or 0):
                continue
            b = obj.find("bndbox")
            x1, y1, x2, y2 = (float(b.findtext(k)) for k in ("xmin", "ymin", "xmax", "ymax"))
            rows.append([classes.index(obj.findtext("name").strip()), x1 / w, y1 / h, x2 / w, y2 / h, 1.0])
        rows = np.clip(np.array(rows[:max_boxes], np.float32).reshape(-1, 6), [-1, 0, 0, 0, 0, 0], None)
        rows[:, 1:5] = np.minimum(rows[:, 1:5], 1.0)
        targets[i, :len(rows)] = rows
    return images, targets


def build_model(num_classes: int, freeze_at: int):
    """PaddleDetection's ppyolo_r18vd (DropBlock off), built from ppdet's own layers."""
    from ppdet.modeling.architectures import YOLOv3
    from ppdet.modeling.backbones import ResNet
    from ppdet.modeling.heads import YOLOv3Head
    from ppdet.modeling.losses import IouLoss, YOLOv3Loss
    from ppdet.modeling.necks import PPYOLOFPN
    backbone = ResNet(depth=18, variant="d", return_idx=[2, 3], freeze_at=freeze_at, freeze_norm=False,
                      norm_decay=0.0)
    neck = PPYOLOFPN(in_channels=[s.channels for s in backbone.out_shape], coord_conv=False, conv_block_num=0,
                     drop_block=False, spp=False)
    loss = YOLOv3Loss(num_classes=num_classes, ignore_thresh=0.7, label_smooth=False, downsample=DOWNSAMPLE,
                      scale_x_y=1.05, iou_loss=IouLoss(loss_weight=2.5, loss_square=True))
    head = YOLOv3Head(in_channels=[s.channels for s in neck.out_shape], anchors=ANCHORS, anchor_masks=ANCHOR_MASKS,
                      num_classes=num_classes, loss=loss)
    return YOLOv3(backbone=backbone, neck=neck, yolo_head=head, post_process=None)


def paddle_inputs(images: np.ndarray, targets: np.ndarray, num_classes: int):
    """PaddleDetection's training inputs for one batch: the normalised image, gt_bbox (centre x, y, w, h
    relative), gt_class, gt_score and the Gt2YoloTarget targets, as paddle tensors."""
    import paddle
    from ppdet.data.transform.batch_operators import Gt2YoloTarget
    x = (images.astype(np.float32) / 255.0 - IMAGENET_MEAN) / IMAGENET_STD
    samples = []
    for i in range(len(images)):
        t = targets[i]
        valid = t[:, 0] >= 0
        box = np.zeros((len(t), 4), np.float32)
        box[valid, 0] = (t[valid, 1] + t[valid, 3]) / 2
        box[valid, 1] = (t[valid, 2] + t[valid, 4]) / 2
        box[valid, 2] = t[valid, 3] - t[valid, 1]
        box[valid, 3] = t[valid, 4] - t[valid, 2]
        samples.append({"image": x[i], "gt_bbox": box, "gt_class": np.where(valid, t[:, 0], 0).astype(np.int32)[:, None],
                        "gt_score": np.where(valid, t[:, 5], 0).astype(np.float32)[:, None]})
    kept = {k: np.stack([s[k] for s in samples]) for k in ("image", "gt_bbox", "gt_class", "gt_score")}
    samples = Gt2YoloTarget(ANCHORS, ANCHOR_MASKS, DOWNSAMPLE, num_classes)(samples)   # pops some keys
    kept.update({f"target{k}": np.stack([s[f"target{k}"] for s in samples]) for k in range(len(DOWNSAMPLE))})
    return {k: paddle.to_tensor(v) for k, v in kept.items()}


def save_params(model, path: str) -> None:
    """{structured name: numpy array}, pickled as PaddleDetection's released weight files are."""
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    with open(path, "wb") as fh:
        pickle.dump(state, fh, protocol=4)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p.add_argument("--dataset", default=os.path.join(os.path.dirname(here), "shared", "data", "cards"),
                   help="VOC folder (default ../shared/data/cards)")
    p.add_argument("--classes", default=",".join(CARDS), help="comma-separated class names (default the cards')")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--size", type=int, default=320, help="input side in pixels, a multiple of 32 (default 320)")
    p.add_argument("--lr", type=float, default=0.0004)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--freeze-at", type=int, default=3, help="ResNet stages frozen (3: all of them, the notes)")
    p.add_argument("--max-boxes", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    classes = [c.strip() for c in args.classes.split(",") if c.strip()]
    if not os.path.isdir(os.path.join(args.dataset, "Annotations")):
        return fail(f"--dataset '{args.dataset}' is not a VOC folder (no Annotations/)")
    if args.size % 32 or args.iters < 1 or args.batch < 1:
        return fail("--size must be a multiple of 32, --iters and --batch at least 1")
    try:
        import paddle
        from paddle.regularizer import L2Decay
    except ImportError as exc:
        return fail(f"paddle cannot be imported ({exc}): run this script with the paddle environment's python")
    try:
        images, targets = read_voc_batches(args.dataset, classes, args.size, args.iters * args.batch, args.max_boxes)
    except (OSError, ValueError) as exc:
        return fail(str(exc))
    paddle.set_device("cpu")
    paddle.seed(args.seed)
    np.random.seed(args.seed)
    model = build_model(len(classes), args.freeze_at)
    model.train()
    os.makedirs(args.out, exist_ok=True)
    save_params(model, os.path.join(args.out, "before.pdparams"))
    opt = paddle.optimizer.Momentum(learning_rate=args.lr, momentum=args.momentum, parameters=model.parameters(),
                                    weight_decay=L2Decay(args.weight_decay))
    names = {"loss_xy": "xy", "loss_wh": "wh", "loss_obj": "obj", "loss_cls": "cls", "loss_iou": "iou",
             "loss": "total"}
    for it in range(1, args.iters + 1):
        sl = slice((it - 1) * args.batch, it * args.batch)
        losses = model(paddle_inputs(images[sl], targets[sl], len(classes)))
        losses["loss"].backward()
        opt.step()
        opt.clear_grad()
        arrays = {"images": images[sl], "images_float": np.array(False), "targets": targets[sl],
                  "indices": np.arange(sl.start, sl.stop, dtype=np.int64), "epoch": np.array(0, np.int64),
                  "iteration": np.array(it, np.int64), "rank": np.array(0, np.int64),
                  "world_size": np.array(1, np.int64), "lr": np.array(args.lr, np.float64)}
        for k, v in losses.items():
            if k in names:
                arrays[f"loss_{names[k]}"] = np.array(float(v), np.float64)
        np.savez(os.path.join(args.out, f"iter_{it:06d}_rank0.npz"), **arrays)
        print(f"iteration {it}: loss {float(losses['loss']):.8g} "
              + " ".join(f"{names[k]} {float(v):.6g}" for k, v in losses.items() if k in names and k != "loss"))
    save_params(model, os.path.join(args.out, "after.pdparams"))
    meta = {"format": "gnetmdk-npz-record", "version": 1, "stage": "step1", "world_size": 1,
            "global_batch": args.batch, "local_batch": args.batch, "iters_per_epoch": args.iters,
            "image_size": args.size, "seed": args.seed, "start": "start.pth", "config": {},
            "reference": {"paddle": paddle.__version__, "model": "ppdet ppyolo_r18vd, DropBlock off",
                          "freeze_at": args.freeze_at, "lr": args.lr, "momentum": args.momentum,
                          "weight_decay": args.weight_decay, "dataset": os.path.abspath(args.dataset)}}
    with open(os.path.join(args.out, "meta.json"), "w") as fh:
        json.dump(meta, fh, indent=2)
    print(f"wrote {args.out}: before.pdparams, after.pdparams, {args.iters} iterations, meta.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
