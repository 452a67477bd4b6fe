"""Exact resume after SIGKILL mid-epoch, and the hardening of train.py's entry point: every refusal
ends with a one-line message, a non-zero exit, no traceback, and existing checkpoints untouched."""
import hashlib
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from gnetmdk.checkpoint.io import load_checkpoint, save_checkpoint
from gnetmdk.config import build_config, load_config_class
from gnetmdk.engine.cli import run_stage

from test_pipeline import ROOT, make_cards_workdir


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    torch.set_num_threads(1)
    return make_cards_workdir(tmp_path_factory, "training_cli")


def _train(path, *args, timeout=300):
    return subprocess.run([sys.executable, "train.py", "--config", path, *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


# ---------------------------------------------------------------------------------------------- exact resume
# 4 iterations per epoch; one thread, so that on a 2-core machine the test's poll for a mid-epoch
# checkpoint keeps a core and sees the run's saves in time
RESUME = ["batch_size", 2, "num_epochs", 3, "checkpoint_interval", 1, "eval_before", "false", "eval_interval", 5,
          "max_val_images", 2, "ema", "true", "ema_ramp", 0, "ema_decay", 0.9, "threads", 1]


def _epoch_losses(text):
    """{epoch number: (loss, {term: value})} of the epoch lines in a run's output."""
    out = {}
    for m in re.finditer(r"\] epoch (\d+)/\d+ loss ([0-9.]+) \(([^)]*)\)", text):
        terms = dict((k, float(v)) for k, v in re.findall(r"(\w+) ([0-9.]+)", m.group(3)))
        out[int(m.group(1))] = (float(m.group(2)), terms)
    return out


def test_sigkill_mid_epoch_then_resume_equals_uninterrupted_run(workdir, tmp_path, capsys):
    """Weights, EMA, optimizer and scheduler after kill + resume equal the uninterrupted run's, and so
    does the epoch line of the interrupted epoch (its means cover the iterations before the kill)."""
    _, path = workdir
    ck = tmp_path / "killed"
    args = ["--step", 1, *RESUME, "checkpoint_root", ck, "log_root", tmp_path / "lk"]
    proc = subprocess.Popen([sys.executable, "train.py", "--config", path, *map(str, args)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    last = ck / "step1" / "run" / "last.pth"           # the run in progress writes into run/
    killed_at, seen = None, None
    deadline = time.time() + 120
    try:
        while proc.poll() is None and time.time() < deadline:
            # a new file each save (written aside, then renamed over): a new inode even where two saves
            # land within one tick of the file system's coarse modification clock
            st = last.stat() if last.exists() else None
            if st is not None and (st.st_ino, st.st_mtime_ns) != seen:
                seen = (st.st_ino, st.st_mtime_ns)
                os.kill(proc.pid, signal.SIGSTOP)          # frozen: no further step lands while the save is read
                it = load_checkpoint(str(last))["iteration"]
                if it > 4 and it % 4 in (1, 2):            # inside epoch 2 or 3, even if one more step lands
                    os.kill(proc.pid, signal.SIGKILL)
                    proc.wait()
                    killed_at = it
                    break
                os.kill(proc.pid, signal.SIGCONT)
            time.sleep(0.001)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait()
    assert killed_at is not None, "the run ended before a mid-epoch checkpoint was seen: " + proc.stderr.read()[-2000:]
    assert proc.returncode == -signal.SIGKILL
    state = load_checkpoint(str(last))
    assert state["iteration"] >= killed_at and state["sampler"]["start_batch"] > 0
    assert not (ck / "step1" / "last.pth").exists()      # the killed run published nothing
    r = _train(path, *args, "--resume")
    assert r.returncode == 0, r.stderr
    assert f"resuming from {last} (epoch {state['epoch']}, iteration {state['iteration']})" in r.stdout
    last = ck / "step1" / "last.pth"                   # the finished run's files, published together
    assert not (ck / "step1" / "run").exists() and (ck / "step1" / "best.pth").exists()

    straight = build_config(load_config_class(path), [*map(str, RESUME), "checkpoint_root", str(tmp_path / "s"),
                                                      "log_root", str(tmp_path / "ls")], step=1)
    capsys.readouterr()
    threads = torch.get_num_threads()
    try:
        run_stage(straight)
    finally:
        torch.set_num_threads(threads)                 # the stage set this process's threads to 1
    straight_lines = _epoch_losses(capsys.readouterr().out)
    resumed_lines = _epoch_losses(r.stdout)
    killed_epoch = state["epoch"] + 1                  # 1-based, as printed
    assert sorted(straight_lines) == [1, 2, 3] and killed_epoch in resumed_lines
    for e in resumed_lines:                            # the interrupted epoch and the ones after it
        (la, ta), (lb, tb) = straight_lines[e], resumed_lines[e]
        assert lb == pytest.approx(la, rel=2e-3, abs=2e-4), (e, la, lb)
        assert ta.keys() == tb.keys() and all(tb[k] == pytest.approx(ta[k], rel=2e-3, abs=2e-3) for k in ta), e
    a = load_checkpoint(str(tmp_path / "s" / "step1" / "last.pth"))
    b = load_checkpoint(str(last))
    assert a["iteration"] == b["iteration"] == 12
    for part in ("model", ):
        for k, v in a[part].items():
            assert torch.allclose(v.double(), b[part][k].double(), atol=1e-6, rtol=0), k
    for k, v in a["ema"]["model"].items():
        assert torch.allclose(v.double(), b["ema"]["model"][k].double(), atol=1e-6, rtol=0), k
    for sa, sb in zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values()):
        assert torch.allclose(sa["exp_avg"], sb["exp_avg"], atol=1e-6, rtol=0)
    assert a["scheduler"]["last_epoch"] == b["scheduler"]["last_epoch"]


# ---------------------------------------------------------------------------------------------- hardening
@pytest.fixture(scope="module")
def trained(workdir, tmp_path_factory):
    """A step-1 run whose checkpoint folder every refusal below must leave byte-identical."""
    root, path = workdir
    ck = str(tmp_path_factory.mktemp("trained"))
    run_stage(build_config(load_config_class(path), ["checkpoint_root", ck, "log_root", ck + "-log",
                                                     "eval_before", "false"], step=1))
    return ck


def _digest(folder):
    out = {}
    for base, _, files in os.walk(folder):
        for f in files:
            p = os.path.join(base, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, folder)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def _refused(r, *words):
    assert r.returncode != 0, r.stdout + r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, r.stderr
    for w in words:
        assert w in errors[0], errors[0]
    return errors[0]


@pytest.mark.parametrize("over,words", [
    (["learning_rate", "-0.1"], ["learning_rate", "positive"]),
    (["batch_size", "0"], ["batch_size"]),
    (["chip", "9999"], ["9999"]),
    (["mask_bits", "2,2,2,2,2,2"], ["mask_bits", "weight format 2"]),
    (["accumulate", "3"], ["batch_size 4", "multiple of 3"]),
    (["disk_reserve_mb", "1e12"], ["not enough free disk"]),
    (["--resume", "VOC_CLASSES", "nine,ten,jack,queen,king,ace,joker"], ["num_classes: checkpoint 6", "config 7"]),
    (["--resume", "width_mult", "0.125"], ["width_mult"]),
])
def test_refusals_leave_checkpoints_intact(workdir, trained, over, words):
    _, path = workdir
    before = _digest(trained)
    r = _train(path, "--step", 1, "checkpoint_root", trained, *over)
    _refused(r, *words)
    assert _digest(trained) == before


def test_checkpoint_of_another_step_is_refused(workdir, trained, tmp_path):
    _, path = workdir
    before = _digest(trained)
    s1 = os.path.join(trained, "step1", "last.pth")
    # resume: step 2's last.pth is a step-1 checkpoint
    (tmp_path / "ck" / "step2").mkdir(parents=True)
    with open(s1, "rb") as src, open(tmp_path / "ck" / "step2" / "last.pth", "wb") as dst:
        dst.write(src.read())
    _refused(_train(path, "--step", 2, "--resume", "checkpoint_root", tmp_path / "ck"), "step1 checkpoint", "not step2")
    # load: a later stage's checkpoint cannot start step 1
    c = load_checkpoint(s1)
    c.update(stage="step3", step=3)
    save_checkpoint(str(tmp_path / "s3.pth"), c)
    _refused(_train(path, "--step", 1, "checkpoint_root", tmp_path / "ck1", "load", tmp_path / "s3.pth"),
             "step3 checkpoint", "later than step1")
    assert _digest(trained) == before


def test_unwritable_checkpoint_dir_is_reported_before_training(workdir, tmp_path):
    _, path = workdir
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    r = _train(path, "--step", 1, "checkpoint_root", blocker / "checkpoint")
    _refused(r, "cannot write checkpoints", str(blocker))
    assert "epoch" not in r.stdout


def test_nan_loss_names_iteration_and_last_good_checkpoint(workdir, trained, tmp_path):
    """A run that diverges stops with one line naming the iteration and its own last checkpoint
    (run/last.pth, resumable); the previous run's outputs stay byte for byte as they were."""
    import shutil
    _, path = workdir
    ck = tmp_path / "nan"
    shutil.copytree(trained, ck)                               # a finished earlier run of step 1
    published = {k: v for k, v in _digest(ck).items() if not k.startswith("step1/run")}
    r = _train(path, "--step", 1, "checkpoint_root", ck, "learning_rate", "1e12", "optimizer", "sgd",
               "num_epochs", 3, "eval_before", "false", "checkpoint_interval", 1)
    line = _refused(r, "non-finite", "iteration", "last good checkpoint is", str(ck / "step1" / "run" / "last.pth"),
                    "previous outputs", "unchanged")
    it = int(line.split("iteration ")[1].split(";")[0].split(" ")[0])
    last = load_checkpoint(str(ck / "step1" / "run" / "last.pth"))
    assert last["iteration"] == it - 1                                  # the checkpoint before the bad step
    assert all(torch.isfinite(v.float()).all() for v in last["model"].values())
    assert {k: v for k, v in _digest(ck).items() if not k.startswith("step1/run")} == published
    assert not [f for f in os.listdir(ck / "step1" / "run") if f.startswith(".tmp")]

def test_progress_bar_only_on_a_terminal(workdir, tmp_path):
    """progress true with output to a pipe (as to a log file): the epoch line is there and no tqdm frame
    (no carriage return, no bar) is written."""
    _, path = workdir
    r = _train(path, "--step", 1, "progress", "true", "num_epochs", 1, "eval_before", "false",
               "checkpoint_root", tmp_path / "ck", "log_root", tmp_path / "log")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "[step1] epoch 1/1 loss" in r.stdout
    assert "\r" not in r.stdout + r.stderr and "it/s" not in r.stdout + r.stderr
