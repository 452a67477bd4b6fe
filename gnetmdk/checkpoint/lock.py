"""One writer per output folder: an exclusive lock held for a run's life.

The lock is filelock's (an OS-level lock on ``<folder>/.lock``), so the operating system releases it
when its process ends, however it ends; beside it ``<folder>/.lock.json`` names the holder (pid, host,
start time, command) for the message a second run gets. A holder record left by a process that ended
without releasing (killed) is taken over with a notice.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import time
from typing import Dict, Optional

from gnetmdk.utils.atomic import atomic_write_text

from .io import CheckpointError

LOCK_NAME = ".lock"
HOLDER_NAME = ".lock.json"


class OutputLocked(CheckpointError):
    """Another run holds the output folder; the message names the holder and the fix."""


def _holder(folder: str) -> Optional[Dict[str, object]]:
    try:
        with open(os.path.join(folder, HOLDER_NAME), encoding="utf-8") as fh:
            rec = json.load(fh)
        return rec if isinstance(rec, dict) else None
    except (OSError, ValueError):
        return None


def describe_holder(rec: Optional[Dict[str, object]]) -> str:
    """``pid 123 on host, started 2026-11-26 10:00:00 (train.py --step 1)`` or ``an unknown run``."""
    if not rec:
        return "an unknown run"
    started = rec.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(started))) if isinstance(started, (int, float)) else "?"
    cmd = rec.get("command") or ""
    return f"pid {rec.get('pid', '?')} on {rec.get('host', '?')}, started {when}" + (f" ({cmd})" if cmd else "")


class OutputLock:
    """An exclusive lock on an output folder for the life of a run.

    Args:
        folder: the folder (created when missing).
        what: what the folder holds, for messages ("the step1 checkpoints").
        fix: what to change to write elsewhere ("set checkpoint_root to another folder").
    """

    def __init__(self, folder: str, what: str, fix: str):
        import filelock
        self.folder, self.what, self.fix = folder, what, fix
        self._lock = filelock.FileLock(os.path.join(folder, LOCK_NAME), timeout=0)
        self.held = False

    def acquire(self) -> Optional[str]:
        """Take the lock; returns a notice when a record of a run that ended without releasing it was
        taken over, else None.

        Raises:
            OutputLocked: another run holds it (the message names that run and the fix).
            CheckpointError: the folder cannot be created or written.
        """
        import filelock
        try:
            os.makedirs(self.folder, exist_ok=True)
        except OSError as exc:
            raise CheckpointError(f"cannot create '{self.folder}' ({exc.strerror or exc}): {self.fix}") from None
        try:
            self._lock.acquire(timeout=0)
        except filelock.Timeout:
            raise OutputLocked(f"'{self.folder}' ({self.what}) is in use by another run: "
                               f"{describe_holder(_holder(self.folder))}. Wait for it to end or stop it, or "
                               f"{self.fix}") from None
        except OSError as exc:
            raise CheckpointError(f"cannot lock '{self.folder}' ({exc.strerror or exc}): {self.fix}") from None
        self.held = True
        old = _holder(self.folder)
        rec = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
               "command": " ".join(os.path.basename(a) if i == 0 else a for i, a in enumerate(sys.argv))[:300]}
        try:
            atomic_write_text(os.path.join(self.folder, HOLDER_NAME), json.dumps(rec) + "\n")
        except OSError:
            pass                                # the lock holds without the record; messages say less
        if old and old.get("pid") != os.getpid():
            return (f"'{self.folder}' was locked by a run that ended without releasing it "
                    f"({describe_holder(old)}); this run took the lock over")
        return None

    def release(self) -> None:
        """Give the lock back (and remove the holder record); a no-op when not held."""
        if not self.held:
            return
        try:
            os.unlink(os.path.join(self.folder, HOLDER_NAME))
        except OSError:
            pass
        self._lock.release()
        self.held = False

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc):
        self.release()
        return False
