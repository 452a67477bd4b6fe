"""The files one run of a stage writes, kept as a set: whole or absent, one generation kept.

    checkpoint/step<N>/best.pth, last.pth, config.json   the outputs of the last finished run (its set)
    checkpoint/step<N>/<stage>.manifest.json              what that set is: each file's SHA-256, the
                                                          files it wrote elsewhere (model/relu_cap.txt),
                                                          and the checkpoint the run started from
    checkpoint/step<N>/previous/<stage>/                  the set the last run replaced (one generation)
    checkpoint/step<N>/run/                               the run in progress, or an interrupted one:
                                                          best.pth, last.pth, config.json as it goes;
                                                          ``--resume`` continues from run/last.pth

A run writes its checkpoints into ``run/`` (atomically, each file), and only when it finishes are they
published as a set: a marker ``<stage>.publishing.json`` naming the new set is written first, the
current set moves into ``previous/<stage>/``, the new files move into place, the manifest is written
last and the marker removed. A run that fails (a non-finite loss, a full disk, Ctrl-C, a kill) before
that leaves the previous outputs byte for byte as they were and its own progress in ``run/``; one
killed while publishing leaves the marker, which every reader of the folder refuses (so no mixed set
is ever read) and the next run of the stage (``--resume`` or not) completes. Calibration publishes
cal.pth and model/relu_cap.txt the same way (``cal.manifest.json``). A checkpoint whose SHA-256 differs
from its manifest's (a copy, another writer) is refused by :func:`check_published`, which
gnetmdk.checkpoint.io.load_checkpoint calls for every file it loads.

Undoing a run: the replaced set is in ``previous/<stage>/`` with its manifest; copy its files back
over the stage's (and ``relu_cap.txt`` to model_root for cal and learned caps).
"""
from __future__ import annotations

import errno
import glob
import hashlib
import json
import os
import shutil
import time
from typing import Dict, List, Optional

import torch

from gnetmdk.utils.atomic import atomic_write_set, atomic_write_text, text_writer

from .io import FORMAT, VERSION, CheckpointError, load_checkpoint

RUN_DIR = "run"
PREVIOUS_DIR = "previous"
#: what a finished training run publishes from run/ (in this order; best.pth first)
PUBLISHED = ("best.pth", "last.pth", "config.json", "replay_report.json")
MANIFEST_FORMAT = "gnetmdk-output-set"


def file_sha256(path: str) -> str:
    """The SHA-256 of a file's bytes, as hex (read in 1 MiB blocks)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def manifest_path(folder: str, stage: str) -> str:
    """``<folder>/<stage>.manifest.json``: the stage's published set's manifest."""
    return os.path.join(folder, f"{stage}.manifest.json")


def pending_path(folder: str, stage: str) -> str:
    """``<folder>/<stage>.publishing.json``: the marker of a publication in progress."""
    return os.path.join(folder, f"{stage}.publishing.json")


def read_manifest(path: str) -> Optional[Dict[str, object]]:
    """A manifest or publishing marker as a dict, or None when missing or not one."""
    try:
        with open(path, encoding="utf-8") as fh:
            rec = json.load(fh)
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) and rec.get("format") == MANIFEST_FORMAT else None


def check_published(path: str) -> None:
    """Refuse a file of a stage's output set that is not whole: a set whose publishing was interrupted
    (its marker is in the folder), or a file whose SHA-256 differs from its manifest's. Files that no
    manifest names (run/, a user's own file, sets written before manifests existed) pass.

    Raises:
        CheckpointError: naming the file, what is wrong and the fix (``--resume`` completes an
            interrupted publish; ``previous/<stage>/`` holds the set before it).
    """
    folder, name = os.path.split(os.path.abspath(path))
    for marker in sorted(glob.glob(os.path.join(folder, "*.publishing.json"))):
        rec = read_manifest(marker)
        if rec is not None and name in (rec.get("files") or {}):
            stage = rec.get("stage", "?")
            raise CheckpointError(
                f"'{path}' belongs to a set of {stage} outputs whose publishing was interrupted ({marker} is still "
                f"there): run {stage} again (with --resume, or as a new run) to complete it, or restore "
                f"{os.path.join(folder, PREVIOUS_DIR, str(stage))}/")
    for man in sorted(glob.glob(os.path.join(folder, "*.manifest.json"))):
        rec = read_manifest(man)
        want = (rec or {}).get("files", {}).get(name)
        if want and os.path.isfile(path) and file_sha256(path) != want:
            stage = rec.get("stage", "?")
            raise CheckpointError(
                f"'{path}' is not the file its set's manifest ({man}) records: another run or a copy replaced it, "
                f"so the set is mixed. Run {stage} again (--resume completes an interrupted run), or restore "
                f"{os.path.join(folder, PREVIOUS_DIR, str(stage))}/")


def manifest_source(path: str) -> Optional[Dict[str, str]]:
    """The checkpoint the set holding ``path`` started from, as its manifest records it
    (``{"path", "sha256", "stage"}``: ``stage`` is the set's own), or None."""
    folder, name = os.path.split(os.path.abspath(path))
    for man in sorted(glob.glob(os.path.join(folder, "*.manifest.json"))):
        rec = read_manifest(man)
        if rec is not None and name in (rec.get("files") or {}):
            src = rec.get("source")
            if isinstance(src, dict) and src.get("path") and src.get("sha256"):
                return {"path": str(src["path"]), "sha256": str(src["sha256"]), "stage": str(rec.get("stage", ""))}
            return None
    return None


def check_writable(folder: str, what: str, field: str) -> None:
    """Fail early when ``folder`` cannot be created or written (a probe file is written and removed).

    Raises:
        CheckpointError: naming the folder, the reason and the config field that moves it.
    """
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise CheckpointError(f"cannot write {what} to '{folder}': it is a file, not a folder: set {field} to a "
                              "folder; nothing was written")
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


def check_output_folder(folder: str, what: str, field: str) -> None:
    """Refuse, before any work and without creating anything, an output folder that cannot be: a file,
    a path below a file, or one inside a folder this process may not write.

    Raises:
        CheckpointError: naming the folder, why, and the option or field that moves it.
    """
    path = os.path.abspath(folder)
    if os.path.exists(path) and not os.path.isdir(path):
        raise CheckpointError(f"cannot write {what} to '{folder}': it is a file, not a folder: set {field} to a "
                              "folder; nothing was written")
    probe = path
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise CheckpointError(f"cannot write {what} to '{folder}': '{probe}' is a file, so no folder can be made below "
                              f"it: set {field} to another folder; nothing was written")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise CheckpointError(f"cannot write {what} to '{folder}': '{probe}' is not writable: fix its permissions or "
                              f"set {field} to another folder; nothing was written")


def write_error(path: str, exc: OSError, last_good: str) -> CheckpointError:
    """One line for an OSError while writing ``path`` (ENOSPC, EROFS, EACCES, ...)."""
    reason = exc.strerror or str(exc)
    fix = ("free disk space or set checkpoint_root to another disk" if exc.errno in (errno.ENOSPC, errno.EDQUOT)
           else "fix the folder's permissions or set checkpoint_root / model_root to another folder")
    return CheckpointError(f"cannot write '{path}' ({reason}): {fix}; {last_good}")


class StageOutputs:
    """Where one stage run's files go, and the moves that make them the stage's output set.

    Args:
        out_dir: checkpoint/step<N> (the stage's output folder).
        stage: the stage name ("step1".."step4", "cal").
        main: whether this process writes (rank 0); the others only read paths.

    Attributes:
        source: ``{"path", "sha256"}`` of the checkpoint the run started from (set by the trainer),
            recorded in the set's manifest (provenance: the next stage refuses a set whose source has
            been replaced since).
    """

    def __init__(self, out_dir: str, stage: str, main: bool = True):
        self.out_dir = out_dir
        self.stage = stage
        self.main = main
        self.run_dir = os.path.join(out_dir, RUN_DIR if stage != "cal" else "run-cal")
        self.previous_dir = os.path.join(out_dir, PREVIOUS_DIR, stage)
        self.written: Dict[str, int] = {}          # file name -> iteration, written by this run
        self.source: Optional[Dict[str, str]] = None

    # ------------------------------------------------------------------ reading
    def final(self, name: str) -> str:
        """The path of ``name`` in the stage's output folder (where publishing puts it)."""
        return os.path.join(self.out_dir, name)

    def staged(self, name: str) -> str:
        """The path of ``name`` in the run's folder (where the run writes it before publishing)."""
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

    def repair(self) -> Optional[str]:
        """Complete a publish that an earlier run of this stage left unfinished (its marker is in the
        folder: it was killed while moving its set into place); returns a notice, or None when there
        was nothing to complete.

        Raises:
            CheckpointError: the unfinished set cannot be completed (a file of it is gone); the message
                says where the replaced set is.
        """
        if not self.main:
            return None
        pending = read_manifest(pending_path(self.out_dir, self.stage))
        if pending is None:
            return None
        try:
            self._complete(pending)
        except OSError as exc:
            raise write_error(pending_path(self.out_dir, self.stage), exc,
                              f"the replaced set is in {self.previous_dir}") from None
        return (f"completed the {self.stage} outputs that an interrupted run was publishing "
                f"({', '.join(pending.get('files', {}))}); the set they replaced is in {self.previous_dir}")

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
        """The run finished: its files in run/ become the stage's set (best.pth first), with ``extra``
        ({path: text}, e.g. model/relu_cap.txt) as part of it; the set they replace moves into
        previous/<stage>/ (module docstring).

        Raises:
            CheckpointError: a file cannot be written or moved (the marker then stays, and the next run
                of the stage completes the set).
        """
        if not self.main:
            return []
        names = [n for n in PUBLISHED if os.path.isfile(self.staged(n))]
        return self._publish(names, extra or {})

    def save_set(self, checkpoints: Dict[str, Dict[str, object]], texts: Dict[str, str]) -> List[str]:
        """Write checkpoints (into the stage's folder, by name) and text files (any path) as one set
        (calibration's cal.pth and model/relu_cap.txt): staged, then published as :meth:`publish` does.

        Raises:
            CheckpointError: a file cannot be written; none of the stage's files was replaced.
        """
        if not self.main:
            return []
        writers = {}
        for name, state in checkpoints.items():
            payload = {"format": FORMAT, "version": VERSION, **state}
            writers[self.staged(name)] = (lambda p: (lambda fh: torch.save(p, fh)))(payload)
        try:
            os.makedirs(self.run_dir, exist_ok=True)
            atomic_write_set(writers)
        except OSError as exc:
            raise write_error(next(iter(writers)), exc, "the previous files are unchanged") from None
        return self._publish(list(checkpoints), texts)

    def _publish(self, names: List[str], extra: Dict[str, str]) -> List[str]:
        man = manifest_path(self.out_dir, self.stage)
        old = read_manifest(man)
        if old is not None:
            old_files = list(old.get("files") or {})
        else:                                    # a set written before manifests: what lies there by name
            old_files = [n for n in (PUBLISHED if self.stage != "cal" else ("cal.pth",))
                         if os.path.isfile(self.final(n))]
        try:
            pending = {"format": MANIFEST_FORMAT, "stage": self.stage,
                       "files": {n: file_sha256(self.staged(n)) for n in names},
                       "extra": {p: hashlib.sha256(t.encode("utf-8")).hexdigest() for p, t in extra.items()},
                       "source": self.source, "written": time.time(),
                       "old_files": old_files, "extra_text": dict(extra)}
            shutil.rmtree(self.previous_dir, ignore_errors=True)       # one generation is kept
            atomic_write_text(pending_path(self.out_dir, self.stage), json.dumps(pending, indent=1) + "\n")
            return self._complete(pending)
        except OSError as exc:
            raise write_error(man, exc, "the next run of this stage completes the set") from None

    def _complete(self, pending: Dict[str, object]) -> List[str]:
        """Carry out a publishing marker; every step can be repeated after a kill. A staged file that
        still exists has not moved yet, so the file at its place is the replaced set's."""
        files: Dict[str, str] = dict(pending.get("files") or {})
        prev = self.previous_dir
        os.makedirs(prev, exist_ok=True)
        for name in dict.fromkeys(list(pending.get("old_files") or []) + list(files)):
            final = self.final(name)
            if os.path.isfile(final) and (name not in files or os.path.isfile(self.staged(name))):
                os.replace(final, os.path.join(prev, name))
        man = manifest_path(self.out_dir, self.stage)
        rec = read_manifest(man)
        if rec is not None and rec.get("files") != files:
            os.replace(man, os.path.join(prev, os.path.basename(man)))
        texts: Dict[str, str] = dict(pending.get("extra_text") or {})
        sums: Dict[str, str] = dict(pending.get("extra") or {})
        for path in texts:
            if os.path.isfile(path) and file_sha256(path) != sums.get(path):
                shutil.copyfile(path, os.path.join(prev, os.path.basename(path)))
        if texts:
            atomic_write_set({p: text_writer(t) for p, t in texts.items()})
        for name in files:
            src, final = self.staged(name), self.final(name)
            if os.path.isfile(src):
                os.replace(src, final)
            elif not os.path.isfile(final):
                raise CheckpointError(f"cannot complete the {self.stage} outputs: {src} is gone; the replaced set "
                                      f"is in {prev}: copy it back, or run {self.stage} again")
        out = {k: v for k, v in pending.items() if k not in ("old_files", "extra_text")}
        atomic_write_text(man, json.dumps(out, indent=1) + "\n")
        os.unlink(pending_path(self.out_dir, self.stage))
        shutil.rmtree(self.run_dir, ignore_errors=True)
        return [self.final(n) for n in files]
