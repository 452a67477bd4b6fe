"""Atomic writes (gnetmdk.utils.atomic), device cpu: a set of files is replaced whole or not at all."""
from __future__ import annotations

import os
import stat

import pytest

from gnetmdk.utils.atomic import atomic_write_bytes, atomic_write_set, atomic_write_text, text_writer


def _listing(folder):
    return sorted(os.listdir(folder))


def test_a_set_is_written_whole_with_the_usual_permissions_device_cpu(tmp_path):
    a, b = str(tmp_path / "a.txt"), str(tmp_path / "sub" / "b.bin")
    assert atomic_write_set({a: text_writer("één\n"), b: lambda fh: fh.write(b"\x00\x01")}) == [a, b]
    assert open(a, encoding="utf-8").read() == "één\n" and open(b, "rb").read() == b"\x00\x01"
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(os.stat(a).st_mode) == 0o666 & ~umask           # not mkstemp's 0600
    assert _listing(tmp_path) == ["a.txt", "sub"] and _listing(tmp_path / "sub") == ["b.bin"]
    atomic_write_text(a, "new")
    atomic_write_bytes(b, lambda fh: fh.write(b"x"))
    assert open(a).read() == "new" and open(b, "rb").read() == b"x"


def test_a_failing_writer_replaces_nothing_and_leaves_no_temporary_file_device_cpu(tmp_path):
    a, b, old = str(tmp_path / "a.txt"), str(tmp_path / "b.txt"), str(tmp_path / "old.txt")
    atomic_write_set({a: text_writer("A1"), b: text_writer("B1"), old: text_writer("O")})

    def broken(fh):
        fh.write(b"half")
        raise OSError(28, "No space left on device")
    with pytest.raises(OSError, match="No space"):
        atomic_write_set({a: text_writer("A2"), b: broken}, remove=[old])
    assert (open(a).read(), open(b).read(), open(old).read()) == ("A1", "B1", "O")
    assert _listing(tmp_path) == ["a.txt", "b.txt", "old.txt"]


def test_remove_deletes_the_previous_members_the_new_set_lacks_device_cpu(tmp_path):
    a, old = str(tmp_path / "a.txt"), str(tmp_path / "old.txt")
    atomic_write_set({a: text_writer("1"), old: text_writer("2")})
    atomic_write_set({a: text_writer("3")}, remove=[a, old, str(tmp_path / "never-there.txt")])
    assert _listing(tmp_path) == ["a.txt"] and open(a).read() == "3"    # a member of both sets is kept
