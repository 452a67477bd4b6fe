"""Helpers of the distributed / alignment tests: a tiny dataset and config in a temporary folder,
command-line runs of train.py / train-dist.py that cannot hang or leak processes, free ports.

Every run gets the environment variable GNETMDK_TEST_MARKER=<uuid>; its children inherit it, so
:func:`leftover_processes` finds any process a run left behind (through /proc/<pid>/environ).
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "train.py")
TRAIN_DIST = os.path.join(ROOT, "train-dist.py")
DIFF_WEIGHTS = os.path.join(ROOT, "tools", "diff_weights.py")

CONFIG_TEMPLATE = '''
from gnetmdk.config import BaseConfig


class Config(BaseConfig):
    DS_NAME = "shapes"
    VOC_CLASSES = ["circle", "square", "triangle"]
    data_root = {data_root!r}
    meta_root = {meta_root!r}
    checkpoint_root = {out!r} + "/checkpoint"
    log_root = {out!r} + "/log"
    model_root = {out!r} + "/model"
    image_size = 224
    width_mult = 0.0625          # the chip's minimum widths: 4..16 channels, 28k parameters
    batch_size = 8
    num_workers = 0
    threads = 1
    num_epochs = 100             # runs stop at max_iters; no evaluation before epoch 1000
    eval_interval = 1000
    eval_before = False
    progress = False
    warmup_epochs = 0
    learning_rate = 1e-3
    device = "cpu"               # gloo CPU processes: the CPU behaviour is what these tests check
    # GTI's weight rule and percentile caps (the strings the calibration tests read); the alignment tests
    # also run the default MSE rule, whose per-kernel argmin is bit-exact too
    gnetdet = dict(weight_scale="gti", cap_method="percentile", output_cap_max=0.0)
'''


#: The environments the alignment tests also run under: other CPU kernels (AVX2 code paths of oneDNN
#: and ATen, whatever the CPU offers) stand in for another machine's summation orders
#: (docs/alignment.md, "Exact, not close"). A recording and its replay share one of them.
OTHER_KERNELS = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_workspace(root: str, num_train: int = 40, num_val: int = 8, extra: str = "") -> str:
    """A shapes dataset (num_train + num_val small images), its meta files and a config file under
    ``root``; returns the config file's path. Outputs of runs go to ``root``/out unless overridden."""
    from gnetmdk.dataset.shapes import make_shapes_dataset
    from gnetmdk.dataset.voc import convert_voc_to_meta
    data = os.path.join(root, "data")
    make_shapes_dataset(os.path.join(data, "shapes"), num_train=num_train, num_val=num_val,
                        image_size=(64, 96), seed=0)
    meta = os.path.join(data, "meta")
    convert_voc_to_meta(os.path.join(data, "shapes"), ["circle", "square", "triangle"],
                        os.path.join(meta, "shapes_train.txt"), os.path.join(meta, "shapes_valid.txt"))
    cfg = os.path.join(root, "config_tiny.py")
    with open(cfg, "w", encoding="utf-8") as fh:
        fh.write(CONFIG_TEMPLATE.format(data_root=data, meta_root=meta, out=os.path.join(root, "out")) + extra)
    return cfg


@dataclass
class Run:
    args: List[str]
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def text(self) -> str:
        return self.stdout + self.stderr

    def check(self) -> "Run":
        assert self.returncode == 0, f"{' '.join(self.args)} exited {self.returncode}:\n{self.text[-4000:]}"
        return self


def _env(marker: str, env: Optional[Dict[str, str]]) -> Dict[str, str]:
    e = dict(os.environ)
    e.update({"GNETMDK_TEST_MARKER": marker, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
              "PYTHONWARNINGS": "ignore"})
    # children import this checkout's gnetmdk, whatever another install on the machine points at
    e["PYTHONPATH"] = ROOT + (os.pathsep + e["PYTHONPATH"] if e.get("PYTHONPATH") else "")
    e.pop("RANK", None)
    e.pop("WORLD_SIZE", None)
    e.pop("LOCAL_WORLD_SIZE", None)
    if env:
        e.update(env)
    return e


def start(args: Sequence[str], marker: str, cwd: str, env: Optional[Dict[str, str]] = None,
          stdout_file=None) -> subprocess.Popen:
    """Start ``python3 ARGS`` in its own session (process group), marked with ``marker``; stdout goes to
    ``stdout_file`` (an open file) when given, so that a test can watch it while the run goes on.

    SIGINT is reset to its default in the child, as for a program started from a terminal: a shell
    makes the jobs it starts in the background ignore SIGINT, and a test suite run that way would
    otherwise hand that on and hide the launcher's Ctrl-C handling."""
    return subprocess.Popen([sys.executable, *args], cwd=cwd, env=_env(marker, env),
                            stdout=stdout_file if stdout_file is not None else subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=_default_sigint)


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def finish(proc: subprocess.Popen, args: Sequence[str], timeout: float, t0: float) -> Run:
    """Wait for ``proc``; on time-out kill its whole process group and fail."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, err = proc.communicate()
        raise AssertionError(f"{' '.join(args)} did not finish in {timeout}s:\n{((out or '') + err)[-4000:]}")
    out = out or ""
    return Run(list(args), proc.returncode, out, err, time.time() - t0)


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run(args: Sequence[str], cwd: str, timeout: float = 120, env: Optional[Dict[str, str]] = None,
        marker: Optional[str] = None) -> Run:
    """Run ``python3 ARGS`` to completion (killed with its children after ``timeout`` seconds)."""
    marker = marker or uuid.uuid4().hex
    t0 = time.time()
    proc = start(args, marker, cwd, env)
    return finish(proc, args, timeout, t0)


def leftover_processes(marker: str) -> List[int]:
    """Pids of live processes (zombies excluded) whose environment holds GNETMDK_TEST_MARKER=marker."""
    needle = f"GNETMDK_TEST_MARKER={marker}".encode()
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as fh:
                if needle not in fh.read():
                    continue
            with open(f"/proc/{name}/stat", "rb") as fh:
                state = fh.read().rsplit(b")", 1)[1].split()[0]
            if state != b"Z":
                pids.append(int(name))
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return pids


def wait_no_leftovers(marker: str, seconds: float = 10.0) -> List[int]:
    """Wait up to ``seconds`` for every marked process to be gone; returns those still alive."""
    deadline = time.time() + seconds
    left = leftover_processes(marker)
    while left and time.time() < deadline:
        time.sleep(0.2)
        left = leftover_processes(marker)
    return left


def diff_weights(a: str, b: str, atol: float, rtol: float = 0.0, cwd: str = ROOT, state: bool = False) -> Run:
    return run([DIFF_WEIGHTS, a, b, "--atol", str(atol), "--rtol", str(rtol), *(["--state"] if state else [])],
               cwd=cwd, timeout=60)


def assert_bit_identical(a: str, b: str) -> None:
    """Two checkpoints equal in every tensor they carry: weights, BatchNorm buffers, caps, the EMA and
    the optimizer's state (tools/diff_weights.py --atol 0 --state)."""
    res = diff_weights(a, b, atol=0, state=True)
    assert res.returncode == 0 and "ALIGNED" in res.stdout, res.text[-3000:]
    assert " 0 outside |a-b| <= 0 + 0*|b|" in res.stdout, res.stdout[-1000:]


def max_change(a: str, b: str) -> float:
    """The largest |a - b| over the floating-point weights of two checkpoints (how far training moved)."""
    import torch
    x = torch.load(a, weights_only=True)["model"]
    y = torch.load(b, weights_only=True)["model"]
    return max(float((x[k].double() - y[k].double()).abs().max()) for k in x if x[k].is_floating_point())
