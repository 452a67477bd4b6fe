"""Atomic file writes: a file, or a set of files, is replaced whole or not at all.

Every file the project writes for a user (checkpoints, meta files, chip-model files, ranges, plots'
data, recordings) goes through :func:`atomic_write_set`: written to a temporary file beside its
destination, flushed and fsynced, and renamed into place only when all files of the set are complete
(the rename of POSIX ``rename(2)`` / ``os.replace`` replaces a directory entry in one step).
"""
from __future__ import annotations

import os
import tempfile
from typing import Any, Dict, List, Sequence

__all__ = ["atomic_write_bytes", "atomic_write_set", "atomic_write_text", "text_writer"]


def _write_temp(path: str, write_fn) -> str:
    """Write ``write_fn(fileobj)`` into a new temporary file beside ``path`` (flushed, fsynced, with the
    permissions a plain ``open`` would give); returns its name. Removes it on any failure."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-" + os.path.basename(path) + "-", dir=folder)
    try:
        with os.fdopen(fd, "wb") as fh:
            write_fn(fh)
            fh.flush()
            os.fsync(fh.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)      # mkstemp makes 0600; give the file the usual permissions
        return tmp
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_bytes(path: str, write_fn) -> None:
    """Write a file through ``write_fn(fileobj)`` to a temporary file in the same folder, fsync, rename.

    A crash at any point leaves either the old file or the new one, never a partial file.
    """
    atomic_write_set({path: write_fn})


def atomic_write_text(path: str, text: str) -> None:
    """Atomically write a text file (UTF-8)."""
    atomic_write_bytes(path, lambda fh: fh.write(text.encode("utf-8")))


def text_writer(text: str):
    """A ``write_fn`` for :func:`atomic_write_set` writing ``text`` as UTF-8."""
    data = text.encode("utf-8")
    return lambda fh: fh.write(data)


def atomic_write_set(writers: Dict[str, Any], remove: Sequence[str] = ()) -> List[str]:
    """Write several files as one set: each first to a temporary file beside its destination (written,
    flushed, fsynced), and only when every one of them is complete are they renamed into place;
    then the files of ``remove`` (a previous set's members this one no longer has) are deleted.

    A failure while writing (a full disk, a read-only folder, an exception in a writer) or a kill
    before the renames leaves every destination as it was and no temporary file behind; the renames
    themselves only replace directory entries. Used for the stages' outputs, the chip-model files and
    the meta files, so that no set is ever half new.

    Args:
        writers: {destination path: write_fn(binary file object)} (see :func:`text_writer`).
        remove: paths to delete after the renames (missing ones are ignored).
    Returns:
        the destination paths, in the order given.
    Raises:
        OSError (and whatever a writer raises): nothing was replaced.
    """
    temps: Dict[str, str] = {}
    try:
        for path, fn in writers.items():
            temps[path] = _write_temp(path, fn)
        for path, tmp in temps.items():
            os.replace(tmp, path)
    finally:
        for tmp in temps.values():
            if os.path.exists(tmp):
                os.unlink(tmp)
    for path in remove:
        if path not in writers and os.path.lexists(path):
            os.unlink(path)
    return list(writers)
