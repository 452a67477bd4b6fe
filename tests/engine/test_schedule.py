"""Learning-rate curves of every schedule against their closed forms (per-iteration stepping)."""
import math

import pytest
import torch

from gnetmdk.config import BaseConfig, build_config
from gnetmdk.engine.schedule import build_optimizer, build_scheduler

IPE = 10          # iterations per epoch
EPOCHS = 6
LR = 0.1
WARM = 15         # 1.5 warm-up epochs x 10 iterations
F = 0.2           # warm-up start factor
ETA = LR * 0.01   # cosine floor (min_lr_ratio 0.01)


def curve(kind, **extra):
    over = ["learning_rate", str(LR), "num_epochs", str(EPOCHS), "lr_scheduler", kind, "warmup_epochs", "1.5",
            "warmup_factor", str(F), "min_lr_ratio", "0.01"]
    for k, v in extra.items():
        over += [k, str(v)]
    cfg = build_config(BaseConfig, over)
    model = torch.nn.Linear(2, 2)
    opt = build_optimizer(model, cfg)
    sched = build_scheduler(opt, cfg, IPE)
    lrs = []
    for _ in range(EPOCHS * IPE):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


def warm(i):
    return LR * (F + (1 - F) * i / WARM)


def test_cosine():
    lrs = curve("cosine")
    total = EPOCHS * IPE - WARM
    for i, lr in enumerate(lrs):
        want = warm(i) if i < WARM else ETA + (LR - ETA) * (1 + math.cos(math.pi * (i - WARM) / total)) / 2
        assert lr == pytest.approx(want, rel=1e-9, abs=1e-12), i


def test_step():
    lrs = curve("step", lr_step_size=2, lr_gamma=0.5)
    for i, lr in enumerate(lrs):
        want = warm(i) if i < WARM else LR * 0.5 ** ((i - WARM) // 20)
        assert lr == pytest.approx(want, rel=1e-9), i


def test_multistep_milestones_are_global_epochs():
    lrs = curve("multistep", lr_milestones="3,5", lr_gamma=0.1)
    for i, lr in enumerate(lrs):
        want = warm(i) if i < WARM else LR * 0.1 ** ((i >= 30) + (i >= 50))
        assert lr == pytest.approx(want, rel=1e-9), i


def test_cosine_warm_restarts():
    lrs = curve("cosine_restarts", lr_restart_epochs=2)
    for i, lr in enumerate(lrs):
        t = (i - WARM) % 20
        want = warm(i) if i < WARM else ETA + (LR - ETA) * (1 + math.cos(math.pi * t / 20)) / 2
        assert lr == pytest.approx(want, rel=1e-9, abs=1e-12), i


def test_constant_and_no_warmup():
    lrs = curve("constant", warmup_epochs=0)
    assert lrs == pytest.approx([LR] * len(lrs))


def test_weight_decay_only_on_conv_weights():
    cfg = build_config(BaseConfig, ["weight_decay", "0.01"])
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
    opt = build_optimizer(model, cfg)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.01 and [p.dim() for p in decay["params"]] == [4]
    assert no_decay["weight_decay"] == 0.0 and len(no_decay["params"]) == 3
