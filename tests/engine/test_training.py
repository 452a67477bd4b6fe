"""Training recipe (docs/training.md): amp, gradient accumulation, EMA, freezing, atomic checkpoint
writes, disk check. Tiny GNetDet (224 px, width 0.0625) on ../shared/data/cards, in-process."""
import glob
import os

import pytest
import torch

from gnetmdk.checkpoint.io import CheckpointError, load_checkpoint, save_checkpoint
from gnetmdk.models.rebuild import build_model_from_checkpoint
from gnetmdk.config import ConfigError, build_config, load_config_class
from gnetmdk.dist.sampler import GlobalBatchSampler
from gnetmdk.engine import runtime as R
from gnetmdk.engine.cli import run_stage
from gnetmdk.engine.stages import STAGES, apply_stage
from gnetmdk.engine.trainer import Trainer
from gnetmdk.models import get_family, model_from_config

from test_pipeline import make_cards_workdir


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    torch.set_num_threads(1)
    return make_cards_workdir(tmp_path_factory, "training")


def _cfg(path, tmp, name, *over, step=1):
    return build_config(load_config_class(path), ["checkpoint_root", str(tmp / name), "log_root",
                                                  str(tmp / ("log-" + name)), *map(str, over)], step=step)


# ---------------------------------------------------------------------------------------------- amp
def _tiny_model(path, **over):
    cfg = build_config(load_config_class(path), [x for kv in over.items() for x in map(str, kv)])
    torch.manual_seed(0)
    return model_from_config(cfg)


@pytest.mark.parametrize("stage", ["step2", "step3"])
def test_amp_keeps_quantized_outputs_identical_on_cpu(workdir, stage):
    _, path = workdir
    model = _tiny_model(path, use_bn="false")
    for i, relu in enumerate(model.relus()):
        relu.cap.fill_(2.0 + i % 3)
    apply_stage(model, STAGES[stage])
    x = torch.randint(0, 32, (2, 3, 224, 224)).float()
    for train in (True, False):
        model.train(train)
        plain = model(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            mixed = model(x)
        assert mixed.dtype == torch.float32
        assert torch.equal(plain, mixed), (stage, train)


def test_amp_runs_step1_convs_in_bf16(workdir):
    """The other side: autocast really is active (float step-1 convs change), so the identity above is
    the quantizers' float32 path, not a no-op."""
    _, path = workdir
    model = _tiny_model(path).eval()
    apply_stage(model, STAGES["step1"])
    x = torch.randint(0, 32, (1, 3, 224, 224)).float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = model(x)
    assert not torch.equal(model(x), mixed)


def test_amp_training_run_and_fp16_note(workdir, tmp_path):
    _, path = workdir
    cfg = _cfg(path, tmp_path, "amp", "amp", "true", "amp_dtype", "fp16", "eval_before", "false")
    p = R.Precision(cfg, torch.device("cpu"))
    assert p.dtype == torch.bfloat16 and p.scaler is None and any("bf16" in n for n in p.notes)
    run_stage(cfg)
    last = load_checkpoint(str(tmp_path / "amp" / "step1" / "last.pth"))
    assert all(torch.isfinite(v.float()).all() for v in last["model"].values())


# ---------------------------------------------------------------------------------------------- allocator
def _train_cli(path, *args):
    import subprocess
    import sys
    from test_pipeline import ROOT
    return subprocess.run([sys.executable, "train.py", "--config", path, *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_cpu_keep_memory_changes_speed_not_numbers(workdir, tmp_path):
    # two fresh processes (mallopt is process-wide): the same 3 iterations with and without it give the
    # same weights bit for bit; the run with it says so in its log, the run without it does not
    _, path = workdir
    runs = {}
    for keep in ("true", "false"):
        r = _train_cli(path, "--step", 1, "checkpoint_root", tmp_path / keep, "log_root", tmp_path / ("l" + keep),
                       "cpu_keep_memory", keep, "max_iters", 3, "eval_before", "false", "threads", 1)
        assert r.returncode == 0, r.stderr[-2000:]
        runs[keep] = (r.stdout, load_checkpoint(str(tmp_path / keep / "step1" / "last.pth"))["model"])
    assert "cpu_keep_memory: freed memory stays in the process heap" in runs["true"][0]
    assert "freed memory stays" not in runs["false"][0]
    assert runs["true"][1].keys() == runs["false"][1].keys()
    for k, v in runs["true"][1].items():
        assert torch.equal(v, runs["false"][1][k]), k
    # and the iterations did move the weights (the comparison is not between two untouched models)
    torch.manual_seed(0)
    start = model_from_config(build_config(load_config_class(path), [])).state_dict()
    assert any(not torch.equal(start[k], v) for k, v in runs["true"][1].items() if v.is_floating_point())


def test_keep_freed_memory_without_mallopt_says_so(monkeypatch):
    # a C library without mallopt (macOS, musl): nothing is changed and the log line says why
    import ctypes

    def no_libc(*a, **k):
        raise OSError("no such library")
    monkeypatch.setattr(ctypes, "CDLL", no_libc)
    assert R.keep_freed_memory() == ("cpu_keep_memory: this C library has no mallopt (not glibc); "
                                     "allocator left as it is")


# ---------------------------------------------------------------------------------------------- accumulation
def test_sampler_micro_batches_concatenate_to_the_global_batch():
    one = GlobalBatchSampler(40, 8, seed=3)
    acc = GlobalBatchSampler(40, 8, seed=3, accumulate=2)
    two_ranks = [GlobalBatchSampler(40, 8, rank=r, world_size=2, seed=3, accumulate=2) for r in range(2)]
    for s in [one, acc] + two_ranks:
        s.set_epoch(1, 1)
    a, b = list(one), list(acc)
    assert len(b) == len(acc) == 2 * len(a) == 8
    assert [b[2 * i] + b[2 * i + 1] for i in range(len(a))] == a
    r0, r1 = list(two_ranks[0]), list(two_ranks[1])
    assert [r0[2 * i] + r0[2 * i + 1] + r1[2 * i] + r1[2 * i + 1] for i in range(len(a))] == a
    with pytest.raises(ValueError, match="multiple of 6"):
        GlobalBatchSampler(40, 8, world_size=2, accumulate=3)


def test_batch_8_equals_4_x_2_accumulated(workdir, tmp_path):
    _, path = workdir
    common = ["batch_size", 8, "use_bn", "false", "num_epochs", 2, "eval_before", "false", "eval_interval", 5,
              "max_val_images", 2]
    run_stage(_cfg(path, tmp_path, "b8", *common))
    run_stage(_cfg(path, tmp_path, "b4x2", *common, "accumulate", 2))
    a = load_checkpoint(str(tmp_path / "b8" / "step1" / "last.pth"))
    b = load_checkpoint(str(tmp_path / "b4x2" / "step1" / "last.pth"))
    assert a["iteration"] == b["iteration"] == 2          # optimizer steps, not micro-batches
    assert a["scheduler"]["last_epoch"] == b["scheduler"]["last_epoch"]
    moved = 0.0
    start = _tiny_model(path, use_bn="false").state_dict()
    for k, v in a["model"].items():
        assert torch.allclose(v, b["model"][k], atol=1e-6, rtol=0), k
        moved = max(moved, float((v - start[k]).abs().max()))
    assert moved > 1e-4          # the runs trained: equality is not two untouched models


def test_accumulate_that_does_not_divide_is_refused(workdir, tmp_path):
    _, path = workdir
    with pytest.raises(ConfigError, match="multiple of 3"):
        _cfg(path, tmp_path, "bad", "accumulate", 3)
    cfg = _cfg(path, tmp_path, "bad", "accumulate", 2)
    cfg.accumulate = 3                          # past the start-up check: the trainer refuses it too
    with pytest.raises(ConfigError, match="multiple of 3"):
        run_stage(cfg)
    with pytest.raises(ConfigError, match="accumulate"):
        _cfg(path, tmp_path, "bad", "accumulate", 0)


# ---------------------------------------------------------------------------------------------- EMA
def test_ema_is_saved_beside_the_raw_weights_and_loaded_for_the_next_stage(workdir, tmp_path):
    _, path = workdir
    cfg = _cfg(path, tmp_path, "ema", "ema", "true", "ema_decay", 0.9, "ema_ramp", 0, "num_epochs", 2,
               "eval_interval", 1)
    summary = run_stage(cfg)
    for name in ("best.pth", "last.pth"):
        ck = load_checkpoint(str(tmp_path / "ema" / "step1" / name))
        assert ck["eval_weights"] == "ema" and set(ck["ema"]["model"]) == set(ck["model"])
    last = load_checkpoint(str(tmp_path / "ema" / "step1" / "last.pth"))
    assert last["ema"]["updates"] == 4
    k = "layers.0.conv.weight"
    assert not torch.equal(last["ema"]["model"][k], last["model"][k])     # never saved in their place
    assert torch.equal(build_model_from_checkpoint(last).state_dict()[k], last["ema"]["model"][k])
    assert torch.equal(build_model_from_checkpoint(last, weights="model").state_dict()[k], last["model"][k])
    assert summary["best_map"] == load_checkpoint(str(tmp_path / "ema" / "step1" / "best.pth"))["best_map"]


# ---------------------------------------------------------------------------------------------- freezing
def _first_layers(model, n):
    return [p for layer in model.layers[:n] for p in layer.parameters()]


def test_freeze_at_leaves_layers_out_of_the_optimizer(workdir, tmp_path):
    _, path = workdir
    cfg = _cfg(path, tmp_path, "fa", "freeze_at", 2, "eval_before", "false")
    t = Trainer(cfg)
    t.run()
    frozen = _first_layers(t.model, 2)
    in_opt = {id(p) for g in t.optimizer.param_groups for p in g["params"]}
    assert frozen and not any(id(p) in in_opt for p in frozen)
    assert not any(id(p) in {id(q) for q in t.optimizer.state} for p in frozen)
    start = _tiny_model(path)
    assert torch.equal(t.model.layers[0].conv.weight, start.layers[0].conv.weight)
    assert not torch.equal(t.model.layers[2].conv.weight, start.layers[2].conv.weight)


def test_finetune_freezes_first_convs_for_n_epochs(workdir, tmp_path):
    _, path = workdir
    t = Trainer(_cfg(path, tmp_path, "ft1", "finetune", 1, "freeze_convs", 2, "eval_before", "false"))
    t.run()
    frozen = _first_layers(t.model, 2)
    assert not any(p in t.optimizer.state for p in frozen)                 # no optimizer state while frozen
    start = _tiny_model(path)
    assert torch.equal(t.model.layers[1].conv.weight, start.layers[1].conv.weight)
    t2 = Trainer(_cfg(path, tmp_path, "ft2", "finetune", 1, "freeze_convs", 2, "num_epochs", 2,
                      "eval_before", "false"))
    t2.run()
    assert all(p in t2.optimizer.state for p in _first_layers(t2.model, 2) if p.requires_grad)
    assert t2.model.layers[0].conv.weight.requires_grad                    # unfrozen after epoch 1
    assert not torch.equal(t2.model.layers[0].conv.weight, start.layers[0].conv.weight)


# ---------------------------------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("exc", [OSError(28, "No space left on device"), KeyboardInterrupt()])
def test_interrupted_checkpoint_write_keeps_the_previous_file(tmp_path, monkeypatch, exc):
    path = str(tmp_path / "last.pth")
    save_checkpoint(path, {"stage": "step1", "iteration": 3, "w": torch.arange(5.0)})
    before = open(path, "rb").read()
    real_save = torch.save

    def broken(obj, fh, *a, **k):
        real_save(obj, fh, *a, **k)           # the bytes of the new file are written ...
        fh.truncate(fh.tell() // 2)           # ... partly
        raise exc

    monkeypatch.setattr(torch, "save", broken)
    with pytest.raises(type(exc)):
        save_checkpoint(path, {"stage": "step1", "iteration": 4, "w": torch.zeros(1000)})
    monkeypatch.undo()
    assert open(path, "rb").read() == before
    assert load_checkpoint(path)["iteration"] == 3
    assert os.listdir(tmp_path) == ["last.pth"]          # no temporary file left


def test_disk_estimate_is_checked_before_training(workdir, tmp_path, monkeypatch):
    _, path = workdir
    cfg = _cfg(path, tmp_path, "disk", "eval_before", "false")
    out = tmp_path / "disk" / "step1"
    out.mkdir(parents=True)
    (out / "last.pth").write_bytes(b"previous")
    need = {}

    def fake_free(folder):
        need["folder"] = folder
        return 1000

    import gnetmdk.engine.trainer as trainer_module
    monkeypatch.setattr(trainer_module, "free_bytes", fake_free)      # where the trainer looks it up
    called = []
    monkeypatch.setattr(Trainer, "train_one_epoch", lambda self, e: called.append(e))
    with pytest.raises(CheckpointError, match="not enough free disk"):
        run_stage(cfg)
    assert not called and (out / "last.pth").read_bytes() == b"previous"
    model = _tiny_model(path)
    assert R.estimate_checkpoint_bytes(model, 2, True) > 4 * sum(p.numel() * 4 for p in model.parameters())
    assert glob.glob(str(out / ".tmp-*")) == []


def test_checkpoint_of_another_model_is_refused_with_the_difference(workdir):
    from gnetmdk.models.rebuild import check_compatible
    _, path = workdir
    cfg = build_config(load_config_class(path), [])
    meta = _tiny_model(path).meta()
    check_compatible({"model_meta": meta}, cfg, "x.pth")
    with pytest.raises(CheckpointError, match="name: checkpoint 'othernet' vs config 'gnetdet'"):
        check_compatible({"model_meta": dict(meta, name="othernet")}, cfg, "x.pth")


# ---------------------------------------------------------------------------------------------- early stopping
def test_patience_ends_the_stage_when_map_stops_improving(workdir, tmp_path, capsys):
    """The tiny model's mAP stays at the entry model's 0.0 on 4 val images: with patience 2 and an
    evaluation every epoch the stage ends after epoch 2 of 5, with that epoch's last.pth and the reason
    logged; without patience all 5 epochs run."""
    _, path = workdir
    common = ["num_epochs", 5, "eval_interval", 1, "max_train_images", 4, "learning_rate", 1e-6]
    summary = run_stage(_cfg(path, tmp_path, "p2", *common, "patience", 2))
    out = capsys.readouterr().out
    assert summary["best_map"] == 0.0 and summary["best_epoch"] == 0
    assert "early stop after epoch 2: no better val mAP than 0.0000 (epoch 0) for 2 epochs (patience 2)" in out
    assert "epoch 3/5" not in out
    assert load_checkpoint(str(tmp_path / "p2" / "step1" / "last.pth"))["epoch"] == 2
    run_stage(_cfg(path, tmp_path, "p0", *common))
    out = capsys.readouterr().out
    assert "epoch 5/5" in out and "early stop" not in out
    assert load_checkpoint(str(tmp_path / "p0" / "step1" / "last.pth"))["epoch"] == 5


def test_min_steps_adds_the_epochs_that_hold_them_device_cpu(workdir, tmp_path, capsys):
    """8 train images in batches of 4 are 2 steps per epoch: min_steps 5 makes num_epochs 1 into 3
    epochs (ceil(5 / 2)), logged, in the summary and in last.pth; min_steps below one epoch's steps
    changes nothing; the float control copies min_steps with the rest of a stage's schedule."""
    from gnetmdk.engine.control import control_configs
    from gnetmdk.engine.schedule import stage_epochs
    assert [stage_epochs(10, m, 15) for m in (0, 150, 151, 450)] == [10, 10, 11, 30]
    assert stage_epochs(0, 450, 15) == 0 and stage_epochs(3, 450, 0) == 3
    _, path = workdir
    common = ["num_epochs", 1, "eval_interval", 1, "learning_rate", 1e-6]
    summary = run_stage(_cfg(path, tmp_path, "m5", *common, "min_steps", 5))
    out = capsys.readouterr().out
    assert summary["num_epochs"] == 3 and "min_steps 5: 3 epochs of 2 steps instead of num_epochs 1" in out
    assert "epoch 3/3" in out
    assert load_checkpoint(str(tmp_path / "m5" / "step1" / "last.pth"))["epoch"] == 3
    summary = run_stage(_cfg(path, tmp_path, "m1", *common, "min_steps", 2))
    assert summary["num_epochs"] == 1 and "min_steps 2:" not in capsys.readouterr().out
    with pytest.raises(ConfigError, match="min_steps"):
        _cfg(path, tmp_path, "bad", "min_steps", -1)
    klass = load_config_class(path)              # a fresh class, loaded from the file
    klass.per_step = {3: dict(min_steps=40)}
    ctl = control_configs(klass, ["checkpoint_root", str(tmp_path / "c")])
    assert [c.min_steps for c in ctl] == [0, 40, 0]


def test_eval_from_is_checked_and_the_control_takes_each_stage_s_own_device_cpu(workdir, tmp_path):
    """eval_from below 0 is refused naming the field; the float control's stages evaluate as the quantized
    stages they stand for do, not from step 1's eval_from (a 10-epoch stage evaluating from epoch 32 would
    evaluate its last epoch only)."""
    from gnetmdk.engine.control import control_configs
    _, path = workdir
    with pytest.raises(ConfigError, match="eval_from"):
        _cfg(path, tmp_path, "bad", "eval_from", -1)
    klass = load_config_class(path)
    klass.per_step = {1: dict(eval_from=32, eval_interval=2), 3: dict(eval_from=4, eval_interval=3)}
    ctl = control_configs(klass, ["checkpoint_root", str(tmp_path / "c")])
    assert [(c.eval_from, c.eval_interval) for c in ctl] == [(0, 1), (4, 3), (0, 1)]


def test_the_control_trains_with_each_stage_s_loss_and_augmentation_not_its_quantization_device_cpu(
        workdir, tmp_path):
    """A loss weight or augmentation field set for one quantized stage reaches the control stage standing
    for it and no other; a quantization field (mask_bits) stays step 1's; every listed field is a field
    of its family's section."""
    from gnetmdk.config.base import ensure_sections
    from gnetmdk.engine.control import TRAINING_SECTION_FIELDS, control_configs
    sections = ensure_sections()
    for name, fields in TRAINING_SECTION_FIELDS.items():
        assert set(fields) <= set(sections[name].field_types()), name
    _, path = workdir
    klass = load_config_class(path)
    klass.per_step = {2: dict(l_range=1.0), 3: dict(flip_prob=0.0, mask_bits=[8, 8, 8, 8, 8, 8])}
    ctl = control_configs(klass, ["checkpoint_root", str(tmp_path / "c")])
    base = build_config(klass, ["checkpoint_root", str(tmp_path / "c")], step=1)
    assert [c.gnetdet.l_range for c in ctl] == [1.0, base.gnetdet.l_range, base.gnetdet.l_range]
    assert [c.gnetdet.flip_prob for c in ctl] == [base.gnetdet.flip_prob, 0.0, base.gnetdet.flip_prob]
    assert all(c.gnetdet.mask_bits == base.gnetdet.mask_bits for c in ctl)
    assert base.gnetdet.l_range != 1.0 and base.gnetdet.flip_prob != 0.0


def test_patience_shorter_than_the_evaluation_interval_is_refused(workdir, tmp_path):
    _, path = workdir
    with pytest.raises(ConfigError, match="patience.*eval_interval 5"):
        _cfg(path, tmp_path, "bad", "eval_interval", 5, "patience", 3)
    with pytest.raises(ConfigError, match="patience"):
        _cfg(path, tmp_path, "bad", "patience", -1)
    with pytest.raises(ConfigError, match="tb_images"):
        _cfg(path, tmp_path, "bad", "tb_images", -1)


# ---------------------------------------------------------------------------------------------- distillation
def test_distill_loss_is_the_per_image_squared_difference_device_cpu():
    from gnetmdk.models import get_family
    fam = get_family("gnetdet")
    s = torch.tensor([[1.0, 2.0], [0.0, 0.5]], requires_grad=True)
    t = torch.tensor([[1.0, 0.0], [1.0, 0.5]])
    loss = fam.distill_loss(s, t)
    assert loss.item() == pytest.approx((4.0 + 1.0) / 2)                  # sum over values, mean over 2 images
    loss.backward()
    assert torch.equal(s.grad, (s - t).detach())                          # d/ds of sum (s - t)^2 / 2
    assert fam.distill_loss([s, s], [t, t]).item() == pytest.approx(5.0)   # a list of levels: summed
    assert fam.distill_loss(t, t).item() == 0.0


def test_distillation_from_the_float_model_in_step_2_device_cpu(workdir, tmp_path, capsys):
    """distill > 0: the step-1 model is loaded as the teacher, the epoch line shows the term, and the
    trained weights differ from the run without it; a missing or non-float teacher is refused."""
    _, path = workdir
    run_stage(_cfg(path, tmp_path, "kd", "num_epochs", 1))
    capsys.readouterr()
    common = ["num_epochs", 1, "max_train_images", 16]
    run_stage(_cfg(path, tmp_path, "kd", *common, "distill", 1.0, step=2))
    out = capsys.readouterr().out
    assert f"distillation from {tmp_path / 'kd' / 'step1' / 'best.pth'}" in out
    line = next(l for l in out.splitlines() if "epoch 1/1" in l)
    assert " distill " in line
    with_kd = load_checkpoint(str(tmp_path / "kd" / "step2" / "last.pth"))["model"]
    run_stage(_cfg(path, tmp_path, "kd", *common, "load", tmp_path / "kd" / "step1" / "best.pth", step=2))
    without = load_checkpoint(str(tmp_path / "kd" / "step2" / "last.pth"))["model"]
    assert any(not torch.equal(with_kd[k], without[k]) for k in with_kd if k.endswith("weight"))
    with pytest.raises(CheckpointError, match="needs the float model"):
        run_stage(_cfg(path, tmp_path, "kd", *common, "distill", 1.0, "distill_from", tmp_path / "none.pth", step=2))
    with pytest.raises(CheckpointError, match="the teacher is the float"):
        run_stage(_cfg(path, tmp_path, "kd", *common, "distill", 1.0, "distill_from",
                       tmp_path / "kd" / "step2" / "best.pth", step=2))
    with pytest.raises(ConfigError, match="distill_from"):
        _cfg(path, tmp_path, "kd", "distill_from", "x.pth", step=2)


def test_run_stopped_before_any_evaluation_reports_no_best_map_device_cpu(workdir, tmp_path):
    """max_iters stops the first epoch before any evaluation (eval_before false): the summary's best mAP
    is None (printed n/a), not the -1 the trainer starts from, and no best.pth is written (device cpu)."""
    from gnetmdk.engine.trainer import Trainer
    _, path = workdir
    cfg = _cfg(path, tmp_path, "mi", "max_iters", 1, "eval_before", "false", "batch_size", 2, "num_epochs", 1,
               "threads", 1, "device", "cpu")
    summary = Trainer(cfg).run()
    assert summary["best_map"] is None and summary["best_epoch"] is None
    assert not (tmp_path / "mi" / "step1" / "best.pth").exists() and (tmp_path / "mi" / "step1" / "last.pth").exists()


# ---------------------------------------------------------------------------------------------- evaluation
def test_eval_voc_reports_the_map_training_recorded_device_cpu(workdir, tmp_path):
    """Training evaluates in forwards of batch_size images, the last batch padded (7 val images: 4 + 3
    padded to 4), and so does tools/eval_voc.py: its mAP of best.pth equals the best_map the stage
    recorded, bit for bit. The threshold is low enough, and 10 epochs long enough, that the model has
    true positives (best mAP 0.037-0.046 under OpenCV 4.14 and 5.1, default and AVX2 kernels; at 6
    epochs it was 0.004 or 0.0: OpenCV 5's warpAffine rounds the augmented pixels differently)."""
    import json
    from repo_paths import load_tool
    _, path = workdir
    over = ["max_val_images", 7, "conf_thresh", 1e-6, "num_epochs", 10, "max_train_images", 16, "learning_rate", 1e-2,
            "eval_interval", 10]
    summary = run_stage(_cfg(path, tmp_path, "ev", *over))
    assert summary["best_map"] > 0
    out = tmp_path / "ev.json"
    best = str(tmp_path / "ev" / "step1" / "best.pth")
    assert load_tool("eval_voc").main([best, "--config", path, "--json", str(out), *map(str, over)]) == 0
    assert json.loads(out.read_text())["map"] == summary["best_map"]
    with pytest.raises(ConfigError, match="eval_batch_size"):
        _cfg(path, tmp_path, "ev2", "eval_batch_size", -1)


# ---------------------------------------------------------------------------------------------- BatchNorm in step 2
def test_step2_bn_keep_trains_batchnorm_on_quantized_folded_weights_and_cal_folds_it_device_cpu(workdir, tmp_path,
                                                                                                capsys):
    """gnetdet.step2_bn keep: step 2 keeps the BatchNorm layers (its checkpoint has them, their running
    statistics moved), evaluates exactly the folded quantized model, and the cal stage folds them: cal's
    entry mAP is step 2's best mAP bit for bit; a bad value and in-place ABN are refused (device cpu)."""
    _, path = workdir
    run_stage(_cfg(path, tmp_path, "bn", "num_epochs", 1, "device", "cpu"))
    s1 = load_checkpoint(str(tmp_path / "bn" / "step1" / "last.pth"))
    capsys.readouterr()
    common = ["num_epochs", 1, "max_train_images", 16, "device", "cpu", "gnetdet.step2_bn", "keep"]
    s2 = run_stage(_cfg(path, tmp_path, "bn", *common, step=2))
    assert "kept " in capsys.readouterr().out
    last = load_checkpoint(str(tmp_path / "bn" / "step2" / "last.pth"))
    assert last["model_meta"]["use_bn"] is True
    k = "layers.0.bn.running_mean"
    assert k in last["model"] and not torch.equal(last["model"][k], s1["model"][k])
    # evaluation: the BN-kept model computes what the folded model computes, bit for bit
    from gnetmdk.gti.transforms import fold_bn
    kept = build_model_from_checkpoint(last)
    folded = build_model_from_checkpoint(last)
    assert fold_bn(folded) > 0
    for m in (kept, folded):
        apply_stage(m, STAGES["step2"])
        m.eval()
    x = torch.rand(2, 3, 224, 224) * 31
    with torch.no_grad():
        assert torch.equal(kept(x), folded(x))
    cal = run_stage(build_config(load_config_class(path), ["checkpoint_root", str(tmp_path / "bn"), "log_root",
                                                           str(tmp_path / "log-bn"), "device", "cpu",
                                                           "max_train_images", 16], step=2, cal=True))
    ck = load_checkpoint(str(tmp_path / "bn" / "step2" / "cal.pth"))
    assert ck["model_meta"]["use_bn"] is False and not any(".bn." in n for n in ck["model"])
    assert cal["entry_map"] == s2["best_map"]
    with pytest.raises(ConfigError, match="step2_bn"):
        _cfg(path, tmp_path, "bn", "gnetdet.step2_bn", "batch", step=2)
    with pytest.raises(ConfigError, match="inplace_abn"):
        _cfg(path, tmp_path, "bn", "gnetdet.step2_bn", "keep", "inplace_abn", "true", step=2)


def test_step3_bn_keep_keeps_batchnorm_through_cal_and_step3_and_step4_starts_from_step3_exactly_device_cpu(
        workdir, tmp_path, capsys):
    """gnetdet.step3_bn keep (with step2_bn keep): cal and step 3 keep the BatchNorm layers, step 3
    trains them on batch statistics while its gain-aware evaluation is the folded, gain-edited model's
    bit for bit, and step 4 folds them on entry: its entry mAP is step 3's best mAP exactly; the
    combinations it cannot serve are refused (device cpu)."""
    _, path = workdir
    run_stage(_cfg(path, tmp_path, "b3", "num_epochs", 1, "device", "cpu"))
    capsys.readouterr()
    keep = ["gnetdet.step2_bn", "keep", "gnetdet.step3_bn", "keep"]
    common = ["num_epochs", 1, "max_train_images", 16, "device", "cpu", *keep]
    # each stage from the one before's last.pth: a 1-epoch stage's best.pth can be its untrained entry
    run_stage(_cfg(path, tmp_path, "b3", *common, "load", tmp_path / "b3" / "step1" / "last.pth", step=2))
    assert "folded on entry to step 4" in capsys.readouterr().out
    run_stage(build_config(load_config_class(path), ["checkpoint_root", str(tmp_path / "b3"), "log_root",
                                                     str(tmp_path / "log-b3"), "device", "cpu", "max_train_images",
                                                     16, "load", str(tmp_path / "b3" / "step2" / "last.pth"), *keep],
                           step=2, cal=True))
    cal = load_checkpoint(str(tmp_path / "b3" / "step2" / "cal.pth"))
    k = "layers.0.bn.running_mean"
    assert cal["model_meta"]["use_bn"] is True and cal["model"][k].abs().sum() > 0
    s3 = run_stage(_cfg(path, tmp_path, "b3", *common, step=3))
    assert "kept 15 BatchNorm layers (step3_bn keep)" in capsys.readouterr().out
    last = load_checkpoint(str(tmp_path / "b3" / "step3" / "last.pth"))
    assert not torch.equal(last["model"][k], cal["model"][k])          # step 3 moved the running statistics
    # evaluation: the BN-kept gain-aware step-3 model computes the folded one's codes, bit for bit
    from gnetmdk.gti.transforms import fold_bn
    kept, folded = build_model_from_checkpoint(last), build_model_from_checkpoint(last)
    assert fold_bn(folded) == 15
    for m in (kept, folded):
        apply_stage(m, STAGES["step3"])
        m.eval()
    x = torch.randint(0, 32, (2, 3, 224, 224)).float()
    with torch.no_grad():
        a, b = kept(x), folded(x)
    assert kept.gain_aware and kept.layers[0].conv.gain is not None
    assert torch.equal(a, b) and a.abs().sum() > 0
    # training: batch statistics, in the code domain of the ReLUs (finite, and unlike the evaluation)
    kept.train()
    y = kept(x)
    assert torch.isfinite(y).all() and not torch.equal(y.detach(), a)
    y.sum().backward()
    assert kept.layers[0].bn.weight.grad is not None and kept.layers[0].conv.weight.grad.abs().sum() > 0
    s4 = run_stage(_cfg(path, tmp_path, "b3", *common, step=4))
    assert s4["entry_map"] == s3["best_map"]
    ck4 = load_checkpoint(str(tmp_path / "b3" / "step4" / "best.pth"))
    assert ck4["model_meta"]["use_bn"] is False
    # step3_bn_freeze 1: epoch 2 normalizes with the running statistics and leaves them alone (BatchNorm
    # counts the batches it updated them with: the 1-epoch run's count, not 2 epochs' worth)
    n = "layers.0.bn.num_batches_tracked"
    per_epoch = int(last["model"][n]) - int(cal["model"][n])
    assert per_epoch > 0
    capsys.readouterr()
    run_stage(_cfg(path, tmp_path, "b3", *common, "num_epochs", 2, "gnetdet.step3_bn_freeze", 1, step=3))
    out = capsys.readouterr().out
    assert out.count("normalize with their running statistics, frozen from epoch 2") == 1
    assert "epoch 2: 15 BatchNorm layers" in out
    frozen = load_checkpoint(str(tmp_path / "b3" / "step3" / "last.pth"))
    assert int(frozen["model"][n]) == int(cal["model"][n]) + per_epoch
    # frozen, the training forward is the folded, gain-edited model's evaluation (the model step 4 starts from)
    m = build_model_from_checkpoint(frozen)
    ref = build_model_from_checkpoint(frozen)
    fold_bn(ref)
    cfg3 = _cfg(path, tmp_path, "b3", *common, "gnetdet.step3_bn_freeze", 1, step=3)
    for mm in (m, ref):
        apply_stage(mm, STAGES["step3"])
    m.train()
    assert get_family("gnetdet").epoch_mode(m, STAGES["step3"], 0, cfg3) is None
    assert all(layer.bn.training for layer in m.layers if layer.bn is not None)
    assert "frozen from epoch 2" in get_family("gnetdet").epoch_mode(m, STAGES["step3"], 1, cfg3)
    assert not any(layer.bn.training for layer in m.layers if layer.bn is not None)
    ref.eval()
    with torch.no_grad():
        assert torch.equal(m(x), ref(x))
    for bad in (["gnetdet.step3_bn_freeze", 2], [*keep, "gnetdet.step3_bn_freeze", -1]):
        with pytest.raises(ConfigError, match="step3_bn_freeze"):
            _cfg(path, tmp_path, "b3", *bad, step=3)
    for bad in (["gnetdet.step3_bn", "keep"], [*keep, "gnetdet.equalize", 0.5], [*keep, "gnetdet.bias_correct", "true"],
                [*keep, "gnetdet.cap_lr", 1e-3], ["gnetdet.step3_bn", "yes"]):
        with pytest.raises(ConfigError, match="step3_bn"):
            _cfg(path, tmp_path, "b3", *bad, step=3)
