"""Which settings a resume (``--resume``) compares with the checkpoint it continues.

A resume continues a run exactly (docs/training.md, "Checkpoints and exact resume") only with the
settings that run had. RESUME_FIXED fix the position in the run or the optimizer's state layout and
must be equal; the others (the schedule, the optimizer's hyperparameters, the process count) may
differ when the config names them in ``resume_changes``: the trainer then applies the new values at
the checkpoint's iteration instead of silently keeping the old ones.
"""
from __future__ import annotations

# the lists are the config's (validate_config checks resume_changes against RESUME_CHANGEABLE)
from gnetmdk.config.overrides import RESUME_CHANGEABLE, RESUME_CHECKED, RESUME_FIXED  # noqa: F401


def same(a, b) -> bool:
    """Config values equal as stored (tuples and lists alike, ints and floats alike)."""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return float(a) == float(b)
    return a == b
