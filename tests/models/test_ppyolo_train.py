"""PP-YOLO as a family of the trainer (device cpu): a tiny r18vd on real cards images through train.py and
train-dist.py (2 processes equal 1 on the same recorded batches), multi-scale sizes the same on every
rank of an iteration, COCO-json data with COCO mAP, tools/xml_2_json.py, and tools/convert_weights.py on a
Paddle-format file written by the test."""
from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch

from dist_helpers import DIFF_WEIGHTS, ROOT, TRAIN, TRAIN_DIST, assert_bit_identical, diff_weights, run
from gnetmdk.checkpoint.io import load_checkpoint
from gnetmdk.models.rebuild import build_model_from_checkpoint
from gnetmdk.config import build_config, load_config_class

torch.set_num_threads(1)

DATA = os.path.join(os.path.dirname(ROOT), "shared", "data")
CARDS = os.path.join(DATA, "cards")
CLASSES = ["nine", "ten", "jack", "queen", "king", "ace"]
needs_cards = pytest.mark.skipif(not os.path.isdir(CARDS), reason="cards dataset not present")

CONFIG = '''
from gnetmdk.config import BaseConfig
from gnetmdk.models.ppyolo.config import R18VD


class Config(BaseConfig):
    model_name = "ppyolo"
    DS_NAME = "cards"
    VOC_CLASSES = {classes!r}
    dataset_path = {dataset!r}
    meta_root = {root!r} + "/meta"
    image_size = 64
    ppyolo = dict(R18VD, train_sizes=[64, 96, 128], mixup_epochs=2, max_boxes=20)
    batch_size = 4
    max_train_images = 8
    max_val_images = 4
    num_workers = 0
    threads = 1
    device = "cpu"
    num_epochs = 1
    warmup_epochs = 0
    learning_rate = 1e-3
    progress = False
'''


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    from gnetmdk.dataset.voc import convert_voc_to_coco, convert_voc_to_meta
    root = str(tmp_path_factory.mktemp("ppyolo"))
    convert_voc_to_meta(CARDS, CLASSES, os.path.join(root, "meta", "cards_train.txt"),
                        os.path.join(root, "meta", "cards_valid.txt"))
    convert_voc_to_coco(CARDS, CLASSES, os.path.join(root, "json", "cards_train.json"),
                        os.path.join(root, "json", "cards_valid.json"))
    path = os.path.join(root, "config.py")
    with open(path, "w") as fh:
        fh.write(CONFIG.format(classes=CLASSES, dataset=CARDS, root=root))
    return root, path


def _out(root, name):
    d = os.path.join(root, name)
    return ["checkpoint_root", os.path.join(d, "checkpoint"), "log_root", os.path.join(d, "log"),
            "model_root", os.path.join(d, "model")]


@needs_cards
def test_ppyolo_trains_evaluates_and_rebuilds_from_its_checkpoint(ws, capsys):
    """train.py --step 1 on PP-YOLO: the family's loss terms on the epoch line, COCO and VOC mAP, a
    checkpoint whose model rebuilds (strict) and evaluates with tools/eval_voc.py."""
    from gnetmdk.engine.cli import main
    root, path = ws
    assert main(["--config", path, "--step", "1", "eval_coco", "true", *_out(root, "a")]) == 0
    out = capsys.readouterr().out
    assert "model ppyolo r18vd, 2 levels, eval 64px, train 64-128px" in out
    line = next(l for l in out.splitlines() if "epoch 1/1" in l)
    import re
    for term in ("xy", "wh", "obj", "cls", "iou"):
        assert re.search(rf"[ (]{term} \d", line), (term, line)
    assert "COCO mAP" in line
    ck = load_checkpoint(os.path.join(root, "a", "checkpoint", "step1", "best.pth"))
    assert ck["model_meta"]["name"] == "ppyolo" and ck["config"]["ppyolo"]["depth"] == 18
    model = build_model_from_checkpoint(ck, build_config(load_config_class(path), [], step=1))
    assert sum(p.numel() for p in model.parameters()) > 1e6
    spec = __import__("importlib.util").util.spec_from_file_location("eval_voc", os.path.join(ROOT, "tools", "eval_voc.py"))
    tool = __import__("importlib.util").util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.main([os.path.join(root, "a", "checkpoint", "step1", "best.pth"), "--config", path, "--coco"]) == 0
    assert "COCO mAP@[.5:.95]" in capsys.readouterr().out


def _tool(name):
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "tools", name + ".py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


@needs_cards
def test_ppyolo_quantized_stages_integer_export_and_check_device_cpu(ws, capsys):
    """PP-YOLO through step 2, cal, step 3 and step 4 (BatchNorm folded, per-channel weights, uint8
    ranges, integer evaluation); tools/export_int.py writes the integer ONNX model and its --check finds
    0 mismatches on every layer; convert_to_chip refuses with the reason; step 3 without calibration
    and a deformable-conv config are refused."""
    from gnetmdk.engine.cli import main
    root, path = ws
    out = _out(root, "q")
    assert main(["--config", path, "--step", "1", *out]) == 0
    assert main(["--config", path, "--step", "3", *out]) == 2                 # no cal.pth yet
    assert "run calibration first" in capsys.readouterr().err
    assert main(["--config", path, "--step", "2", *out]) == 0
    log = capsys.readouterr().out
    assert "folded 28 BatchNorm layers" in log and "38 activation quantizers" in log
    ck = load_checkpoint(os.path.join(root, "q", "checkpoint", "step2", "best.pth"))
    assert ck["model_meta"]["quant"] == {"weight_bits": 8, "weight_scale": "max"}
    assert not any(k.endswith("running_var") for k in ck["model"])
    assert main(["--config", path, "--cal", *out]) == 0
    assert "range widths (least squared uint8 error" in capsys.readouterr().out
    ranges = open(os.path.join(root, "q", "model", "act_ranges.txt")).read().split("\n")
    assert len([r for r in ranges if r]) == 38 and ranges[0].startswith("input -")
    # 2 processes (gloo) calibrate to the same ranges bit for bit: MIN / MAX all-reduced, histogram
    # counts summed
    from dist_helpers import TRAIN_DIST, run
    step2 = os.path.join(root, "q", "checkpoint", "step2", "best.pth")
    r = run([TRAIN_DIST, "--config", path, "--cal", "--gpus", "2", "load", step2, *_out(root, "q2")], root,
            timeout=300).check()
    assert "batch 4 (2 x 2)" in r.stdout
    assert open(os.path.join(root, "q2", "model", "act_ranges.txt")).read() == "\n".join(ranges)
    q1 = load_checkpoint(os.path.join(root, "q", "checkpoint", "step2", "cal.pth"))["model"]
    q2 = load_checkpoint(os.path.join(root, "q2", "checkpoint", "step2", "cal.pth"))["model"]
    assert all(torch.equal(q1[k], q2[k]) for k in q1 if k.startswith("quant."))
    assert main(["--config", path, "--step", "3", *out]) == 0
    assert main(["--config", path, "--step", "4", *out]) == 0
    assert "evaluation runs the integer model" in capsys.readouterr().out
    step4 = os.path.join(root, "q", "checkpoint", "step4", "best.pth")
    tool = _tool("export_int")
    assert tool.main([step4, "--config", path, "--check", "--out", os.path.join(root, "q", "model")]) == 0
    text = capsys.readouterr().out
    assert "EQUAL: 0 code mismatches in 44 layers, 0 output differences" in text
    assert os.path.isfile(os.path.join(root, "q", "model", "int_model.onnx"))
    # step 4 with the runtime's conv rounding: its integer export is still equal, and its QDQ export run
    # by onnxruntime (uint8 weights: no 16-bit saturation on any x86 CPU) meets the goal
    step3 = os.path.join(root, "q", "checkpoint", "step3", "best.pth")
    assert main(["--config", path, "--step", "4", "ppyolo.requant", "float", "load", step3, *_out(root, "qf")]) == 0
    assert "step 4's conv requantization: float (ppyolo.requant)" in capsys.readouterr().out
    step4f = os.path.join(root, "qf", "checkpoint", "step4", "best.pth")
    assert load_checkpoint(step4f)["model_meta"]["quant"]["requant"] == "float"
    qf_model = os.path.join(root, "qf", "model")
    assert tool.main([step4f, "--config", path, "--check", "--out", qf_model]) == 0
    assert "EQUAL: 0 code mismatches in 44 layers" in capsys.readouterr().out
    assert tool.main([step4f, "--config", path, "--format", "qdq", "--weights", "uint8", "--check",
                      "--out", qf_model]) == 0
    text = capsys.readouterr().out
    assert "QDQ model of 44 ops" in text and "requant float" in text and "WITHIN GOAL" in text, text
    assert os.path.isfile(os.path.join(qf_model, "qdq_model.onnx"))
    with pytest.raises(SystemExit) as stop:
        tool.main([step4f, "--config", path, "--weights", "uint8"])
    assert stop.value.code == 2
    assert "--weights applies to --format qdq only" in capsys.readouterr().err
    import onnxruntime
    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        assert tool.main([step4f, "--config", path, "--format", "qdq", "--check", "--provider", "cuda"]) == 2
        assert "no CUDAExecutionProvider" in capsys.readouterr().err
    assert tool.main([step3, "--config", path, "--out", os.path.join(root, "q", "x")]) == 2
    assert "not step4" in capsys.readouterr().err
    assert tool.main([step3, "--config", path, "--format", "qdq", "--out", os.path.join(root, "q", "x")]) == 2
    assert "not step4" in capsys.readouterr().err
    assert tool.main([os.path.join(root, "q", "none.pth"), "--config", path]) == 2
    assert "none.pth" in capsys.readouterr().err
    assert not os.path.exists(os.path.join(root, "q", "x"))
    assert _tool("convert_to_chip").main([step4, "--out", os.path.join(root, "q", "chip")]) == 2
    assert "PP-YOLO model, which the chip cannot run" in capsys.readouterr().err
    assert main(["--config", path, "--step", "2", "ppyolo.dcn_v2_stages", "[3]", *_out(root, "dcn")]) == 2
    assert "deformable convs (DCNv2) have no integer form" in capsys.readouterr().err


@needs_cards
def test_multiscale_size_is_the_same_on_every_rank_of_an_iteration(ws):
    """The multi-scale size comes from (seed, epoch, global batch index): two ranks' halves of a global
    batch get the same size, and the sizes of an epoch are not all one."""
    from gnetmdk.dataset.dataset import build_dataset
    from gnetmdk.dist.sampler import EpochBatches, GlobalBatchSampler
    root, path = ws
    cfg = build_config(load_config_class(path), ["max_train_images", "40", "batch_size", "4"], step=1)
    ds = build_dataset(cfg, "train")
    sizes = {}
    for rank in (0, 1):
        s = GlobalBatchSampler(len(ds), 4, rank, 2, shuffle=True, seed=0)
        s.set_epoch(3)
        for b, keys in enumerate(EpochBatches(s)):
            got = {tuple(ds[k][0].shape) for k in keys}
            assert len(got) == 1
            assert sizes.setdefault(b, got) == got, (b, rank)
    assert len({v.pop()[1] for v in sizes.values()}) > 1


@needs_cards
def test_two_processes_equal_one_process(ws):
    """--deterministic (augmentation and DropBlock off, fixed size): 2 processes x 2 record 3 iterations
    from fresh weights, 1 process replays them as 2 virtual ranks: weights, BatchNorm buffers, optimizer
    state and every loss term bit for bit (docs/alignment.md)."""
    root, path = ws
    rec = os.path.join(root, "rec")
    common = ["--config", path, "--step", "1", "--deterministic", "num_epochs", "3", "eval_before", "false"]
    a = run([TRAIN_DIST, *common, "--gpus", "2", "--max-iters", "3", "--save-npz", rec, *_out(root, "d2")],
            root, timeout=300).check()
    assert "DropBlock off" in a.stdout and "2 x 2" in a.stdout
    b = run([TRAIN, *common, "--replay-npz", rec, *_out(root, "d1")], root, timeout=300).check()
    assert "2 virtual ranks" in b.stdout and "every loss term equal" in b.stdout
    lines = [l for l in b.stdout.splitlines() if l.startswith("[replay] iteration")]
    assert len(lines) == 3 and all(float(l.split(" diff ")[1].split()[0]) == 0.0 for l in lines), lines
    pa = os.path.join(root, "d2", "checkpoint", "step1", "last.pth")
    pb = os.path.join(root, "d1", "checkpoint", "step1", "last.pth")
    assert_bit_identical(pa, pb)


@needs_cards
def test_quantized_stages_two_processes_equal_virtual_ranks(ws):
    """PP-YOLO's integer target: calibration on 2 processes and on one process of 2 virtual ranks gives the
    same ranges (multi-level outputs concatenated per level), and step 3 (fake-quantized, BatchNorm
    folded) recorded on 2 processes replays bit for bit on one."""
    root, path = ws
    c = ["--config", path, "eval_before", "false", "num_epochs", "3"]
    run([TRAIN, *c, "--step", "1", "--max-iters", "2", *_out(root, "q1")], root, timeout=300).check()
    run([TRAIN, *c, "--step", "2", "--max-iters", "2", "load", os.path.join(root, "q1", "checkpoint", "step1", "last.pth"),
         *_out(root, "q2")], root, timeout=300).check()
    step2 = os.path.join(root, "q2", "checkpoint", "step2", "last.pth")
    cals = {}
    for name, launcher, extra in (("c2", TRAIN_DIST, ["--gpus", "2"]), ("cv", TRAIN, ["virtual_ranks", "2"])):
        r = run([launcher, *c, "--cal", *extra, "load", step2, *_out(root, "q" + name)], root, timeout=300).check()
        assert "batch 4 (2 x 2" in r.stdout
        cals[name] = os.path.join(root, "q" + name, "checkpoint", "step2", "cal.pth")
    assert_bit_identical(cals["c2"], cals["cv"])
    ranges = [open(os.path.join(root, "q" + n, "model", "act_ranges.txt")).read() for n in ("c2", "cv")]
    assert ranges[0] == ranges[1] and len(ranges[0].splitlines()) > 10
    rec = os.path.join(root, "rec3")
    run([TRAIN_DIST, *c, "--step", "3", "--deterministic", "--gpus", "2", "--max-iters", "3", "load", cals["c2"],
         "--save-npz", rec, *_out(root, "q3a")], root, timeout=300).check()
    b = run([TRAIN, *c, "--step", "3", "--deterministic", "--replay-npz", rec, *_out(root, "q3b")], root,
            timeout=300).check()
    assert "every loss term equal" in b.stdout
    assert_bit_identical(os.path.join(root, "q3a", "checkpoint", "step3", "last.pth"),
                         os.path.join(root, "q3b", "checkpoint", "step3", "last.pth"))


@needs_cards
def test_amp_accumulation_and_resume_give_the_uninterrupted_weights(ws):
    """bf16 autocast and 2 micro-batches per step, 2 epochs of 2 steps: a run cut after 3 iterations
    and resumed ends with the uninterrupted run's weights bit for bit (the multi-scale sizes, the
    augmentation draws and the optimizer state continue where they stopped)."""
    from gnetmdk.engine.cli import main
    root, path = ws
    common = ["--config", path, "--step", "1", "amp", "true", "accumulate", "2", "num_epochs", "2",
              "eval_before", "false"]
    assert main(common + _out(root, "full")) == 0
    assert main(common + ["max_iters", "3"] + _out(root, "cut")) == 0
    cut = load_checkpoint(os.path.join(root, "cut", "checkpoint", "step1", "last.pth"))
    assert cut["iteration"] == 3
    assert main(common + ["--resume"] + _out(root, "cut")) == 0
    a = load_checkpoint(os.path.join(root, "full", "checkpoint", "step1", "last.pth"))
    b = load_checkpoint(os.path.join(root, "cut", "checkpoint", "step1", "last.pth"))
    assert a["iteration"] == b["iteration"] == 4
    assert a["model"].keys() == b["model"].keys()
    for k, v in a["model"].items():
        assert torch.equal(v, b["model"][k]), k
    assert any(not torch.equal(v, cut["model"][k]) for k, v in a["model"].items() if v.is_floating_point())


@needs_cards
def test_evaluations_leave_the_training_weights_alone_device_cpu(ws):
    """2 epochs of 2 steps with DropBlock (which draws from torch's global generator): evaluated before
    training and after every epoch, or only after the last, the last weights are the same bits, and
    DropBlock is what could tell them apart (off, the weights differ from the run with it on). A
    DataLoader without a generator of its own draws from the global one each time it is iterated."""
    from gnetmdk.engine.cli import main
    root, path = ws
    common = ["--config", path, "--step", "1", "num_epochs", "2", "device", "cpu"]
    assert main(common + ["eval_interval", "1", "eval_before", "true"] + _out(root, "ev1")) == 0
    assert main(common + ["eval_interval", "2", "eval_before", "false"] + _out(root, "ev2")) == 0
    assert main(common + ["eval_interval", "2", "eval_before", "false", "ppyolo.drop_block", "false"]
                + _out(root, "ev0")) == 0
    a, b, c = (load_checkpoint(os.path.join(root, n, "checkpoint", "step1", "last.pth"))["model"]
               for n in ("ev1", "ev2", "ev0"))
    assert a.keys() == b.keys()
    for k, v in a.items():
        assert torch.equal(v, b[k]), k
    assert any(not torch.equal(v, c[k]) for k, v in a.items() if v.is_floating_point())


@needs_cards
def test_coco_json_data_gives_the_meta_files_records(ws):
    from gnetmdk.dataset.records import load_records
    root, path = ws
    meta = build_config(load_config_class(path), [], step=1)
    coco = build_config(load_config_class(path), ["train_json", os.path.join(root, "json", "cards_train.json"),
                                                  "val_json", os.path.join(root, "json", "cards_valid.json")], step=1)
    for split in ("train", "valid"):
        a, b = load_records(meta, split), load_records(coco, split)
        assert len(a) == len(b) > 0
        for (na, ba, la), (nb, bb, lb) in zip(a, b):
            assert na == nb and np.array_equal(ba, bb) and np.array_equal(la, lb)


@needs_cards
def test_xml_2_json_tool(ws, tmp_path):
    out = tmp_path / "j"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "xml_2_json.py"), "--name", "cards",
                        "--dataset-dir", CARDS, "--classes", ",".join(CLASSES), "--out-dir", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    doc = json.load(open(out / "cards_train.json"))
    assert [c["name"] for c in doc["categories"]] == CLASSES and len(doc["images"]) == 296
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "xml_2_json.py"), "--name", "cards",
                        "--dataset-dir", str(tmp_path / "nothing"), "--classes", "a", "--out-dir", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("error:") and "Traceback" not in r.stderr


# ---------------------------------------------------------------------------------------------- weights
def test_convert_weights_tool_writes_a_checkpoint_train_can_load(ws, tmp_path):
    """A PaddleDetection-format r18vd file (names from the test's own statement of PaddleDetection's
    rules, tests/checkpoint/test_paddle_convert.py) -> tools/convert_weights.py -nc 6 -> a step-0 checkpoint with
    those tensors, which step 1 loads as its pretrained model; a malicious file is refused unexecuted."""
    from test_paddle_convert import fill, paddle_save_state_dict, pd_ppyolo
    root, path = ws
    shapes = pd_ppyolo(18, [2, 3], [], False, 0, True, False, [[3, 4, 5], [0, 1, 2]], 80, False)
    arrays = fill(shapes, seed=3)
    pd = paddle_save_state_dict(str(tmp_path / "ppyolo_r18vd_coco.pdparams"), arrays)
    out = tmp_path / "00.pth"
    tool = os.path.join(ROOT, "tools", "convert_weights.py")
    r = subprocess.run([sys.executable, tool, "-f", path, "-c", pd, "-oc", str(out), "-nc", "6"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    ck = load_checkpoint(str(out))
    assert ck["stage"] == "step0" and ck["model_meta"]["num_classes"] == 6
    w = ck["model"]["backbone.stem.0.conv.weight"]
    assert torch.equal(w, torch.from_numpy(arrays["backbone.conv1.conv1_1.conv.weight"]))
    assert torch.equal(ck["model"]["backbone.stem.0.bn.running_var"],
                       torch.from_numpy(arrays["backbone.conv1.conv1_1.norm._variance"]))
    head = ck["model"]["head.outputs.0.weight"]
    assert head.shape[0] == 3 * (5 + 6)
    # step 1 starts from it (as checkpoint/step0/best.pth: the pretrained model, matching tensors)
    step0 = os.path.join(root, "p", "checkpoint", "step0")
    os.makedirs(step0, exist_ok=True)
    os.replace(out, os.path.join(step0, "best.pth"))
    r = run([TRAIN, "--config", path, "--step", "1", "num_epochs", "0", *_out(root, "p")], root, timeout=300).check()
    assert "pretrained" in r.stdout and "skipped 0" in r.stdout
    # a file that asks to run code is refused, and nothing runs
    marker = tmp_path / "PWNED"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))
    evil = tmp_path / "evil.pdparams"
    evil.write_bytes(pickle.dumps({"x": Evil()}, protocol=2))
    r = subprocess.run([sys.executable, tool, "-f", path, "-c", str(evil), "-oc", str(tmp_path / "e.pth")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stderr.startswith("error:") and "not executed" in r.stderr
    assert not marker.exists() and not (tmp_path / "e.pth").exists()
    # another architecture: the keys do not map, exit 1, nothing written
    r = subprocess.run([sys.executable, tool, "-f", path, "-c", pd, "-oc", str(tmp_path / "x.pth"), "ppyolo.depth", "34"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and not (tmp_path / "x.pth").exists()


def test_coord_range_reaches_the_model_and_the_checkpoint_check(ws):
    """ppyolo.coord_range from the config builds CoordConvs with that range, is stored in the model's
    meta, and a checkpoint with the other range is refused by name (the same weights compute another
    function); a value out of the two is refused at start-up."""
    from gnetmdk.checkpoint.io import CheckpointError
    from gnetmdk.models.rebuild import check_compatible
    from gnetmdk.config import ConfigError
    from gnetmdk.models import model_from_config
    from gnetmdk.models.ppyolo.neck import CoordConv
    _, path = ws
    klass = load_config_class(path)
    cfg = build_config(klass, ["ppyolo.coord_conv", "true", "ppyolo.coord_range", "paddle"], step=1)
    model = model_from_config(cfg)
    ranges = {m.coord_range for m in model.modules() if isinstance(m, CoordConv)}
    assert ranges == {"paddle"} and model.meta()["coord_range"] == "paddle"
    other = build_config(klass, ["ppyolo.coord_conv", "true"], step=1)
    ck = {"model_meta": model.meta(), "config": cfg.to_dict()}
    check_compatible(ck, cfg, "p.pth")
    with pytest.raises(CheckpointError, match="coord_range: checkpoint 'paddle' vs config 'full'"):
        check_compatible(ck, other, "p.pth")
    with pytest.raises(ConfigError, match="ppyolo.coord_range"):
        build_config(klass, ["ppyolo.coord_range", "half"], step=1)
    # a checkpoint written before the field existed computed with the full range, and is read so
    full_cfg = build_config(klass, ["ppyolo.coord_conv", "true"], step=1)
    old_meta = {k: v for k, v in model_from_config(full_cfg).meta().items() if k != "coord_range"}
    old = {"model_meta": old_meta, "config": full_cfg.to_dict()}
    check_compatible(old, full_cfg, "old.pth")
    with pytest.raises(CheckpointError, match="coord_range: checkpoint 'full' vs config 'paddle'"):
        check_compatible(old, cfg, "old.pth")
    from gnetmdk.models import get_family
    rebuilt = get_family("ppyolo").rebuild(old_meta)
    assert {m.coord_range for m in rebuilt.modules() if isinstance(m, CoordConv)} == {"full"}


def test_deterministic_cuda_run_through_deformable_convs_is_refused(ws):
    """grid_sample's CUDA backward has no deterministic kernel: a --deterministic CUDA run whose
    backward reaches a DCN stage is refused with the fixes; a frozen backbone, no DCN, or the CPU pass."""
    from gnetmdk.config import ConfigError
    from gnetmdk.models.ppyolo.family import check_deterministic_dcn
    _, path = ws
    klass = load_config_class(path)

    def cfg(*over):
        c = build_config(klass, ["ppyolo.dcn_v2_stages", "[3]", *over], step=1)
        c.deterministic = True
        return c
    with pytest.raises(ConfigError, match=r"ppyolo.freeze_at 3.*dcn_v2_stages \[\]"):
        check_deterministic_dcn(cfg(), "cuda")
    with pytest.raises(ConfigError, match="trained stage"):
        check_deterministic_dcn(cfg("ppyolo.freeze_at", "2"), "cuda")
    check_deterministic_dcn(cfg("ppyolo.freeze_at", "3"), "cuda")
    check_deterministic_dcn(cfg(), "cpu")
    no_dcn = cfg("ppyolo.dcn_v2_stages", "[]")
    assert no_dcn.ppyolo.dcn_v2_stages == []
    check_deterministic_dcn(no_dcn, "cuda")
