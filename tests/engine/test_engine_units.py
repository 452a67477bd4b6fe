"""Units of the trainer's parts that the end-to-end tests reach only through train.py (device cpu): the
weights' EMA, the EMA and early-stop hooks, and the integer graph's checks."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from gnetmdk.engine.ema import ModelEMA
from gnetmdk.engine.events import EventStorage
from gnetmdk.engine.hooks import CurvesHook, EarlyStopHook, EMAHook, EvalHook, TensorboardHook
from gnetmdk.intq.graph import Node, check_graph, tensor_quantizers


class _Relu(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("cap", torch.tensor(3.0))     # a calibrated cap, as "layers.N.relu.cap"


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.relu = _Relu()
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))


def test_ema_follows_its_formula_and_copies_what_is_not_averaged_device_cpu():
    """ema <- d ema + (1 - d) w with d = decay (1 - exp(-n / ramp)); integer buffers and calibrated caps
    are copied; the state dict round-trips."""
    torch.manual_seed(0)
    net = _Net()
    ema = ModelEMA(net, decay=0.9, ramp=2.0)
    start = net.fc.weight.detach().clone()
    with torch.no_grad():
        net.fc.weight.add_(1.0)
        net.steps.fill_(7)
        net.relu.cap.fill_(5.0)
    ema.update(net)
    d = 0.9 * (1 - math.exp(-1 / 2.0))
    assert ema.current_decay() == pytest.approx(d, rel=0, abs=1e-15)
    want = start * d + (start + 1.0) * (1 - d)
    assert torch.allclose(ema.module.fc.weight, want, rtol=0, atol=1e-6)
    assert int(ema.module.steps) == 7 and float(ema.module.relu.cap) == 5.0
    assert not any(p.requires_grad for p in ema.module.parameters())
    other = ModelEMA(_Net(), decay=0.9, ramp=2.0)
    other.load_state_dict(ema.state_dict())
    assert other.updates == 1 and torch.equal(other.module.fc.weight, ema.module.fc.weight)
    assert ModelEMA(net, decay=0.5, ramp=0).current_decay() == 0.5


def test_ema_reuses_its_plan_until_the_model_swaps_a_tensor_or_a_cap_starts_training_device_cpu():
    """The update's plan (what is averaged, what copied) is reused over iterations and rebuilt when the
    model holds another tensor or a cap starts to train; the numbers are the per-element formula's bit
    for bit (v * d, then + (1 - d) w) every time."""
    torch.manual_seed(1)
    net = _Net()
    ema = ModelEMA(net, decay=0.9, ramp=2.0)
    ema.update(net)
    plan = ema._plan
    ema.update(net)
    assert ema._plan is plan                                 # same tensors: the plan is kept

    def expect(before, w):
        d = ema.current_decay()
        return before.clone().mul_(d).add_(w, alpha=1 - d)

    net.fc.weight = nn.Parameter(torch.randn(2, 2))           # another tensor object: a new plan
    before = ema.module.fc.weight.detach().clone()
    ema.update(net)
    assert ema._plan is not plan and torch.equal(ema.module.fc.weight, expect(before, net.fc.weight.detach()))
    plan = ema._plan
    net.fc.weight.data = torch.randn(2, 2)                    # new storage, same parameter: read where it lives
    before = ema.module.fc.weight.detach().clone()
    ema.update(net)
    assert ema._plan is plan and torch.equal(ema.module.fc.weight, expect(before, net.fc.weight.detach()))
    with torch.no_grad():
        net.relu.cap.fill_(4.0)
    ema.update(net)
    assert float(ema.module.relu.cap) == 4.0                  # a calibrated cap is copied
    net.relu.cap.requires_grad_(True)                        # ... until it trains (learned caps): averaged
    with torch.no_grad():
        net.relu.cap.fill_(2.0)
    before = ema.module.relu.cap.detach().clone()
    ema.update(net)
    assert torch.equal(ema.module.relu.cap, expect(before, torch.tensor(2.0)))
    assert float(ema.module.relu.cap) != 2.0


class _FakeTrainer(SimpleNamespace):
    """A trainer's attributes; a subclass, so that hooks can hold it by weak reference."""


def _trainer(**cfg):
    logs = []
    t = _FakeTrainer(model=_Net(), cfg=SimpleNamespace(**cfg), resume_state=None, stage=SimpleNamespace(name="step1"),
                        log=logs.append)
    return t, logs


def test_ema_hook_starts_from_the_model_and_resumes_its_average_device_cpu():
    """before_train starts the average from the model (or from the resumed checkpoint's EMA handed to
    load_state_dict, with a notice when it has none); after_step updates it; state_dict carries it."""
    t, logs = _trainer(ema_decay=0.9, ema_ramp=2.0)
    hook = EMAHook()
    assert hook.state_dict() == {}
    hook.trainer = t
    hook.before_train()
    assert "EMA of the weights (decay 0.9, ramp 2 steps)" in logs[-1]
    hook.after_step()
    state = hook.state_dict()["ema"]
    assert state["updates"] == 1
    t2, logs2 = _trainer(ema_decay=0.9, ema_ramp=2.0)
    h2 = EMAHook()
    h2.trainer = t2
    h2.load_state_dict({"ema": state, "curves": []})
    h2.before_train()
    assert h2.ema.updates == 1
    for k, v in h2.ema.state_dict()["model"].items():
        assert torch.equal(v, state["model"][k]), k
    assert not any("has no EMA" in line for line in logs2)
    t3, logs3 = _trainer(ema_decay=0.9, ema_ramp=2.0)
    h3 = EMAHook()
    h3.trainer = t3
    h3.load_state_dict({})
    h3.before_train()
    assert h3.ema.updates == 0 and any("has no EMA" in line for line in logs3)


def test_curves_hook_owns_its_history_device_cpu():
    """The epoch history goes out through state_dict and comes back through load_state_dict (a copy:
    the checkpoint's list is not shared); a checkpoint without curves leaves the history empty."""
    hook = CurvesHook()
    assert hook.state_dict() == {"curves": []}
    saved = [{"epoch": 1, "iteration": 4, "val_map": 0.5}, {"epoch": 2, "iteration": 8}]
    hook.load_state_dict({"curves": saved, "ema": {}})
    out = hook.state_dict()["curves"]
    assert out == saved and out[0] is not saved[0]
    saved[0]["val_map"] = 0.0
    assert hook.state_dict()["curves"][0]["val_map"] == 0.5
    other = CurvesHook()
    other.load_state_dict({"model": {}})
    assert other.state_dict() == {"curves": []}


def test_event_storage_keeps_the_latest_and_hands_out_each_event_once_device_cpu():
    """put_scalar converts to (str, float, int); latest gives the last per name; take_unwritten gives
    the events since the last call, oldest first, once; past max_unwritten the oldest are dropped."""
    st = EventStorage(max_unwritten=3)
    assert st.latest("a") is None and st.take_unwritten() == []
    st.put_scalar("a", torch.tensor(0.5), 1)
    st.put_scalar("b", 2, 1.0)
    st.put_scalar("a", 0.25, 2)
    assert st.latest("a") == (0.25, 2) and st.latest("b") == (2.0, 1)
    events = st.take_unwritten()
    assert events == [("a", 0.5, 1), ("b", 2.0, 1), ("a", 0.25, 2)]
    assert all(type(v) is float and type(k) is int for _, v, k in events)
    assert st.take_unwritten() == []
    for i in range(5):
        st.put_scalar("c", i, i)
    assert st.take_unwritten() == [("c", 2.0, 2), ("c", 3.0, 3), ("c", 4.0, 4)]
    assert st.latest("a") == (0.25, 2)
    with pytest.raises(ValueError):
        st.put_scalar("a", "not a number", 0)


def test_tensorboard_hook_writes_the_event_storage_device_cpu(tmp_path):
    """The tensorboard hook writes every scalar put into the trainer's storage, at its step, on the main
    process; on another rank it takes them too (nothing piles up) and writes nothing."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    t, _ = _trainer(log_dir=str(tmp_path / "log"))
    t.main, t.storage = True, EventStorage()
    hook = TensorboardHook()
    hook.trainer = t
    t.storage.put_scalar("step1/mAP", 0.5, 0)
    hook.before_train()
    for it in (1, 2):
        t.storage.put_scalar("step1/loss_total", 3.0 / it, it)
        t.storage.put_scalar("step1/lr", 1e-3 * it, it)
        hook.after_iteration({})
    t.storage.put_scalar("step1/mAP", 0.75, 1)
    hook.after_epoch(0, {"train": {}})
    hook.after_train()
    assert t.storage.take_unwritten() == []
    acc = EventAccumulator(str(tmp_path / "log"))
    acc.Reload()
    read = {tag: [(e.step, round(e.value, 6)) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    assert read == {"step1/mAP": [(0, 0.5), (1, 0.75)], "step1/loss_total": [(1, 3.0), (2, 1.5)],
                    "step1/lr": [(1, 0.001), (2, 0.002)]}
    other, _ = _trainer(log_dir=str(tmp_path / "log-rank1"))
    other.main, other.storage = False, EventStorage()
    h1 = TensorboardHook()
    h1.trainer = other
    other.storage.put_scalar("step1/lr", 1e-3, 1)
    h1.after_iteration({})
    assert other.storage.take_unwritten() == [] and h1.writer is None and not (tmp_path / "log-rank1").exists()


@pytest.mark.parametrize("epoch,best_epoch,stops", [(4, 2, True), (3, 2, False), (9, 2, False), (2, None, True)])
def test_early_stop_hook_counts_epochs_since_the_best_device_cpu(epoch, best_epoch, stops):
    """patience 3 over 10 epochs (``epoch`` 0-based, the best's epoch 1-based): with the best at epoch 2,
    stop after the 5th epoch (3 without a better mAP), not after the 4th; with the entry model best,
    after the 3rd; never after the last epoch, and only where the epoch evaluated."""
    t, _ = _trainer(patience=3, num_epochs=10)
    hook = EarlyStopHook()
    hook.trainer = t
    result = {"eval": {}, "best_map": 0.5, "best_epoch": best_epoch}
    hook.after_epoch(epoch, result)
    assert ("stop" in result) == stops
    quiet = {}
    hook.after_epoch(epoch, quiet)
    assert "stop" not in quiet


def test_evaluation_epochs_follow_eval_interval_from_eval_from_and_always_the_last_device_cpu():
    """Epochs (from 1) after which a stage evaluates: every eval_interval epochs from eval_from on (0: from
    the first), and the last epoch whatever the two say; the hook evaluates after exactly those."""
    from gnetmdk.engine.hooks import evaluates_after

    def epochs(**kw):
        cfg = SimpleNamespace(**kw)
        return [e for e in range(1, cfg.num_epochs + 1) if evaluates_after(e, cfg)]
    assert epochs(num_epochs=40, eval_interval=2, eval_from=32) == [32, 34, 36, 38, 40]     # the shapes demo
    assert epochs(num_epochs=40, eval_interval=2, eval_from=31) == [32, 34, 36, 38, 40]
    assert epochs(num_epochs=10, eval_interval=5, eval_from=0) == [5, 10]
    assert epochs(num_epochs=7, eval_interval=3, eval_from=0) == [3, 6, 7]
    assert epochs(num_epochs=6, eval_interval=1, eval_from=4) == [4, 5, 6]
    assert epochs(num_epochs=6, eval_interval=2, eval_from=50) == [6]
    t, _ = _trainer(resume=False, eval_before=False, eval_interval=2, eval_from=4, num_epochs=7)
    t.summary, t.storage, t.t_start, t.iteration = {}, EventStorage(), 0.0, 0
    seen = []
    t.evaluate = lambda tag: seen.append(tag) or {"map": 0.1, "loss": {"total": 1.0}, "seconds": 0.1}
    t.save = lambda *a, **k: None
    t.caps = lambda: []
    hook = EvalHook()
    hook.trainer = t
    for epoch in range(7):
        hook.after_epoch(epoch, {})
    assert seen == ["epoch4", "epoch6", "epoch7"]


def test_eval_hook_owns_the_best_and_writes_best_pth_only_when_beaten_device_cpu():
    """The evaluation hook keeps the best mAP, its epoch and the latest mAP itself: best.pth is written
    for the entry model and then only for a higher mAP; every epoch's result carries the best's mAP and
    epoch; state_dict / load_state_dict carry the record across a resume; nothing is set on the trainer."""
    maps = iter([0.30, 0.50, 0.40, 0.60])
    saved = []
    t, logs = _trainer(resume=False, eval_before=True, eval_interval=1, eval_from=0, num_epochs=4)
    t.summary, t.storage, t.t_start, t.iteration = {}, EventStorage(), 0.0, 0
    t.evaluate = lambda tag: {"map": next(maps), "loss": {"total": 1.0}, "seconds": 0.1}
    t.save = lambda name, epoch, iteration, full=False: saved.append((name, epoch))
    t.caps = lambda: [float(t.iteration)]                  # the model's caps change as it trains
    hook = EvalHook()
    assert (hook.best_map, hook.last_map, hook.best_epoch, hook.evaluated_best()) == (-1.0, None, None, None)
    hook.trainer = t
    hook.before_train()
    results, caps = [], [hook.best_caps]
    for epoch in range(3):
        t.iteration += 10
        results.append({})
        hook.after_epoch(epoch, results[-1])
        caps.append(hook.best_caps)
    assert saved == [("best.pth", 0), ("best.pth", 1), ("best.pth", 3)]
    assert caps == [[0.0], [10.0], [10.0], [30.0]]        # the caps of the model each best.pth holds
    assert [r.get("best", False) for r in results] == [True, False, True]
    assert [(r["best_map"], r["best_epoch"]) for r in results] == [(0.5, 1), (0.5, 1), (0.6, 3)]
    assert (hook.best_map, hook.last_map, hook.best_epoch) == (0.6, 0.6, 3)
    assert not any(hasattr(t, k) for k in ("best_map", "last_map", "best_epoch", "best_seconds"))
    state = hook.state_dict()
    assert state["best_map"] == 0.6 and state["best_epoch"] == 3 and state["map"] == 0.6
    resumed = EvalHook()
    resumed.load_state_dict(state)
    assert (resumed.best_map, resumed.best_epoch, resumed.best_seconds) == (0.6, 3, state["best_seconds"])
    resumed.load_state_dict({"best_map": None})          # a run stopped before its first evaluation
    assert resumed.best_map == -1.0 and resumed.evaluated_best() is None


def test_calibration_stage_writes_its_ranges_and_records_their_map_device_cpu(tmp_path):
    """run_calibration: the entry evaluation, the family's calibration over the train batches in order,
    the evaluation with the new ranges as the stage's best and final mAP (in the evaluation hook), and
    cal.pth with the ranges file handed to the stage outputs as one set."""
    from gnetmdk.engine.calibration import run_calibration
    maps = iter([0.70, 0.65])
    sets, seen = [], []
    t, logs = _trainer(eval_before=True, model_root=str(tmp_path / "model"))
    loader = [(torch.full((1,), float(i)), None, None, None) for i in range(3)]
    t.train_loader, t.train_sampler = loader, SimpleNamespace(set_epoch=lambda e: seen.append(("epoch", e)))
    t.summary, t.out_dir, t.main, t.device = {"stage": "cal"}, str(tmp_path / "step2"), True, torch.device("cpu")
    t.evaluate = lambda tag: {"map": next(maps)}
    t.evaluation = EvalHook()
    t.state = lambda epoch, iteration, full: {"best_map": t.evaluation.best_map}
    t.outputs = SimpleNamespace(save_set=lambda ckpts, files: sets.append((ckpts, files)))
    t._progress = lambda it, desc, total=None: it

    def calibrate(model, batches, cfg, device, progress):
        seen.extend(float(b) for b in batches())
        return {"caps": [1.5, 2.0], "label": "caps", "how": "{batches} batches", "file": ("relu_cap.txt", "1.5\n2\n")}

    t.family = SimpleNamespace(calibrate=calibrate)
    summary = run_calibration(t, t_start=0.0)
    assert seen == [("epoch", 0), 0.0, 1.0, 2.0]
    assert (summary["entry_map"], summary["best_map"], summary["final_map"], summary["caps"]) == (0.70, 0.65, 0.65, [1.5, 2.0])
    assert (t.evaluation.best_map, t.evaluation.last_map) == (0.65, 0.65)
    cap_file = str(tmp_path / "model" / "relu_cap.txt")
    assert sets == [({"cal.pth": {"best_map": 0.65}}, {cap_file: "1.5\n2\n"})]
    assert summary["best_path"] == str(tmp_path / "step2" / "cal.pth") and summary["cap_file"] == cap_file
    assert any("(3 batches): 1.5 2" in line for line in logs)


def test_integer_graph_checks_name_the_node_device_cpu():
    """check_graph refuses an unknown op, a tensor read before it is written or written twice, and an
    add without its quantizer; tensor_quantizers passes a quantizer through pooling."""
    good = [Node("input", ("image",), "x", quant="q_in"), Node("maxpool", ("x",), "p", k=2, s=2),
            Node("conv", ("p",), "y", module="c", act="relu", quant="q_y"), Node("add", ("y", "p"), "z", quant="q_z")]
    check_graph(good)
    assert tensor_quantizers(good) == {"x": "q_in", "p": "q_in", "y": "q_y", "z": "q_z"}
    for nodes, msg in (([Node("dense", ("image",), "x")], "unknown op 'dense'"),
                       ([Node("conv", ("w",), "x", module="c")], "input 'w' is not written"),
                       (good + [Node("conv", ("z",), "y", module="c")], "tensor written twice"),
                       (good[:3] + [Node("add", ("y", "p"), "z")], "needs a quantizer")):
        with pytest.raises(ValueError, match=msg):
            check_graph(nodes)


def test_trainer_sets_every_attribute_in_init():
    """Every attribute the Trainer assigns anywhere is first set in __init__ (read from the source with
    ast), so no method needs getattr with a default to read trainer state."""
    import ast
    import inspect
    from gnetmdk.engine import trainer
    tree = ast.parse(inspect.getsource(trainer))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Trainer")
    in_init, elsewhere = set(), {}
    for fn in cls.body:
        if not isinstance(fn, ast.FunctionDef):
            continue
        for node in ast.walk(fn):
            targets = node.targets if isinstance(node, ast.Assign) else (
                [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
            for target in targets:
                for e in ast.walk(target):
                    if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self":
                        (in_init.add(e.attr) if fn.name == "__init__" else elsewhere.setdefault(e.attr, fn.name))
    assert {a: m for a, m in elsewhere.items() if a not in in_init} == {}
    assert "getattr(self, " not in inspect.getsource(trainer.Trainer)


def test_the_trainer_branches_on_the_stage_table_not_on_stage_names():
    """What makes calibration, step 1's partial load and step 3's trainable caps different is read from
    the stage table's columns; the trainer compares no stage name."""
    import inspect
    import re
    from gnetmdk.engine import trainer
    from gnetmdk.engine.stages import STAGES
    assert [n for n, s in STAGES.items() if s.calibration] == ["cal"]
    assert [n for n, s in STAGES.items() if s.partial_source] == ["step1"]
    assert [n for n, s in STAGES.items() if s.trainable_caps] == ["step3"]
    src = inspect.getsource(trainer)
    assert not re.findall(r"stage\.name\s*(==|!=|in\b)", src)


def test_a_hook_holds_its_trainer_by_weak_reference():
    """A registered hook reads its trainer while the trainer lives and None after it is gone: hooks never
    keep a finished trainer (its model, loaders, optimizer) in memory."""
    import gc
    t, _ = _trainer(ema_decay=0.9, ema_ramp=2.0)
    hook = EMAHook()
    hook.trainer = t
    assert hook.trainer is t
    del t
    gc.collect()
    assert hook.trainer is None


def test_alignment_options_stand_for_config_overrides():
    """--save-npz / --replay-npz / --max-iters / --replay-merged / --deterministic become the config
    overrides of the same names; none given, none added."""
    import argparse
    from gnetmdk.align.options import add_alignment_arguments, alignment_overrides
    p = argparse.ArgumentParser()
    add_alignment_arguments(p)
    assert alignment_overrides(p.parse_args([])) == []
    over = alignment_overrides(p.parse_args(["--save-npz", "rec", "--max-iters", "7", "--replay-merged"]))
    assert over[:4] == ["save_npz", "rec", "max_iters", "7"] and over[4:6] == ["replay_merged", "true"]
    assert alignment_overrides(p.parse_args(["--replay-npz", "r"]))[:2] == ["replay_npz", "r"]


def test_resume_settings_compare_as_stored():
    """same(): lists and tuples alike, ints and floats alike; the fixed and the changeable settings are
    disjoint and together the checked ones."""
    from gnetmdk.engine.resume import RESUME_CHANGEABLE, RESUME_CHECKED, RESUME_FIXED, same
    assert same([20, 25], (20, 25.0)) and same(1e-3, 0.001) and same(32, 32.0)
    assert not same([20, 25], [20]) and not same(2, 3) and not same("adamw", "sgd")
    assert not set(RESUME_FIXED) & set(RESUME_CHANGEABLE) and set(RESUME_CHECKED) == set(RESUME_FIXED) | set(RESUME_CHANGEABLE)


def test_detector_family_base_defaults():
    """The base family: every pipeline stage named in order, create() and calibrate() left to the subclass, the loss
    line's terms sorted after the total, default_loss_order's named keys first."""
    from gnetmdk.models.base import ALL_STAGES, DetectorFamily, default_loss_order
    assert ALL_STAGES == ("step1", "step2", "cal", "step3", "step4")
    fam = DetectorFamily()
    with pytest.raises(NotImplementedError):
        fam.create()
    with pytest.raises(NotImplementedError, match="has no calibration stage"):
        fam.calibrate(None, lambda: [], None, None, None)
    assert fam.loss_line({"total": 1.5, "cls": 0.25, "loc": 0.5}) == "loss 1.5000 (cls 0.250 loc 0.500)"
    assert default_loss_order({"b": 1, "total": 2, "a": 3, "loc": 4}, ("total", "loc")) == ["total", "loc", "a", "b"]


def test_distillation_adds_its_weighted_term_and_refuses_a_wrong_teacher_device_cpu(tmp_path):
    """gnetmdk.engine.distill: no distillation with distill 0, in step 1 or in the calibration pass; the
    term is weight x the family's distill_loss(student, teacher) on the teacher's no-grad outputs, added
    to the total; a missing teacher or one that is not a step-1 checkpoint is one CheckpointError."""
    from gnetmdk.checkpoint.io import CheckpointError, save_checkpoint
    from gnetmdk.config import BaseConfig, build_config
    from gnetmdk.engine.distill import Distillation
    from gnetmdk.engine.stages import STAGES
    base = ["checkpoint_root", str(tmp_path / "ck"), "device", "cpu"]
    cfg = build_config(BaseConfig, base + ["distill", "0.5"], step=2)
    fam = SimpleNamespace(distill_loss=lambda s, t: ((s - t) ** 2).sum())
    assert Distillation.from_config(build_config(BaseConfig, base, step=2), STAGES["step2"], fam, "cpu") is None
    assert Distillation.from_config(cfg, STAGES["step1"], fam, "cpu") is None
    assert Distillation.from_config(cfg, STAGES["cal"], fam, "cpu") is None
    with pytest.raises(CheckpointError, match="train step 1 first"):
        Distillation.from_config(cfg, STAGES["step2"], fam, "cpu")
    (tmp_path / "ck" / "step1").mkdir(parents=True)
    save_checkpoint(str(tmp_path / "ck" / "step1" / "best.pth"), {"stage": "step2", "model": {}})
    with pytest.raises(CheckpointError, match="the teacher is the float"):
        Distillation.from_config(cfg, STAGES["step2"], fam, "cpu")
    teacher = nn.Linear(2, 2)
    d = Distillation(teacher, 0.5, fam, "t.pth")
    x = torch.tensor([[1.0, -2.0]])
    student = nn.Linear(2, 2)
    pred = student(x)
    terms = {"total": torch.tensor(3.0)}
    d.add_term(x, pred, terms)
    want = 0.5 * ((pred - teacher(x)) ** 2).sum()
    assert torch.equal(terms["distill"], want) and torch.equal(terms["total"], 3.0 + want)
    terms["total"].backward()
    assert student.weight.grad is not None and teacher.weight.grad is None
    assert "t.pth" in d.describe() and "weight 0.5" in d.describe()


def test_learned_caps_part_of_step_3_device_cpu():
    """gnetmdk.engine.learned_caps: step 3 with cap_lr > 0 learns every ReLU's cap (they require
    gradients, in the model's order); other stages, or cap_lr 0, learn none; after a step each cap is
    kept at least CAP_FLOOR; without a process group the gradients are left as they are."""
    from gnetmdk.engine.learned_caps import CAP_FLOOR, LearnedCaps
    from gnetmdk.engine.stages import STAGES
    from gnetmdk.models.gnetdet.model import GNetDet
    m = GNetDet(3, 224, 0.0625, use_bn=False)
    on = SimpleNamespace(cap_lr=0.01)
    assert not LearnedCaps.for_stage(m, STAGES["step2"], on) and not LearnedCaps.for_stage(m, STAGES["step3"],
                                                                                            SimpleNamespace(cap_lr=0.0))
    assert not LearnedCaps.for_stage(m, STAGES["step3"], SimpleNamespace())     # a family without cap_lr
    assert not any(r.cap.requires_grad for r in m.relus())
    caps = LearnedCaps.for_stage(m, STAGES["step3"], on)
    assert len(caps) == len(m.relus()) and all(c is r.cap and c.requires_grad for c, r in zip(caps.caps, m.relus()))
    assert caps.lr == 0.01 and "cap_lr 0.01" in caps.describe()
    with torch.no_grad():
        caps.caps[0].fill_(-1.0)
        caps.caps[1].fill_(2.5)
    caps.caps[1].grad = torch.tensor(0.25)
    caps.average_gradients()
    caps.clamp_()
    assert float(caps.caps[0].detach()) == pytest.approx(CAP_FLOOR) and float(caps.caps[1].detach()) == 2.5
    assert float(caps.caps[1].grad) == 0.25 and caps.caps[0].grad is None


def test_freezing_parts_freeze_at_and_finetune_device_cpu():
    """gnetmdk.engine.freezing: freeze_at N freezes the first N sublayers' parameters for good (and is
    refused past the model's sublayers, as freeze_convs is with finetune); finetune N freezes the first
    freeze_convs sublayers for epochs 0..N-1, says so once per change, and unfreezes them after."""
    from gnetmdk.config import ConfigError
    from gnetmdk.engine.freezing import Finetune, freeze_leading
    from gnetmdk.models import get_family
    from gnetmdk.models.gnetdet.model import GNetDet
    fam = get_family("gnetdet")
    m = GNetDet(3, 224, 0.0625, use_bn=False)
    n = len(m.layers)
    frozen = freeze_leading(m, fam, SimpleNamespace(freeze_at=2, finetune=0, freeze_convs=0))
    first_two = list(m.layers[0].parameters()) + list(m.layers[1].parameters())
    assert len(frozen) == len(first_two) and all(not p.requires_grad for p in first_two)
    assert all(p.requires_grad for p in m.layers[2].parameters())
    for sec in (SimpleNamespace(freeze_at=n + 1, finetune=0, freeze_convs=0),
                SimpleNamespace(freeze_at=0, finetune=1, freeze_convs=n + 1)):
        with pytest.raises(ConfigError, match="sublayers"):
            freeze_leading(GNetDet(3, 224, 0.0625, use_bn=False), fam, sec)
    m = GNetDet(3, 224, 0.0625, use_bn=False)
    ft = Finetune(fam, SimpleNamespace(finetune=2, freeze_convs=1))
    msg, changed = ft.apply(m, 0)
    assert changed and "frozen until epoch 2" in msg and not any(p.requires_grad for p in m.layers[0].parameters())
    assert ft.apply(m, 1) == (None, False)
    msg, changed = ft.apply(m, 2)
    assert changed and "unfrozen from epoch 3" in msg and all(p.requires_grad for p in m.parameters())
    assert Finetune(fam, SimpleNamespace()).apply(m, 0) == (None, False)
