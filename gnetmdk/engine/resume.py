"""Resume (``--resume``): which settings a resume compares with the checkpoint it continues, the RNG
states a checkpoint carries, and :func:`restore_run`, which takes a run's state back from its checkpoint.

A resume continues a run exactly (docs/training.md, "Checkpoints and exact resume") only with the
settings that run had. RESUME_FIXED fix the position in the run or the optimizer's state layout and
must be equal; the others (the schedule, the optimizer's hyperparameters, the process count) may
differ when the config names them in ``resume_changes``: the trainer then applies the new values at
the checkpoint's iteration instead of silently keeping the old ones.
"""
from __future__ import annotations

import random
import warnings
from typing import Dict, List, Tuple

import numpy as np
import torch

from gnetmdk.config import ConfigError, config_from_dict, config_value
from gnetmdk.utils import environment

from .schedule import build_optimizer, build_scheduler

# the lists are the config's (validate_config checks resume_changes against RESUME_CHANGEABLE)
from gnetmdk.config.overrides import RESUME_CHANGEABLE, RESUME_CHECKED, RESUME_FIXED  # noqa: F401


def same(a, b) -> bool:
    """Config values equal as stored (tuples and lists alike, ints and floats alike)."""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return float(a) == float(b)
    return a == b


def resume_changes(st: Dict[str, object], cfg, ranks: int, family_name: str,
                   path: str) -> Tuple[List[str], List[str]]:
    """Compare the settings of the checkpoint being resumed with this run's.

    Args:
        st: the checkpoint (its ``config``, ``world_size`` and ``accumulate`` entries).
        cfg: this run's resolved config; ranks: this run's ranks (processes x virtual ranks).
        family_name: the model family's name (its config section); path: the checkpoint, for messages.
    Returns:
        (the changed settings the config accepts with ``resume_changes``, one log line per change).
    Raises:
        ConfigError: a changed setting that fixes the position in the run or the optimizer's state
            (batch_size, accumulate, optimizer, cap_lr: never), or another one of RESUME_CHECKED not
            listed in ``resume_changes``; the message names each with both values and the fix.
    """
    raw = dict(st.get("config") or {})
    old_cfg = config_from_dict(raw)
    saved, now = {}, {}
    for k in RESUME_CHECKED:
        if k == "world_size":
            saved[k], now[k] = int(st.get("world_size", 1) or 1), ranks
            continue
        a, b = config_value(old_cfg, k), config_value(cfg, k)
        if a is not None and b is not None and (k in raw or k in (raw.get(family_name) or {})):
            saved[k], now[k] = a, b
    if "accumulate" in st:
        saved["accumulate"] = st["accumulate"]
    diffs = {k: (saved[k], now[k]) for k in RESUME_CHECKED if k in saved and not same(saved[k], now[k])}
    where = f"cannot resume from '{path}'"
    fixed = [k for k in diffs if k in RESUME_FIXED]
    if fixed:
        raise ConfigError(f"{where}: " + "; ".join(f"{k} {diffs[k][0]!r} in the checkpoint, {diffs[k][1]!r} now"
                                                  for k in fixed) +
                          f" ({'these fix' if len(fixed) > 1 else 'this fixes'} the position in the run or the "
                          "optimizer's state): resume with the checkpoint's values, or start a new run without --resume")
    refused = [k for k in diffs if k not in cfg.resume_changes]
    if refused:
        raise ConfigError(f"{where}: " + "; ".join(f"{k} {diffs[k][0]!r} in the checkpoint, {diffs[k][1]!r} now"
                                                  for k in refused) +
                          f": resume with the checkpoint's values, or accept the new ones with resume_changes "
                          f"{','.join(refused)} (the schedule is rebuilt for them at the checkpoint's iteration; "
                          "docs/training.md)")
    return list(diffs), [f"resume: {k} {diffs[k][0]!r} -> {diffs[k][1]!r} (resume_changes)" for k in diffs]


def apply_resume_changes(optimizer: torch.optim.Optimizer, model: torch.nn.Module, cfg, caps: List[torch.Tensor],
                         iters_per_epoch: int, iteration: int):
    """Resume with accepted changes: the optimizer's groups take this config's hyperparameters (the
    checkpoint's moments, already loaded, are kept), and a schedule built from this config is advanced
    to ``iteration``, so the learning rate is the new schedule's at that point.

    Args:
        optimizer: the run's optimizer with the checkpoint's state loaded; model, caps (learned caps, or
            []): what it optimizes; iters_per_epoch: optimizer steps per epoch; iteration: the
            checkpoint's.
    Returns:
        the new learning-rate scheduler (torch.optim.lr_scheduler), stepped ``iteration`` times.
    """
    fresh = build_optimizer(model, cfg, caps, getattr(cfg.section(), "cap_lr", 0.0))
    for group, new in zip(optimizer.param_groups, fresh.param_groups):
        for key in ("lr", "weight_decay", "momentum", "nesterov"):
            if key in new:
                group[key] = new[key]
        group["initial_lr"] = new["lr"]
    scheduler = build_scheduler(optimizer, cfg, iters_per_epoch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")        # stepping a schedule without optimizer steps, on purpose
        for _ in range(iteration):
            scheduler.step()
    return scheduler


def rng_state() -> Dict[str, object]:
    """RNG states of python, numpy and torch as checkpoint-safe values."""
    py = random.getstate()
    npst = np.random.get_state()
    return {"python": [py[0], list(py[1]), py[2]],
            "numpy": [npst[0], torch.from_numpy(npst[1].astype(np.int64)), int(npst[2]), int(npst[3]), float(npst[4])],
            "torch": torch.get_rng_state()}


def set_rng_state(state: Dict[str, object]) -> None:
    """Restore the python, numpy and torch (CPU) RNG states that :func:`rng_state` saved in a checkpoint."""
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state((n[0], n[1].numpy().astype(np.uint32), n[2], n[3], n[4]))
    torch.set_rng_state(state["torch"])


def restore_run(trainer, st: Dict[str, object], t_start: float) -> float:
    """Continue a run from its full checkpoint ``st`` (``--resume``), on a trainer whose data, model and
    optimizer are set up (Trainer.run does it).

    The settings that differ from the checkpoint's are compared first (:func:`resume_changes`: refused
    unless the config's ``resume_changes`` names them; each accepted change is logged). Then the
    optimizer's state, the schedule (the checkpoint's, or rebuilt with the new values at the
    checkpoint's iteration: :func:`apply_resume_changes`), the RNG states, the GradScaler, the position
    in the run (iteration, epoch, batch within the epoch) and the stage's clock, and each hook's own
    entries (``load_state_dict``) are taken over.

    Args:
        trainer: gnetmdk.engine.trainer.Trainer.
        st: the resumed checkpoint (plain data and tensors: optimizer, scheduler, rng, scaler,
            iteration, epoch, elapsed, entry_map, the hooks' entries).
        t_start: the stage's start (time.time()) of this process.
    Returns:
        the stage's start moved back by the seconds the interrupted run had spent (``elapsed``), so
        the stage's seconds run on across the resume.
    Raises:
        ConfigError: a setting differs that may not (resume_changes).
    """
    t, cfg = trainer, trainer.cfg
    changed, notes = resume_changes(st, cfg, t.ranks, t.family.name, t.outputs.resume_path())
    for note in notes:
        t.log(f"[{t.stage.name}] {note}")
    moved = environment.differences(st.get("environment") or {}, t.environment)
    if moved:       # not refused: the run goes on, but it is no longer the uninterrupted run's computation
        t.log(f"[{t.stage.name}] resume: the checkpoint was written under another environment ({'; '.join(moved)}): "
              "training goes on, but no longer repeats the uninterrupted run bit for bit (docs/training.md, "
              "\"Checkpoints and exact resume\")")
    t.optimizer.load_state_dict(st["optimizer"])
    if changed:      # accepted with resume_changes: the new values, at the checkpoint's iteration
        t.scheduler = apply_resume_changes(t.optimizer, t.model, cfg, t.learned_caps.caps,
                                           t.iters_per_epoch, int(st["iteration"]))
    else:
        t.scheduler.load_state_dict(st["scheduler"])
    set_rng_state(st["rng"])
    t.precision.load_state_dict(st.get("scaler"))
    t.iteration = int(st["iteration"])
    t.start_epoch = int(st["epoch"])
    t.start_batch = t.iteration - t.start_epoch * t.iters_per_epoch
    if t.start_batch >= t.iters_per_epoch:
        t.start_epoch, t.start_batch = t.start_epoch + 1, 0
    # the stage's clock goes on from where the interrupted run's last checkpoint left it
    t_start = t.t_start = t_start - float(st.get("elapsed") or 0.0)
    t.summary["entry_map"] = st.get("entry_map")
    for hook in t.hooks:      # each hook takes its own entries of the resumed checkpoint
        hook.load_state_dict(st)
    return t_start
