"""The log-space size head (gnetdet.size_head "log"), device cpu: the size code and its inverse, the
precision it buys on the output layer's 5-bit code grid, the loss, the config / model / checkpoint /
chip-model plumbing, and the chip model equal to the step-4 model under it."""
import json
import os
import sys

import numpy as np
import pytest
import torch

from gnetmdk.config import BaseConfig, ConfigError, build_config
from gnetmdk.dataset.dataset import encode_targets
from gnetmdk.evaluation.boxes import paired_iou
from gnetmdk.models.gnetdet import GNetDet
from gnetmdk.models.gnetdet.decode import decode_gnetdet
from gnetmdk.models.gnetdet.head import (SIZE_MIN, cell_boxes_to_xyxy, output_boxes, output_head, output_sizes,
                                         size_codes)
from gnetmdk.models.gnetdet.loss import gnetdet_loss

GRID, C = 14, 3


pytestmark = pytest.mark.usefixtures("one_thread")


def test_size_codes_invert_output_sizes_device_cpu():
    sizes = torch.tensor([SIZE_MIN, 0.02, 0.07, 0.25, 0.5, 1.0], dtype=torch.float64)
    codes = size_codes(sizes, "log")
    assert codes.min() >= 0 and codes.max() <= 1
    assert codes[0] == 0 and codes[-1] == 1
    assert torch.allclose(output_sizes(codes, "log"), sizes, rtol=1e-12)
    # one output unit multiplies the size by 1 / size_min at every size: the same relative step everywhere
    y = torch.tensor([0.1, 0.4, 0.7], dtype=torch.float64)
    ratio = output_sizes(y + 0.01, "log") / output_sizes(y, "log")
    assert torch.allclose(ratio, torch.full_like(ratio, SIZE_MIN ** -0.01), rtol=1e-12)
    # a box below size_min is coded 0 (size_min itself); untrained huge outputs stay finite (at most 2)
    assert size_codes(torch.tensor([1e-4]), "log").item() == 0.0
    assert output_sizes(torch.tensor([1e4]), "log").item() == pytest.approx(2.0)
    # the linear head is the identity both ways
    assert torch.equal(size_codes(sizes, "linear"), sizes) and torch.equal(output_sizes(sizes, "linear"), sizes)
    # another size_min moves both ends
    assert output_sizes(torch.tensor([0.0]), "log", 0.05).item() == pytest.approx(0.05)


def test_log_head_keeps_small_boxes_on_the_code_grid_device_cpu():
    """The reason for the head: the output layer's codes step by cap / 31 (docs/quantization.md,
    "Activations"). With the cap the dense set's calibration chose (1.22), a 4-16 px box in a 224-px
    input decoded from the nearest code
    keeps IoU >= 0.8 with the log head (relative step size_min ** (-cap/31) = 1.18, so each side is off by
    at most 9%: IoU >= 1/1.09^2 = 0.84), while the linear head's 8.8-px steps leave IoU far lower."""
    cap, side = 1.22, 224.0
    step = cap / 31
    px = torch.linspace(4.0, 16.0, 49, dtype=torch.float64)
    true = px / side

    def iou_after_codes(head):
        y = size_codes(true, head)
        yq = (y / step).round().clamp(0, 31) * step                    # the chip's 5-bit output code
        w = output_sizes(yq, head)
        boxes = torch.stack([0.5 - w / 2, 0.5 - w / 2, 0.5 + w / 2, 0.5 + w / 2], -1)
        ref = torch.stack([0.5 - true / 2, 0.5 - true / 2, 0.5 + true / 2, 0.5 + true / 2], -1)
        return paired_iou(boxes, ref)

    log_iou, lin_iou = iou_after_codes("log"), iou_after_codes("linear")
    bound = 1.0 / (SIZE_MIN ** (-step / 2)) ** 2
    assert bound > 0.8
    assert float(log_iou.min()) >= bound - 1e-9
    assert float(lin_iou.min()) < 0.5                                   # a 4-16 px box on 8.8-px steps


def test_log_head_loss_perfect_prediction_and_gradient_device_cpu():
    rng = np.random.default_rng(3)
    targets = []
    for _ in range(4):
        k = int(rng.integers(1, 4))
        xy = rng.uniform(0.0, 0.8, size=(k, 2))
        wh = rng.uniform(0.02, 0.15, size=(k, 2))                      # small boxes
        boxes = np.concatenate([xy, xy + wh], axis=1).astype(np.float32)
        targets.append(encode_targets(boxes, rng.integers(0, C, size=k), GRID, C))
    target = torch.from_numpy(np.stack(targets))
    obj = target[..., 4] > 0
    # the outputs a perfect log-head model gives: the target's size codes in both slots
    pred = target.clone()
    for sl in (slice(2, 4), slice(7, 9)):
        pred[..., sl] = torch.where(obj.unsqueeze(-1), size_codes(target[..., sl], "log"), pred[..., sl])
    pred[..., 9][obj] = 0.0
    terms = gnetdet_loss(pred, target, size_head="log", box_slots=1)
    assert float(terms["loc"]) == pytest.approx(0.0, abs=1e-10)
    assert float(terms["conf"]) < 1e-6                                  # decoded box IoU 1 with the target
    # the same outputs read as linear sizes are wrong boxes
    assert float(gnetdet_loss(pred, target, box_slots=1)["loc"]) > 0.01
    # a too-large size output is pulled down, toward the target's code
    p = pred.clone()
    p[..., 2][obj] += 0.2
    p.requires_grad_(True)
    gnetdet_loss(p, target, size_head="log", box_slots=1)["loc"].backward()
    assert bool((p.grad[..., 2][obj] > 0).all())
    assert float(p.grad[..., 3][obj].abs().max()) == 0.0
    with pytest.raises(ConfigError, match="size_head must be 'linear'"):
        gnetdet_loss(pred, target, size_head="sqrt")


def test_decode_reads_log_sizes_device_cpu():
    pred = torch.zeros(1, GRID, GRID, 10 + C)
    pred[0, 5, 6, 0:5] = torch.tensor([0.5, 0.5, 0.3, 0.6, 1.0])
    pred[0, 5, 6, 10] = 1.0
    det = decode_gnetdet(pred, C, conf_thresh=0.5, size_head="log", size_min=1 / 64)[0]
    assert det["boxes"].shape == (1, 4) and det["labels"].tolist() == [0]
    w, h = (det["boxes"][0, 2:] - det["boxes"][0, :2]).tolist()
    assert w == pytest.approx((1 / 64) ** 0.7, rel=1e-5) and h == pytest.approx((1 / 64) ** 0.4, rel=1e-5)
    cx = float(det["boxes"][0, 0] + det["boxes"][0, 2]) / 2
    assert cx == pytest.approx(6.5 / GRID, rel=1e-5)
    # output_boxes + cell_boxes_to_xyxy is what decode applies
    xyxy = cell_boxes_to_xyxy(output_boxes(pred[..., 0:4], "log"), GRID)[0, 5, 6]
    assert torch.allclose(xyxy, det["boxes"][0], atol=1e-6)


@pytest.mark.parametrize("kwargs,needle", [
    (dict(size_head="sqrt"), "size_head must be 'linear'.*or 'log'.*'sqrt'"),
    (dict(size_head="log", size_min=0.0), "size_min must be a fraction"),
    (dict(size_head="log", size_min=1.5), "size_min must be a fraction"),
    (dict(size_head="log", size_min=float("nan")), "size_min must be a fraction"),
])
def test_size_head_settings_refused_device_cpu(kwargs, needle):
    with pytest.raises(ConfigError, match=needle):
        GNetDet(num_classes=2, image_size=224, width_mult=0.0625, **kwargs)


def test_size_head_from_config_to_checkpoint_meta_device_cpu(capsys):
    from gnetmdk.models.rebuild import build_model_from_checkpoint
    from gnetmdk.models import model_from_config
    cfg = build_config(BaseConfig, ["image_size", "224", "width_mult", "0.0625", "size_head", "log",
                                    "size_min", "0.02"])
    model = model_from_config(cfg)
    assert (model.size_head, model.size_min) == ("log", 0.02)
    assert model.loss_weights["size_head"] == "log" and model.loss_weights["size_min"] == 0.02
    assert output_head(model)["size_head"] == "log"
    meta = model.meta()
    assert (meta["size_head"], meta["size_min"]) == ("log", 0.02)
    # a checkpoint keeps the head it was trained with; a config asking for another gets a note
    ckpt = {"model_meta": meta, "model": model.state_dict(), "stage": "step1"}
    plain = build_config(BaseConfig, ["image_size", "224", "width_mult", "0.0625"])
    back = build_model_from_checkpoint(ckpt, plain, path="s1.pth")
    assert (back.size_head, back.size_min) == ("log", 0.02)
    err = capsys.readouterr().err
    assert "s1.pth" in err and "size_head 'log'" in err
    # a checkpoint from before the option reads as GTI's linear head
    old = {k: v for k, v in meta.items() if k not in ("size_head", "size_min")}
    assert build_model_from_checkpoint({"model_meta": old, "model": model.state_dict(), "stage": "step1"},
                                       plain, path="old.pth").size_head == "linear"
    with pytest.raises(ConfigError, match="gnetdet"):
        build_config(BaseConfig, ["image_size", "224", "size_head", "exp"])


@pytest.fixture(scope="module")
def log_head_step4():
    from chip_helpers import build_step4_model
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(6, 224, 224, 3), dtype=np.uint8)
    model, caps = build_step4_model(3, images, seed=2, score_head="logit", score_offset=0.5, score_scale=10.0,
                                    size_head="log", size_min=1 / 32)
    return model, caps, images


def test_log_head_chip_model_equals_step4_device_cpu(log_head_step4, tmp_path):
    """The chip model records the size head; its decoded detections equal the step-4 model's, box for box;
    a chip-model file with a head the host cannot apply is refused."""
    from gnetmdk.chip import ChipEmulator, ChipModelError, load_chip_model
    from gnetmdk.chip.convert import chip_model_from_gnetdet
    from gnetmdk.chip.host import codes_to_predictions, decode_predictions
    from gnetmdk.gti.quantize import image_to_codes
    model, caps, images = log_head_step4
    cm = chip_model_from_gnetdet(model, ["a", "b", "c"], calibrated_caps=caps)
    assert (cm.size_head, cm.size_min) == ("log", 1 / 32)
    assert cm.header()["decode"]["size_head"] == "log"
    with torch.no_grad():
        ref_pred = model(image_to_codes(torch.from_numpy(images)).permute(0, 3, 1, 2).float())
    chip_pred = codes_to_predictions(ChipEmulator(cm).run(images), cm)
    assert torch.equal(chip_pred, ref_pred.float())
    sizes = [(224, 224)] * len(images)
    dets = decode_predictions(chip_pred, cm, sizes, conf_thresh=1e-6)
    ref = model.decode(ref_pred, 1e-6, cm.nms_thresh, cm.max_detections)
    assert sum(len(d["scores"]) for d in dets) > 0
    for d, r in zip(dets, ref):
        assert torch.equal(d["boxes"], r["boxes"] * 224) and torch.equal(d["labels"], r["labels"])
    # read back from the file, the head is the same; a wrong one is refused naming the field
    path = cm.save(str(tmp_path / "m.json"))
    back = load_chip_model(path)
    assert (back.size_head, back.size_min) == ("log", 1 / 32)
    d = json.load(open(path))
    for key, value in (("size_head", "sqrt"), ("size_min", 2.0)):
        wrong = json.loads(json.dumps(d))
        wrong["decode"][key] = value
        json.dump(wrong, open(tmp_path / "w.json", "w"))
        with pytest.raises(ChipModelError, match=key):
            load_chip_model(str(tmp_path / "w.json"))
    # a file from before the option reads as the linear head
    old = json.loads(json.dumps(d))
    del old["decode"]["size_head"], old["decode"]["size_min"]
    json.dump(old, open(tmp_path / "old.json", "w"))
    assert load_chip_model(str(tmp_path / "old.json")).size_head == "linear"
