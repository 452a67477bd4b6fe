"""Data parallelism computes what one process computes (docs/distributed.md, docs/alignment.md).

Every run goes through the real command line (train.py / train-dist.py, gloo on 127.0.0.1), on a
tiny GNetDet (width 0.0625, 224 px, 28k parameters) and 40 synthetic images, batch 8:

- step 1 (BatchNorm): 2 processes x 4 recorded, replayed by 1 process x 8 from the same weights,
  10 iterations: every parameter within ALIGN_ATOL (1e-5; running statistics within 1e-5 + 1e-5 |b|);
  and the same check fails by far with BatchNorm not synchronised (the test can see a wrong computation);
- step 3 (quantized, from calibrated caps): the same, default AdamW, within ALIGN_ATOL_ADAM (2e-5);
  both tolerances are derived in dist_helpers.py;
- calibration with 2 processes gives bit-identical caps;
- two "machines" (two train-dist.py, --world-size 2 --rank 0/1) match one process on the real loader;
- torchrun runs the same computation.

Step 1 starts from a warmed-up checkpoint with SGD at a small learning rate: from a fresh
initialisation GNetDet's BatchNorm training is chaotic (a 1e-7 relative perturbation of the weights
in ONE process grows to ~1e-2 in the loss within 10 iterations), so no two float32 runs that sum in
a different order can agree to 1e-5 there; docs/distributed.md, "How close is close".
"""
from __future__ import annotations

import json
import os
import time
import uuid

import pytest
import torch

from dist_helpers import (ALIGN_ATOL, ALIGN_ATOL_ADAM, TRAIN, TRAIN_DIST, diff_weights, finish, free_port,
                          make_workspace, run, start, wait_no_leftovers)

pytestmark = pytest.mark.slow

STEP1_ALIGN = ["optimizer", "sgd", "learning_rate", "2e-5"]


def _ckpt(root, name, step):
    return os.path.join(root, name, "checkpoint", f"step{step}", "last.pth")


def _out(root, name):
    d = os.path.join(root, name)
    return ["checkpoint_root", os.path.join(d, "checkpoint"), "log_root", os.path.join(d, "log"),
            "model_root", os.path.join(d, "model")]


def _fold(src, dst):
    """The step-2 starting point made in-process (what 'train.py --step 2 num_epochs 0' writes): BN folded."""
    from gnetmdk.checkpoint.io import build_model_from_checkpoint, load_checkpoint, save_checkpoint
    from gnetmdk.gti.transforms import fold_bn
    ck = load_checkpoint(src)
    model = build_model_from_checkpoint(ck)
    assert fold_bn(model) == 15
    ck.update(stage="step2", step=2, model_meta=model.meta(), model=model.state_dict())
    ck.pop("optimizer", None), ck.pop("scheduler", None), ck.pop("rng", None)
    save_checkpoint(dst, ck)
    return dst


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    """Dataset, config, a warmed-up step-1 checkpoint, its folded step-2 model and a 1-process cal."""
    root = str(tmp_path_factory.mktemp("dist_train"))
    cfg = make_workspace(root)
    c = ["--config", cfg]
    run([TRAIN, *c, "--step", "1", "--max-iters", "40", "learning_rate", "3e-3", *_out(root, "warm")], root).check()
    warm = _ckpt(root, "warm", 1)
    fold = _fold(warm, os.path.join(root, "fold.pth"))
    cal1 = run([TRAIN, *c, "--cal", "load", fold, *_out(root, "cal1")], root).check()
    return {"root": root, "cfg": cfg, "warm": warm, "fold": fold, "cal1": cal1,
            "cal_pth": os.path.join(root, "cal1", "checkpoint", "step2", "cal.pth")}


def _record_and_replay(ws, name, step_args, extra, record_extra=()):
    """2 processes x 4 recording 10 iterations, then 1 process x 8 replaying them; returns both runs."""
    root, c = ws["root"], ["--config", ws["cfg"]]
    rec = os.path.join(root, name, "rec")
    a = run([TRAIN_DIST, *c, *step_args, "--gpus", "2", "--max-iters", "10", "--save-npz", rec, *extra,
             *record_extra, *_out(root, name + "_a")], root).check()
    b = run([TRAIN, *c, *step_args, "--replay-npz", rec, *extra, *_out(root, name + "_b")], root).check()
    return a, b, rec


def _param_diffs(a_path, b_path):
    a = torch.load(a_path, weights_only=True)["model"]
    b = torch.load(b_path, weights_only=True)["model"]
    return {k: float((a[k].double() - b[k].double()).abs().max()) for k in a
            if "running" not in k and "num_batches" not in k and a[k].is_floating_point()}


def _assert_aligned(ws, name, step, rec, atol=ALIGN_ATOL):
    root = ws["root"]
    a, b = _ckpt(root, name + "_a", step), _ckpt(root, name + "_b", step)
    res = diff_weights(a, b, atol=atol, rtol=1e-5)
    assert res.returncode == 0, res.text
    assert "ALIGNED" in res.stdout
    diffs = _param_diffs(a, b)
    assert max(diffs.values()) <= atol, sorted(diffs.items(), key=lambda kv: -kv[1])[:5]
    moved = _param_diffs(a, os.path.join(rec, "start.pth"))
    # the runs did train: the weights moved far more than the two runs differ
    assert max(moved.values()) > 100 * max(max(diffs.values()), 1e-7), (max(moved.values()), max(diffs.values()))
    report = json.load(open(os.path.join(root, name + "_b", "checkpoint", f"step{step}", "replay_report.json")))
    assert len(report["iterations"]) == 10 and report["recorded_world_size"] == 2 and report["world_size"] == 1
    assert report["max_abs_loss_diff"] < 1e-4, report["max_abs_loss_diff"]
    return diffs


@pytest.fixture(scope="module")
def s1(ws):
    """Step 1: 2 x 4 recorded, 1 x 8 replayed (shared by the tests that need the 2-process result)."""
    return _record_and_replay(ws, "s1", ["--step", "1"], ["load", ws["warm"], *STEP1_ALIGN])


def test_step1_two_processes_equal_one_process(ws, s1):
    a, b, rec = s1
    assert "2 CPU process(es), gloo backend (no GPU in use)" in a.stdout
    assert "BatchNorm: 15 layers synchronised over 2 process(es)" in a.stdout
    assert "2 x 4" in a.stdout and "1 x 8" in b.stdout
    files = sorted(f for f in os.listdir(rec) if f.endswith(".npz"))
    assert len(files) == 20 and files[0] == "iter_000001_rank0.npz" and files[-1] == "iter_000010_rank1.npz"
    assert os.path.isfile(os.path.join(rec, "start.pth")) and os.path.isfile(os.path.join(rec, "meta.json"))
    assert "[replay] iteration 10:" in b.stdout and "end of the recording" in b.stdout
    _assert_aligned(ws, "s1", 1, rec)


def test_step1_without_sync_bn_is_caught(ws, s1):
    """Negative control: the same 2-process run with per-process BatchNorm statistics (sync_bn false)
    fails the check against the one-process replay of the same batches."""
    root = ws["root"]
    r = run([TRAIN_DIST, "--config", ws["cfg"], "--step", "1", "--gpus", "2", "--max-iters", "10", "load", ws["warm"],
             *STEP1_ALIGN, "sync_bn", "false", *_out(root, "nosync")], root).check()
    assert "synchronised" not in r.stdout
    res = diff_weights(_ckpt(root, "nosync", 1), _ckpt(root, "s1_b", 1), atol=1e-5, rtol=1e-5)
    assert res.returncode == 1 and "NOT ALIGNED" in res.stdout
    assert max(_param_diffs(_ckpt(root, "nosync", 1), _ckpt(root, "s1_b", 1)).values()) > 1e-4


def test_step3_two_processes_equal_one_process(ws):
    # default optimizer (AdamW, lr 1e-3 from the config) and the deterministic mode
    a, b, rec = _record_and_replay(ws, "s3", ["--step", "3", "--deterministic"], ["load", ws["cal_pth"]])
    assert "deterministic mode" in a.stdout
    _assert_aligned(ws, "s3", 3, rec, atol=ALIGN_ATOL_ADAM)


def test_step3_learned_caps_two_processes_equal_one_process(ws):
    """cap_lr > 0: the caps are buffers, so their gradients are averaged by the trainer, not DDP;
    2 processes then train the same caps (and weights) as one process replaying the same batches."""
    a, b, rec = _record_and_replay(ws, "s3c", ["--step", "3", "--deterministic"],
                                   ["load", ws["cal_pth"], "cap_lr", "1e-2"])
    assert "learning the 16 activation caps" in a.stdout
    diffs = _assert_aligned(ws, "s3c", 3, rec, atol=ALIGN_ATOL_ADAM)
    caps = [k for k in diffs if k.endswith(".cap")]
    assert len(caps) == 16 and max(diffs[k] for k in caps) <= ALIGN_ATOL_ADAM
    start = torch.load(os.path.join(rec, "start.pth"), weights_only=True)["model"]
    end = torch.load(_ckpt(ws["root"], "s3c_a", 3), weights_only=True)["model"]
    assert min(float((end[k] - start[k]).abs()) for k in caps) > 1e-3     # every cap trained


def test_cal_two_processes_same_caps(ws):
    root = ws["root"]
    r = run([TRAIN_DIST, "--config", ws["cfg"], "--cal", "--gpus", "2", "load", ws["fold"], *_out(root, "cal2")],
            root).check()
    caps1 = torch.load(ws["cal_pth"], weights_only=True)["caps"]
    caps2 = torch.load(os.path.join(root, "cal2", "checkpoint", "step2", "cal.pth"), weights_only=True)["caps"]
    assert len(caps1) == 16 and all(c > 0 for c in caps1)
    assert caps2 == caps1                       # exact: global-batch percentiles, then all-reduce MAX
    txt1 = open(os.path.join(root, "cal1", "model", "relu_cap.txt")).read()
    txt2 = open(os.path.join(root, "cal2", "model", "relu_cap.txt")).read()
    assert txt1 == txt2
    assert "batch 8 (2 x 4)" in r.stdout


def test_cal_mse_two_processes_same_caps(ws):
    # cap_method mse: the maxima (MAX) and the histograms (SUM of exact counts) over 2 processes give
    # the caps of one process bit for bit; they are not the percentile caps
    root = ws["root"]
    caps = {}
    for name, launcher, extra in (("m1", TRAIN, []), ("m2", TRAIN_DIST, ["--gpus", "2"])):
        r = run([launcher, "--config", ws["cfg"], "--cal", *extra, "load", ws["fold"], "cap_method", "mse",
                 *_out(root, name)], root).check()
        assert "MSE-best for 5-bit codes" in r.stdout
        caps[name] = torch.load(os.path.join(root, name, "checkpoint", "step2", "cal.pth"), weights_only=True)["caps"]
    assert len(caps["m1"]) == 16 and all(c > 0 for c in caps["m1"])
    assert caps["m2"] == caps["m1"]
    pct = torch.load(ws["cal_pth"], weights_only=True)["caps"]
    assert sum(a != b for a, b in zip(caps["m1"], pct)) >= 8


def test_two_machines_match_one_process(ws):
    """Two train-dist.py invocations as machines 0 and 1 on 127.0.0.1 (real data loader, no replay)
    finish and match a one-process run of the same command."""
    root, c = ws["root"], ["--config", ws["cfg"]]
    port = free_port()
    common = [*c, "--step", "1", "--world-size", "2", "--dist-url", f"127.0.0.1:{port}", "--dist-timeout", "60",
              "--max-iters", "10", "load", ws["warm"], *STEP1_ALIGN]
    marker = uuid.uuid4().hex
    t0 = time.time()
    p1 = start([TRAIN_DIST, *common, "--rank", "1", *_out(root, "m1")], marker, root)
    p0 = start([TRAIN_DIST, *common, "--rank", "0", *_out(root, "m0")], marker, root)
    r0 = finish(p0, ["rank0"], 120, t0)
    r1 = finish(p1, ["rank1"], 60, t0)
    assert r0.returncode == 0, r0.text
    assert r1.returncode == 0, r1.text
    assert "machine 0 of 2" in r0.stdout and "machine 1 of 2" in r1.stdout
    assert "[step1]" in r0.stdout and "[step1]" not in r1.stdout      # rank 0 alone logs and writes
    assert not os.path.exists(os.path.join(root, "m1", "checkpoint", "step1", "last.pth"))
    one = run([TRAIN, *c, "--step", "1", "--max-iters", "10", "load", ws["warm"], *STEP1_ALIGN, *_out(root, "m_one")],
              root).check()
    res = diff_weights(_ckpt(root, "m0", 1), _ckpt(root, "m_one", 1), atol=ALIGN_ATOL, rtol=1e-5)
    assert res.returncode == 0, res.text
    assert max(_param_diffs(_ckpt(root, "m0", 1), _ckpt(root, "m_one", 1)).values()) <= ALIGN_ATOL
    assert wait_no_leftovers(marker) == []
    assert one.returncode == 0


def test_torchrun_runs_the_same_computation(ws, s1):
    """Started by torchrun (RANK / WORLD_SIZE / MASTER_ADDR), two processes compute what the
    launcher's two processes compute."""
    root, c = ws["root"], ["--config", ws["cfg"]]
    port = free_port()
    r = run(["-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
             str(port), TRAIN_DIST, *c, "--step", "1", "--max-iters", "10", "load", ws["warm"], *STEP1_ALIGN,
             *_out(root, "trun")], root, timeout=180).check()
    assert "started by torchrun, world size 2" in r.stdout
    # the launcher's 2-process run of the same command (recording does not change the computation)
    res = diff_weights(_ckpt(root, "trun", 1), _ckpt(root, "s1_a", 1), atol=ALIGN_ATOL, rtol=1e-5)
    assert res.returncode == 0, res.text


def test_step2_and_step4_run_distributed(ws):
    """The stages not covered above run with 2 processes too (step 2: BN folded on entry; step 4: gain
    editing on entry, integer activations)."""
    root, c = ws["root"], ["--config", ws["cfg"]]
    r2 = run([TRAIN_DIST, *c, "--step", "2", "--gpus", "2", "--max-iters", "2", "load", ws["warm"],
              *_out(root, "d2")], root).check()
    assert "folded 15 BatchNorm layers" in r2.stdout and "batch 8 (2 x 4)" in r2.stdout
    r4 = run([TRAIN_DIST, *c, "--step", "4", "--gpus", "2", "--max-iters", "2", "load", ws["cal_pth"],
              *_out(root, "d4")], root).check()
    assert "gain-edited" in r4.stdout
    for name, step in (("d2", 2), ("d4", 4)):
        ck = torch.load(_ckpt(root, name, step), weights_only=True)
        assert ck["iteration"] == 2 and ck["world_size"] == 2 and ck["stage"] == f"step{step}"


def test_two_processes_with_accumulation_equal_one_process(ws):
    """DDP with gradient accumulation (no_sync on all but the last micro-batch): 2 processes x 2
    micro-batches of 2 images take the optimizer steps that 1 process takes with whole batches of 8,
    on the same global batches (step 3: no BatchNorm, deterministic mode)."""
    root, c = ws["root"], ["--config", ws["cfg"]]
    common = [*c, "--step", "3", "--deterministic", "--max-iters", "6", "load", ws["cal_pth"]]
    a = run([TRAIN_DIST, *common, "--gpus", "2", "accumulate", "2", *_out(root, "acc_a")], root).check()
    assert "gradient accumulation: 2 micro-batches" in a.stdout and "batch 8 (2 x 4)" in a.stdout
    run([TRAIN, *common, *_out(root, "acc_b")], root).check()
    a_ck, b_ck = _ckpt(root, "acc_a", 3), _ckpt(root, "acc_b", 3)
    res = diff_weights(a_ck, b_ck, atol=ALIGN_ATOL_ADAM, rtol=1e-5)
    assert res.returncode == 0, res.text
    diffs = _param_diffs(a_ck, b_ck)
    moved = _param_diffs(a_ck, ws["cal_pth"])
    assert max(diffs.values()) <= ALIGN_ATOL_ADAM
    assert max(moved.values()) > 100 * max(max(diffs.values()), 1e-8)
    assert torch.load(a_ck, weights_only=True)["iteration"] == 6


def test_cal_output_error_search_two_processes_same_caps_device_cpu(ws):
    """cap_method output: the MSE caps refined against the network's output error; per-image errors
    gathered and summed in sorted order, so 2 processes choose one process's caps."""
    root = ws["root"]
    caps = {}
    for name, launcher, extra in (("o1", TRAIN, []), ("o2", TRAIN_DIST, ["--gpus", "2"])):
        r = run([launcher, "--config", ws["cfg"], "--cal", *extra, "load", ws["fold"], "cap_method", "output",
                 *_out(root, name)], root, timeout=300).check()
        assert "searched against the network's output error" in r.stdout
        caps[name] = torch.load(os.path.join(root, name, "checkpoint", "step2", "cal.pth"), weights_only=True)["caps"]
    assert len(caps["o1"]) == 16 and caps["o2"] == caps["o1"]


def test_output_error_search_lowers_the_output_error_device_cpu(ws):
    """refine_caps_for_output on synthetic batches: the output error of the chosen caps, computed here
    independently, is at most that of the starting caps, and the search moved some cap."""
    from gnetmdk.checkpoint.io import build_model_from_checkpoint, load_checkpoint
    from gnetmdk.engine.calibration import refine_caps_for_output
    from gnetmdk.engine.stages import STAGES, apply_stage
    model = build_model_from_checkpoint(load_checkpoint(ws["cal_pth"]))
    start = [float(r.cap) for r in model.relus()]
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 32, (4, 3, 224, 224), generator=g).float() for _ in range(2)]

    @torch.no_grad()
    def out_error(cs):
        apply_stage(model, STAGES["cal"])
        model.eval()
        refs = [model(x).double() for x in data]
        for r, c in zip(model.relus(), cs):
            r.cap.fill_(c)
        apply_stage(model, STAGES["step3"])
        model.eval()
        return sum(float(((model(x).double() - ref) ** 2).sum()) for x, ref in zip(data, refs))

    chosen = refine_caps_for_output(model, lambda: iter(data), start, torch.device("cpu"))
    assert chosen != start
    assert out_error(chosen) <= out_error(start)
