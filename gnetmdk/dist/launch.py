"""launch(): one entry for one process, several processes and several machines.

Rank arithmetic: with N processes per machine (``--gpus``), M machines (``--world-size``, held as
``DistSpec.num_machines``) and machine rank R (``--rank``, ``DistSpec.machine_rank``), process
``local_rank`` has global rank ``R * N + local_rank`` in a world of ``M * N`` processes. A world of
one process runs the function directly in this process, without a process group: the same trainer,
whose collectives are no-ops.

Backend: NCCL when CUDA is used (process group ``cpu:gloo,cuda:nccl``: CUDA tensors go through
NCCL, the few small CPU tensors of logging through gloo), gloo otherwise, so ``--gpus 2`` without a
GPU runs 2 CPU processes. ``CUDA_VISIBLE_DEVICES`` is respected: local rank i uses visible GPU i.
Started by torchrun, the RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT variables win.

Supervision (several processes): torch's elastic agent (``torch.distributed.launcher.api.elastic_launch``,
what torchrun runs on) starts the workers with the spawn method, meets the other machines at a static
rendezvous on ``--dist-url`` (machine 0 hosts its TCP store), gives every worker its ranks through the
environment, stops the others when one fails, and stops every worker on Ctrl-C (SIGINT) or SIGTERM.
No restarts (``max_restarts 0``): a failed run resumes from ``last.pth``. This module keeps what the
agent does not: the refusals before anything starts (bad ranks, busy port, a rendezvous address that
does not answer as a torch store), one line per failure that names the failed rank and the fix
(:class:`WorkerFailed`, built from the record each failed worker writes), and workers that die with
the launcher (PR_SET_PDEATHSIG) if it is killed. The agent's own log is silenced unless ``LOGLEVEL``
is set (torchrun's variable). Every failure a user can cause ends with one message that names the
fix (docs/distributed.md, "Troubleshooting").
"""
from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Sequence, Tuple

import torch
import torch.distributed as dist


class LaunchError(RuntimeError):
    """A launch that cannot start or a worker that failed; the message names the cause and the fix.

    ``exit_code``: what the command should exit with (2: a user error; 1: a crash).
    """
    exit_code = 2


class WorkerFailed(LaunchError):
    """A worker process failed; the message is that worker's error, ``exit_code`` its exit code."""

    def __init__(self, message: str, exit_code: int = 1, rank: int = -1):
        super().__init__(message)
        self.exit_code = int(exit_code)
        self.rank = int(rank)


@dataclass
class DistSpec:
    """Where this launch sits.

    Attributes:
        gpus: processes on this machine (one per GPU; CPU processes without CUDA); ``--gpus``.
        num_machines: number of machines; ``--world-size`` on the command line (the MDK's name).
        machine_rank: this machine's rank, 0 .. num_machines - 1; ``--rank`` on the command line.
        dist_url: machine 0's ``host:port`` or ``tcp://host:port`` ("" on one machine: a free port
            on 127.0.0.1 is chosen).
        timeout: seconds to wait for peers to join, and for every collective.
        use_cuda: NCCL on GPUs, else gloo on CPU.
        threads: intra-op threads of each process (torch.set_num_threads); 0 leaves torch's default.
    """
    gpus: int = 1
    num_machines: int = 1
    machine_rank: int = 0
    dist_url: str = ""
    timeout: float = 300.0
    use_cuda: bool = False
    threads: int = 0

    @property
    def total(self) -> int:
        """World size in processes: machines x processes per machine."""
        return self.gpus * self.num_machines

    def global_rank(self, local_rank: int) -> int:
        """The global rank of process ``local_rank`` on this machine: ``machine rank x gpus + local_rank``."""
        return self.machine_rank * self.gpus + local_rank


def torchrun_env() -> bool:
    """True when started by torchrun / torch.distributed.run (RANK, WORLD_SIZE and LOCAL_WORLD_SIZE set)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_WORLD_SIZE" in os.environ


def backend_for(use_cuda: bool) -> str:
    """The process group backend: with ``use_cuda`` NCCL for CUDA tensors and gloo for CPU ones, else gloo."""
    return "cpu:gloo,cuda:nccl" if use_cuda else "gloo"


def normalise_url(url: str) -> str:
    """'host:port' or 'tcp://host:port' -> 'tcp://host:port'.

    Raises:
        LaunchError: no host, no port, or a port that is not a number in 1..65535.
    """
    u = url.strip()
    if u.startswith("tcp://"):
        u = u[len("tcp://"):]
    elif "://" in u:
        raise LaunchError(f"--dist-url '{url}': the rendezvous is a TCP address, host:port or tcp://host:port "
                          f"(machine 0's, e.g. 192.168.3.100:8888), not a {u.split('://', 1)[0]}:// URL")
    host, sep, port = u.rpartition(":")
    if "/" in host or "/" in port:
        raise LaunchError(f"--dist-url '{url}' must be host:port or tcp://host:port without a path (machine 0's "
                          "address, e.g. 192.168.3.100:8888)")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise LaunchError(f"--dist-url '{url}' must be host:port or tcp://host:port (machine 0's address, "
                          "e.g. 192.168.3.100:8888)")
    return f"tcp://{host}:{port}"


def split_url(url: str) -> Tuple[str, int]:
    """``'tcp://host:port'`` -> ``(host, port)`` (port as int)."""
    host, port = url[len("tcp://"):].rsplit(":", 1)
    return host, int(port)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_port_free(url: str) -> None:
    """On machine 0, refuse a rendezvous port that another program already listens on.

    Binds like the rendezvous server does (all interfaces, SO_REUSEADDR, so the TIME_WAIT leftovers of
    an earlier run do not count).

    Raises:
        LaunchError: naming the port and how to find its holder.
    """
    _, port = split_url(url)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
            s.listen(1)
        except OSError:
            raise LaunchError(port_in_use_message(port)) from None


def port_in_use_message(port) -> str:
    """The one-line LaunchError text for a rendezvous ``port`` that another program already holds, with the fix."""
    return (f"port {port} is already in use (Address already in use): pick another --dist-url port, or "
            f"stop the program holding it (find it with: lsof -i :{port})")


# ------------------------------------------------------------------------------------- messages
_SHM_PATTERNS = ("unable to open shared memory", "shared memory", "/dev/shm", "too many open files",
                 "bus error", "unable to mmap", "dataloader worker (pid")


def explain_error(exc: BaseException) -> Optional[str]:
    """A one-line explanation with the fix for failures whose raw text does not say what to do, or None.

    Data-loader shared-memory failures (``unable to open shared memory object``, ``Too many open
    files``, a worker killed by a bus error) -> lower num_workers / raise the open-file limit / give
    Docker more /dev/shm.
    """
    text = str(exc)
    low = text.lower()
    if any(p in low for p in _SHM_PATTERNS):
        first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
        return (f"the data loader ran out of shared memory or file handles ({first}): lower num_workers "
                "(e.g. 'num_workers 0'), or raise the open-file limit ('ulimit -n 64000'); in Docker give the "
                "container more /dev/shm (--shm-size 8g)")
    return None


def _peer_lost(text: str) -> bool:
    low = text.lower()
    return any(p in low for p in ("connection closed by peer", "connection reset by peer", "broken pipe",
                                  "read error", "gloo::enforceerror", "socket closed", "connection refused"))


def _join_error(exc: Exception, url: str, world: int, rank: int, timeout: float) -> LaunchError:
    text = str(exc)
    low = text.lower()
    if "address already in use" in low or "eaddrinuse" in low:
        return LaunchError(port_in_use_message(split_url(url)[1]))
    if "timed out" in low or "timeout" in low:
        if "connect" in low and rank != 0:
            return LaunchError(
                f"rank {rank}: could not reach machine 0 at {url} within {timeout:g}s: start machine 0 (--rank 0) "
                f"with the same --dist-url, check that the address is machine 0's and reachable from here, and "
                f"that no VPN or firewall blocks the port (dist_timeout / --dist-timeout sets the wait)")
        return LaunchError(
            f"rank {rank}: not all {world} processes joined at {url} within {timeout:g}s. Check that every "
            f"machine runs the same command with its own --rank and the same --world-size and --gpus, that "
            f"{url} is machine 0's reachable address, and that no VPN or firewall blocks the port "
            f"(dist_timeout / --dist-timeout sets the wait)")
    return LaunchError(f"rank {rank}: could not join the process group at {url}: {text.strip().splitlines()[0]}")


def wait_for_rendezvous(host: str, port: int, timeout: float, poll: float = 0.25) -> bool:
    """Whether a TCP connection to machine 0's rendezvous ``host:port`` opens within ``timeout`` seconds
    (retried every ``poll`` seconds). torch's store client retries its own connection with the whole
    time-out per attempt, so a lone rank used to wait about twice ``--dist-timeout`` before giving up;
    waiting here first bounds the wait by one time-out."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(0.05, min(1.0, left))):
                return True
        except OSError:
            if time.monotonic() + poll >= deadline:
                return False
            time.sleep(poll)


def check_machine_zero(url: str, world: int, rank: int, timeout: float) -> None:
    """On a machine other than 0, before any worker starts: machine 0's rendezvous at ``url`` accepts
    connections within ``timeout`` seconds (:func:`wait_for_rendezvous`) and answers as a torch TCP
    store (one ``check`` round trip, bounded by ``timeout``: torch's store client waits without end for
    an answer from a listener that never speaks its protocol).

    Raises:
        LaunchError: machine 0 not reachable, or something else listening on its port.
    """
    host, port = split_url(url)
    if not wait_for_rendezvous(host, port, timeout):
        raise _join_error(TimeoutError(f"connect to {host}:{port} timed out"), url, world, rank, timeout)

    def probe():
        store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=timeout))
        store.check(["gnetmdk/launch-probe"])     # a round trip; counts as no machine joining

    try:
        _bounded(probe, timeout + 10.0, lambda: LaunchError(
            f"rank {rank}: nothing answered as a torch rendezvous at {url} within {timeout:g}s, though the port "
            "accepts connections: another program (or another run) listens there. Check that --dist-url is "
            "machine 0's address and port and that machine 0 runs the same command (--rank 0)"))
    except LaunchError:
        raise
    except Exception as exc:  # refused or reset between the two checks
        raise _join_error(exc, url, world, rank, timeout) from None


def _bounded(fn: Callable[[], None], seconds: float, on_timeout: Callable[[], Exception]) -> None:
    """Run ``fn`` in a daemon thread and wait at most ``seconds`` for it: torch's store client waits
    without end for an answer from a listener that never speaks its protocol, so the wait is bounded
    here. Raises ``on_timeout()`` when it does not return (the thread is left to the process's exit,
    which follows: a failed worker ends with os._exit), else what ``fn`` raised."""
    import threading
    box: Dict[str, BaseException] = {}

    def body():
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            box["exc"] = exc

    t = threading.Thread(target=body, name="rendezvous", daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        raise on_timeout()
    if "exc" in box:
        raise box["exc"]


def _destroy() -> None:
    """Tear the process group down. Objects that still hold it (a DistributedDataParallel wrapper kept
    alive by a reference cycle) are collected first: destroyed after the group, at interpreter exit,
    they abort the process ("terminate called without an active exception", SIGABRT) in about one
    run of four."""
    if dist.is_available() and dist.is_initialized():
        import gc
        gc.collect()
        try:
            dist.destroy_process_group()
        except Exception:  # a peer already gone: nothing left to tidy
            pass


# ------------------------------------------------------------------------------------- worker side
def _die_with_parent() -> None:
    """Linux: get SIGKILL when the launcher dies, so no worker outlives it (best effort elsewhere)."""
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)   # PR_SET_PDEATHSIG
    except Exception:
        pass


def _classify(exc: BaseException, user_errors: tuple) -> Tuple[int, str, bool]:
    """(exit code, one-line message, print traceback?) of an exception ending a worker."""
    if isinstance(exc, KeyboardInterrupt):
        return 130, "interrupted", False
    if isinstance(exc, SystemExit):
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        return code, f"exited with code {code}", False
    hint = explain_error(exc)
    if hint:
        return 2, hint, False
    if isinstance(exc, LaunchError):
        return getattr(exc, "exit_code", 2), str(exc), False
    if user_errors and isinstance(exc, user_errors):
        return 2, str(exc), False
    text = f"{type(exc).__name__}: {exc}".strip()
    low = text.lower()
    if "timed out waiting" in low or ("timeout" in low and ("recv" in low or "send" in low or "collective" in low)):
        return 1, ("a collective with the other processes timed out (" + text.splitlines()[0][:160] + "): another "
                   "process stopped answering (frozen, paused or overloaded) or ended; its console has the cause "
                   "(dist_timeout / --dist-timeout sets the wait)"), False
    if _peer_lost(text):
        first = text.splitlines()[0].split(" This is typically caused")[0]
        return 1, (f"lost the connection to another process ({first}): a process on another "
                   "machine probably failed or was stopped; its console has the cause"), False
    return 1, text.splitlines()[0] if text else type(exc).__name__, True


def _worker(fn: Callable, spec: DistSpec, args: tuple, err_dir: str, user_errors: tuple) -> None:
    """One process of the world, started by the elastic agent (its RANK, LOCAL_RANK, WORLD_SIZE,
    MASTER_ADDR and MASTER_PORT in the environment): joins the process group through the agent's
    store and runs ``fn(*args)``. A failure is classified (:func:`_classify`), written as a record to
    ``err_dir`` for the launcher's one line, and ends the process with its exit code."""
    # Ctrl-C reaches every process of the terminal's group; the launcher reports it, a worker just ends
    signal.signal(signal.SIGINT, lambda *_: os._exit(130))
    _die_with_parent()
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    code = 0
    try:
        if spec.use_cuda:
            torch.cuda.set_device(local_rank)
        if spec.threads > 0:
            torch.set_num_threads(spec.threads)
        dist.init_process_group(backend_for(spec.use_cuda), init_method="env://",
                                timeout=datetime.timedelta(seconds=spec.timeout))
        fn(*args)
    except BaseException as exc:  # noqa: BLE001 - everything is reported to the launcher
        code, msg, show_tb = _classify(exc, user_errors)
        if code != 0:
            record = {"rank": rank, "local_rank": local_rank, "pid": os.getpid(), "code": code,
                      "message": msg, "type": type(exc).__name__, "time": time.time(),
                      "traceback": traceback.format_exc(), "printed": bool(show_tb)}
            path = os.path.join(err_dir, f"rank{rank}.json")
            try:
                with open(path + ".tmp", "w", encoding="utf-8") as fh:
                    json.dump(record, fh)
                os.replace(path + ".tmp", path)
            except OSError:
                pass
            if show_tb:
                print(f"rank {rank} failed:", file=sys.stderr)
                traceback.print_exc()
    finally:
        _destroy()
    sys.stdout.flush()
    sys.stderr.flush()
    if code != 0:
        os._exit(code)   # no atexit handlers of half-torn-down libraries in a failed worker


# ------------------------------------------------------------------------------------- launcher side
def _failure(failed: Sequence[Tuple[int, int, int]], err_dir: str, spec: DistSpec) -> WorkerFailed:
    """The error of the worker that failed first: the earliest error record a worker wrote (a peer's
    lost connection only when there is no other cause), else the exit the agent saw (``failed``:
    (global rank, pid, exit code) of each failure it reports). A worker killed from outside writes no
    record: when the agent reports such a worker and every record is a lost connection, its exit is
    the cause."""
    records = []
    for name in os.listdir(err_dir):
        if name.endswith(".json"):
            try:
                with open(os.path.join(err_dir, name), encoding="utf-8") as fh:
                    records.append(json.load(fh))
            except (OSError, ValueError):
                pass
    others = spec.gpus - 1
    stopped = f"; stopped the other {others} worker(s) on this machine" if others else ""
    recorded = {r["rank"] for r in records}
    unrecorded = [f for f in failed if f[0] not in recorded]
    if unrecorded and all("lost the connection" in r["message"] for r in records):
        # the records are the peers' lost connections; the cause is a worker that ended without one
        # (killed from outside), as the agent saw it
        records = []
        failed = unrecorded
    if records:
        # a peer's lost connection is a consequence; prefer a root cause when there is one
        records.sort(key=lambda r: ("lost the connection" in r["message"], r["time"]))
        r = records[0]
        if r["code"] == 2:
            msg = r["message"] if r["message"].startswith(f"rank {r['rank']}") else f"rank {r['rank']}: {r['message']}"
            return WorkerFailed(msg + stopped, 2, r["rank"])
        above = " (traceback above)" if r.get("printed", r["code"] == 1 and "lost the connection" not in r["message"]) \
            else ""
        return WorkerFailed(f"rank {r['rank']} (pid {r['pid']}) failed: {r['message']}{above}{stopped}",
                            r["code"] or 1, r["rank"])
    for rank, pid, code in sorted(failed):
        if code < 0:
            sig = signal.Signals(-code).name
            why = " (out of memory? check dmesg)" if sig == "SIGKILL" else ""
            return WorkerFailed(f"rank {rank} (pid {pid}) was killed by {sig}{why}{stopped}", 1, rank)
        if code != 0:
            return WorkerFailed(f"rank {rank} (pid {pid}) exited with code {code}{stopped}", code, rank)
    return WorkerFailed("a worker failed without a report" + stopped, 1)


#: loggers of the elastic agent and of torch.multiprocessing, silenced while it runs (LOGLEVEL unset)
_AGENT_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")


@contextlib.contextmanager
def _quiet_agent():
    """Silence the agent's log (its rendezvous settings, a failed worker's traceback a second time,
    each process it stops): the launcher reports in one line. torchrun's ``LOGLEVEL`` brings it back."""
    if os.environ.get("LOGLEVEL"):
        yield
        return
    import logging
    saved = {}
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(_AGENT_LOGGERS):
            logger = logging.getLogger(name)
            saved[name] = logger.level
            logger.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        for name, level in saved.items():
            logging.getLogger(name).setLevel(level)


def _elastic_config(spec: DistSpec, url: str, log_dir: str):
    """The agent's LaunchConfig: ``spec.num_machines`` machines of ``spec.gpus`` workers each, a static
    rendezvous at machine 0's ``url`` with this machine's rank and ``spec.timeout`` (whole seconds, at
    least 1) as the wait for the others, no restarts, spawned workers."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig
    host, port = split_url(url)
    return LaunchConfig(min_nodes=spec.num_machines, max_nodes=spec.num_machines, nproc_per_node=spec.gpus,
                        run_id="gnetmdk", rdzv_backend="static", rdzv_endpoint=f"{host}:{port}",
                        rdzv_configs={"rank": spec.machine_rank, "timeout": max(1, math.ceil(spec.timeout))},
                        max_restarts=0, monitor_interval=0.1, start_method="spawn",
                        logs_specs=DefaultLogsSpecs(log_dir=log_dir))


def _run_elastic(fn: Callable, spec: DistSpec, url: str, args: tuple, user_errors: tuple) -> None:
    """Run ``_worker(fn, ...)`` in ``spec.gpus`` processes under the elastic agent and turn what can end
    it into this module's errors: a worker's failure -> :class:`WorkerFailed`; a rendezvous that times
    out or cannot connect (torch's DistError, the agent's RendezvousError, an OSError) -> :class:`LaunchError`
    (any other exception is a defect and keeps its traceback); SIGINT -> KeyboardInterrupt and SIGTERM (or another
    signal) -> SystemExit(128 + signal), after every worker was stopped."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.launcher.api import elastic_launch
    tmp = tempfile.mkdtemp(prefix="gnetmdk-launch-")
    err_dir = os.path.join(tmp, "errors")
    os.makedirs(err_dir)
    try:
        with _quiet_agent():
            elastic_launch(_elastic_config(spec, url, os.path.join(tmp, "agent")), _worker)(
                fn, spec, args, err_dir, user_errors)
    except ChildFailedError as exc:
        failed = [(rank, f.pid, f.exitcode) for rank, f in exc.failures.items()]
        if failed and all(code == 130 for _, _, code in failed) and not os.listdir(err_dir):
            _interrupted(spec)        # the workers saw Ctrl-C before the agent did
            raise KeyboardInterrupt from None
        raise _failure(failed, err_dir, spec) from None
    except SignalException as exc:
        _interrupted(spec)
        if exc.sigval == signal.SIGINT:
            raise KeyboardInterrupt from None
        raise SystemExit(128 + int(exc.sigval)) from None
    except (LaunchError, KeyboardInterrupt, SystemExit):
        raise
    except (dist.DistError, RendezvousError, OSError) as exc:   # peers that never join, machine 0 gone, ...
        raise _join_error(exc, url, spec.total, spec.machine_rank, spec.timeout) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _interrupted(spec: DistSpec) -> None:
    print(f"interrupted: stopped {spec.gpus} worker process(es)", file=sys.stderr, flush=True)


def _run_here(fn: Callable, args: tuple) -> None:
    try:
        fn(*args)
    except (LaunchError, KeyboardInterrupt, SystemExit):
        raise
    except Exception as exc:
        hint = explain_error(exc)
        if hint:
            raise LaunchError(hint) from exc
        raise


def describe(spec: DistSpec, url: str) -> str:
    """The launch's one-line summary for the log: processes and backend on this machine, machine rank,
    world size, global ranks, rendezvous URL, time-out and threads per process."""
    kind = ("GPU process(es), NCCL backend" if spec.use_cuda else
            "CPU process(es), gloo backend (no GPU in use)")
    return (f"launch: {spec.gpus} {kind} on this machine (machine {spec.machine_rank} of {spec.num_machines}), "
            f"world size {spec.total}, global ranks {spec.global_rank(0)}..{spec.global_rank(spec.gpus - 1)}, "
            f"rendezvous {url}, time-out {spec.timeout:g}s"
            + (f", {spec.threads} thread(s) per process" if spec.threads else ""))


def launch(fn: Callable, spec: DistSpec, args: tuple = (), user_errors: tuple = (),
           log: Callable[[str], None] = lambda m: print(m, flush=True)) -> None:
    """Run ``fn(*args)`` in every process of the world described by ``spec`` (or by torchrun's variables).

    ``fn`` and ``args`` must be picklable (spawned processes import ``fn`` by name). Inside ``fn`` the
    default process group is initialised when the world has more than one process.

    Args:
        user_errors: exception types that are the user's to fix (reported as one line, exit code 2).
        log: where the one launch line goes.
    Raises:
        LaunchError: bad spec (exit code 2), busy port, peers that never join.
        WorkerFailed: a worker failed; its message and exit code are that worker's, every other worker
            on this machine was stopped.
        KeyboardInterrupt: Ctrl-C; every worker was stopped.
        SystemExit: 128 + the signal (143 for SIGTERM) that stopped the launcher; every worker was stopped.
    """
    if torchrun_env():
        world = int(os.environ["WORLD_SIZE"])
        rank = int(os.environ["RANK"])
        local = int(os.environ.get("LOCAL_RANK", 0))
        if spec.use_cuda:
            torch.cuda.set_device(local)
        if world > 1:
            if rank == 0:
                log(f"launch: started by torchrun, world size {world} "
                    f"({'NCCL' if spec.use_cuda else 'gloo, CPU processes'}); --gpus/--world-size/--rank/"
                    "--dist-url are torchrun's here")
            url = f"tcp://{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{os.environ.get('MASTER_PORT', '29500')}"
            try:
                dist.init_process_group(backend_for(spec.use_cuda), init_method="env://",
                                        timeout=datetime.timedelta(seconds=spec.timeout))
            except Exception as exc:
                raise _join_error(exc, url, world, rank, spec.timeout) from None
        try:
            _run_here(fn, args)
        finally:
            _destroy()
        return
    check_spec(spec)
    if spec.use_cuda and spec.gpus > torch.cuda.device_count():
        raise LaunchError(f"--gpus {spec.gpus} but only {torch.cuda.device_count()} GPU(s) are visible "
                          f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): lower --gpus "
                          "or set device=cpu")
    if spec.total == 1:
        if spec.use_cuda:
            torch.cuda.set_device(0)
        _run_here(fn, args)
        return
    if spec.num_machines > 1 and not spec.dist_url:
        raise LaunchError("--world-size > 1 needs --dist-url HOST:PORT, machine 0's address, on every machine")
    url = normalise_url(spec.dist_url) if spec.dist_url else f"tcp://127.0.0.1:{free_port()}"
    if spec.machine_rank == 0 and spec.dist_url:
        check_port_free(url)
    if not spec.use_cuda:
        # c10d's C++ log repeats the rendezvous retries and time-outs with stack frames; the launcher reports
        # them as one line (LaunchError). TORCH_CPP_LOG_LEVEL=INFO brings the C++ log back.
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
    if spec.machine_rank != 0:
        check_machine_zero(url, spec.total, spec.global_rank(0), spec.timeout)
    log(describe(spec, url))
    _run_elastic(fn, spec, url, args, tuple(user_errors))


# ------------------------------------------------------------------------------------- from the command line
def check_global_batch(batch_size: int, spec: DistSpec) -> None:
    """Refuse a global batch that does not split evenly over the processes of ``spec`` (or torchrun's).

    Raises:
        LaunchError: with the batch, the process count and how it is made up, and valid choices
            (gnetmdk.config.overrides.check_batch_split's message).
    """
    from gnetmdk.config.base import ConfigError
    from gnetmdk.config.overrides import check_batch_split as check
    world = int(os.environ["WORLD_SIZE"]) if torchrun_env() else spec.total
    how = "torchrun" if torchrun_env() else f"{spec.num_machines} machine(s) x {spec.gpus} per machine"
    try:
        check(batch_size, world, 1, how)
    except ConfigError as exc:
        raise LaunchError(str(exc)) from None


def spec_from_args(args, cfg) -> DistSpec:
    """The DistSpec of a parsed command line (train.py has no --gpus/... options: world size 1) and a
    resolved config (device, dist_timeout, batch_size, checked here).

    Raises:
        LaunchError: the global batch does not split over the processes.
    """
    from gnetmdk.config.base import cuda_wanted
    use_cuda = cuda_wanted(cfg.device)
    timeout = getattr(args, "dist_timeout", None)
    spec = DistSpec(gpus=getattr(args, "gpus", 1), num_machines=getattr(args, "world_size", 1),
                    machine_rank=getattr(args, "rank", 0), dist_url=getattr(args, "dist_url", "") or "",
                    timeout=float(cfg.dist_timeout if timeout is None else timeout), use_cuda=use_cuda)
    spec.threads = threads_per_process(cfg.threads, spec.gpus, use_cuda)
    check_spec(spec)
    check_global_batch(cfg.batch_size, spec)
    return spec


def threads_per_process(threads: int, local_processes: int, use_cuda: bool) -> int:
    """The intra-op thread count each process of this machine sets: ``threads`` when given (> 0); with
    several CPU processes the machine's cores shared out (at least 1 each), so that they do not compete
    for the cores and every rank sums in an order a replay can reproduce (the replay takes the recorded
    count); 0 (torch's default) otherwise."""
    if threads > 0:
        return int(threads)
    if local_processes > 1 and not use_cuda:
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # pragma: no cover - not Linux
            cores = os.cpu_count() or 1
        return max(1, cores // local_processes)
    return 0


def check_spec(spec: DistSpec) -> None:
    """Refuse process counts, ranks and time-outs that cannot work, before anything starts.

    Raises:
        LaunchError: naming the option, its value and the valid range.
    """
    if spec.gpus < 1 or spec.num_machines < 1:
        raise LaunchError(f"--gpus ({spec.gpus}) and --world-size ({spec.num_machines}) must be at least 1 "
                          "(--gpus: processes on this machine; --world-size: the number of machines)")
    if not 0 <= spec.machine_rank < spec.num_machines:
        raise LaunchError(f"--rank {spec.machine_rank} must be in 0..{spec.num_machines - 1} (this machine's index, from 0; "
                          f"--world-size is the number of machines)")
    if not (spec.timeout > 0 and spec.timeout < float("inf")):
        raise LaunchError(f"--dist-timeout {spec.timeout:g} must be a positive, finite number of seconds (every wait for "
                          "the other processes ends after it; default 300)")
