"""Output sets (device cpu): one writer per output folder (gnetmdk.checkpoint.lock), sets published whole
with a manifest and one previous generation kept (gnetmdk.checkpoint.outputs), provenance between
stages, recordings marked complete. docs/pipeline.md, "Outputs"."""
from __future__ import annotations

import hashlib
import json
import os
import signal
import time
import uuid

import pytest
import torch

from dist_helpers import TRAIN, finish, kill_group, make_workspace, run, start, wait_no_leftovers
from gnetmdk.checkpoint.io import CheckpointError, load_checkpoint
from gnetmdk.checkpoint.lock import OutputLock, OutputLocked
from gnetmdk.checkpoint.outputs import StageOutputs, check_published, read_manifest


def _sha(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def _state(v):
    return {"stage": "step1", "model": {"w": torch.full((3,), float(v))}}


def _run_set(folder, value, extra=None):
    """A finished run of stage step1 in ``folder`` whose files hold ``value``."""
    out = StageOutputs(folder, "step1")
    out.start()
    out.save("best.pth", _state(value), 1)
    out.save("last.pth", _state(value), 2, config={"v": value})
    out.source = {"path": "src.pth", "sha256": "0" * 64}
    return out, out.publish(extra)


# ------------------------------------------------------------------------------------ locks
def test_lock_refuses_a_second_holder_and_names_the_first(tmp_path):
    folder = str(tmp_path / "out")
    a = OutputLock(folder, "the step1 outputs", "set checkpoint_root to another folder")
    assert a.acquire() is None
    b = OutputLock(folder, "the step1 outputs", "set checkpoint_root to another folder")
    with pytest.raises(OutputLocked) as exc:
        b.acquire()
    msg = str(exc.value)
    assert f"pid {os.getpid()}" in msg and "is in use by another run" in msg and "checkpoint_root" in msg
    a.release()
    assert b.acquire() is None                # released: free for the next run
    b.release()
    # a holder record of a run killed before it released: taken over with a notice
    with open(os.path.join(folder, ".lock.json"), "w") as fh:
        json.dump({"pid": 999999, "host": "h", "started": time.time(), "command": "train.py"}, fh)
    note = OutputLock(folder, "x", "y").acquire()
    assert note and "ended without releasing it" in note and "pid 999999" in note


def test_two_runs_on_one_checkpoint_root_the_second_is_refused_device_cpu(tmp_path):
    """A step-1 run holds checkpoint/step1; a second one started meanwhile exits 2 with one line naming
    the first (pid) and leaves the outputs alone; killed with SIGKILL, the first run's lock is free again
    and the next run takes it over with a notice."""
    root = str(tmp_path)
    cfg = make_workspace(root, num_train=16, num_val=2)
    c = ["--config", cfg, "--step", "1", "batch_size", "8"]
    run([TRAIN, *c, "num_epochs", "1"], root).check()
    step1 = os.path.join(root, "out", "checkpoint", "step1")
    before = {n: _sha(os.path.join(step1, n)) for n in ("best.pth", "last.pth", "config.json")}
    marker = uuid.uuid4().hex
    log = open(os.path.join(root, "first.log"), "w")
    first = start([TRAIN, *c, "num_epochs", "1000"], marker, root, stdout_file=log)
    deadline = time.time() + 60
    while not os.path.isfile(os.path.join(step1, ".lock.json")) and time.time() < deadline:
        time.sleep(0.2)
    second = run([TRAIN, *c, "num_epochs", "1"], root)
    assert second.returncode == 2, second.text[-2000:]
    err = [l for l in second.stderr.splitlines() if l.strip()]
    assert len(err) == 1 and "is in use by another run" in err[0] and f"pid {first.pid}" in err[0], err
    kill_group(first)
    first.wait(30)
    assert wait_no_leftovers(marker) == []
    assert {n: _sha(os.path.join(step1, n)) for n in before} == before      # nothing replaced
    third = run([TRAIN, *c, "num_epochs", "1"], root).check()
    assert "ended without releasing it" in third.stdout


# ------------------------------------------------------------------------------------ sets
def test_publish_keeps_one_previous_generation_and_a_manifest(tmp_path):
    folder = str(tmp_path / "step1")
    caps = str(tmp_path / "model" / "relu_cap.txt")
    _run_set(folder, 1, {caps: "1.5\n"})
    first = {n: _sha(os.path.join(folder, n)) for n in ("best.pth", "last.pth", "config.json")}
    man = read_manifest(os.path.join(folder, "step1.manifest.json"))
    assert man["files"] == first and man["source"] == {"path": "src.pth", "sha256": "0" * 64}
    assert man["extra"] == {caps: hashlib.sha256(b"1.5\n").hexdigest()}
    _run_set(folder, 2, {caps: "2.5\n"})
    prev = os.path.join(folder, "previous", "step1")
    assert {n: _sha(os.path.join(prev, n)) for n in first} == first           # the replaced set, byte for byte
    assert open(os.path.join(prev, "relu_cap.txt")).read() == "1.5\n" and open(caps).read() == "2.5\n"
    assert read_manifest(os.path.join(prev, "step1.manifest.json"))["files"] == first
    assert float(load_checkpoint(os.path.join(folder, "best.pth"))["model"]["w"][0]) == 2.0
    assert not os.path.exists(os.path.join(folder, "run"))
    _run_set(folder, 3)                                                        # one generation only
    assert float(load_checkpoint(os.path.join(prev, "best.pth"))["model"]["w"][0]) == 2.0


def test_a_publish_killed_midway_is_refused_then_completed(tmp_path, monkeypatch):
    """The kill at the instant of publishing: the new best.pth in place beside the old last.pth. Every
    reader refuses the folder's set (the marker), the next run of the stage completes it, and the
    replaced set is whole in previous/."""
    folder = str(tmp_path / "step1")
    _run_set(folder, 1)
    old_last = _sha(os.path.join(folder, "last.pth"))
    out = StageOutputs(folder, "step1")
    out.start()
    out.save("best.pth", _state(2), 1)
    out.save("last.pth", _state(2), 2, config={"v": 2})
    real = os.replace
    moved = []

    def dying_replace(src, dst):
        if os.path.dirname(src) == out.run_dir and moved:
            raise KeyboardInterrupt                       # killed after the first file moved in
        real(src, dst)
        if os.path.dirname(src) == out.run_dir:
            moved.append(dst)

    monkeypatch.setattr(os, "replace", dying_replace)
    with pytest.raises(KeyboardInterrupt):
        out.publish()
    monkeypatch.setattr(os, "replace", real)
    assert moved == [os.path.join(folder, "best.pth")]
    for name in ("best.pth", "last.pth"):
        with pytest.raises(CheckpointError, match="publishing was interrupted"):
            load_checkpoint(os.path.join(folder, name))
    note = StageOutputs(folder, "step1").repair()
    assert note and "completed the step1 outputs" in note
    assert float(load_checkpoint(os.path.join(folder, "last.pth"))["model"]["w"][0]) == 2.0
    assert _sha(os.path.join(folder, "previous", "step1", "last.pth")) == old_last
    assert not os.path.exists(os.path.join(folder, "step1.publishing.json"))
    assert StageOutputs(folder, "step1").repair() is None


def test_a_file_replaced_behind_the_manifest_is_refused(tmp_path):
    folder = str(tmp_path / "step1")
    _run_set(folder, 1)
    other = str(tmp_path / "other.pth")
    torch.save({"format": "gnetmdk-checkpoint", "version": 1, **_state(9)}, other)
    os.replace(other, os.path.join(folder, "best.pth"))          # a copy, another writer
    with pytest.raises(CheckpointError, match="is not the file its set's manifest"):
        load_checkpoint(os.path.join(folder, "best.pth"))
    check_published(os.path.join(folder, "last.pth"))            # the rest of the set still reads


# ------------------------------------------------------------------------------------ provenance
def test_cal_of_an_earlier_step2_is_refused_by_step3_device_cpu(tmp_path):
    """cal.pth records the step-2 model it calibrated; after step 2 is trained again, step 3 refuses the
    old cal.pth (naming the fix), starts with 'load' anyway, and after a new --cal trains."""
    root = str(tmp_path)
    cfg = make_workspace(root, num_train=16, num_val=2)
    c = ["--config", cfg, "batch_size", "8", "num_epochs", "1"]
    for stage in (["--step", "1"], ["--step", "2"], ["--cal"], ["--step", "2", "seed", "3"]):
        run([TRAIN, *c, *stage], root).check()
    cal = os.path.join(root, "out", "checkpoint", "step2", "cal.pth")
    r = run([TRAIN, *c, "--step", "3"], root)
    assert r.returncode == 2 and "which has been replaced since" in r.stderr
    assert "train.py --cal again" in r.stderr and f"load {cal}" in r.stderr
    assert len([l for l in r.stderr.splitlines() if l.strip()]) == 1
    run([TRAIN, *c, "--step", "3", "max_iters", "1", "load", cal], root).check()
    run([TRAIN, *c, "--cal"], root).check()
    run([TRAIN, *c, "--step", "3", "max_iters", "1"], root).check()


def test_a_recording_cut_short_stays_incomplete_device_cpu(tmp_path):
    """meta.json says complete only once the recording run ends: one killed mid-way keeps complete false,
    and its replay says the recording is incomplete."""
    root = str(tmp_path)
    cfg = make_workspace(root, num_train=16, num_val=2)
    rec = os.path.join(root, "rec")
    marker = uuid.uuid4().hex
    log = open(os.path.join(root, "rec.log"), "w")
    p = start([TRAIN, "--config", cfg, "--step", "1", "batch_size", "8", "num_epochs", "1000", "--save-npz", rec],
              marker, root, stdout_file=log)
    deadline = time.time() + 90
    while len([f for f in os.listdir(rec) if f.endswith(".npz")] if os.path.isdir(rec) else []) < 3:
        assert time.time() < deadline, open(os.path.join(root, "rec.log")).read()[-2000:]
        time.sleep(0.2)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait(30)
    meta = json.load(open(os.path.join(rec, "meta.json")))
    assert meta["complete"] is False
    r = run([TRAIN, "--config", cfg, "--step", "1", "batch_size", "8", "num_epochs", "1000", "--replay-npz", rec,
             "checkpoint_root", os.path.join(root, "replay")], root).check()
    assert "is incomplete (its recording run did not finish)" in r.stdout
