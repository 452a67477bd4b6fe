"""The one place where a stage's measurements go: an event storage that hooks write to and read from.

The trainer puts every iteration's loss terms (mean over ranks) and learning rate here, the evaluation
hook every val mAP, COCO mAP and val loss; writers (the tensorboard hook) take what is new, and any
hook can read the latest value of a name. So no hook calls another hook to report a number (the part
detectron2's EventStorage plays in its trainer).
"""
from __future__ import annotations

import collections
from typing import Deque, Dict, List, Optional, Tuple

#: events kept for writers that have not taken them; older ones are dropped (a run without a writer,
#: e.g. a benchmark, must not grow without end)
MAX_UNWRITTEN = 100_000


class EventStorage:
    """Scalars of one stage, by name (e.g. ``"step1/loss_total"``, ``"step1/mAP"``).

    Each scalar is ``(name, value, step)`` with ``value`` a Python float and ``step`` an int (the
    iteration for loss terms and the learning rate, the epoch count for evaluations, 0 for the entry
    evaluation). ``latest(name)`` gives the last one put under a name; ``take_unwritten()`` gives every
    scalar put since the previous call, in the order they were put, and forgets them.
    """

    def __init__(self, max_unwritten: int = MAX_UNWRITTEN):
        self._latest: Dict[str, Tuple[float, int]] = {}
        self._unwritten: Deque[Tuple[str, float, int]] = collections.deque(maxlen=int(max_unwritten))

    def put_scalar(self, name: str, value: float, step: int) -> None:
        """Record ``name`` = ``value`` at ``step`` (``value`` converted with float, ``step`` with int).

        Raises:
            TypeError / ValueError: a value or step that float / int cannot convert.
        """
        event = (str(name), float(value), int(step))
        self._latest[event[0]] = (event[1], event[2])
        self._unwritten.append(event)

    def latest(self, name: str) -> Optional[Tuple[float, int]]:
        """``(value, step)`` of the last scalar put under ``name``, or None if there is none."""
        return self._latest.get(name)

    def take_unwritten(self) -> List[Tuple[str, float, int]]:
        """Every ``(name, value, step)`` put since the last call, oldest first; the storage forgets them."""
        events = list(self._unwritten)
        self._unwritten.clear()
        return events
