"""The files one run of a stage writes, kept as a set: nothing of a previous run is replaced until this
one has finished.

    checkpoint/step<N>/best.pth, last.pth, config.json   the outputs of the last finished run
    checkpoint/step<N>/run/                               the run in progress, or an interrupted one:
                                                          best.pth, last.pth, config.json as it goes;
                                                          ``--resume`` continues from run/last.pth

A run writes its checkpoints into ``run/`` (atomically, each file), and only when it finishes moves
them into ``step<N>/`` together with any files it writes elsewhere (model/relu_cap.txt of learned caps),
so a run that fails (a non-finite loss, a full disk, Ctrl-C, a kill) leaves the previous run's
outputs byte for byte as they were, and its own progress in ``run/`` to resume from. Calibration is
one pass: it writes cal.pth and model/relu_cap.txt as one set at its end.
"""
from __future__ import annotations

import errno
import os
import shutil
from typing import Dict, List, Optional

import torch

from .io import FORMAT, VERSION, CheckpointError, atomic_write_set, load_checkpoint, text_writer

RUN_DIR = "run"
#: what a finished training run publishes from run/ (in this order; best.pth first)
PUBLISHED = ("best.pth", "last.pth", "config.json", "replay_report.json")


def check_writable(folder: str, what: str, field: str) -> None:
    """Fail early when ``folder`` cannot be created or written (a probe file is written and removed).

    Raises:
        CheckpointError: naming the folder, the reason and the config field that moves it.
    """
    try:
        os.makedirs(folder, exist_ok=True)
        probe = os.path.join(folder, ".write-test")
        with open(probe, "wb") as fh:
            fh.write(b"0" * 1024)
            fh.flush()
            os.fsync(fh.fileno())
        os.unlink(probe)
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise CheckpointError(f"cannot write {what} to '{folder}' ({reason}): fix its permissions or free disk "
                              f"space, or set {field} to another folder; nothing was written") from None


def write_error(path: str, exc: OSError, last_good: str) -> CheckpointError:
    """One line for an OSError while writing ``path`` (ENOSPC, EROFS, EACCES, ...)."""
    reason = exc.strerror or str(exc)
    fix = ("free disk space or set checkpoint_root to another disk" if exc.errno in (errno.ENOSPC, errno.EDQUOT)
           else "fix the folder's permissions or set checkpoint_root / model_root to another folder")
    return CheckpointError(f"cannot write '{path}' ({reason}): {fix}; {last_good}")


class StageOutputs:
    """Where one stage run's files go, and the moves that make them the stage's outputs.

    Args:
        out_dir: checkpoint/step<N> (the stage's output folder).
        stage: the stage name ("step1".."step4", "cal").
        main: whether this process writes (rank 0); the others only read paths.
    """

    def __init__(self, out_dir: str, stage: str, main: bool = True):
        self.out_dir = out_dir
        self.stage = stage
        self.main = main
        self.run_dir = os.path.join(out_dir, RUN_DIR)
        self.written: Dict[str, int] = {}          # file name -> iteration, written by this run

    # ------------------------------------------------------------------ reading
    def final(self, name: str) -> str:
        return os.path.join(self.out_dir, name)

    def staged(self, name: str) -> str:
        return os.path.join(self.run_dir, name)

    def resume_path(self) -> str:
        """The checkpoint ``--resume`` continues from: an interrupted run's run/last.pth, else the last
        finished run's last.pth (a run stopped by max_iters, say)."""
        staged = self.staged("last.pth")
        return staged if os.path.isfile(staged) else self.final("last.pth")

    def interrupted(self) -> Optional[int]:
        """The iteration of an interrupted run's run/last.pth, or None when there is none."""
        path = self.staged("last.pth")
        if not os.path.isfile(path):
            return None
        try:
            return int(load_checkpoint(path).get("iteration", 0))
        except CheckpointError:
            return -1

    def last_good(self) -> str:
        """A phrase naming the checkpoint to go back to after a failure of this run."""
        if "last.pth" in self.written:
            return (f"the last good checkpoint is {self.staged('last.pth')} (iteration {self.written['last.pth']}; "
                    "--resume continues from it); the previous outputs in "
                    f"{self.out_dir} are unchanged")
        return (f"no checkpoint of this run was written; the previous outputs in {self.out_dir} are unchanged")

    # ------------------------------------------------------------------ writing
    def start(self) -> None:
        """Create run/ for a new run, and remove the temporary files a killed write left (``.tmp-*``:
        never a checkpoint, only a write that did not reach its rename). A stale run/ of an interrupted
        run stays until this run writes its first file over it (its last.pth can be resumed until then)."""
        if not self.main:
            return
        os.makedirs(self.run_dir, exist_ok=True)
        for folder in (self.out_dir, self.run_dir):
            for name in os.listdir(folder):
                if name.startswith(".tmp-"):
                    try:
                        os.unlink(os.path.join(folder, name))
                    except OSError:
                        pass

    def save(self, name: str, state: Dict[str, object], iteration: int, config: Optional[dict] = None) -> str:
        """Write checkpoint ``name`` (and config.json beside it) into run/, atomically.

        Raises:
            CheckpointError: the disk is full or the folder not writable (naming the last good checkpoint).
        """
        path = self.staged(name)
        if not self.main:
            return path
        payload = {"format": FORMAT, "version": VERSION, **state}
        writers = {path: lambda fh: torch.save(payload, fh)}
        if config is not None:
            import json
            writers[self.staged("config.json")] = text_writer(json.dumps(config, indent=2, sort_keys=True,
                                                                         default=str) + "\n")
        try:
            os.makedirs(self.run_dir, exist_ok=True)
            atomic_write_set(writers)
        except OSError as exc:
            raise write_error(path, exc, self.last_good()) from None
        self.written[name] = iteration
        return path

    def publish(self, extra: Optional[Dict[str, str]] = None) -> List[str]:
        """The run finished: move its files from run/ into the stage's folder (best.pth first), write
        ``extra`` ({path: text}, e.g. model/relu_cap.txt) as part of the same set, remove run/.

        Raises:
            CheckpointError: an extra file cannot be written (then nothing was moved).
        """
        if not self.main:
            return []
        if extra:
            try:
                atomic_write_set({p: text_writer(t) for p, t in extra.items()})
            except OSError as exc:
                raise write_error(next(iter(extra)), exc, self.last_good()) from None
        moved = []
        for name in PUBLISHED:
            src = self.staged(name)
            if os.path.isfile(src):
                os.replace(src, self.final(name))
                moved.append(self.final(name))
        shutil.rmtree(self.run_dir, ignore_errors=True)
        return moved

    def save_set(self, checkpoints: Dict[str, Dict[str, object]], texts: Dict[str, str]) -> List[str]:
        """Write checkpoints (into the stage's folder, by name) and text files (any path) as one set:
        all or none (calibration's cal.pth and model/relu_cap.txt).

        Raises:
            CheckpointError: a file cannot be written; none of them was replaced.
        """
        if not self.main:
            return []
        writers = {}
        for name, state in checkpoints.items():
            payload = {"format": FORMAT, "version": VERSION, **state}
            writers[self.final(name)] = (lambda p: (lambda fh: torch.save(p, fh)))(payload)
        for path, text in texts.items():
            writers[path] = text_writer(text)
        try:
            return atomic_write_set(writers)
        except OSError as exc:
            raise write_error(next(iter(writers)), exc, "the previous files are unchanged") from None

