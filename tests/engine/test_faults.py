"""Fault injection (device cpu): a full disk, read-only folders, kill -9 during a checkpoint write, a worker
killed by a signal, a corrupt chip model, malicious pickles; and the user mistakes that used to end in
a traceback or a silently wrong run. Every case ends in one ``error:`` line (exit 2 for a user's
mistake) and leaves the previous outputs byte for byte as they were.

A tiny GNetDet (224 px, width 0.0625) on 16 generated shapes images; the runs are in-process where the
command line allows it (train.py runs world size 1 in its own process), subprocesses otherwise.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest
import torch

from dist_helpers import ROOT, TRAIN, TRAIN_DIST, make_workspace, run, wait_no_leftovers
from repo_paths import load_tool

torch.set_num_threads(1)




def _train(*argv) -> int:
    from gnetmdk.engine.cli import main
    return main([str(a) for a in argv])


def _digest(folder) -> dict:
    out = {}
    for base, _, files in os.walk(folder):
        for f in files:
            p = os.path.join(base, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, folder)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def _one_error(capsys, *words) -> str:
    err = capsys.readouterr().err
    lines = [l for l in err.splitlines() if l.startswith("error:")]
    assert len(lines) == 1, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    """Shapes data, a config, and a finished pipeline in ``base``: step1 -> step2 -> cal -> step3 -> step4
    (short) and a chip model; the tests copy ``base`` and check that a failing run leaves it intact."""
    root = str(tmp_path_factory.mktemp("faults"))
    cfg = make_workspace(root, num_train=16, num_val=4)
    base = os.path.join(root, "base")
    out = ["checkpoint_root", os.path.join(base, "checkpoint"), "log_root", os.path.join(base, "log"),
           "model_root", os.path.join(base, "model"), "num_epochs", 1, "eval_before", "false"]
    for stage in (["--step", 1], ["--step", 2], ["--cal"], ["--step", 3], ["--step", 4]):
        assert _train("--config", cfg, *stage, *out) == 0
    conv = load_tool("convert_to_chip")
    assert conv.main([os.path.join(base, "checkpoint", "step4", "best.pth"), "--out", os.path.join(base, "model"),
                      "--config", cfg]) == 0
    return {"root": root, "cfg": cfg, "base": base}


def _copy(ws, tmp_path) -> str:
    dst = str(tmp_path / "copy")
    shutil.copytree(ws["base"], dst)
    return dst


def _outs(d):
    return ["checkpoint_root", os.path.join(d, "checkpoint"), "log_root", os.path.join(d, "log"),
            "model_root", os.path.join(d, "model")]


def _published(folder):
    """Digest of everything but an in-progress run folder (checkpoint/step<N>/run/), tensorboard logs and
    the output lock's files (a killed run's holder record stays until the next run takes the lock over)."""
    return {k: v for k, v in _digest(folder).items()
            if "/run/" not in "/" + k and not k.startswith("log") and os.path.basename(k) not in (".lock", ".lock.json")}


class _Faults:
    """Make the N-th and later temporary files written by gnetmdk (atomic writes) fail with ``code``."""

    def __init__(self, monkeypatch, code: int, after: int = 0):
        from gnetmdk.utils import atomic as cio
        self.calls = 0
        real = cio._write_temp

        def failing(path, write_fn):
            self.calls += 1
            if self.calls > after:
                raise OSError(code, os.strerror(code), path)
            return real(path, write_fn)
        monkeypatch.setattr(cio, "_write_temp", failing)


def _read_only(monkeypatch, root: str):
    """Every write under ``root`` fails with EROFS (root ignores permission bits, so chmod cannot do it)."""
    import builtins
    import tempfile
    root = os.path.abspath(root)
    real_open, real_makedirs, real_mkstemp = builtins.open, os.makedirs, tempfile.mkstemp

    def under(p) -> bool:
        return os.path.abspath(str(p)).startswith(root)

    def ro(p):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(p))

    def fake_open(file, mode="r", *a, **k):
        if any(c in mode for c in "wax+") and not isinstance(file, int) and under(file):
            ro(file)
        return real_open(file, mode, *a, **k)

    def fake_makedirs(p, *a, **k):
        if under(p) and not os.path.isdir(p):
            ro(p)
        return real_makedirs(p, *a, **k)

    def fake_mkstemp(*a, dir=None, **k):
        if dir is not None and under(dir):
            ro(dir)
        return real_mkstemp(*a, dir=dir, **k)
    monkeypatch.setattr(builtins, "open", fake_open)
    monkeypatch.setattr(os, "makedirs", fake_makedirs)
    monkeypatch.setattr(tempfile, "mkstemp", fake_mkstemp)


# ---------------------------------------------------------------------------------------------- disk full
def test_disk_full_during_training_keeps_the_previous_outputs(ws, tmp_path, monkeypatch, capsys):
    d = _copy(ws, tmp_path)
    before = _published(d)
    _Faults(monkeypatch, errno.ENOSPC, after=2)      # the first checkpoints go through, then the disk is full
    rc = _train("--config", ws["cfg"], "--step", 1, *_outs(d), "num_epochs", 4, "eval_before", "false")
    assert rc == 2
    _one_error(capsys, "No space left on device", "free disk space", "previous outputs in", "unchanged")
    assert _published(d) == before
    assert not [f for f in os.listdir(os.path.join(d, "checkpoint", "step1", "run")) if f.startswith(".tmp-")]


def test_calibration_writes_its_files_as_one_set(ws, tmp_path, monkeypatch, capsys):
    """cal.pth and model/relu_cap.txt: the second write fails, the first is not replaced either."""
    d = _copy(ws, tmp_path)
    before = _published(d)
    _Faults(monkeypatch, errno.ENOSPC, after=1)
    assert _train("--config", ws["cfg"], "--cal", *_outs(d), "eval_before", "false") == 2
    _one_error(capsys, "No space left on device", "previous files are unchanged")
    assert _published(d) == before


def test_converter_disk_full_keeps_the_previous_conversion(ws, tmp_path, monkeypatch, capsys):
    d = _copy(ws, tmp_path)
    before = _digest(os.path.join(d, "model"))
    _Faults(monkeypatch, errno.ENOSPC, after=3)      # chip_model.json, filter, bias written: then full
    conv = load_tool("convert_to_chip")
    rc = conv.main([os.path.join(d, "checkpoint", "step4", "best.pth"), "--out", os.path.join(d, "model"),
                    "--config", ws["cfg"]])
    assert rc == 2
    _one_error(capsys, "No space left on device", "previous files there are unchanged")
    assert _digest(os.path.join(d, "model")) == before


def test_meta_files_are_written_as_a_set(ws, tmp_path, monkeypatch, capsys):
    from gnetmdk.dataset.voc import convert_voc_to_meta
    meta = tmp_path / "meta"
    data = os.path.join(ws["root"], "data", "shapes")
    convert_voc_to_meta(data, ["circle", "square", "triangle"], str(meta / "t.txt"), str(meta / "v.txt"))
    before = _digest(meta)
    _Faults(monkeypatch, errno.ENOSPC, after=1)
    with pytest.raises(OSError):
        convert_voc_to_meta(data, ["circle", "square", "triangle"], str(meta / "t.txt"), str(meta / "v.txt"),
                            val_fraction=0.5)
    assert _digest(meta) == before


# ---------------------------------------------------------------------------------------------- read-only
@pytest.mark.parametrize("field", ["checkpoint_root", "log_root", "model_root"])
def test_read_only_output_roots_are_refused_before_any_work(ws, tmp_path, monkeypatch, capsys, field):
    d = _copy(ws, tmp_path)
    before = _digest(d)
    ro = {"checkpoint_root": os.path.join(d, "checkpoint"), "log_root": os.path.join(d, "log2"),
          "model_root": os.path.join(d, "model")}[field]
    _read_only(monkeypatch, ro)
    outs = _outs(d)
    outs[outs.index("log_root") + 1] = os.path.join(d, "log2")
    stage = ["--cal"] if field == "model_root" else ["--step", 1]
    assert _train("--config", ws["cfg"], *stage, *outs) == 2
    line = _one_error(capsys, "Read-only file system", field, "nothing was written")
    assert ro in line
    assert _digest(d) == before
    assert "epoch" not in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------- kill -9
def test_kill_during_a_checkpoint_write_leaves_no_checkpoint_half_written(ws, tmp_path):
    """kill -9 while torch.save is half-way through a checkpoint: the previous outputs are intact, no
    checkpoint file is half written (only a temporary file, removed by the next run), and the run can
    start again."""
    d = _copy(ws, tmp_path)
    before = _published(d)
    marker = tmp_path / "writing"
    env = dict(os.environ, GNETMDK_FAULT=f"slow-save:{marker}", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "tests", "fault_inject"), ROOT]))
    proc = subprocess.Popen([sys.executable, TRAIN, "--config", ws["cfg"], "--step", "1", *_outs(d),
                             "num_epochs", "2", "eval_before", "false"], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), proc.stderr.read() if proc.poll() is not None else "no checkpoint write seen"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert _published(d) == before
    run_dir = os.path.join(d, "checkpoint", "step1", "run")
    left = os.listdir(run_dir)
    assert all(f.startswith(".tmp-") for f in left if f.endswith(".pth") or ".pth-" in f), left
    # the next run starts cleanly: the killed write's temporary file is removed
    assert _train("--config", ws["cfg"], "--step", 1, *_outs(d), "num_epochs", 1, "eval_before", "false") == 0
    assert not [f for f in os.listdir(os.path.join(d, "checkpoint", "step1")) if f.startswith(".tmp-")]


# ---------------------------------------------------------------------------------------------- a worker killed
SUICIDE_MODEL = '''
import os as _os
import signal as _signal
from gnetmdk.models.gnetdet.model import GNetDet as _GNetDet
from gnetmdk.models import register_model as _register


class _KilledGNetDet(_GNetDet):
    """Rank 1 is killed by SIGKILL in its 2nd training forward (as by the OOM killer or a user)."""
    calls = 0

    def forward(self, x):
        if self.training:
            _KilledGNetDet.calls += 1
            if _os.environ.get("RANK") == "1" and _KilledGNetDet.calls == 2:
                _os.kill(_os.getpid(), _signal.SIGKILL)
        return super().forward(x)


_register("killed_rank1")(lambda **kw: _KilledGNetDet(**kw))
'''


def test_a_worker_killed_by_a_signal_is_named_with_its_rank(ws, tmp_path):
    cfg = str(tmp_path / "config_killed.py")
    with open(ws["cfg"]) as src, open(cfg, "w") as dst:
        dst.write(src.read() + SUICIDE_MODEL)
    marker = uuid.uuid4().hex
    r = run([TRAIN_DIST, "--config", cfg, "--step", "1", "--gpus", "2", "model_name", "killed_rank1",
             *_outs(str(tmp_path / "o"))], ws["root"], timeout=120, marker=marker)
    assert r.returncode == 1, r.text[-3000:]
    lines = [l for l in r.stderr.splitlines() if l.startswith("error:")]
    assert len(lines) == 1 and "rank 1" in lines[0] and "SIGKILL" in lines[0], r.stderr[-3000:]
    assert "rank 0" not in lines[0]
    assert wait_no_leftovers(marker) == []


# ---------------------------------------------------------------------------------------------- corrupt chip model
def test_a_chip_model_with_a_deleted_sublayer_is_refused(ws, tmp_path, capsys):
    from gnetmdk.chip import ChipModelError, load_chip_model
    src = os.path.join(ws["base"], "model", "chip_model.json")
    d = json.load(open(src))
    # delete a sublayer whose neighbours keep the channel chain (in == out), renumber nothing else
    i = next(k for k in range(1, len(d["layers"]) - 1) if d["layers"][k]["in_channels"] == d["layers"][k]["out_channels"]
             and not d["layers"][k]["pool_after"])
    del d["layers"][i]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(d))
    with pytest.raises(ChipModelError, match="sublayer"):
        load_chip_model(str(bad))
    before = _digest(tmp_path)
    assert load_tool("chip_eval").main([str(bad), "--config", ws["cfg"], "--check",
                                         os.path.join(ws["base"], "checkpoint", "step4", "best.pth")]) == 2
    _one_error(capsys, str(bad), "convert the checkpoint again")
    assert load_tool("predict").main([str(bad), os.path.join(ws["root"], "data", "shapes", "JPEGImages"),
                                       "--out", str(tmp_path / "pred")]) == 2
    _one_error(capsys, str(bad))
    assert {k: v for k, v in _digest(tmp_path).items() if not k.startswith("pred")} == before


# ---------------------------------------------------------------------------------------------- malicious pickles
class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_malicious_pickles_are_never_executed(ws, tmp_path, capsys):
    marker = tmp_path / "PWNED"
    evil = tmp_path / "evil.pth"
    with open(evil, "wb") as fh:
        pickle.dump({"format": "gnetmdk-checkpoint", "stage": "step4", "model": _Payload(str(marker))}, fh)
    d = _copy(ws, tmp_path)
    before = _published(d)
    images = os.path.join(ws["root"], "data", "shapes", "JPEGImages")
    runs = [
        ("train", lambda: _train("--config", ws["cfg"], "--step", 2, "load", evil, *_outs(d))),
        ("resume", lambda: (shutil.copy(evil, os.path.join(d, "checkpoint", "step3", "last.pth")),
                            _train("--config", ws["cfg"], "--step", 3, "--resume", *_outs(d)))[1]),
        ("eval_voc", lambda: load_tool("eval_voc").main([str(evil), "--config", ws["cfg"]])),
        ("convert_to_chip", lambda: load_tool("convert_to_chip").main([str(evil), "--out", os.path.join(d, "model"),
                                                                         "--config", ws["cfg"]])),
        ("chip_eval", lambda: load_tool("chip_eval").main([os.path.join(d, "model", "chip_model.json"), "--config",
                                                             ws["cfg"], "--check", str(evil)])),
        ("predict", lambda: load_tool("predict").main([str(evil), images, "--out", str(tmp_path / "pred")])),
    ]
    for name, fn in runs:
        assert fn() == 2, name
        if name == "resume":       # copied over a published last.pth: its set's manifest refuses it first
            line = _one_error(capsys)
            assert "never unpickled" in line or "is not the file its set's manifest" in line, line
        else:
            _one_error(capsys, "never unpickled")
        assert not marker.exists(), name
    shutil.copy(os.path.join(ws["base"], "checkpoint", "step3", "last.pth"), os.path.join(d, "checkpoint", "step3"))
    assert _published(d) == before


def test_a_recording_with_an_object_array_is_refused(ws, tmp_path, capsys):
    rec = tmp_path / "rec"
    rec.mkdir()
    (rec / "meta.json").write_text(json.dumps({"format": "gnetmdk-npz-record", "version": 1, "stage": "step1",
                                               "world_size": 1, "global_batch": 8, "local_batch": 8,
                                               "iters_per_epoch": 2}))
    np.savez(rec / "iter_000001_rank0.npz", images=np.array([_Payload(str(tmp_path / "PWNED"))], dtype=object),
             targets=np.zeros(1), indices=np.zeros(1), epoch=np.array(0))
    assert _train("--config", ws["cfg"], "--step", 1, "--replay-npz", rec, *_outs(str(tmp_path / "o"))) == 2
    _one_error(capsys, "iter_000001_rank0.npz", "never unpickled")
    assert not (tmp_path / "PWNED").exists()


# ---------------------------------------------------------------------------------------------- resume
@pytest.mark.parametrize("over,words", [
    (["batch_size", 4], ["batch_size 8 in the checkpoint, 4 now", "start a new run"]),
    (["optimizer", "sgd"], ["optimizer 'adamw' in the checkpoint, 'sgd' now"]),
    (["num_epochs", 5], ["num_epochs 2 in the checkpoint, 5 now", "resume_changes num_epochs"]),
    (["learning_rate", 3e-4], ["learning_rate", "resume_changes learning_rate"]),
])
def test_resume_refuses_changed_settings(ws, tmp_path, capsys, over, words):
    d = str(tmp_path / "r")
    args = ["--config", ws["cfg"], "--step", 1, *_outs(d), "num_epochs", 2, "eval_before", "false"]
    assert _train(*args, "--max-iters", 1) == 0                 # stopped early: resumable
    before = _digest(d)
    assert _train(*args, "--resume", *over) == 2
    _one_error(capsys, "cannot resume", *words)
    assert _digest(d) == before


def test_resume_applies_an_accepted_schedule_change(ws, tmp_path, capsys):
    """resume_changes num_epochs: the run goes on to the new length, with the new schedule's rate at the
    checkpoint's iteration."""
    d = str(tmp_path / "r")
    args = ["--config", ws["cfg"], "--step", 1, *_outs(d), "eval_before", "false", "warmup_epochs", 0]
    assert _train(*args, "num_epochs", 2, "--max-iters", 2) == 0
    assert _train(*args, "--resume", "num_epochs", 4, "resume_changes", "num_epochs") == 0
    out = capsys.readouterr().out
    assert "resume: num_epochs 2 -> 4 (resume_changes)" in out
    from gnetmdk.checkpoint.io import load_checkpoint
    last = load_checkpoint(os.path.join(d, "checkpoint", "step1", "last.pth"))
    assert last["iteration"] == 4 * 2 and last["epoch"] == 4          # 16 images / batch 8 = 2 per epoch
    # the cosine schedule of 8 iterations, read at iteration 8, ends at min_lr_ratio x lr
    assert last["optimizer"]["param_groups"][0]["lr"] == pytest.approx(1e-3 * 0.01, rel=1e-6)


# ---------------------------------------------------------------------------------------------- one line each
def test_user_mistakes_end_in_one_error_line(ws, tmp_path, capsys):
    d = _copy(ws, tmp_path)
    before = _published(d)
    empty = tmp_path / "empty_meta"
    empty.mkdir()
    (empty / "shapes_train.txt").write_text("")
    (empty / "shapes_valid.txt").write_text("")
    ck4 = os.path.join(d, "checkpoint", "step4", "best.pth")
    chip = os.path.join(d, "model", "chip_model.json")
    images = os.path.join(ws["root"], "data", "shapes", "JPEGImages")
    reordered = ["VOC_CLASSES", "square,circle,triangle"]
    cases = [
        (lambda: _train("--config", ws["cfg"], "--step", 1, *_outs(d), "meta_root", empty), ["lists no images"]),
        (lambda: _train("--config", ws["cfg"], "--cal", "--step", 3, *_outs(d)), ["--cal", "--step 3"]),
        (lambda: _train("--config", ws["cfg"], "--step", 1, *_outs(d), "threads", -1), ["threads", ">= 0"]),
        (lambda: _train("--config", ws["cfg"], "--step", 2, *_outs(d), "load", os.path.join(d, "checkpoint")),
         ["is a folder", "best.pth"]),
        (lambda: _train("--config", ws["cfg"], "--step", 2, *_outs(d), *reordered), ["VOC_CLASSES", "same order"]),
        (lambda: load_tool("eval_voc").main([ck4, "--config", ws["cfg"], *reordered]), ["VOC_CLASSES"]),
        (lambda: load_tool("eval_voc").main([ck4, "--config", ws["cfg"], "--batch-size", "-1"]),
         ["--batch-size", "at least 0"]),
        (lambda: load_tool("chip_eval").main([chip, "--config", ws["cfg"], "--batch-size", "0"]),
         ["--batch-size", "at least 1"]),
        (lambda: load_tool("predict").main([ck4, images, "--batch-size", "0"]), ["--batch-size"]),
        (lambda: load_tool("predict").main([ck4, images, "--thresh", "5"]), ["--thresh", "[0, 1]"]),
        (lambda: load_tool("predict").main([ck4, images, "--nms", "-1"]), ["--nms", "(0, 1]"]),
    ]
    for i, (fn, words) in enumerate(cases):
        rc = _call(fn)
        assert rc == 2, (i, words)
        _one_error(capsys, *words)
    for argv, words in ((["--gpus", "0"], ["--gpus (0)", "at least 1"]), (["--world-size", "0"], ["--world-size (0)"])):
        from gnetmdk.engine.cli import main
        assert main(["--config", ws["cfg"], "--step", "1", *argv, *_outs(d)], distributed=True) == 2
        _one_error(capsys, *words)
    assert _published(d) == before


def test_a_truncated_checkpoint_is_one_line_in_our_words(ws, tmp_path, capsys):
    src = os.path.join(ws["base"], "checkpoint", "step1", "best.pth")
    data = open(src, "rb").read()
    bad = tmp_path / "half.pth"
    bad.write_bytes(data[: len(data) // 2])
    assert _train("--config", ws["cfg"], "--step", 2, "load", bad, *_outs(str(tmp_path / "o"))) == 2
    line = _one_error(capsys, "truncated")
    assert "weights_only" not in line


def test_predict_goes_on_past_an_unreadable_image(ws, tmp_path, capsys):
    folder = tmp_path / "imgs"
    folder.mkdir()
    src = os.path.join(ws["root"], "data", "shapes", "JPEGImages")
    names = sorted(os.listdir(src))[:3]
    for n in names:
        shutil.copy(os.path.join(src, n), folder / n)
    data = (folder / names[1]).read_bytes()
    (folder / names[1]).write_bytes(data[: len(data) // 2])            # truncated
    (folder / "noise.jpg").write_bytes(os.urandom(2000))               # not an image
    rc = load_tool("predict").main([os.path.join(ws["base"], "checkpoint", "step4", "best.pth"), str(folder),
                                     "--out", str(tmp_path / "pred")])
    assert rc == 1
    err = capsys.readouterr().err
    assert err.count("skipped: ") == 2 and "truncated" in err and "noise.jpg" in err
    assert "xml_2_txt" not in err and "Traceback" not in err
    doc = json.load(open(tmp_path / "pred" / "detections.json"))
    assert len(doc["results"]) == 2 and len(doc["skipped"]) == 2


def test_xml_2_txt_decodes_every_image(ws, tmp_path):
    """A random-bytes .jpg, a truncated JPEG and an image resized after annotation are refused with the
    file named; nothing is written; an empty dataset is refused too."""
    from gnetmdk.dataset.voc import VOCFormatError, convert_voc_to_meta
    import cv2
    classes = ["circle", "square", "triangle"]
    src = os.path.join(ws["root"], "data", "shapes")
    for case in ("noise", "truncated", "resized"):
        d = tmp_path / case
        shutil.copytree(src, d)
        name = sorted(os.listdir(d / "JPEGImages"))[0]
        img = d / "JPEGImages" / name
        if case == "noise":
            img.write_bytes(os.urandom(3000))
        elif case == "truncated":
            data = img.read_bytes()
            img.write_bytes(data[: len(data) // 2])
        else:
            a = cv2.imread(str(img))
            cv2.imwrite(str(img), cv2.resize(a, (a.shape[1] // 2, a.shape[0] // 2)))
        out = tmp_path / f"meta-{case}"
        with pytest.raises(VOCFormatError) as e:
            convert_voc_to_meta(str(d), classes, str(out / "t.txt"), str(out / "v.txt"))
        assert name in str(e.value) and {"noise": "decoded", "truncated": "truncated",
                                         "resized": "decodes to"}[case] in str(e.value)
        assert not out.exists()
        rep = convert_voc_to_meta(str(d), classes, str(out / "t.txt"), str(out / "v.txt"), skip_bad=True)
        assert len(rep["skipped"]) == 1
    empty = tmp_path / "empty"
    (empty / "JPEGImages").mkdir(parents=True)
    (empty / "Annotations").mkdir()
    with pytest.raises(VOCFormatError, match="nothing was written"):
        convert_voc_to_meta(str(empty), classes, str(tmp_path / "e" / "t.txt"), str(tmp_path / "e" / "v.txt"))
    assert not (tmp_path / "e").exists()


def _call(fn) -> int:
    """Run a tool's main; argparse's refusals raise SystemExit(2) from parse_args (this project's Parser)."""
    try:
        return fn()
    except SystemExit as exc:
        return int(exc.code)


def test_resume_under_another_environment_says_so(ws, tmp_path, capsys, monkeypatch):
    """Device cpu. Every checkpoint records what it was trained with (gnetmdk.utils.environment), the
    stage's log prints it, and a resume under another OpenCV names the difference and goes on."""
    from gnetmdk.checkpoint.io import load_checkpoint
    from gnetmdk.engine import trainer as trainer_module
    from gnetmdk.utils.environment import describe, run_environment

    d = str(tmp_path / "r")
    args = ["--config", ws["cfg"], "--step", 1, *_outs(d), "eval_before", "false", "warmup_epochs", 0,
            "num_epochs", 2, "threads", 1]
    assert _train(*args, "--max-iters", 2) == 0
    here = run_environment("cpu", 1)
    assert f"environment: {describe(here)}" in capsys.readouterr().out
    last = load_checkpoint(os.path.join(d, "checkpoint", "step1", "last.pth"))
    assert last["environment"] == here and all(isinstance(v, str) for v in here.values())
    other = dict(here, opencv="4.14.0")
    monkeypatch.setattr(trainer_module, "run_environment", lambda device, threads: dict(other))
    assert _train(*args, "--resume") == 0
    out = capsys.readouterr().out
    assert f"another environment (opencv 4.14.0 -> {here['opencv']})" not in out     # the order is old -> new
    assert f"another environment (opencv {here['opencv']} -> 4.14.0)" in out
    assert "no longer repeats the uninterrupted run" in out
    last = load_checkpoint(os.path.join(d, "checkpoint", "step1", "last.pth"))
    assert last["environment"]["opencv"] == "4.14.0" and last["iteration"] == 4
