"""Data parallelism computes what one process computes, bit for bit (docs/alignment.md, docs/distributed.md).

Every run goes through the real command line (train.py / train-dist.py, gloo on 127.0.0.1), on a tiny
GNetDet (width 0.0625, 224 px, 28k parameters) and 40 synthetic images, batch 8, device cpu. A run of
N processes in ``--deterministic`` mode records 10 iterations; one process replays the recording as N
virtual ranks (each rank's images through forward and backward as its own chunk, BatchNorm and the
gradients combined in rank order), and the two end with the same weights, BatchNorm buffers, caps, EMA
and optimizer state, and the same loss terms at every iteration: ``--atol 0``, no tolerance, from fresh
weights at AdamW's 1e-3 as well. The same holds under other CPU kernels and thread counts
(OTHER_KERNELS, threads 1 and 2 per rank). Negative controls (unsynchronised BatchNorm, a rank fed
another batch, the learned caps' gradients not averaged) still fail.
"""
from __future__ import annotations

import json
import os
import shutil
import time
import uuid

import numpy as np
import pytest
import torch

from dist_helpers import (OTHER_KERNELS, TRAIN, TRAIN_DIST, assert_bit_identical, diff_weights, finish, free_port,
                          make_workspace, max_change, run, start, wait_no_leftovers)

pytestmark = pytest.mark.slow


def _ckpt(root, name, step):
    return os.path.join(root, name, "checkpoint", f"step{step}", "last.pth")


def _out(root, name):
    d = os.path.join(root, name)
    return ["checkpoint_root", os.path.join(d, "checkpoint"), "log_root", os.path.join(d, "log"),
            "model_root", os.path.join(d, "model")]


def _fold(src, dst):
    """The step-2 starting point made in-process (what 'train.py --step 2 num_epochs 0' writes): BN folded."""
    from gnetmdk.checkpoint.io import load_checkpoint, save_checkpoint
    from gnetmdk.models.rebuild import build_model_from_checkpoint
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
    """Dataset, config, a briefly trained step-1 checkpoint, its folded step-2 model and a 1-process cal."""
    root = str(tmp_path_factory.mktemp("dist_train"))
    cfg = make_workspace(root)
    c = ["--config", cfg]
    run([TRAIN, *c, "--step", "1", "--max-iters", "40", "learning_rate", "3e-3", *_out(root, "warm")], root).check()
    warm = _ckpt(root, "warm", 1)
    fold = _fold(warm, os.path.join(root, "fold.pth"))
    run([TRAIN, *c, "--cal", "load", fold, *_out(root, "cal1")], root).check()
    return {"root": root, "cfg": cfg, "warm": warm, "fold": fold,
            "cal_pth": os.path.join(root, "cal1", "checkpoint", "step2", "cal.pth")}


def _record_and_replay(ws, name, stage, extra=(), procs=("--gpus", "2"), env=None, replay_procs=()):
    """N processes (``procs``) record 10 deterministic iterations; one process (or ``replay_procs``)
    replays them; returns (record run, replay run, recording folder)."""
    root, c = ws["root"], ["--config", ws["cfg"]]
    rec = os.path.join(root, name, "rec")
    a = run([TRAIN_DIST, *c, *stage, "--deterministic", *procs, "--max-iters", "10", "--save-npz", rec, *extra,
             *_out(root, name + "_a")], root, timeout=300, env=env).check()
    b = run([TRAIN_DIST if replay_procs else TRAIN, *c, *stage, "--deterministic", *replay_procs, "--replay-npz", rec,
             *extra, *_out(root, name + "_b")], root, timeout=300, env=env).check()
    return a, b, rec


def _assert_equal(ws, name, step, rec, ranks=2):
    """The replay ends bit-identical to the recording run, with every loss term of every iteration
    equal, and the runs did train."""
    root = ws["root"]
    a, b = _ckpt(root, name + "_a", step), _ckpt(root, name + "_b", step)
    assert_bit_identical(a, b)
    report = json.load(open(os.path.join(root, name + "_b", "checkpoint", f"step{step}", "replay_report.json")))
    assert report["exact"] and report["recorded_world_size"] == ranks and report["world_size"] == ranks
    assert len(report["iterations"]) == 10
    for row in report["iterations"]:
        assert row["max_abs_diff"] == 0.0 and row["rank_max_abs_diff"] == [0.0] * ranks, row
        assert row["lr"] == row["recorded_lr"]
    assert report["max_abs_loss_diff"] == 0.0
    assert max_change(a, os.path.join(rec, "start.pth")) > 1e-3          # the weights did move


@pytest.fixture(scope="module")
def s1(ws):
    """Step 1 from fresh weights (AdamW 1e-3, the EMA on): 2 x 4 recorded, 1 x 8 replayed."""
    return _record_and_replay(ws, "s1", ["--step", "1"], ["ema", "true", "ema_ramp", "2"])


def test_step1_from_fresh_weights_two_processes_equal_one_process(ws, s1):
    a, b, rec = s1
    assert "2 CPU process(es), gloo backend (no GPU in use)" in a.stdout and "1 thread(s) per process" in a.stdout
    assert "starting from a fresh gnetdet" in a.stdout
    assert "BatchNorm: 15 layers synchronised over 2 rank(s)" in a.stdout and "batch 8 (2 x 4)" in a.stdout
    assert "batch 8 (2 x 4: 2 virtual ranks in each of 1 process(es))" in b.stdout
    assert "exact, every value should be equal" in b.stdout and "every loss term equal" in b.stdout
    files = sorted(f for f in os.listdir(rec) if f.endswith(".npz"))
    assert len(files) == 20 and files[0] == "iter_000001_rank0.npz" and files[-1] == "iter_000010_rank1.npz"
    meta = json.load(open(os.path.join(rec, "meta.json")))
    assert meta["world_size"] == 2 and meta["threads"] == 1 and meta["complete"] and meta["iterations"] == 10
    assert meta["kernels"]["cpu_capability"]
    _assert_equal(ws, "s1", 1, rec)
    ck = torch.load(_ckpt(ws["root"], "s1_b", 1), weights_only=True)
    assert ck["ema"]["updates"] == 10 and ck["world_size"] == 2
    # the EMA (compared above with the optimizer's state) is an average, not a copy of the weights
    w = "layers.0.conv.weight"
    assert not torch.equal(ck["ema"]["model"][w], ck["model"][w]) and len(ck["optimizer"]["state"]) > 0


def test_step1_without_sync_bn_is_caught(ws, s1):
    """Negative control: 2 processes from the same weights with per-process BatchNorm statistics
    (sync_bn false) end far from the one-process replay of the synchronised run."""
    root, rec = ws["root"], s1[2]
    r = run([TRAIN_DIST, "--config", ws["cfg"], "--step", "1", "--deterministic", "--gpus", "2", "--max-iters", "10",
             "load", os.path.join(rec, "start.pth"), "ema", "true", "ema_ramp", "2", "sync_bn", "false",
             *_out(root, "nosync")], root).check()
    assert "synchronised" not in r.stdout
    res = diff_weights(_ckpt(root, "nosync", 1), _ckpt(root, "s1_b", 1), atol=1e-4)
    assert res.returncode == 1 and "NOT ALIGNED" in res.stdout


def test_a_rank_fed_another_batch_is_caught(ws, s1):
    """Negative control: the recording with rank 1's images of iteration 4 replaced by another batch's;
    the replay reports the difference from iteration 4 on and ends elsewhere."""
    root, rec = ws["root"], s1[2]
    bad = os.path.join(root, "s1_bad_rec")
    shutil.copytree(rec, bad)
    with np.load(os.path.join(rec, "iter_000005_rank1.npz")) as z5, np.load(os.path.join(rec, "iter_000004_rank1.npz")) as z4:
        arrays = {k: z4[k] for k in z4.files}
        arrays["images"] = z5["images"]
    np.savez(os.path.join(bad, "iter_000004_rank1.npz"), **arrays)
    b = run([TRAIN, "--config", ws["cfg"], "--step", "1", "--deterministic", "--replay-npz", bad, "ema", "true",
             "ema_ramp", "2", *_out(root, "s1_bad")], root).check()
    report = json.load(open(os.path.join(root, "s1_bad", "checkpoint", "step1", "replay_report.json")))
    rows = report["iterations"]
    assert all(r["max_abs_diff"] == 0.0 for r in rows[:3])
    # iteration 4: rank 1's terms differ (and rank 0's too: BatchNorm normalises with both ranks' batches)
    assert rows[3]["rank_max_abs_diff"][1] > 1e-3
    assert "largest loss difference" in b.stdout
    res = diff_weights(_ckpt(root, "s1_a", 1), _ckpt(root, "s1_bad", 1), atol=0)
    assert res.returncode == 1


@pytest.mark.parametrize("threads,kernels,amp", [(2, False, False), (1, True, False), (2, True, False),
                                                 (1, False, True)],
                         ids=["threads2", "avx2-threads1", "avx2-threads2", "amp-bf16"])
def test_exact_under_other_kernels_and_thread_counts(ws, threads, kernels, amp):
    """The same record-and-replay under other CPU kernels (ONEDNN_MAX_CPU_ISA=AVX2,
    ATEN_CPU_CAPABILITY=avx2) and 2 threads per rank: other summation orders inside every operator,
    the same for the recording and its replay, so still bit for bit (threads 1 with the default
    kernels is the test above); and under bfloat16 autocast."""
    name = f"k{threads}{'x' if kernels else ''}{'a' if amp else ''}"
    a, b, rec = _record_and_replay(ws, name, ["--step", "1"], ["threads", str(threads), "amp", str(amp).lower()],
                                   env=OTHER_KERNELS if kernels else None)
    assert f"{threads} thread(s) per rank" in b.stdout
    meta = json.load(open(os.path.join(rec, "meta.json")))
    assert meta["threads"] == threads
    assert (meta["kernels"]["ONEDNN_MAX_CPU_ISA"] == "AVX2") == kernels
    _assert_equal(ws, name, 1, rec)


def test_step2_two_processes_equal_one_process(ws):
    """Step 2 (BatchNorm folded on entry, conv weights quantized with the default MSE rule)."""
    a, b, rec = _record_and_replay(ws, "s2", ["--step", "2"], ["load", ws["warm"], "gnetdet.weight_scale", "mse"])
    assert "folded 15 BatchNorm layers" in a.stdout
    _assert_equal(ws, "s2", 2, rec)


def test_step2_batchnorm_kept_two_processes_equal_one_process_device_cpu(ws):
    """Step 2 with ``gnetdet.step2_bn keep``: BatchNorm trained on the global batch's statistics while
    the convs quantize their folded weights; 2 processes and 1 replaying them end bit-identical."""
    a, b, rec = _record_and_replay(ws, "s2bn", ["--step", "2"], ["load", ws["warm"], "gnetdet.step2_bn", "keep"])
    assert "kept 15 BatchNorm layers" in a.stdout and "folded 15" not in a.stdout
    _assert_equal(ws, "s2bn", 2, rec)


def test_step3_batchnorm_kept_two_processes_equal_one_process_device_cpu(ws):
    """Step 3 with ``gnetdet.step3_bn keep``: calibrated with the BatchNorm layers kept (cal.pth keeps
    them), then trained gain-aware on the global batch's statistics; 2 processes and 1 replaying them
    end bit-identical."""
    root, keep = ws["root"], ["gnetdet.step2_bn", "keep", "gnetdet.step3_bn", "keep"]
    run([TRAIN, "--config", ws["cfg"], "--cal", "load", ws["warm"], *keep, *_out(root, "cal_bn")], root).check()
    cal = os.path.join(root, "cal_bn", "checkpoint", "step2", "cal.pth")
    assert "layers.0.bn.running_var" in torch.load(cal, weights_only=True)["model"]
    a, b, rec = _record_and_replay(ws, "s3bn", ["--step", "3"], ["load", cal, *keep])
    assert "kept 15 BatchNorm layers (step3_bn keep)" in a.stdout and "folded 15" not in a.stdout
    _assert_equal(ws, "s3bn", 3, rec)


@pytest.mark.parametrize("method,equalize", [("percentile", "0"), ("mse", "0"), ("mse", "0.5")])
def test_cal_virtual_ranks_equal_two_processes(ws, method, equalize):
    """Calibration: 2 processes and one process with 2 virtual ranks (each rank observes its own chunk;
    percentiles of the global batch, maxima and histograms combined over the ranks) give the same caps,
    and the same relu_cap.txt; with range equalization (per-channel maxima combined over the ranks) also
    the same equalized weights, which differ from the step-2 model's."""
    root, caps, models = ws["root"], {}, {}
    tag = f"{method}_e{equalize}"
    for name, launcher, extra in (("c2", TRAIN_DIST, ["--gpus", "2"]), ("cv", TRAIN, ["virtual_ranks", "2"])):
        r = run([launcher, "--config", ws["cfg"], "--cal", *extra, "load", ws["fold"], "cap_method", method,
                 "gnetdet.equalize", equalize, *_out(root, f"{name}_{tag}")], root).check()
        assert "batch 8 (2 x 4" in r.stdout
        assert ("after equalizing the channels' ranges" in r.stdout) == (equalize != "0")
        ck = torch.load(os.path.join(root, f"{name}_{tag}", "checkpoint", "step2", "cal.pth"), weights_only=True)
        caps[name], models[name] = ck["caps"], ck["model"]
    assert len(caps["c2"]) == 16 and all(c > 0 for c in caps["c2"]) and caps["cv"] == caps["c2"]
    txt = [open(os.path.join(root, f"{n}_{tag}", "model", "relu_cap.txt")).read() for n in ("c2", "cv")]
    assert txt[0] == txt[1]
    assert all(torch.equal(models["c2"][k], models["cv"][k]) for k in models["c2"])
    fold = torch.load(ws["fold"], weights_only=True)["model"]
    moved = [k for k in fold if k.endswith("conv.weight") and not torch.equal(fold[k], models["c2"][k])]
    assert (len(moved) == 16) == (equalize != "0") and (not moved) == (equalize == "0")


def test_cal_bias_correction_virtual_ranks_equal_two_processes_device_cpu(ws):
    """gnetdet.bias_correct: the channel means are gathered per image and added in sorted order, so 2
    processes and one process of 2 virtual ranks shift every conv's bias alike (the cal.pth models are
    equal bit for bit), and the biases differ from the step-2 model's (the weights do not)."""
    root, models = ws["root"], {}
    for name, launcher, extra in (("b2", TRAIN_DIST, ["--gpus", "2"]), ("bv", TRAIN, ["virtual_ranks", "2"])):
        r = run([launcher, "--config", ws["cfg"], "--cal", *extra, "load", ws["fold"], "gnetdet.bias_correct", "true",
                 *_out(root, name)], root, timeout=300).check()
        assert "biases corrected to the float activations' channel means" in r.stdout
        models[name] = torch.load(os.path.join(root, name, "checkpoint", "step2", "cal.pth"), weights_only=True)["model"]
    assert all(torch.equal(models["b2"][k], models["bv"][k]) for k in models["b2"])
    fold = torch.load(ws["fold"], weights_only=True)["model"]
    moved = [k for k in fold if k.endswith("conv.bias") and not torch.equal(fold[k], models["b2"][k])]
    assert len(moved) == 16
    assert all(torch.equal(fold[k], models["b2"][k]) for k in fold if k.endswith("conv.weight"))


def test_cal_output_error_search_virtual_ranks_equal_two_processes_device_cpu(ws):
    """cap_method output: the MSE caps refined against the network's output error; per-image errors
    gathered and summed in sorted order, so 2 processes and 2 virtual ranks choose the same caps."""
    root, caps = ws["root"], {}
    for name, launcher, extra in (("o2", TRAIN_DIST, ["--gpus", "2"]), ("ov", TRAIN, ["virtual_ranks", "2"])):
        r = run([launcher, "--config", ws["cfg"], "--cal", *extra, "load", ws["fold"], "cap_method", "output",
                 *_out(root, name)], root, timeout=300).check()
        assert "searched against the network's output error" in r.stdout
        caps[name] = torch.load(os.path.join(root, name, "checkpoint", "step2", "cal.pth"), weights_only=True)["caps"]
    assert len(caps["o2"]) == 16 and caps["ov"] == caps["o2"]


@pytest.fixture(scope="module")
def s3c(ws):
    """Step 3 with learned caps (cap_lr) under the MSE weight rule: 2 x 4 recorded, 1 x 8 replayed."""
    return _record_and_replay(ws, "s3c", ["--step", "3"], ["load", ws["cal_pth"], "cap_lr", "1e-2",
                                                           "gnetdet.weight_scale", "mse"])


def test_step3_learned_caps_two_processes_equal_one_process(ws, s3c):
    """cap_lr > 0: the caps are buffers, so their gradients are averaged by the trainer (2 processes)
    or with the virtual ranks' other gradients; both give the same caps and weights."""
    a, b, rec = s3c
    assert "learning the 16 activation caps" in a.stdout
    _assert_equal(ws, "s3c", 3, rec)
    start = torch.load(os.path.join(rec, "start.pth"), weights_only=True)["model"]
    end = torch.load(_ckpt(ws["root"], "s3c_a", 3), weights_only=True)["model"]
    caps = [k for k in end if k.endswith(".cap")]
    assert len(caps) == 16 and min(float((end[k] - start[k]).abs()) for k in caps) > 1e-3     # every cap trained


def test_caps_gradients_not_averaged_are_caught(ws, s3c, tmp_path):
    """Negative control: the 2-process run with the all-reduce of the caps' gradients removed (through a
    sitecustomize module in the processes' path) ends elsewhere than the replay of the correct run."""
    root, rec = ws["root"], s3c[2]
    (tmp_path / "sitecustomize.py").write_text(
        "import os\n"
        "if os.environ.get('GNETMDK_TEST_NO_CAPS_REDUCE'):\n"
        "    import gnetmdk.engine.learned_caps as t\n"
        "    t.all_reduce = lambda tensor, op='sum': tensor\n")
    from dist_helpers import ROOT
    env = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}", "GNETMDK_TEST_NO_CAPS_REDUCE": "1"}
    run([TRAIN_DIST, "--config", ws["cfg"], "--step", "3", "--deterministic", "--gpus", "2", "--max-iters", "10",
         "load", os.path.join(rec, "start.pth"), "cap_lr", "1e-2", "gnetdet.weight_scale", "mse",
         *_out(root, "nocaps")], root, env=env).check()
    res = diff_weights(_ckpt(root, "nocaps", 3), _ckpt(root, "s3c_b", 3), atol=0)
    assert res.returncode == 1 and "cap" in res.stdout


def test_step3_distillation_two_processes_equal_one_process(ws):
    """Distillation from the float model (teacher forward per rank) with the EMA."""
    a, b, rec = _record_and_replay(ws, "s3d", ["--step", "3"], ["load", ws["cal_pth"], "distill", "1.0",
                                                                "distill_from", ws["warm"], "ema", "true"])
    assert "distillation from" in a.stdout
    _assert_equal(ws, "s3d", 3, rec)


def test_step4_two_processes_equal_one_process(ws, s3c):
    """Step 4 (gain editing on entry, integer activations) from the learned-caps step-3 model."""
    a, b, rec = _record_and_replay(ws, "s4", ["--step", "4"], ["load", _ckpt(ws["root"], "s3c_a", 3)])
    assert "gain-edited" in a.stdout
    _assert_equal(ws, "s4", 4, rec)


def test_two_machines_of_two_processes_equal_one_process(ws):
    """Two train-dist.py invocations as machines 0 and 1 of 2 processes each (4 ranks, real loader)
    record; one process replays them as 4 virtual ranks and 2 processes as 2 x 2, bit for bit."""
    root, c = ws["root"], ["--config", ws["cfg"]]
    rec = os.path.join(root, "m4", "rec")
    port = free_port()
    common = [*c, "--step", "1", "--deterministic", "--gpus", "2", "--world-size", "2", "--dist-url",
              f"127.0.0.1:{port}", "--dist-timeout", "60", "--max-iters", "10", "--save-npz", rec]
    marker = uuid.uuid4().hex
    t0 = time.time()
    p1 = start([TRAIN_DIST, *common, "--rank", "1", *_out(root, "m4_1")], marker, root)
    p0 = start([TRAIN_DIST, *common, "--rank", "0", *_out(root, "m4_a")], marker, root)
    r0 = finish(p0, ["rank0"], 240, t0)
    r1 = finish(p1, ["rank1"], 60, t0)
    assert r0.returncode == 0, r0.text
    assert r1.returncode == 0, r1.text
    assert "machine 0 of 2" in r0.stdout and "machine 1 of 2" in r1.stdout
    assert "[step1]" in r0.stdout and "[step1]" not in r1.stdout      # process 0 alone logs and writes
    assert not os.path.exists(_ckpt(root, "m4_1", 1))
    assert wait_no_leftovers(marker) == []
    assert len([f for f in os.listdir(rec) if f.endswith(".npz")]) == 40
    run([TRAIN, *c, "--step", "1", "--deterministic", "--replay-npz", rec, *_out(root, "m4_b")], root,
        timeout=300).check()
    _assert_equal(ws, "m4", 1, rec, ranks=4)
    b2 = run([TRAIN_DIST, *c, "--step", "1", "--deterministic", "--gpus", "2", "--replay-npz", rec,
              *_out(root, "m4_c")], root, timeout=300).check()
    assert "batch 8 (4 x 2: 2 virtual ranks in each of 2 process(es))" in b2.stdout
    assert_bit_identical(_ckpt(root, "m4_a", 1), _ckpt(root, "m4_c", 1))


def test_torchrun_runs_the_same_computation(ws, s1):
    """Started by torchrun (RANK / WORLD_SIZE / MASTER_ADDR), two processes compute what the
    launcher's two processes compute, bit for bit."""
    root, c = ws["root"], ["--config", ws["cfg"]]
    port = free_port()
    r = run(["-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
             str(port), TRAIN_DIST, *c, "--step", "1", "--deterministic", "--max-iters", "10", "ema", "true",
             "ema_ramp", "2", "threads", "1", *_out(root, "trun")], root, timeout=180).check()
    assert "started by torchrun, world size 2" in r.stdout
    # the launcher's 2-process run of the same command (recording does not change the computation)
    assert_bit_identical(_ckpt(root, "trun", 1), _ckpt(root, "s1_a", 1))


def test_accumulation_two_processes_equal_virtual_ranks(ws):
    """Gradient accumulation (DDP's no_sync on all but the last micro-batch): 2 processes x 2 micro-batches
    of 2 images, and one process with 2 virtual ranks on the same data loader, take the same steps."""
    root, c = ws["root"], ["--config", ws["cfg"]]
    common = [*c, "--step", "3", "--deterministic", "--max-iters", "6", "load", ws["cal_pth"], "accumulate", "2"]
    a = run([TRAIN_DIST, *common, "--gpus", "2", *_out(root, "acc_a")], root).check()
    assert "gradient accumulation: 2 micro-batches" in a.stdout and "batch 8 (2 x 4)" in a.stdout
    run([TRAIN, *common, "virtual_ranks", "2", *_out(root, "acc_b")], root).check()
    assert_bit_identical(_ckpt(root, "acc_a", 3), _ckpt(root, "acc_b", 3))
    assert max_change(_ckpt(root, "acc_a", 3), ws["cal_pth"]) > 1e-3
    assert torch.load(_ckpt(root, "acc_a", 3), weights_only=True)["iteration"] == 6


def test_merged_replay_is_a_comparison(ws, s1):
    """replay_merged: the notes' plain comparison (the ranks' batches as one batch of 8), labelled as
    such. Its first iteration's loss, one forward pass from the same weights on the same images, sums
    the loss terms' n = 8 x 14 x 14 x 13 = 20,384 elements in another order: within the worst-case
    bound n u = 1.2e-3 relative (u = 2^-24), where a batch of another iteration is O(1) away."""
    root = ws["root"]
    b = run([TRAIN, "--config", ws["cfg"], "--step", "1", "--deterministic", "--replay-npz", s1[2], "--replay-merged",
             "ema", "true", "ema_ramp", "2", *_out(root, "s1_m")], root).check()
    assert "a comparison, round-off expected" in b.stdout and "batch 8 (1 x 8)" in b.stdout
    report = json.load(open(os.path.join(root, "s1_m", "checkpoint", "step1", "replay_report.json")))
    assert not report["exact"] and len(report["iterations"]) == 10
    first = report["iterations"][0]
    assert abs(first["diff"]["total"]) <= 20384 * 2.0 ** -24 * abs(first["recorded"])


def test_output_error_search_lowers_the_output_error_device_cpu(ws):
    """refine_caps_for_output on synthetic batches: the output error of the chosen caps, computed here
    independently, is at most that of the starting caps, and the search moved some cap."""
    from gnetmdk.checkpoint.io import load_checkpoint
    from gnetmdk.models.rebuild import build_model_from_checkpoint
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
