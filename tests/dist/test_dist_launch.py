"""Failures of a distributed launch end cleanly: one message naming the fix, a non-zero exit code,
and no process left behind (docs/distributed.md, "Troubleshooting"). All on 127.0.0.1 with gloo."""
from __future__ import annotations

import os
import signal
import socket
import time
import uuid

import pytest

from dist_helpers import (TRAIN_DIST, finish, free_port, leftover_processes, make_workspace, run, start,
                          wait_no_leftovers)

CRASH_MODEL = '''

import os as _os
from gnetmdk.models.gnetdet.model import GNetDet as _GNetDet
from gnetmdk.models import register_model as _register


class _CrashyGNetDet(_GNetDet):
    """Rank 1 raises in its 3rd training forward: a worker crashing mid-training."""
    calls = 0

    def forward(self, x):
        if self.training:
            _CrashyGNetDet.calls += 1
            if _os.environ.get("RANK") == "1" and _CrashyGNetDet.calls == 3:
                raise RuntimeError("injected failure in rank 1")
        return super().forward(x)


_register("crashy")(lambda **kw: _CrashyGNetDet(**kw))
'''


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("dist_launch"))
    cfg = make_workspace(root, num_train=16, num_val=4)
    crash_cfg = os.path.join(root, "config_crash.py")
    with open(cfg) as src, open(crash_cfg, "w") as dst:
        dst.write(src.read() + CRASH_MODEL)
    return {"root": root, "cfg": cfg, "crash_cfg": crash_cfg}


def _run(ws, args, timeout=90, script=TRAIN_DIST):
    marker = uuid.uuid4().hex
    r = run([script, "--config", ws["cfg"], *args], ws["root"], timeout=timeout, marker=marker)
    assert wait_no_leftovers(marker) == [], f"processes left behind by {args}"
    return r


def _one_error_line(r):
    lines = [l for l in r.stderr.splitlines() if l.startswith("error: ")]
    assert len(lines) == 1, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    return lines[0]


def test_port_in_use(ws):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        r = _run(ws, ["--step", "1", "--gpus", "2", "--dist-url", f"127.0.0.1:{port}"])
    assert r.returncode == 2
    line = _one_error_line(r)
    assert f"port {port} is already in use" in line and "pick another --dist-url port" in line
    assert f"lsof -i :{port}" in line
    assert "launch:" not in r.stdout          # refused before any worker was started (no rendezvous wait)


def test_missing_peer_times_out(ws):
    """Machine 0 of 2 alone: the rendezvous gives up after --dist-timeout and says why (VPN included)."""
    port = free_port()
    r = _run(ws, ["--step", "1", "--world-size", "2", "--rank", "0", "--dist-url", f"127.0.0.1:{port}",
                  "--dist-timeout", "3"])
    assert r.returncode == 2
    line = _one_error_line(r)
    assert "not all 2 processes joined" in line and "within 3s" in line and "VPN" in line
    assert "--dist-timeout" in line


def test_machine_zero_unreachable(ws):
    """Machine 1 of 2 with nobody listening at --dist-url: a time-out naming machine 0's address."""
    port = free_port()
    r = _run(ws, ["--step", "1", "--world-size", "2", "--rank", "1", "--dist-url", f"tcp://127.0.0.1:{port}",
                  "--dist-timeout", "2"])
    assert r.returncode == 2
    line = _one_error_line(r)
    assert "rank 1: could not reach machine 0" in line and f"127.0.0.1:{port}" in line and "VPN" in line


def test_worker_crash_stops_all_workers(ws):
    marker = uuid.uuid4().hex
    r = run([TRAIN_DIST, "--config", ws["crash_cfg"], "--step", "1", "--gpus", "2", "model_name", "crashy"],
            ws["root"], timeout=90, marker=marker)
    assert r.returncode == 1, r.text[-3000:]
    line = _one_error_line_allowing_traceback(r)
    assert "rank 1" in line and "RuntimeError: injected failure in rank 1" in line
    assert "stopped the other 1 worker(s)" in line
    assert "injected failure in rank 1" in r.stderr.split("error: ")[0]     # the worker's traceback above
    assert wait_no_leftovers(marker) == []


def _one_error_line_allowing_traceback(r):
    lines = [l for l in r.stderr.splitlines() if l.startswith("error: ")]
    assert len(lines) == 1, r.stderr[-3000:]
    return lines[0]


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_interrupt_stops_every_process(ws, how):
    """Ctrl-C in a terminal (SIGINT to the whole foreground process group), or SIGTERM to the launcher
    alone: every worker stops and the launcher exits 130 / 143."""
    marker = uuid.uuid4().hex
    # enough epochs that the run is still training when the signal comes, however fast the machine
    args = [TRAIN_DIST, "--config", ws["cfg"], "--step", "1", "--gpus", "2", "progress", "false",
            "num_epochs", "100"]
    log = os.path.join(ws["root"], f"interrupt-{how}.log")
    t0 = time.time()
    with open(log, "w") as fh:
        proc = start(args, marker, ws["root"], stdout_file=fh)
    try:
        deadline = time.time() + 60
        # wait until the workers train (rank 0 logs the data line just before the first iteration)
        while time.time() < deadline and "train / " not in open(log).read() and proc.poll() is None:
            time.sleep(0.2)
        time.sleep(1.0)
        assert proc.poll() is None, "the run ended before it could be interrupted"
        assert len(leftover_processes(marker)) >= 3                # launcher and two workers
        if how == "ctrl-c":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            os.kill(proc.pid, signal.SIGTERM)
        r = finish(proc, args, 30, t0)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert r.returncode == (130 if how == "ctrl-c" else 143), r.text[-3000:]
    assert "interrupted: stopped 2 worker process(es)" in r.stderr
    assert wait_no_leftovers(marker) == []


def test_batch_that_does_not_split_is_refused(ws):
    r = _run(ws, ["--step", "1", "--gpus", "2", "batch_size", "7"])
    assert r.returncode == 2
    line = _one_error_line(r)
    assert "batch_size 7 does not split evenly over 2 processes (1 machine(s) x 2 per machine)" in line
    assert "multiple of 2 (e.g. 6 or 8)" in line


def test_bad_rank_and_url_are_refused(ws):
    r = _run(ws, ["--step", "1", "--world-size", "2", "--rank", "2", "--dist-url", "127.0.0.1:1234"])
    assert r.returncode == 2 and "--rank 2 must be in 0..1" in _one_error_line(r)
    r = _run(ws, ["--step", "1", "--world-size", "2", "--rank", "1"])
    assert r.returncode == 2 and "--world-size > 1 needs --dist-url" in _one_error_line(r)
    r = _run(ws, ["--step", "1", "--world-size", "2", "--rank", "1", "--dist-url", "machine0"])
    assert r.returncode == 2 and "must be host:port" in _one_error_line(r)


def test_lone_rank_waits_one_time_out_for_machine_zero(monkeypatch):
    """wait_for_rendezvous gives up at its deadline (one --dist-timeout; torch's store client alone
    retried with the whole time-out per attempt, about twice as long). A fake clock: no wall time."""
    from gnetmdk.dist import launch as L
    clock = {"t": 100.0}
    attempts = []

    def fake_connect(addr, timeout):
        attempts.append((clock["t"], timeout))
        clock["t"] += timeout                      # a connection attempt that times out
        raise OSError("connection timed out")

    monkeypatch.setattr(L.time, "monotonic", lambda: clock["t"])
    monkeypatch.setattr(L.time, "sleep", lambda s: clock.__setitem__("t", clock["t"] + s))
    monkeypatch.setattr(L.socket, "create_connection", fake_connect)
    assert L.wait_for_rendezvous("10.0.0.1", 29500, timeout=7.0) is False
    assert clock["t"] - 100.0 <= 7.0 + 0.25                     # at most one time-out (and one poll)
    assert len(attempts) >= 5 and all(t <= 1.0 for _, t in attempts)

    class Conn:
        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False
    clock["t"] = 0.0
    monkeypatch.setattr(L.socket, "create_connection", lambda addr, timeout: Conn())
    assert L.wait_for_rendezvous("10.0.0.1", 29500, timeout=7.0) is True and clock["t"] == 0.0
