"""Every value checked the same way, inputs that changed refused, and one line instead of a traceback
(device cpu): configs.py / per_step / command-line values, image sizes against their annotations,
non-finite converted weights, recordings, the log on a full disk, tools' output folders, checkpoint
files that are not checkpoints, the launcher's addresses, frozen peers and foreign listeners."""
from __future__ import annotations

import copy
import json
import os
import socket
import threading
import time

import cv2
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dist_helpers import ROOT, TRAIN, TRAIN_DIST, free_port, make_workspace, run
from gnetmdk.config import BaseConfig, ConfigError, build_config

TOOLS = os.path.join(ROOT, "tools")
FAULTS = os.path.join(ROOT, "tests", "fault_inject")


def _cls(**attrs):
    return type("Config", (BaseConfig,), attrs)


def _one_line(r, code=2):
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert r.returncode == code and len(lines) == 1 and lines[0].startswith("error: "), (r.returncode, r.stderr[-3000:])
    assert "Traceback" not in r.stderr
    return lines[0]


# ------------------------------------------------------------------------------------ one validation
def test_config_file_values_are_converted_and_checked_as_the_command_line():
    cfg = build_config(_cls(batch_size="4", learning_rate="1e-3", augment="no", lr_milestones=("3", 5.0),
                            VOC_CLASSES="cat,dog"))
    assert cfg.batch_size == 4 and cfg.learning_rate == 1e-3 and cfg.augment is False
    assert cfg.lr_milestones == [3, 5] and cfg.VOC_CLASSES == ["cat", "dog"]     # read as the command line's
    for attrs, needle in (({"weight_decay": -0.1}, "'weight_decay'"),
                          ({"momentum": 1.0}, "'momentum'"),
                          ({"batch_size": "four"}, "'batch_size'"),
                          ({"batch_size": 4.5}, "must be an integer"),
                          ({"augment": 2}, "must be true or false"),
                          ({"learning_rate": float("nan")}, "finite"),
                          ({"learning_rate": float("inf")}, "finite"),
                          ({"grad_clip": -1.0}, "'grad_clip'"),
                          ({"foo_bar": 3}, "Config.foo_bar is not a config field"),
                          ({"batchsize": 3}, "did you mean batch_size"),
                          ({"per_step": {7: {"num_epochs": 1}}}, "per_step[7]"),
                          ({"per_step": {4: {"num_epoch": 1}}}, "num_epochs"),   # a stage this run is not
                          ({"per_step": {2: "x"}}, "must be a dict"),
                          ({"VOC_CLASSES": 3}, "must be a list")):
        with pytest.raises(ConfigError, match=None) as exc:
            build_config(_cls(**attrs), step=1)
        assert needle in str(exc.value), (attrs, str(exc.value))
    assert build_config(_cls(_helper=3)).batch_size == 16          # helpers start with '_'


def test_command_line_ranges_and_other_families_fields():
    for words, needle in ((["momentum", "-1"], "'momentum'"), (["weight_decay", "-1"], "'weight_decay'"),
                          (["dist_timeout", "inf"], "finite"), (["learning_rate", "nan"], "finite")):
        with pytest.raises(ConfigError) as exc:
            build_config(BaseConfig, words)
        assert needle in str(exc.value)
    with pytest.raises(ConfigError) as exc:
        build_config(BaseConfig, ["model_name", "ppyolo", "gnetdet.width_mult", "0.5"])
    assert "field of the gnetdet family, but this config trains ppyolo" in str(exc.value)
    with pytest.raises(ConfigError) as exc:
        build_config(_cls(model_name="ppyolo", per_step={1: {"gnetdet.l_coord": 2.0}}), step=1)
    assert "per_step[1]" in str(exc.value) and "gnetdet family" in str(exc.value)


_FIELDS = sorted(BaseConfig.field_types())
_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-10 ** 6, 10 ** 6), st.floats(allow_nan=True),
                    st.text(max_size=8), st.lists(st.integers(-5, 50), max_size=3),
                    st.dictionaries(st.integers(-2, 9), st.dictionaries(st.sampled_from(_FIELDS), st.integers()),
                                    max_size=2))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(_FIELDS + ["bogus", "DS_NAMES"]), _VALUES, max_size=3),
       st.lists(st.sampled_from(["batch_size", "momentum", "gnetdet.l_coord", "ppyolo.depth", "8", "-1", "x", "nan",
                                 "1e9", "true"]), max_size=4))
def test_random_config_values_never_give_a_traceback(attrs, words):
    """Any value in configs.py and any command-line words: a resolved config or a ConfigError, never
    another exception (the entry points print ConfigError as one line)."""
    try:
        build_config(_cls(**attrs), words, step=1)
    except ConfigError:
        pass


# ------------------------------------------------------------------------------------ COCO json
def _coco_doc():
    return {"images": [{"id": 1, "file_name": "a.jpg", "width": 64, "height": 48},
                       {"id": 2, "file_name": "b.jpg", "width": 32, "height": 32}],
            "categories": [{"id": 1, "name": "cat"}, {"id": 2, "name": "dog"}],
            "annotations": [{"id": 1, "image_id": 1, "category_id": 1, "bbox": [1, 2, 10, 10], "iscrowd": 0},
                            {"id": 2, "image_id": 2, "category_id": 2, "bbox": [0, 0, 5, 5]}]}


_JUNK = st.one_of(st.none(), st.booleans(), st.integers(-3, 100), st.floats(allow_nan=True), st.text(max_size=4),
                  st.lists(st.integers(-2, 70), max_size=5), st.just({}))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["images", "categories", "annotations"]), st.integers(0, 2),
                          st.sampled_from(["id", "file_name", "width", "height", "name", "image_id", "category_id",
                                           "bbox", "iscrowd", "<drop>", "<list>"]), _JUNK), max_size=3),
       st.integers(0, 400))
def test_random_coco_mutations_never_give_a_traceback(tmp_path_factory, muts, cut):
    """A valid COCO json with random fields replaced, dropped or the file cut: read_coco_json gives
    records or a CocoFormatError naming the file, never another exception."""
    from gnetmdk.dataset.coco import CocoFormatError, read_coco_json
    doc = copy.deepcopy(_coco_doc())
    for section, i, key, value in muts:
        items = doc[section]
        if key == "<list>":
            doc[section] = value
            continue
        if not isinstance(items, list) or i >= len(items) or not isinstance(items[i], dict):
            continue
        if key == "<drop>":
            items.pop(i)
        else:
            items[i][key] = value
    text = json.dumps(doc)
    if cut % 3 == 0:
        text = text[:cut]
    path = str(tmp_path_factory.mktemp("coco") / "a.json")
    with open(path, "w") as fh:
        fh.write(text)
    try:
        read_coco_json(path, ["cat", "dog"])
    except CocoFormatError as exc:
        assert path in str(exc)


def test_malformed_coco_json_is_one_line_from_train_py_device_cpu(tmp_path):
    root = str(tmp_path)
    cfg = make_workspace(root, num_train=8, num_val=2)
    doc = _coco_doc()
    doc["categories"] = [{"id": i + 1, "name": n} for i, n in enumerate(["circle", "square", "triangle"])]
    doc["annotations"][0]["category_id"] = 9
    path = os.path.join(root, "bad.json")
    with open(path, "w") as fh:
        json.dump(doc, fh)
    line = _one_line(run([TRAIN, "--config", cfg, "train_json", path, "val_json", path], root))
    assert path in line and "category_id" in line


# ------------------------------------------------------------------------------------ image sizes
def test_an_image_resized_after_xml_2_txt_is_refused_device_cpu(tmp_path):
    """xml_2_txt records the size every image's boxes were converted for; the dataset refuses an image
    that has another size now (its boxes would land beyond it), naming the image and the fix."""
    from gnetmdk.dataset.image_io import ImageReadError
    from gnetmdk.dataset.records import load_split
    from gnetmdk.dataset.voc import read_sizes
    root = str(tmp_path)
    cfg_path = make_workspace(root, num_train=6, num_val=2)
    cfg = build_config(__import__("gnetmdk.config", fromlist=["load_config_class"]).load_config_class(cfg_path),
                       ["cache_images", "false"], step=1)
    sizes = read_sizes(cfg.train_meta)
    records, expected = load_split(cfg, "train")
    assert expected is not None and expected.sizes == [sizes[r[0]] for r in records]
    from gnetmdk.dataset.dataset import build_dataset
    ds = build_dataset(cfg, "train")
    ds[0]
    img_path = ds.image_path(1)
    img = cv2.imread(img_path)
    cv2.imwrite(img_path, cv2.resize(img, (img.shape[1] // 2, img.shape[0] // 2)))
    with pytest.raises(ImageReadError) as exc:
        build_dataset(cfg, "train")[1]
    msg = str(exc.value)
    assert img_path in msg and "run tools/xml_2_txt.py again" in msg and cfg.train_meta[:-4] + ".sizes.json" in msg


def test_a_coco_width_other_than_the_image_is_refused(tmp_path):
    from gnetmdk.dataset.image_io import ImageReadError
    from gnetmdk.dataset.ppyolo_dataset import PPYOLODataset
    from gnetmdk.dataset.records import ExpectedSizes
    img_dir = tmp_path / "img"
    img_dir.mkdir()
    cv2.imwrite(str(img_dir / "a.png"), np.zeros((48, 64, 3), np.uint8))
    rec = [("a.png", np.array([[1, 2, 10, 12]], np.float32), np.array([0]))]
    ds = PPYOLODataset(rec, str(img_dir), 1, 64, cache=False,
                       expected_sizes=ExpectedSizes([(32, 48)], "ann.json", "fix its width and height"))
    with pytest.raises(ImageReadError, match="is 64x48 pixels, but 'ann.json' says 32x48"):
        ds.load_image(0)


# ------------------------------------------------------------------------------------ converted weights
def test_converted_weights_with_nan_are_refused():
    import torch
    from test_paddle_convert import fill, pd_ppyolo
    from gnetmdk.models.ppyolo.config import R18VD
    from gnetmdk.config import build_config as bc
    from gnetmdk.models import model_from_config
    from gnetmdk.models.ppyolo.convert import convert_paddle_state
    cfg = bc(_cls(model_name="ppyolo", ppyolo=dict(R18VD), VOC_CLASSES=[f"c{i}" for i in range(80)]), step=1)
    torch.manual_seed(0)
    model = model_from_config(cfg)
    shapes = pd_ppyolo(18, [2, 3], [], False, 0, True, False, [[3, 4, 5], [0, 1, 2]], 80, False)
    arrays = fill(shapes, seed=3)
    _, report = convert_paddle_state(arrays, model, 80)
    assert report.ok
    name = "backbone.conv1.conv1_1.conv.weight"
    arrays[name] = arrays[name].copy()
    arrays[name].flat[:3] = np.nan
    _, report = convert_paddle_state(arrays, model, 80)
    assert not report.ok and report.nonfinite == [(name, 3)]
    assert "NaN or infinite" in report.format() and "NOT OK" in report.format()


# ------------------------------------------------------------------------------------ recordings, logs, outputs
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("reliability"))
    cfg = make_workspace(root, num_train=16, num_val=2)
    rec = os.path.join(root, "rec")
    run([TRAIN, "--config", cfg, "--step", "1", "--max-iters", "2", "--save-npz", rec, "batch_size", "8"],
        root).check()
    return root, cfg, rec


def test_a_cut_or_damaged_recording_is_one_line_device_cpu(tiny, tmp_path):
    import shutil
    root, cfg, rec = tiny
    cut = str(tmp_path / "cut")
    shutil.copytree(rec, cut)
    text = open(os.path.join(cut, "meta.json")).read()
    open(os.path.join(cut, "meta.json"), "w").write(text[:120])
    assert "cut, or not JSON" in _one_line(run([TRAIN, "--config", cfg, "--step", "1", "--replay-npz", cut,
                                                "batch_size", "8"], root))
    open(os.path.join(cut, "meta.json"), "w").write(json.dumps({"format": "gnetmdk-npz-record"}))
    assert "incomplete recording" in _one_line(run([TRAIN, "--config", cfg, "--step", "1", "--replay-npz", cut,
                                                    "batch_size", "8"], root))
    other = str(tmp_path / "other")
    shutil.copytree(rec, other)
    with np.load(os.path.join(other, "iter_000001_rank0.npz")) as z:
        arrays = {k: z[k] for k in z.files}
    arrays["images"] = arrays["images"][:4, :, :112, :112]
    np.savez(os.path.join(other, "iter_000001_rank0.npz"), **arrays)
    meta = json.load(open(os.path.join(other, "meta.json")))
    meta["world_size"] = 2
    meta["local_batch"] = 4
    json.dump(meta, open(os.path.join(other, "meta.json"), "w"))
    arrays["images"] = np.zeros((4, 3, 224, 224), np.uint8)
    np.savez(os.path.join(other, "iter_000001_rank1.npz"), **arrays)
    line = _one_line(run([TRAIN, "--config", cfg, "--step", "1", "--replay-npz", other, "batch_size", "8"], root))
    assert "iter_000001_rank1.npz" in line and "every rank of an iteration records one size" in line


def test_recording_on_a_full_disk_is_one_line_and_stays_incomplete_device_cpu(tiny):
    root, cfg, _ = tiny
    rec = os.path.join(root, "full_rec")
    env = {"GNETMDK_FAULT": "enospc-npz:1", "PYTHONPATH": os.pathsep.join([FAULTS, ROOT])}
    line = _one_line(run([TRAIN, "--config", cfg, "--step", "1", "--max-iters", "3", "--save-npz", rec,
                          "batch_size", "8", "checkpoint_root", os.path.join(root, "full")], root, env=env))
    assert "No space left on device" in line and "marked incomplete" in line
    assert json.load(open(os.path.join(rec, "meta.json")))["complete"] is False


def test_the_log_on_a_full_disk_stops_with_one_warning_device_cpu(tiny):
    root, cfg, _ = tiny
    env = {"GNETMDK_FAULT": "enospc-log", "PYTHONPATH": os.pathsep.join([FAULTS, ROOT])}
    out = os.path.join(root, "tblog")
    r = run([TRAIN, "--config", cfg, "--step", "1", "num_epochs", "1", "batch_size", "8", "checkpoint_root",
             os.path.join(out, "ck"), "log_root", os.path.join(out, "log")], root, env=env).check()
    assert "Traceback" not in r.stderr and not r.stderr.strip(), r.stderr[-2000:]
    assert len([l for l in r.stdout.splitlines() if "the tensorboard log stops here" in l]) == 1
    assert os.path.isfile(os.path.join(out, "ck", "step1", "best.pth"))


@pytest.mark.parametrize("where", ["file", "below_file"])
def test_tool_outputs_to_a_file_are_one_line_device_cpu(tiny, tmp_path, where):
    root, cfg, _ = tiny
    f = tmp_path / "a_file"
    f.write_text("keep")
    out = str(f) if where == "file" else str(f / "sub")
    for tool in ("convert_to_chip.py", "export_int.py"):
        line = _one_line(run([os.path.join(TOOLS, tool), "--config", cfg, "--out", out], root))
        assert out in line and "--out" in line, line
    assert f.read_text() == "keep"


def test_checkpoint_like_files_are_named_for_what_they_are(tmp_path, tiny):
    from gnetmdk.checkpoint.io import CheckpointError, load_checkpoint
    root, _, rec = tiny
    good = open(os.path.join(rec, "start.pth"), "rb").read()
    (tmp_path / "cut.pth").write_bytes(good[:len(good) // 2])
    (tmp_path / "noise.pth").write_bytes(np.random.default_rng(0).bytes(40000))
    (tmp_path / "empty.pth").write_bytes(b"")
    (tmp_path / "m.onnx").write_bytes(b"\x08\x08\x12\x07gnetmdk" + bytes(64))
    for name, needle in (("cut.pth", "truncated or damaged"), ("noise.pth", "not torch's format"),
                         ("empty.pth", "empty"), ("m.onnx", "an ONNX model")):
        with pytest.raises(CheckpointError) as exc:
            load_checkpoint(str(tmp_path / name))
        assert needle in str(exc.value) and "pickle of classes" not in str(exc.value), str(exc.value)
    tool = os.path.join(TOOLS, "diff_weights.py")
    assert "is a folder" in _one_line(run([tool, str(tmp_path), os.path.join(rec, "start.pth")], root))
    assert "an ONNX model" in _one_line(run([tool, str(tmp_path / "m.onnx"), os.path.join(rec, "start.pth")], root))


def test_sensitivity_tolerance_out_of_range_is_one_line(tiny):
    root, cfg, _ = tiny
    assert "--tolerance" in _one_line(run([os.path.join(TOOLS, "sensitivity.py"), "--config", cfg, "--tolerance",
                                           "-1"], root))


# ------------------------------------------------------------------------------------ the launcher
def test_launcher_addresses_and_time_outs_are_one_line(tiny):
    root, cfg, _ = tiny
    c = [TRAIN_DIST, "--config", cfg, "--step", "1"]
    assert "finite" in _one_line(run([*c, "--dist-timeout", "inf"], root))
    line = _one_line(run([*c, "--world-size", "2", "--rank", "1", "--dist-url", "http://127.0.0.1:8888"], root))
    assert "not a http:// URL" in line


@pytest.mark.slow
def test_a_foreign_listener_on_the_rendezvous_port_ends_in_one_line_device_cpu(tiny):
    """Something else listens on --dist-url's port and never speaks torch's protocol: the run ends
    within --dist-timeout (plus the start), with one line naming the address, instead of waiting for ever."""
    root, cfg, _ = tiny
    port = free_port()
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", port))
    srv.listen(5)
    held = []
    threading.Thread(target=lambda: [held.append(srv.accept()) for _ in range(50)], daemon=True).start()
    t0 = time.time()
    r = run([TRAIN_DIST, "--config", cfg, "--step", "1", "--world-size", "2", "--rank", "1", "--dist-url",
             f"127.0.0.1:{port}", "--dist-timeout", "5"], root, timeout=120)
    line = _one_line(r)
    assert "nothing answered as a torch rendezvous" in line and f"127.0.0.1:{port}" in line
    assert time.time() - t0 < 90
    srv.close()


@pytest.mark.slow
def test_a_frozen_peer_ends_the_run_in_one_line_device_cpu(tiny):
    """One of 2 processes stops (SIGSTOP) mid-training: the other's collective times out after
    --dist-timeout and the launcher ends with one line that says so, without a traceback."""
    import signal
    import subprocess
    import uuid
    from dist_helpers import finish, start, wait_no_leftovers
    root, cfg, _ = tiny
    marker = uuid.uuid4().hex
    t0 = time.time()
    log = open(os.path.join(root, "frozen.log"), "w")
    p = start([TRAIN_DIST, "--config", cfg, "--step", "1", "--gpus", "2", "--dist-timeout", "8", "num_epochs", "1000",
               "eval_interval", "1000", "batch_size", "8", "checkpoint_root", os.path.join(root, "frozen")],
              marker, root, stdout_file=log)
    workers = []
    deadline = time.time() + 60
    while len(workers) < 2 and time.time() < deadline:
        time.sleep(0.5)
        kids = subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True, text=True).stdout.split()
        workers = [k for k in kids if b"spawn_main" in open(f"/proc/{k}/cmdline", "rb").read()]
    while "epoch" not in open(os.path.join(root, "frozen.log")).read() and time.time() < deadline + 60:
        time.sleep(0.5)                                   # training has started: the ranks are in collectives
    os.kill(int(workers[-1]), signal.SIGSTOP)
    r = finish(p, ["train-dist.py"], 180, t0)
    line = _one_line(r, code=1)
    assert "timed out" in line and "another process stopped answering" in line
    assert wait_no_leftovers(marker) == []
