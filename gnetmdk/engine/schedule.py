"""Optimizers and per-iteration learning-rate schedules built from torch.optim.lr_scheduler.

Schedule = LinearLR warm-up (from ``warmup_factor`` x lr to lr over ``warmup_epochs``) followed by
CosineAnnealingLR (down to ``min_lr_ratio`` x lr), CosineAnnealingWarmRestarts (period
``lr_restart_epochs``, growing by ``lr_restart_mult``), StepLR, MultiStepLR or a constant rate, chained
with SequentialLR and stepped once per optimizer step. Epoch-based fields are converted to
iterations with the number of iterations per epoch.
"""
from __future__ import annotations

import torch
from torch.optim import lr_scheduler as S


def build_optimizer(model: torch.nn.Module, cfg, caps=(), cap_lr: float = 0.0) -> torch.optim.Optimizer:
    """AdamW / Adam / SGD (Nesterov momentum unless ``nesterov`` is false) over the trainable
    parameters; weight decay on conv weights only
    (biases and BatchNorm parameters get none). Frozen parameters are left out entirely.

    ``caps``: learned activation caps (step 3 with ``cap_lr`` > 0, GNetDet's ``gnetdet.cap_lr``; 0-d
    float32 tensors that require grad), a third group at learning rate ``cap_lr`` without weight decay; the schedule
    shapes its rate like the others'."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() > 1 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if caps:
        groups.append({"params": list(caps), "weight_decay": 0.0, "lr": cap_lr})
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=cfg.learning_rate, momentum=cfg.momentum,
                               nesterov=bool(getattr(cfg, "nesterov", True)))
    if cfg.optimizer == "adam":
        return torch.optim.Adam(groups, lr=cfg.learning_rate)
    return torch.optim.AdamW(groups, lr=cfg.learning_rate)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg, iters_per_epoch: int) -> S.LRScheduler:
    """The per-iteration schedule described in the module docstring.

    Args:
        iters_per_epoch: optimizer steps per epoch (>= 1).
    """
    ipe = max(1, int(iters_per_epoch))
    total = max(1, cfg.num_epochs * ipe)
    warm = min(int(round(cfg.warmup_epochs * ipe)), total - 1) if cfg.warmup_epochs > 0 else 0
    rest = max(1, total - warm)
    kind = cfg.lr_scheduler
    if kind == "cosine":
        main = S.CosineAnnealingLR(optimizer, T_max=rest, eta_min=cfg.learning_rate * cfg.min_lr_ratio)
    elif kind == "cosine_restarts":
        main = S.CosineAnnealingWarmRestarts(optimizer, T_0=max(1, int(round(cfg.lr_restart_epochs * ipe))),
                                             T_mult=int(cfg.lr_restart_mult),
                                             eta_min=cfg.learning_rate * cfg.min_lr_ratio)
    elif kind == "step":
        main = S.StepLR(optimizer, step_size=max(1, cfg.lr_step_size * ipe), gamma=cfg.lr_gamma)
    elif kind == "multistep":
        main = S.MultiStepLR(optimizer, milestones=[max(1, m * ipe - warm) for m in cfg.lr_milestones],
                             gamma=cfg.lr_gamma)
    else:
        main = S.ConstantLR(optimizer, factor=1.0, total_iters=0)
    if warm <= 0:
        return main
    warmup = S.LinearLR(optimizer, start_factor=cfg.warmup_factor, end_factor=1.0, total_iters=warm)
    return S.SequentialLR(optimizer, [warmup, main], milestones=[warm])


def stage_epochs(num_epochs: int, min_steps: int, iters_per_epoch: int) -> int:
    """The epochs a stage trains: ``num_epochs``, or more where that many epochs hold fewer than
    ``min_steps`` optimizer steps (a small dataset has few steps per epoch; docs/training.md, "A budget in
    steps").

    Args:
        num_epochs: the config's epochs (>= 0); 0 stays 0 (nothing to train).
        min_steps: the fewest optimizer steps (>= 0; 0 = off).
        iters_per_epoch: optimizer steps per epoch (the trainer's: train images // global batch).
    Returns:
        ``max(num_epochs, ceil(min_steps / iters_per_epoch))``, or ``num_epochs`` when it is 0, min_steps is
        0 or an epoch holds no step.
    """
    if num_epochs <= 0 or min_steps <= 0 or iters_per_epoch <= 0:
        return int(num_epochs)
    return max(int(num_epochs), -(-int(min_steps) // int(iters_per_epoch)))
