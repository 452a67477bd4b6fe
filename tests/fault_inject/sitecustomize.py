"""Fault injection for the subprocess runs of tests/test_faults.py (device cpu).

Put this folder first on PYTHONPATH and set GNETMDK_FAULT; Python imports this module at start-up.

    GNETMDK_FAULT=slow-save:<marker>   every checkpoint write (torch.save into an open file) writes half
                                        its bytes, creates <marker>, then sleeps: a kill -9 lands in the
                                        middle of a checkpoint write
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
