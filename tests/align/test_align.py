"""Alignment tooling (docs/alignment.md): record / replay, regrouping of recorded batches over process
counts, tools/diff_weights.py."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from dist_helpers import DIFF_WEIGHTS, ROOT, TRAIN, assert_bit_identical, make_workspace, max_change, run
from gnetmdk.align.compare import diff_state_dicts
from gnetmdk.align.record import AlignmentError, ReplayLoader, check_alignment_config, load_iteration


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("align"))
    return {"root": root, "cfg": make_workspace(root, num_train=24, num_val=4)}


def _out(root, name):
    d = os.path.join(root, name)
    return ["checkpoint_root", os.path.join(d, "checkpoint"), "log_root", os.path.join(d, "log")]


def test_record_and_replay_against_itself(ws):
    """A run and its replay from the recorded weights are bit-identical: weights, BatchNorm buffers, the
    optimizer's state and every loss term of every iteration (the same operations in the same order,
    with the recorded thread count), from fresh weights at the config's AdamW 1e-3."""
    root, c = ws["root"], ["--config", ws["cfg"]]
    rec = os.path.join(root, "self_rec")
    a = run([TRAIN, *c, "--step", "1", "--max-iters", "10", "--save-npz", rec, *_out(root, "self_a")], root).check()
    assert "recording batches, losses and starting weights" in a.stdout
    meta = json.load(open(os.path.join(rec, "meta.json")))
    assert meta["world_size"] == 1 and meta["global_batch"] == 8 and meta["stage"] == "step1"
    assert meta["complete"] and meta["threads"] == 1 and meta["version"] == 2
    with np.load(os.path.join(rec, "iter_000001_rank0.npz")) as z:
        assert z["images"].dtype == np.uint8 and z["images"].shape == (8, 3, 224, 224)   # exact chip codes
        assert z["targets"].shape == (8, 14, 14, 13) and int(z["iteration"]) == 1
        assert {"loss_total", "loss_loc", "loss_conf", "loss_noresp", "loss_noobj", "loss_cls"} <= set(z.files)
        assert float(z["lr"]) == 1e-3                   # the first step's rate (no warm-up in this config)
    b = run([TRAIN, *c, "--step", "1", "--replay-npz", rec, *_out(root, "self_b")], root).check()
    assert "replay: starting from the recorded weights" in b.stdout
    diffs = [l for l in b.stdout.splitlines() if l.startswith("[replay] iteration")]
    assert len(diffs) == 10, diffs
    assert all(float(l.split(" diff ")[1].split()[0]) == 0.0 for l in diffs), diffs
    a_pth = os.path.join(root, "self_a", "checkpoint", "step1", "last.pth")
    b_pth = os.path.join(root, "self_b", "checkpoint", "step1", "last.pth")
    assert_bit_identical(a_pth, b_pth)
    assert max_change(a_pth, os.path.join(rec, "start.pth")) > 1e-3
    # the resumable state is saved too: iteration 10 in epoch 3 (3 iterations per epoch)
    ck = torch.load(a_pth, weights_only=True)
    assert ck["iteration"] == 10 and "optimizer" in ck


def test_replay_refusals(ws):
    root, c = ws["root"], ["--config", ws["cfg"]]
    r = run([TRAIN, *c, "--step", "1", "--replay-npz", os.path.join(root, "nothing")], root)
    assert r.returncode == 2 and "holds no recording" in r.stderr and "Traceback" not in r.stderr
    rec = os.path.join(root, "self_rec")
    if os.path.isdir(rec):
        r = run([TRAIN, *c, "--step", "1", "--replay-npz", rec, "batch_size", "4", *_out(root, "bad")], root)
        assert r.returncode == 2 and "recorded with batch_size 8" in r.stderr, r.text[-2000:]
    r = run([TRAIN, *c, "--step", "1", "--save-npz", "x", "--replay-npz", "x"], root)
    assert r.returncode == 2 and "same folder" in r.stderr


def _fake_recording(folder, world, local, iterations=2):
    """A recording of ``world`` ranks x ``local`` images whose image values name (iteration, global index)."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "meta.json"), "w") as fh:
        json.dump({"format": "gnetmdk-npz-record", "version": 1, "stage": "step1", "world_size": world,
                   "global_batch": world * local, "local_batch": local, "iters_per_epoch": iterations}, fh)
    for it in range(1, iterations + 1):
        for r in range(world):
            idx = np.arange(r * local, (r + 1) * local) + 100 * it
            images = np.broadcast_to((idx % 256).astype(np.uint8).reshape(-1, 1, 1, 1), (local, 3, 2, 2)).copy()
            np.savez(os.path.join(folder, f"iter_{it:06d}_rank{r}.npz"), images=images,
                     targets=np.zeros((local, 2, 2, 13), np.float32), indices=idx, epoch=np.array(0),
                     iteration=np.array(it), rank=np.array(r), world_size=np.array(world),
                     loss_total=np.array(float(r + it)), images_float=np.array(False))


class _FakeTrainer:
    class train_sampler:
        epoch = 0
    iteration = 0


@pytest.mark.parametrize("rec_world,world", [(2, 1), (1, 2), (2, 4), (4, 2)])
def test_replay_regroups_batches_over_process_counts(tmp_path, rec_world, world):
    folder = str(tmp_path / "rec")
    _fake_recording(folder, rec_world, 8 // rec_world)
    for it in (1, 2):
        whole = load_iteration({r: os.path.join(folder, f"iter_{it:06d}_rank{r}.npz") for r in range(rec_world)},
                               rec_world)
        assert whole["indices"].tolist() == list(range(100 * it, 100 * it + 8))      # concatenation in rank order
        assert whole["losses"]["total"] == np.mean([r + it for r in range(rec_world)])  # ranks' losses averaged
    got = []
    for rank in range(world):
        loader = ReplayLoader(folder, _FakeTrainer(), rank, world)
        batches = list(loader)
        assert len(batches) == 2
        got.append([b[2].tolist() for b in batches])
        for images, _, idx, _ in batches:
            assert images.dtype == torch.float32 and images.shape[0] == 8 // world
            assert images[:, 0, 0, 0].tolist() == (idx % 256).float().tolist()
    for it in range(2):
        assert sum((g[it] for g in got), []) == list(range(100 * (it + 1), 100 * (it + 1) + 8))


def _replay_cfg(folder, **kw):
    from types import SimpleNamespace
    base = dict(save_npz="", replay_npz=folder, max_iters=0, accumulate=1, virtual_ranks=1, threads=0, sync_bn=True,
                inplace_abn=False, recompute_stem=False, replay_merged=False, load="x.pth")
    base.update(kw)
    return SimpleNamespace(**base)


def _meta(folder, **kw):
    path = os.path.join(folder, "meta.json")
    meta = json.load(open(path))
    meta.update(kw)
    json.dump(meta, open(path, "w"))


def test_replay_plan_virtual_ranks_threads_and_comparisons(tmp_path):
    """How a replay runs a recording of W ranks on P processes: W / P virtual ranks with the recorded
    threads per rank (exact) when P divides W; otherwise, with replay_merged, with a memory option that
    virtual ranks do not run, or for another implementation's recording, merged batches (a comparison,
    said so in one note). The settings go into the hook's copy of the config; the given one is unchanged."""
    from gnetmdk.engine.align_hook import AlignmentHook
    folder = str(tmp_path / "rec")
    _fake_recording(folder, 4, 2)
    _meta(folder, threads=3, config={"deterministic": True, "sync_bn": True})
    cfg = _replay_cfg(folder)
    hook = AlignmentHook(cfg, 2)
    assert hook.exact and hook.cfg.virtual_ranks == 2 and hook.cfg.threads == 3
    assert hook.cfg is not cfg and cfg.virtual_ranks == 1 and cfg.threads == 0
    cfg = _replay_cfg(folder, threads=1)
    hook = AlignmentHook(cfg, 1)
    assert hook.exact and hook.cfg.virtual_ranks == 4 and hook.cfg.threads == 3 and cfg.threads == 1
    assert any("threads 1 -> 3" in n for n in hook.notes)
    for cfg, processes, why in ((_replay_cfg(folder), 3, "3 processes do not divide the recording's 4 ranks"),
                                (_replay_cfg(folder, replay_merged=True), 1, "replay_merged"),
                                (_replay_cfg(folder, inplace_abn=True), 1, "inplace_abn")):
        hook = AlignmentHook(cfg, processes)
        assert not hook.exact and hook.cfg.virtual_ranks == 1
        assert [n for n in hook.notes if "round-off expected" in n and why in n], hook.notes
    with pytest.raises(AlignmentError, match="virtual_ranks 3"):
        AlignmentHook(_replay_cfg(folder, virtual_ranks=3), 1)
    _meta(folder, config={}, reference={"model": "ppdet ppyolo_r18vd"})
    cfg = _replay_cfg(folder)
    hook = AlignmentHook(cfg, 1)
    assert not hook.exact and hook.cfg.virtual_ranks == 1
    assert any("another implementation (ppdet ppyolo_r18vd)" in n for n in hook.notes)


def test_alignment_config_checks():
    class C:
        save_npz, replay_npz, max_iters = "", "", -1
    with pytest.raises(AlignmentError, match="max_iters"):
        check_alignment_config(C)

    class D:
        save_npz, replay_npz, max_iters, accumulate = "rec", "", 0, 2
    with pytest.raises(AlignmentError, match="set accumulate 1"):
        check_alignment_config(D)


# ------------------------------------------------------------------------------------ diff_weights
def _save(path, state, wrap=True):
    torch.save({"format": "gnetmdk-checkpoint", "model": state} if wrap else state, path)
    return str(path)


def test_diff_weights_verdicts_and_exit_codes(tmp_path):
    g = torch.Generator().manual_seed(0)
    base = {"conv.weight": torch.randn(4, 3, 3, 3, generator=g), "bn.running_var": torch.rand(4, generator=g) + 30,
            "bn.num_batches_tracked": torch.tensor(5), "relu.cap": torch.tensor(2.5)}
    a = _save(tmp_path / "a.pth", base)
    same = _save(tmp_path / "same.pth", {k: v.clone() for k, v in base.items()}, wrap=False)  # plain state_dict
    r = run([DIFF_WEIGHTS, a, same], ROOT)
    assert r.returncode == 0 and "ALIGNED: all within tolerance" in r.stdout
    assert "1 bookkeeping skipped" in r.stdout

    near = {k: v.clone() for k, v in base.items()}
    near["conv.weight"][0, 0, 0, 0] += 3e-6
    near["bn.running_var"] += 1e-4                      # 3e-6 relative on values near 30
    near["bn.num_batches_tracked"] = torch.tensor(9)     # bookkeeping: never compared
    b = _save(tmp_path / "near.pth", near)
    r = run([DIFF_WEIGHTS, a, b, "--atol", "1e-6"], ROOT)
    assert r.returncode == 1 and "NOT ALIGNED" in r.stdout and "conv.weight" in r.stdout
    r = run([DIFF_WEIGHTS, a, b, "--atol", "1e-5", "--rtol", "1e-5", "--all"], ROOT)
    assert r.returncode == 0, r.stdout
    line = next(l for l in r.stdout.splitlines() if l.startswith("conv.weight"))
    assert "3.000e-06" in line or "2.9" in line                   # max |a - b|

    missing = {k: v.clone() for k, v in base.items() if k != "relu.cap"}
    missing["extra.bias"] = torch.zeros(2)
    c = _save(tmp_path / "missing.pth", missing)
    r = run([DIFF_WEIGHTS, a, c, "--atol", "1"], ROOT)
    assert r.returncode == 1
    assert "relu.cap" in r.stdout and "only in a.pth" in r.stdout
    assert "extra.bias" in r.stdout and "only in missing.pth" in r.stdout

    r = run([DIFF_WEIGHTS, a, str(tmp_path / "nope.pth")], ROOT)
    assert r.returncode == 2 and "does not exist" in r.stderr


def test_diff_state_dicts_numbers():
    a = {"w": torch.tensor([1.0, -2.0, 0.0]), "s": torch.zeros(2, 2)}
    b = {"w": torch.tensor([1.0, -2.5, 0.0]), "s": torch.zeros(3)}
    rep = diff_state_dicts(a, b, atol=0.1)
    w = next(r for r in rep.rows if r.name == "w")
    assert w.max_abs == 0.5 and w.max_rel == pytest.approx(0.2) and w.sum_sq == 0.25 and not w.ok
    s = next(r for r in rep.rows if r.name == "s")
    assert not s.ok and "shape" in s.note
    assert not rep.ok
    assert diff_state_dicts(a, a).ok


def test_running_mean_judged_on_the_activation_scale():
    # mean 0.1, std 7: a 1.1e-5 difference is 1.6e-6 of the spread -> within rtol 1e-5; the same
    # difference on a weight of 0.1 is not, and a running_mean without its running_var uses |b|
    b = {"bn.running_mean": torch.tensor([0.1, 3.0]), "bn.running_var": torch.tensor([49.0, 1.0]),
         "conv.weight": torch.tensor([0.1])}
    a = {"bn.running_mean": torch.tensor([0.1 + 1.1e-5, 3.0]), "bn.running_var": torch.tensor([49.0, 1.0]),
         "conv.weight": torch.tensor([0.1 + 1.1e-5])}
    rep = diff_state_dicts(a, b, atol=1e-6, rtol=1e-5)
    ok = {r.name: r.ok for r in rep.rows}
    assert ok == {"bn.running_mean": True, "bn.running_var": True, "conv.weight": False}
    # the spread bound is still a bound: 1e-3 on a std of 7 fails
    a["bn.running_mean"] = torch.tensor([0.1 + 1e-3, 3.0])
    assert not next(r for r in diff_state_dicts(a, b, atol=1e-6, rtol=1e-5).rows if r.name == "bn.running_mean").ok
    lone_a = {"m.running_mean": torch.tensor([0.1 + 1.1e-5])}
    lone_b = {"m.running_mean": torch.tensor([0.1])}
    assert not diff_state_dicts(lone_a, lone_b, atol=1e-6, rtol=1e-5).ok


def test_d_value_rule_of_the_notes_device_cpu(tmp_path):
    """--d-value judges a tensor by its sum of squared differences (the PP-YOLO notes' rule), alone or
    together with --atol; both figures are listed and the exit codes stay 0 / 1 / 2."""
    f64 = torch.float64
    a = {"w": torch.zeros(100, dtype=f64), "v": torch.zeros(4, dtype=f64)}
    b = {"w": torch.full((100,), 2e-3, dtype=f64), "v": torch.tensor([0.03, 0.0, 0.0, 0.0], dtype=f64)}
    # w: max 2e-3, sum sq 100 * 4e-6 = 4e-4; v: max 0.03, sum sq 9e-4
    rep = diff_state_dicts(a, b, atol=None, d_value=5e-4)
    by = {r.name: r for r in rep.rows}
    assert by["w"].sum_sq == pytest.approx(4e-4, rel=1e-12) and by["w"].ok
    assert by["v"].sum_sq == pytest.approx(9e-4, rel=1e-12) and not by["v"].ok
    both = {r.name: r.ok for r in diff_state_dicts(a, b, atol=1e-3, d_value=5e-4).rows}
    assert both == {"w": False, "v": False}               # w passes the notes' rule, not |a-b| <= 1e-3
    assert diff_state_dicts(a, b, atol=None, d_value=1e-3).ok
    with pytest.raises(ValueError):
        diff_state_dicts(a, b, atol=None, d_value=None)
    pa, pb = _save(tmp_path / "a.pth", a), _save(tmp_path / "b.pth", b)
    r = run([DIFF_WEIGHTS, pa, pb, "--d_value", "0.0005", "--all"], ROOT)
    assert r.returncode == 1 and "NOT ALIGNED" in r.stdout
    assert "sum (a-b)^2 <= 0.0005" in r.stdout and "|a-b| <=" not in r.stdout
    assert "largest sum sq 9.000e-04 (v)" in r.stdout and "largest max|a-b| 3.000e-02 (v)" in r.stdout
    r = run([DIFF_WEIGHTS, pa, pb, "--d-value", "0.001"], ROOT)
    assert r.returncode == 0 and "ALIGNED: all within tolerance" in r.stdout
    r = run([DIFF_WEIGHTS, pa, pb, "--d-value", "0.001", "--atol", "0.01"], ROOT)
    assert r.returncode == 1 and "and sum (a-b)^2" in r.stdout
    r = run([DIFF_WEIGHTS, pa, pb, "--d-value", "-1"], ROOT)
    assert r.returncode == 2 and "must be >= 0" in r.stderr
