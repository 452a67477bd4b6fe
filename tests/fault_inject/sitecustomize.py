"""Fault injection for the subprocess runs of tests/engine/test_faults.py (device cpu).

Put this folder first on PYTHONPATH and set GNETMDK_FAULT; Python imports this module at start-up.

    GNETMDK_FAULT=slow-save:<marker>   every checkpoint write (torch.save into an open file) writes half
                                        its bytes, creates <marker>, then sleeps: a kill -9 lands in the
                                        middle of a checkpoint write
    GNETMDK_FAULT=enospc-log            every write of a tensorboard event file fails (No space left)
    GNETMDK_FAULT=enospc-npz:<N>        every recording file (--save-npz) after the first N fails likewise
"""
import os

_FAULT = os.environ.get("GNETMDK_FAULT", "")

if _FAULT.startswith("slow-save:"):
    import io
    import time

    import torch

    _marker = _FAULT.split(":", 1)[1]
    _real_save = torch.save

    def _slow_save(obj, f, *args, **kwargs):
        if isinstance(f, (str, os.PathLike)):
            return _real_save(obj, f, *args, **kwargs)
        buf = io.BytesIO()
        _real_save(obj, buf, *args, **kwargs)
        data = buf.getvalue()
        f.write(data[: len(data) // 2])
        f.flush()
        with open(_marker, "w") as fh:
            fh.write(str(os.getpid()))
        time.sleep(120)
        f.write(data[len(data) // 2:])
        return None

    torch.save = _slow_save

if _FAULT == "enospc-log":
    # every write of tensorboard's event files fails as on a full disk (No space left on device)
    import errno

    from tensorboard.summary.writer import record_writer

    def _full(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    record_writer.RecordWriter.write = _full

if _FAULT.startswith("enospc-npz:"):
    # every recording file (.npz) after the first N fails as on a full disk
    import errno

    import gnetmdk.align.record as _record

    _left = [int(_FAULT.split(":", 1)[1])]
    _real_bytes = _record._npz_bytes

    def _npz_bytes(arrays):
        write = _real_bytes(arrays)

        def failing(fh):
            if _left[0] <= 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            _left[0] -= 1
            write(fh)
        return failing

    _record._npz_bytes = _npz_bytes
