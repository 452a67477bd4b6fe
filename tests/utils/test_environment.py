"""The environment record of a run (gnetmdk.utils.environment), device cpu."""
from __future__ import annotations

import platform

import cv2
import numpy as np
import torch

from gnetmdk.utils.environment import KEYS, describe, differences, run_environment


def test_record_holds_this_process_as_plain_strings_device_cpu():
    env = run_environment("cpu", 2)
    assert env["threads"] == "2" and env["torch"] == torch.__version__ and env["opencv"] == cv2.__version__
    assert env["numpy"] == np.__version__ and env["python"] == platform.python_version()
    assert env["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert set(env) <= set(KEYS) and all(isinstance(v, str) for v in env.values())
    assert "cuda" not in env and "gpu" not in env                       # a CPU run names no GPU
    assert "threads" not in run_environment("cpu")


def test_kernel_settings_are_read_from_the_environment_device_cpu(monkeypatch):
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    env = run_environment("cpu")
    assert env["ONEDNN_MAX_CPU_ISA"] == "AVX2" and env["ATEN_CPU_CAPABILITY"] == ""
    assert "(ONEDNN_MAX_CPU_ISA=AVX2)" in describe(env)


def test_describe_and_differences_device_cpu():
    env = {"threads": "2", "torch": "2.13.0+cpu", "cpu_capability": "AVX512", "ONEDNN_MAX_CPU_ISA": "",
           "ATEN_CPU_CAPABILITY": "", "opencv": "5.1.0", "numpy": "2.2.6", "python": "3.12.3"}
    assert describe(env) == "torch 2.13.0+cpu, CPU kernels AVX512, OpenCV 5.1.0, numpy 2.2.6, Python 3.12.3"
    gpu = dict(env, cuda="12.8", cudnn="91000", gpu="NVIDIA H100")
    assert describe(gpu).endswith("CUDA 12.8, cuDNN 91000, GPU NVIDIA H100")
    assert differences(env, env) == []
    assert differences(env, dict(env, opencv="4.14.0", threads="1")) == ["threads 2 -> 1", "opencv 5.1.0 -> 4.14.0"]
    assert differences(env, gpu) == ["cuda (none) -> 12.8", "cudnn (none) -> 91000", "gpu (none) -> NVIDIA H100"]
    assert differences({}, gpu) == [] and differences(None, env) == []   # written before runs were recorded
    assert differences(["opencv", "4.14.0"], env) == [] and differences("AVX2", env) == []   # malformed: no record
