"""Units of the modules that the other tests reach only through subprocesses or package re-exports:
gnetmdk.config.recipe, gnetmdk.dist.virtual, gnetmdk.chip.check, gnetmdk.chip.predictor,
gnetmdk.chip.export, gnetmdk.models.gnetdet.family, gnetmdk.models.ppyolo.head / quant / resnet_vd.

Every model is tiny (GNetDet-224 at width 0.0625, ResNet-vd on 32..64 px inputs, a PP-YOLO r18vd with
narrow neck) and every test runs on the CPU (device cpu).
"""
from __future__ import annotations

import copy
import json
import math
import os
import sys

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from chip_helpers import build_step4_model  # noqa: E402

from gnetmdk.config import BaseConfig, ConfigError, build_config  # noqa: E402
import gnetmdk.config.recipe as recipe  # noqa: E402
import gnetmdk.dist.virtual as virtual  # noqa: E402
import gnetmdk.chip.check as check  # noqa: E402
import gnetmdk.chip.predictor as predictor  # noqa: E402
import gnetmdk.chip.export as export  # noqa: E402
from gnetmdk.chip.convert import chip_model_from_gnetdet  # noqa: E402
from gnetmdk.chip.emulator import ChipEmulator  # noqa: E402
from gnetmdk.chip.model_file import ChipModelError  # noqa: E402
import gnetmdk.models.gnetdet.family as gfamily  # noqa: E402
import gnetmdk.models.ppyolo.head as yhead  # noqa: E402
import gnetmdk.models.ppyolo.quant as yquant  # noqa: E402
import gnetmdk.models.ppyolo.resnet_vd as resnet_vd  # noqa: E402
from gnetmdk.models.gnetdet.model import GNetDet  # noqa: E402
from gnetmdk.models.ppyolo.common import ConvBNLayer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread_module")

CLASSES = ["circle", "square"]


# ------------------------------------------------------------------ shared fixtures
@pytest.fixture(scope="module")
def step4():
    """A tiny step-4 GNetDet-224 (2 classes), its chip model and 2 random 8-bit images."""
    imgs = np.random.default_rng(0).integers(0, 256, (2, 224, 224, 3), dtype=np.uint8)
    model, caps = build_step4_model(len(CLASSES), imgs)
    cm = chip_model_from_gnetdet(model, CLASSES, calibrated_caps=caps)
    return model, cm, imgs, caps


@pytest.fixture
def no_virtual_ranks():
    """Leave the process-wide virtual ranks unset after the test, whatever it set."""
    yield
    virtual.set_virtual_ranks(1)


# ------------------------------------------------------------------ gnetmdk.config.recipe
def test_recipe_quantized_stages_values_and_fresh_dicts():
    """quantized_stages gives steps 2, cal, 3, 4 with the documented schedule, as new dicts on every call."""
    a = recipe.quantized_stages()
    assert list(a) == [2, "cal", 3, 4]
    assert a["cal"] == {}
    assert [a[k]["learning_rate"] for k in (2, 3, 4)] == [1e-4, 1e-4, 2e-5]
    assert [a[k]["num_epochs"] for k in (2, 3, 4)] == [10, 10, 6]          # 10 + 10 + 6 epochs
    for k in (2, 3, 4):
        assert (a[k]["ema"], a[k]["ema_decay"], a[k]["warmup_epochs"], a[k]["eval_interval"]) == (True, 0.99, 0.5, 2)
    assert "ema_ramp" not in a[2] and a[3]["ema_ramp"] == a[4]["ema_ramp"] == 20
    # fresh dicts: editing one call's entries (as a config does per stage) leaves the next call alone
    a[3]["num_epochs"] = 20
    a["cal"]["batch_size"] = 4
    b = recipe.quantized_stages()
    assert b[3]["num_epochs"] == 10 and b["cal"] == {}
    assert all(a[k] is not b[k] for k in a)
    assert a[4] is not a[3] and a[4]["num_epochs"] == 6


def test_recipe_epoch_factor_keeps_the_optimizer_steps_device_cpu():
    """quantized_stages(epoch_factor): epochs and evaluation interval scaled and rounded half up (at least
    1), the warm-up scaled exactly, everything else as measured; a bad factor is one ValueError."""
    import math
    a = recipe.quantized_stages(42 / 115)         # examples/facemask_tiles.py: 115 steps an epoch against 42
    assert [a[k]["num_epochs"] for k in (2, 3, 4)] == [4, 4, 2]            # 3.65, 3.65, 2.19 epochs
    assert [a[k]["eval_interval"] for k in (2, 3, 4)] == [1, 1, 1]         # 0.73 -> 1
    assert all(math.isclose(a[k]["warmup_epochs"], 0.5 * 42 / 115, rel_tol=1e-15) for k in (2, 3, 4))
    base = recipe.quantized_stages()
    for k in (2, 3, 4):
        same = {f: v for f, v in base[k].items() if f not in ("num_epochs", "eval_interval", "warmup_epochs")}
        assert {f: a[k][f] for f in same} == same
    assert recipe.quantized_stages(1.0) == base
    b = recipe.quantized_stages(2.0)
    assert [b[k]["num_epochs"] for k in (2, 3, 4)] == [20, 20, 12] and b[2]["eval_interval"] == 4
    assert [recipe.quantized_stages(f)[4]["num_epochs"] for f in (0.25, 0.01)] == [2, 1]   # 1.5 -> 2; at least 1
    for bad in (0, -1.0, float("nan"), float("inf"), "2", True):
        with pytest.raises(ValueError, match="epoch_factor"):
            recipe.quantized_stages(bad)


def test_recipe_stages_resolve_through_build_config():
    """A Config with per_step = {1: ..., **quantized_stages()} resolves each stage's recipe values, and a
    per-stage edit on top changes only that stage."""
    stages = {1: dict(num_epochs=3, learning_rate=1e-3), **recipe.quantized_stages()}
    stages[3]["num_epochs"] = 20
    klass = type("Config", (BaseConfig,), {"per_step": stages})
    s1, s3, s4 = (build_config(klass, [], step=s) for s in (1, 3, 4))
    assert (s1.learning_rate, s1.num_epochs) == (1e-3, 3)
    assert (s3.learning_rate, s3.num_epochs, s3.ema, s3.ema_ramp) == (1e-4, 20, True, 20)
    assert (s4.learning_rate, s4.num_epochs, s4.ema_decay, s4.eval_interval) == (2e-5, 6, 0.99, 2)
    cal = build_config(klass, [], cal=True)
    assert cal.cal and cal.step == 2
    # the command line still wins over the recipe
    assert build_config(klass, ["learning_rate", "3e-4"], step=4).learning_rate == 3e-4


# ------------------------------------------------------------------ gnetmdk.dist.virtual
def test_split_batch_chunks_are_fresh_contiguous_and_rebuild_the_batch_device_cpu():
    """split_batch gives equal rank-order chunks, each contiguous and with its own storage, whose
    concatenation is the batch; an uneven split is refused with the sizes in the message."""
    t = torch.arange(6 * 4, dtype=torch.float32).view(4, 6).t()          # (6, 4), not contiguous
    parts = virtual.split_batch(t, 3)
    assert [tuple(p.shape) for p in parts] == [(2, 4)] * 3
    assert all(p.is_contiguous() for p in parts)
    assert torch.equal(torch.cat(parts), t)
    parts[0].fill_(-1)                                                     # its own memory
    assert torch.equal(t[:2], torch.arange(24, dtype=torch.float32).view(4, 6).t()[:2])
    with pytest.raises(ValueError, match="a batch of 6 does not split over 4 virtual ranks"):
        virtual.split_batch(t, 4)
    with pytest.raises(ValueError, match="1 or more virtual ranks, not 0"):
        virtual.split_batch(t, 0)


def test_forward_batch_concatenates_rank_outputs_in_order_device_cpu(no_virtual_ranks):
    """With V virtual ranks forward_batch equals the per-chunk outputs concatenated in rank order (also
    for a dict / tuple output); without them it is model(images); other outputs are refused."""
    assert virtual.set_virtual_ranks(1) is None and virtual.virtual_ranks() is None
    torch.manual_seed(0)
    lin = nn.Linear(5, 3)
    x = torch.randn(6, 5)

    def model(z):
        return {"a": lin(z), "b": (z * 2, z.sum(1))}

    with torch.no_grad():
        assert torch.equal(virtual.forward_batch(lin, x), lin(x))
        ranks = virtual.set_virtual_ranks(3)
        assert virtual.virtual_ranks() is ranks and ranks.size == 3
        out = virtual.forward_batch(model, x)
        want = [model(c) for c in x.chunk(3)]
        assert torch.equal(out["a"], torch.cat([w["a"] for w in want]))
        assert isinstance(out["b"], tuple)
        assert torch.equal(out["b"][0], x * 2) and torch.equal(out["b"][1], torch.cat([w["b"][1] for w in want]))
        with pytest.raises(TypeError, match="cannot concatenate the virtual ranks' outputs of type float"):
            virtual.forward_batch(lambda z: float(z.sum()), x)


def test_replica_shares_storage_with_own_leaves_device_cpu():
    """replica: parameters (and training buffers) are new leaves on the model's storage, other buffers
    are the model's own tensors, module attributes are copies."""
    m = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    m.register_buffer("cap", torch.tensor(2.0).requires_grad_(True))
    m.note = {"k": [1]}
    r = virtual.replica(m)
    for p, q in zip(m.parameters(), r.parameters()):
        assert q is not p and isinstance(q, nn.Parameter) and q.is_leaf
        assert q.data_ptr() == p.data_ptr()
    assert r[1].running_mean is m[1].running_mean
    assert r.cap is not m.cap and r.cap.is_leaf and r.cap.requires_grad and r.cap.data_ptr() == m.cap.data_ptr()
    assert r.note == m.note and r.note is not m.note
    assert virtual.trainable_tensors(r)[-1] is r.cap and len(virtual.trainable_tensors(r)) == 5
    # an update of the model is seen by the replica (no copy of the values)
    with torch.no_grad():
        m[0].weight.add_(1.0)
    assert torch.equal(r[0].weight, m[0].weight)


def test_combine_gradients_is_the_rank_order_mean_device_cpu():
    """combine_gradients sets each gradient to ((g_0 + g_1) + g_2) / 3 of the replicas' gradients, each
    computed independently with autograd on the model; untouched tensors keep grad None."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 1))
    m.register_buffer("cap", torch.tensor(1.5).requires_grad_(True))
    unused = nn.Parameter(torch.ones(2))
    m.register_parameter("unused", unused)
    x = torch.randn(6, 4)
    chunks = x.chunk(3)

    def loss(mod, c):
        return (mod(c) * mod.cap).pow(2).mean()

    reps = [virtual.replica(m) for _ in range(3)]
    for r, c in zip(reps, chunks):
        loss(r, c).backward()
    # the third rank alone gives the cap no gradient: it counts as zero there
    reps[2].cap.grad = None
    virtual.combine_gradients(m, reps)

    tensors = [p for n, p in m.named_parameters() if n != "unused"] + [m.cap]
    per_rank = [torch.autograd.grad(loss(m, c), tensors) for c in chunks]
    for i, t in enumerate(tensors):
        rows = [g[i] for g in per_rank]
        if t is m.cap:
            rows[2] = torch.zeros_like(rows[2])
        want = ((rows[0] + rows[1]) + rows[2]) / 3
        assert torch.equal(t.grad, want), i
    assert m.unused.grad is None


# ------------------------------------------------------------------ gnetmdk.chip.check
def test_check_report_counts_and_verdict():
    """CheckReport: total = mismatches + non-zero padding; ok needs no mismatch and equal outputs; the
    table lists every layer and the totals."""
    rep = check.CheckReport([0, 2, 1], [10, 20, 30], padded_nonzero=4, max_output_diff=0.0, num_images=3,
                            layer_names=["conv1", "conv2", "conv3"])
    assert rep.total_mismatches == 7 and not rep.ok
    text = rep.format().splitlines()
    assert text[2].split() == ["conv1", "10", "0"] and text[4].split() == ["conv3", "30", "1"]
    assert text[6].split() == ["total", "60", "3"]
    assert text[-1] == "NOT bit-exact: 7 mismatching codes"
    assert "padded output channels non-zero: 4" in text[-2] and "images: 3" in text[-2]
    assert check.CheckReport([0], [5], layer_names=["conv1"]).ok
    assert not check.CheckReport([0], [5], max_output_diff=0.5).ok
    assert check.CheckReport([0], [5]).format().endswith("bit-exact: every activation code of every layer agrees")


def test_model_layer_codes_are_integer_codes_and_refuse_a_float_model_device_cpu(step4):
    """model_layer_codes: int64 codes 0..31 per sublayer of the documented shapes, predictions = last
    codes x output_scale (NHWC); a float (step-1) model is refused."""
    model, cm, imgs, _ = step4
    codes, pred = check.model_layer_codes(model, imgs, with_predictions=True)
    assert len(codes) == len(cm.layers)
    for c, layer in zip(codes[:-1], cm.layers):
        assert c.dtype == np.int64 and c.shape == (2, layer.out_channels, layer.output_size, layer.output_size)
        assert c.min() >= 0 and c.max() <= 31
    assert codes[-1].shape == (2, cm.used_channels, 14, 14)
    want = (torch.from_numpy(codes[-1]).double() * model.output_scale.double()).permute(0, 2, 3, 1).float()
    assert pred.dtype == torch.float32 and torch.equal(pred, want)
    float_model = GNetDet(num_classes=2, image_size=224, width_mult=0.0625)
    with pytest.raises(ValueError, match="does not output integer codes 0..31: put the model in step-4 eval mode"):
        check.model_layer_codes(float_model, imgs[:1])


def test_check_bit_exact_counts_each_planted_difference_device_cpu(step4):
    """check_bit_exact: the emulator agrees everywhere (element counts N x C x H x W per layer); one code
    changed in one layer counts 1 there; a non-zero padded output code counts as padding; a runner of
    another shape is refused; all_layers=False compares the output layer only."""
    model, cm, imgs, _ = step4
    emu = ChipEmulator(cm)
    rep = check.check_bit_exact(model, emu.run, cm, images=imgs, batch_size=1)
    n = len(cm.layers)
    want_elems = [2 * l.out_channels * l.output_size ** 2 for l in cm.layers[:-1]] + [2 * cm.used_channels * 14 * 14]
    assert rep.ok and rep.num_images == 2 and rep.elements == want_elems and rep.mismatches == [0] * n
    assert rep.layer_names == [f"conv{i + 1}" for i in range(n)]

    def planted(images, return_all=False):
        out, layers = emu.run(images, return_all=True)
        layers = [np.array(l) for l in layers]
        layers[4][0, 1, 2, 3] = (int(layers[4][0, 1, 2, 3]) + 1) % 32        # one code of conv5
        layers[-1][0, cm.used_channels, 0, 0] = 7                            # one padded output channel
        return out, layers

    bad = check.check_bit_exact(model, planted, cm, images=imgs)
    assert bad.mismatches == [0] * 4 + [1] + [0] * (n - 5)
    assert bad.padded_nonzero == 1 and bad.max_output_diff == 0.0 and bad.total_mismatches == 2 and not bad.ok

    out_only = check.check_bit_exact(model, emu.run, cm, images=imgs, all_layers=False)
    assert out_only.layer_names == [f"conv{n}"] and out_only.elements == want_elems[-1:] and out_only.ok

    def cropped(images, return_all=False):
        out, layers = emu.run(images, return_all=True)
        return out, [l[:, :, :-1] for l in layers]

    with pytest.raises(ChipModelError, match="layer 1: the model gives codes of shape"):
        check.check_bit_exact(model, cropped, cm, images=imgs)
    with pytest.raises(ValueError, match="pass dataset or images"):
        check.check_bit_exact(model, emu.run, cm)
    assert not model.training                                              # left in the mode it came in


# ------------------------------------------------------------------ gnetmdk.chip.predictor
def test_detection_records_round_and_name_device_cpu():
    """detection_records: one JSON-ready dict per detection, in order, score to 6 and box to 2 decimals."""
    det = {"boxes": torch.tensor([[1.234567, 2.0, 30.005, 40.5], [0.0, 0.0, 1.0, 1.0]], dtype=torch.float64),
           "scores": torch.tensor([0.91234567, 0.5], dtype=torch.float64), "labels": torch.tensor([1, 0])}
    recs = predictor.detection_records(det, ["cat", "dog"])
    assert recs == [{"class": "dog", "label": 1, "score": 0.912346, "box": [1.23, 2.0, round(30.005, 2), 40.5]},
                    {"class": "cat", "label": 0, "score": 0.5, "box": [0.0, 0.0, 1.0, 1.0]}]
    json.dumps(recs)                                                       # JSON-ready


def test_list_inputs_classifies_and_refuses(tmp_path):
    """list_inputs: a folder lists its images sorted (other files and sub-folders skipped), a video and an image file are
    named as such; a missing path, an empty folder and an unknown extension are refused with the reason."""
    for name in ("b.png", "a.JPG", "notes.txt"):
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / "crops.jpg").mkdir()                                       # a folder named like an image
    kind, files = predictor.list_inputs(str(tmp_path))
    assert kind == "folder" and files == [str(tmp_path / "a.JPG"), str(tmp_path / "b.png")]
    (tmp_path / "clip.MP4").write_bytes(b"x")
    assert predictor.list_inputs(str(tmp_path / "clip.MP4")) == ("video", [str(tmp_path / "clip.MP4")])
    assert predictor.list_inputs(str(tmp_path / "b.png")) == ("image", [str(tmp_path / "b.png")])
    with pytest.raises(ChipModelError, match="unknown extension"):
        predictor.list_inputs(str(tmp_path / "notes.txt"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        predictor.list_inputs(str(tmp_path / "missing.png"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no image"):
        predictor.list_inputs(str(tmp_path / "empty"))


def test_predictor_detect_scales_relative_boxes_to_image_sizes_device_cpu():
    """Predictor.detect decodes a hand-made prediction (one cell, one class) and scales the relative box
    by each image's (width, height)."""
    s, c = 8, 2
    pred = torch.zeros(2, s, s, 10 + c)
    pred[:, 2, 5, 0:5] = torch.tensor([0.5, 0.5, 0.25, 0.5, 1.0])          # row 2, col 5: centre of the cell
    pred[:, 2, 5, 10 + 1] = 1.0                                             # class 1
    p = predictor.Predictor("checkpoint", "x.pth", ["a", "b"], 64, 0.1, 0.5, 10, 0.3, lambda images: pred)
    assert p.num_classes == 2
    dets = p.detect(np.zeros((2, s, s, 3), np.uint8), [(64, 32), (1, 1)], conf_thresh=0.1, nms_thresh=0.5)
    # cx = 5.5 / 8, cy = 2.5 / 8, w 0.25, h 0.5: every corner is exact in float32
    rel = torch.tensor([[5.5 / 8 - 0.125, 2.5 / 8 - 0.25, 5.5 / 8 + 0.125, 2.5 / 8 + 0.25]])
    assert torch.equal(dets[1]["boxes"], rel)
    assert torch.equal(dets[0]["boxes"], rel * torch.tensor([64.0, 32.0, 64.0, 32.0]))
    assert dets[0]["labels"].tolist() == [1] and dets[0]["scores"].tolist() == [1.0]


def test_load_predictor_chip_model_matches_the_step4_model_device_cpu(step4, tmp_path):
    """load_predictor on a saved chip model: its settings come from the file and its predictions equal
    the step-4 model's (two implementations, bit-exact by design); unknown kinds and backends are refused."""
    model, cm, imgs, _ = step4
    path = cm.save(str(tmp_path / "chip_model.json"))
    p = predictor.load_predictor(path)
    assert (p.kind, p.class_names, p.image_size, p.num_classes) == ("chip", CLASSES, 224, 2)
    assert (p.conf_thresh, p.max_detections) == (cm.conf_thresh, cm.max_detections)
    _, want = check.model_layer_codes(model, imgs, with_predictions=True)
    got = p.predictions(imgs)
    assert got.shape == (2, 14, 14, 10 + 2) and torch.equal(got, want)
    with pytest.raises(ChipModelError, match="unknown backend 'tpu'"):
        predictor.load_predictor(path, backend="tpu")
    with pytest.raises(ChipModelError, match="unknown kind"):
        predictor.load_predictor(str(tmp_path / "model.bin"))


# ------------------------------------------------------------------ gnetmdk.chip.export
def test_gti_files_hold_the_chip_models_integers_device_cpu(step4, tmp_path):
    """write_gti_files: filter.txt / bias.txt are W_int / 2^s and b_int / 2^s per layer in OIHW order
    (exact), relu_cap.txt the calibrated caps, the dat / model JSON describe the major layers and output."""
    _, cm, _, caps = step4
    paths = export.write_gti_files(cm, str(tmp_path / "gti"), data_file="chip.dat")
    assert sorted(paths) == ["bias", "dat", "filter", "model", "relu_cap"]
    assert os.path.basename(paths["dat"]) == "5801_gnetdet_dat_224.json"
    assert os.path.basename(paths["model"]) == "5801_gnetdet_model_224.json"
    w = np.array([float(v) for v in open(paths["filter"]).read().split()])
    b = np.array([float(v) for v in open(paths["bias"]).read().split()])
    assert len(w) == sum(l.weight.size for l in cm.layers) and len(b) == sum(l.bias.size for l in cm.layers)
    ow = ob = 0
    for l in cm.layers:                 # the text gives back every integer exactly: x 2^s is W_int
        assert np.array_equal(w[ow:ow + l.weight.size] * 2.0 ** l.shift, l.weight.ravel().astype(np.float64))
        assert np.array_equal(b[ob:ob + l.bias.size] * 2.0 ** l.shift, l.bias.astype(np.float64))
        ow, ob = ow + l.weight.size, ob + l.bias.size
    assert (w[-(cm.output_channels - cm.used_channels) * cm.layers[-1].in_channels * 9:] == 0).all()
    written_caps = [float(v) for v in open(paths["relu_cap"]).read().split()]
    # 8 significant digits in the text: equal to the caps to that precision
    assert written_caps == pytest.approx(caps, rel=1e-7)
    dat = json.load(open(paths["dat"]))
    assert dat == export.dat_json(cm)
    assert dat["model"] == [{"ChipType": 5801, "MajorLayerNumber": len(cm.major_layers())}]
    assert [s for m in dat["layer"] for s in m["scaling"]] == [l.shift for l in cm.layers]
    assert sum(m["sublayer_number"] for m in dat["layer"]) == len(cm.layers)
    assert [m["major_layer"] for m in dat["layer"]] == list(range(1, len(cm.major_layers()) + 1))
    mod = json.load(open(paths["model"]))
    cnn = mod["layer"][1]
    assert mod["layer"][0]["output height"] == mod["layer"][0]["output width"] == 224
    assert (cnn["data file"], cnn["output channels"], cnn["output height"]) == ("chip.dat", 16, 14)


def test_gti_relu_cap_file_keeps_a_matching_calibration_file_device_cpu(step4, tmp_path):
    """Without calibrated caps relu_cap.txt is 31 per conv, unless out_dir already holds one cap per conv
    ending in cap_last (calibration's file), which is kept unchanged."""
    _, cm, _, _ = step4
    bare = copy.deepcopy(cm)
    for l in bare.layers:
        l.calibrated_cap = None
    n = len(bare.layers)
    cap_file = tmp_path / "relu_cap.txt"
    texts = export.gti_file_texts(bare, str(tmp_path))
    assert texts[str(cap_file)] == "31\n" * n
    kept = "".join(f"{1.0 + i / 8:.8g}\n" for i in range(n - 1)) + f"{bare.cap_last:.8g}\n"
    cap_file.write_text(kept)
    assert str(cap_file) not in export.gti_file_texts(bare, str(tmp_path))
    export.write_gti_files(bare, str(tmp_path))
    assert cap_file.read_text() == kept
    cap_file.write_text("2\n" * n)                   # last cap is not cap_last: replaced
    export.write_gti_files(bare, str(tmp_path))
    assert cap_file.read_text() == "31\n" * n


# ------------------------------------------------------------------ gnetmdk.models.gnetdet.family
def _gnetdet_cfg(*over):
    return build_config(BaseConfig, ["image_size", "224", "width_mult", "0.0625", *over])


def test_gnetdet_family_build_takes_config_and_overrides_device_cpu():
    """GNetDetFamily.build: architecture and training settings from the config, keyword overrides win, a
    builder replaces the constructor; describe / compat_fields / output_cap_limit follow the config."""
    fam = gfamily.GNetDetFamily()
    assert (fam.name, fam.input_kind, fam.target_kind) == ("gnetdet", "chip_codes", "dense")
    assert set(gfamily.QUANTIZED_STAGES) < set(fam.stages)
    cfg = _gnetdet_cfg("l_coord", "3.5", "box_slots", "1", "weight_scale", "mse")
    m = fam.build(cfg)
    meta = m.meta()
    assert (meta["num_classes"], meta["image_size"], meta["width_mult"]) == (cfg.num_classes, 224, 0.0625)
    assert meta["weight_scale"] == "mse" and meta["gain_aware"] is True
    assert m.loss_weights["l_coord"] == 3.5 and m.loss_weights["box_slots"] == 1
    assert fam.training_kwargs(cfg)["l_coord"] == 3.5
    assert fam.build(cfg, num_classes=5).num_classes == 5
    seen = {}
    assert fam.build(cfg, builder=lambda **kw: seen.update(kw) or "built") == "built"
    assert seen["width_mult"] == 0.0625 and seen["chip"] == "5801" and seen["l_coord"] == 3.5
    assert fam.describe(cfg) == "224px x0.0625"
    assert fam.compat_fields(cfg) == {"image_size": 224, "width_mult": 0.0625, "head_width_mult": 0.0, "chip": "5801"}
    # the output cap rule: 2 x 1 for the linear heads; a model's logit head replaces the config's
    assert fam.output_cap_limit(cfg) == 2.0
    logit = GNetDet(num_classes=2, image_size=224, width_mult=0.0625, score_head="logit", score_offset=1.0)
    assert fam.output_cap_limit(cfg, logit) == 2.0 * (1.0 + math.log(99.0))
    assert fam.output_cap_limit(_gnetdet_cfg("output_cap_max", "3")) == 3.0


def test_gnetdet_family_rebuild_keeps_a_quantized_checkpoints_settings_device_cpu(capsys):
    """GNetDetFamily.rebuild: a step-1 checkpoint takes the config's weight rule, weight formats and gain_aware;
    a step-3 one keeps its own (gain_aware False when it predates the option), with notes on stderr."""
    fam = gfamily.GNetDetFamily()
    cfg = _gnetdet_cfg("weight_scale", "gti")                 # gain_aware true, mask_bits [] (chip default)
    old = GNetDet(num_classes=3, image_size=224, width_mult=0.0625, weight_scale="mse",
                  mask_bits=[8, 8, 8, 8, 8, 8]).meta()
    del old["gain_aware"]                                     # a checkpoint from before the option
    s1 = fam.rebuild(old, cfg, stage="step1", path="s1.pth").meta()
    default = fam._config_mask_bits(cfg, old)
    assert (s1["weight_scale"], s1["mask_bits"], s1["gain_aware"]) == ("gti", default, True)
    assert default == GNetDet(num_classes=3, image_size=224, width_mult=0.0625).meta()["mask_bits"] != [8] * 6
    err = capsys.readouterr().err
    assert "s1.pth (step1, float) recorded mask_bits [8, 8, 8, 8, 8, 8]" in err.replace("'", "")
    s3 = fam.rebuild(old, cfg, stage="step3", path="s3.pth").meta()
    assert (s3["weight_scale"], s3["mask_bits"], s3["gain_aware"]) == ("mse", [8] * 6, False)
    err = capsys.readouterr().err
    assert "weight_scale 'mse'; keeping it" in err and "gain_aware False; keeping it" in err
    assert "mask_bits [8, 8, 8, 8, 8, 8]; keeping them" in err
    assert "name" in old and "gain_aware" not in old          # the caller's meta is not modified


def test_gnetdet_family_data_and_training_hooks_device_cpu():
    """encode_targets puts a box in its centre cell (grid from the config), leading_parameters lists the
    first n sublayers' parameters, loss_line prints the known terms in a fixed order."""
    fam = gfamily.GNetDetFamily()
    cfg = _gnetdet_cfg()
    t = fam.encode_targets(np.array([[0.5, 0.25, 0.75, 0.75]]), np.array([1]), np.ones(1), cfg)
    assert t.shape == (14, 14, 10 + cfg.num_classes) and t.dtype == np.float32
    row, col = int(0.5 * 14), int(0.625 * 14)
    assert np.count_nonzero(t[..., 4]) == 1 and t[row, col, 4] == t[row, col, 9] == 1.0
    assert t[row, col, 10 + 1] == 1.0 and t[row, col, 2] == np.float32(0.25) and t[row, col, 3] == np.float32(0.5)
    m = fam.build(cfg)
    lead = fam.leading_parameters(m, 2)
    assert [id(p) for p in lead] == [id(p) for l in m.layers[:2] for p in l.parameters()]
    assert lead and fam.leading_parameters(m, 0) == []
    assert len(fam.leading_parameters(m, 100)) == len(list(m.layers.parameters()))
    line = fam.loss_line({"total": 1.23456, "cls": 0.5, "other": 9.0, "loc": 0.25})
    assert line == "loss 1.2346 (loc 0.250 cls 0.500)"
    assert fam.configure(m, cfg) == []                        # this small model fits the chip either way
    cfg.gnetdet.cap_percentile = 0.0
    with pytest.raises(ConfigError, match="gnetdet.cap_percentile"):
        fam.check_config(cfg)


# ------------------------------------------------------------------ gnetmdk.models.ppyolo.head
def test_head_output_channels_and_prior_layout_device_cpu():
    """YOLOv3Head: per level (N, na (5 + C [+1]), H, W); on zero features the output is the bias, and
    split_level reads the objectness prior logit at every anchor and cell, zeros elsewhere."""
    torch.manual_seed(0)
    for iou_aware in (False, True):
        h = yhead.YOLOv3Head([8, 4], [3, 2], num_classes=4, iou_aware=iou_aware, obj_prior=0.2)
        feats = [torch.zeros(2, 8, 3, 5), torch.zeros(2, 4, 6, 10)]
        outs = h(feats)
        per = 5 + 4 + int(iou_aware)
        assert [tuple(o.shape) for o in outs] == [(2, 3 * per, 3, 5), (2, 2 * per, 6, 10)]
        for o, na in zip(outs, [3, 2]):
            parts = yhead.split_level(o, na, 4, iou_aware)
            prior = torch.full((2, na, o.shape[2], o.shape[3]), math.log(0.2 / 0.8), dtype=torch.float32)
            assert torch.equal(parts["obj"], prior)
            for k in ("tx", "ty", "tw", "th"):
                assert torch.equal(parts[k], torch.zeros_like(prior))
            assert torch.equal(parts["cls"], torch.zeros(2, na, o.shape[2], o.shape[3], 4))
            assert (parts["iou"] is None) == (not iou_aware)
            if iou_aware:
                assert torch.equal(parts["iou"], torch.zeros_like(prior))
    plain = yhead.YOLOv3Head([8], [3], num_classes=1, obj_prior=None)
    assert torch.count_nonzero(plain.outputs[0].bias) == 0


def test_head_refuses_bad_arguments_device_cpu():
    """YOLOv3Head refuses mismatched levels, no classes, a prior outside (0, 1) and a wrong feature count."""
    with pytest.raises(ValueError, match=r"in_channels \(2 levels\) and num_anchors \(1 levels\)"):
        yhead.YOLOv3Head([8, 4], [3], num_classes=2)
    with pytest.raises(ValueError, match="num_classes must be >= 1, got 0"):
        yhead.YOLOv3Head([8], [3], num_classes=0)
    with pytest.raises(ValueError, match="obj_prior must be in"):
        yhead.YOLOv3Head([8], [3], num_classes=2, obj_prior=1.0)
    h = yhead.YOLOv3Head([8, 4], [3, 3], num_classes=2)
    with pytest.raises(ValueError, match="YOLOv3Head has 2 levels, got 1 feature maps"):
        h([torch.zeros(1, 8, 2, 2)])


def test_decode_level_boxes_at_zero_t_are_cell_centred_anchors_device_cpu():
    """With t = 0 and scale_x_y 1 every box is its anchor (relative to the H*s x W*s image) centred on its
    cell; grid_offsets stays in [-(k-1)/2, (k+1)/2] for scale k."""
    h, w, s = 4, 2, 8                                       # 32 x 16 px image
    out = torch.zeros(1, 2 * (5 + 1), h, w)
    boxes = yhead.decode_level_boxes(yhead.split_level(out, 2, 1, False), [[8, 16], [4, 4]], s, 1.0)
    assert boxes.shape == (1, 2, h, w, 4)
    for a, (aw, ah) in enumerate([(8, 16), (4, 4)]):
        for j in range(h):
            for i in range(w):
                cx, cy, bw, bh = (i + 0.5) / w, (j + 0.5) / h, aw / (w * s), ah / (h * s)
                want = torch.tensor([cx - bw / 2, cy - bh / 2, cx + bw / 2, cy + bh / 2])
                assert torch.equal(boxes[0, a, j, i], want), (a, j, i)
    t = torch.tensor([-1e4, 0.0, 1e4])
    assert torch.equal(yhead.grid_offsets(t, 1.0), torch.sigmoid(t))
    off = yhead.grid_offsets(t, 1.05)
    # float32 arithmetic of 1.05 * sigmoid - 0.025 against the decimal bounds: within a few ulps
    assert off.tolist() == pytest.approx([-0.025, 0.5, 1.025], abs=1e-6)


# ------------------------------------------------------------------ gnetmdk.models.ppyolo.quant
def _tiny_ppyolo(**kw):
    """A narrow 3-level PP-YOLO r18vd with non-trivial BatchNorm statistics, in eval mode."""
    from gnetmdk.models.ppyolo.model import PPYOLO, PPYOLO_R50VD
    args = dict(PPYOLO_R50VD, depth=18, num_classes=3, neck_channels=[16, 8, 4], route_channels=[8, 4],
                dcn_v2_stages=[], coord_conv=False)
    args.update(kw)
    torch.manual_seed(0)
    m = PPYOLO(**args).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, nn.BatchNorm2d):
                mod.running_mean.uniform_(-0.2, 0.2, generator=g)
                mod.running_var.uniform_(0.5, 2.0, generator=g)
                mod.weight.uniform_(0.5, 1.5, generator=g)
                mod.bias.uniform_(-0.3, 0.3, generator=g)
    return m


def test_quant_limits_name_the_fields():
    """quant_limits: nothing for a plain model; one reason per unsupported option, naming field and fix."""
    assert yquant.quant_limits([], False) == [] and yquant.quant_limits((), False) == []
    reasons = yquant.quant_limits((2, 3), True)
    assert len(reasons) == 2
    assert reasons[0].startswith("ppyolo.dcn_v2_stages [2, 3]: deformable convs") and "dcn_v2_stages []" in reasons[0]
    assert reasons[1].startswith("ppyolo.coord_conv true") and "coord_conv false" in reasons[1]


def test_fold_bn_keeps_outputs_and_structure_device_cpu():
    """fold_bn_ replaces each BatchNorm by the folded conv bias (outputs kept), skips folded units, gives
    the bias the weight's requires_grad; structure_only keeps the weights with bias 0; a DCN is refused."""
    torch.manual_seed(0)
    net = nn.Sequential(ConvBNLayer(3, 4, 3, 1, act="relu"), ConvBNLayer(4, 2, 1, 2, act=None))
    with torch.no_grad():
        for bn in (net[0].bn, net[1].bn):
            bn.running_mean.uniform_(-1, 1)
            bn.running_var.uniform_(0.5, 2)
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-0.5, 0.5)
    net.eval()
    net[1].conv.weight.requires_grad_(False)
    x = torch.randn(2, 3, 6, 6)
    with torch.no_grad():
        ref = net(x)
        w0 = net[0].conv.weight.clone()
        bn0 = copy.deepcopy(net[0].bn)
        assert yquant.fold_bn_(net) == 2
        assert all(isinstance(u.bn, nn.Identity) for u in net)
        # float64 folding vs float32 BN after the conv: a few ulps apart
        torch.testing.assert_close(net(x), ref, rtol=0, atol=1e-5)
        inv = bn0.weight.double() / torch.sqrt(bn0.running_var.double() + bn0.eps)
        assert torch.equal(net[0].conv.bias, (bn0.bias.double() - bn0.running_mean.double() * inv).float())
        assert torch.equal(net[0].conv.weight, (w0.double() * inv.view(-1, 1, 1, 1)).float())
    assert net[0].conv.bias.requires_grad and not net[1].conv.bias.requires_grad
    assert yquant.fold_bn_(net) == 0
    fresh = nn.Sequential(ConvBNLayer(3, 4, 3, 1))
    w = fresh[0].conv.weight.detach().clone()
    assert yquant.fold_bn_(fresh, structure_only=True) == 1
    assert torch.equal(fresh[0].conv.weight, w) and torch.equal(fresh[0].conv.bias, torch.zeros(4))
    with pytest.raises(ValueError, match="0: a DeformConv2d cannot be folded"):
        yquant.fold_bn_(nn.Sequential(ConvBNLayer(4, 4, 3, 1, dcn=True)))


def test_ppyolo_graph_runs_as_the_folded_model_device_cpu():
    """ppyolo_graph of a folded PP-YOLO: one quantized conv node per conv unit, one add per residual
    block, the head convs last as outputs; run by gnetmdk.intq with quantizers off it gives the folded
    model's outputs bit for bit. A model with CoordConv is refused."""
    from gnetmdk.intq.graph import make_quantizers, run_graph
    m = _tiny_ppyolo()
    x = torch.randint(0, 256, (1, 3, 64, 64), generator=torch.Generator().manual_seed(2)).float()
    n_units = sum(isinstance(u, ConvBNLayer) for u in m.modules())
    assert yquant.fold_bn_(m) == n_units
    nodes = yquant.ppyolo_graph(m)
    ops = [n.op for n in nodes]
    assert ops[0] == "input" and ops.count("add") == sum(len(s) for s in m.backbone.stages)
    assert ops.count("conv") == n_units + len(m.head.outputs)
    assert [n.output for n in nodes[-3:]] == ["head.outputs.0", "head.outputs.1", "head.outputs.2"]
    assert all(n.quant is None for n in nodes[-3:]) and all(n.quant for n in nodes if n.op in ("add", "concat"))
    assert sum(n.pool for n in nodes) == 3                     # the ResNet-D shortcuts of stages 1..3
    with torch.no_grad():
        want = m(x)
        got = run_graph(m, nodes, x, make_quantizers(nodes), None, normalize=m.normalize)
    assert len(got) == 3 and all(torch.equal(a, b) for a, b in zip(got, want))
    coord = _tiny_ppyolo(coord_conv=True)
    yquant.fold_bn_(coord)
    with pytest.raises(ValueError, match="CoordConv is not supported by the integer model"):
        yquant.ppyolo_graph(coord)


# ------------------------------------------------------------------ gnetmdk.models.ppyolo.resnet_vd
@pytest.mark.parametrize("depth,return_idx,widths", [(18, [0, 2], [64, 256]), (50, [1], [512])])
def test_resnet_vd_stage_shapes_on_odd_inputs_device_cpu(depth, return_idx, widths):
    """ResNet-vd returns the named stages, shallow to deep, at side ceil(side / stride) for any input
    side (stem, pool and every strided block round up); stages after the last named are not built."""
    torch.manual_seed(0)
    m = resnet_vd.ResNetVd(depth, return_idx=return_idx).eval()
    assert len(m.stages) == max(return_idx) + 1
    assert m.out_channels == widths and m.out_strides == [4 * 2 ** i for i in return_idx]
    h, w = 37, 50
    with torch.no_grad():
        outs = m(torch.randn(1, 3, h, w))

    def side(n, stride):                                       # halve, rounding up, log2(stride) times
        for _ in range(int(math.log2(stride))):
            n = math.ceil(n / 2)
        return n
    assert [tuple(o.shape) for o in outs] == [(1, c, side(h, s), side(w, s)) for c, s in zip(widths, m.out_strides)]


def test_resnet_vd_blocks_compute_their_formula_device_cpu():
    """BasicBlock without projection is relu(branch2b(branch2a(x)) + x); a strided BottleneckBlock gives
    4 x ch_out channels at half the side, its shortcut the ResNet-D avg pool + 1x1 conv."""
    torch.manual_seed(0)
    blk = resnet_vd.BasicBlock(8, 8, 1, shortcut=True).eval()
    assert blk.short is None
    x = torch.randn(2, 8, 5, 5)
    with torch.no_grad():
        assert torch.equal(blk(x), torch.relu(blk.branch2b(blk.branch2a(x)) + x))
        bot = resnet_vd.BottleneckBlock(8, 4, 2, shortcut=False).eval()
        y = bot(x)
        assert y.shape == (2, 16, 3, 3)
        assert isinstance(bot.short[0], nn.AvgPool2d) and bot.short[1].conv.kernel_size == (1, 1)
        want = torch.relu(bot.branch2c(bot.branch2b(bot.branch2a(x))) + bot.short[1](
            F.avg_pool2d(x, 2, 2, ceil_mode=True, count_include_pad=False)))
        assert torch.equal(y, want)


@pytest.mark.parametrize("kwargs,needle", [
    (dict(return_idx=[]), r"return_idx must name at least one stage in 0..3, got \[\]"),
    (dict(dcn_v2_stages=[3, 3]), r"dcn_v2_stages must be strictly increasing without repeats, got \[3, 3\]"),
    (dict(return_idx=[-1]), r"return_idx has stage indices \[-1\] outside 0..3"),
    (dict(freeze_at="1"), "freeze_at must be an int in -1..3"),
])
def test_resnet_vd_refuses_bad_stage_arguments_device_cpu(kwargs, needle):
    """ResNetVd refuses empty / repeated / out-of-range stage lists and a non-int freeze_at."""
    with pytest.raises(ValueError, match=needle):
        resnet_vd.ResNetVd(18, **kwargs)
