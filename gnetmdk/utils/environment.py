"""The software and kernels a run computed with, recorded in every checkpoint and stage log.

Two runs with the same seed, config and data repeat each other bit for bit only where these agree
(docs/alignment.md, "Exact, not close", its last paragraphs): torch's version and the CPU kernels it dispatches
to (its CPU capability, ``ONEDNN_MAX_CPU_ISA`` / ``ATEN_CPU_CAPABILITY``) decide the order of float
sums inside an operator; OpenCV's version decides the augmented pixels (its warpAffine and resize
round differently between releases); numpy's decides its random streams' use in augmentation; CUDA,
cuDNN and the GPU model decide a GPU run's kernels. Every value is a plain string, so the record is
plain data in a checkpoint (loaded with ``weights_only=True``) and in JSON.
"""
from __future__ import annotations

import os
import platform
from typing import Dict, List, Mapping, Optional

#: the keys whose difference between two runs can change the bits they compute, in log order
KEYS = ("threads", "torch", "cpu_capability", "ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "opencv", "numpy",
        "python", "cuda", "cudnn", "gpu")


def cpu_kernels() -> Dict[str, str]:
    """What selects this machine's CPU kernels: torch's CPU capability (``AVX512``, ``AVX2``, ...; empty
    where torch cannot say) and the ``ONEDNN_MAX_CPU_ISA`` / ``ATEN_CPU_CAPABILITY`` settings (empty
    when unset)."""
    import torch

    cap = ""
    try:
        cap = str(torch.backends.cpu.get_cpu_capability())
    except Exception:  # pragma: no cover - torch without the query
        pass
    return {"cpu_capability": cap, "ONEDNN_MAX_CPU_ISA": os.environ.get("ONEDNN_MAX_CPU_ISA", ""),
            "ATEN_CPU_CAPABILITY": os.environ.get("ATEN_CPU_CAPABILITY", "")}


def run_environment(device: Optional[str] = None, threads: Optional[int] = None) -> Dict[str, str]:
    """This process's record: {key: value} for every key of :data:`KEYS` that applies, all strings.

    Args:
        threads: the intra-op threads per rank the run computes with (``threads``; None: not recorded).
        device: the run's device type (``"cpu"``, ``"cuda"``); with ``"cuda"`` the record adds
            ``cuda`` (torch's CUDA version), ``cudnn`` (its cuDNN version) and ``gpu`` (the current
            device's name). None or ``"cpu"``: no GPU keys.
    Returns:
        e.g. {"threads": "2", "torch": "2.13.0+cpu", "cpu_capability": "AVX512", "ONEDNN_MAX_CPU_ISA": "",
        "ATEN_CPU_CAPABILITY": "", "opencv": "5.1.0", "numpy": "2.2.6", "python": "3.12.3"}.
    """
    import cv2
    import numpy as np
    import torch

    env = {} if threads is None else {"threads": str(int(threads))}
    env.update({"torch": str(torch.__version__), **cpu_kernels(), "opencv": str(cv2.__version__),
                "numpy": str(np.__version__), "python": platform.python_version()})
    if device == "cuda" and torch.cuda.is_available():
        env["cuda"] = str(torch.version.cuda or "")
        env["cudnn"] = str(torch.backends.cudnn.version() or "")
        env["gpu"] = str(torch.cuda.get_device_name(torch.cuda.current_device()))
    return env


def describe(env: Mapping[str, str]) -> str:
    """One log line's text for a record: ``torch 2.13.0+cpu, CPU kernels AVX512, OpenCV 5.1.0, numpy
    2.2.6, Python 3.12.3`` (the kernel settings and the GPU keys where set; the threads are logged on
    their own line by the trainer)."""
    parts = [f"torch {env.get('torch', '?')}"]
    kernels = env.get("cpu_capability") or "?"
    settings = [f"{k}={env[k]}" for k in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY") if env.get(k)]
    parts.append(f"CPU kernels {kernels}" + (f" ({', '.join(settings)})" if settings else ""))
    parts += [f"OpenCV {env.get('opencv', '?')}", f"numpy {env.get('numpy', '?')}", f"Python {env.get('python', '?')}"]
    if env.get("cuda") or env.get("gpu"):
        parts.append(f"CUDA {env.get('cuda', '?')}, cuDNN {env.get('cudnn', '?')}, GPU {env.get('gpu', '?')}")
    return ", ".join(parts)


def differences(old: Mapping[str, str], new: Mapping[str, str]) -> List[str]:
    """The keys of :data:`KEYS` whose values differ between two records, as ``"opencv 4.14.0 -> 5.1.0"``
    (a key one record lacks reads ``(none)``: a CPU run's record has no ``gpu``). An empty or missing
    ``old`` (a checkpoint written before runs were recorded), or one that is not a mapping (a file
    from elsewhere), gives no differences: the record informs, it never stops a run."""
    if not old or not isinstance(old, Mapping):
        return []
    out = []
    for k in KEYS:
        if k not in old and k not in new:
            continue
        a, b = str(old.get(k, "")), str(new.get(k, ""))
        if a != b:
            out.append(f"{k} {a or '(none)'} -> {b or '(none)'}")
    return out
