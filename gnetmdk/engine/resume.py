"""Which settings a resume (``--resume``) compares with the checkpoint it continues.

A resume continues a run exactly (docs/training.md, "Checkpoints and exact resume") only with the
settings that run had. RESUME_FIXED fix the position in the run or the optimizer's state layout and
must be equal; the others (the schedule, the optimizer's hyperparameters, the process count) may
differ when the config names them in ``resume_changes``: the trainer then applies the new values at
the checkpoint's iteration instead of silently keeping the old ones.
"""
from __future__ import annotations

#: must be equal to the checkpoint's (a different batch or accumulation moves the position in the epoch;
#: another optimizer or cap_lr changes the optimizer's state layout)
RESUME_FIXED = ("batch_size", "accumulate", "optimizer", "cap_lr")
#: may differ when listed in resume_changes (world_size: the global batches and their arithmetic do not
#: depend on the process count, docs/distributed.md)
RESUME_CHANGEABLE = ("world_size", "num_epochs", "lr_scheduler", "learning_rate", "warmup_epochs", "warmup_factor",
                     "min_lr_ratio", "lr_step_size", "lr_milestones", "lr_gamma", "lr_restart_epochs",
                     "lr_restart_mult", "momentum", "nesterov", "weight_decay")
RESUME_CHECKED = RESUME_FIXED + RESUME_CHANGEABLE


def same(a, b) -> bool:
    """Config values equal as stored (tuples and lists alike, ints and floats alike)."""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return float(a) == float(b)
    return a == b
