"""Ranks and collectives: processes (torch.distributed) and virtual ranks (threads of one process).

A run has W = P x V ranks: P processes (torch.distributed; P = 1 without a process group) and V virtual
ranks in each (:class:`VirtualRanks`, V = 1 unless asked for). Global rank ``p V + v``. Rank r of a
W-rank run computes exactly what process r of a W-process run computes: its own chunk of the global
batch through forward and backward, and every reduction across ranks is a function of the table of
all ranks' contributions in rank order (docs/alignment.md, "Exact, not close"):

    gather_rows(local)   (V, ...) rows of this process's ranks -> (W, ...) rows of all ranks, rank order
    fold_rows(rows)      the left fold rows[0] + rows[1] + ... + rows[W-1], elementwise
    ordered_sum / ordered_mean    fold_rows(gather_rows(...)) (and / W)

So the same numbers are added in the same order whether the ranks are processes, threads or both, on
any machine; with two ranks the fold is the plain (commutative) sum. MAX and MIN are exact in any
order. Inside a virtual rank's thread, :func:`get_rank`, :func:`get_world_size`, :func:`is_dist`,
:func:`all_reduce`, :func:`all_gather_object` and :func:`barrier` act on the W ranks; in the process's
own thread they act on the P processes (files, logging and evaluation are per process).

In a single process without virtual ranks every collective is a no-op.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

_TLS = threading.local()


# ---------------------------------------------------------------------------------------------
# processes

def process_world() -> int:
    """Processes in the process group (1 without one)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def process_rank() -> int:
    """This process's rank in the process group (0 without one)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _vctx():
    """(VirtualRanks, v) inside a virtual rank's thread, else None."""
    return getattr(_TLS, "ctx", None)


def is_dist() -> bool:
    """True when this rank has peers: inside a virtual rank of a world of more than one rank, or (in the
    process's own thread) in a process group of more than one process."""
    ctx = _vctx()
    if ctx is not None:
        return ctx[0].world > 1
    return process_world() > 1


def get_rank() -> int:
    """This rank: ``p V + v`` inside virtual rank v of process p, else the process's rank."""
    ctx = _vctx()
    if ctx is not None:
        return ctx[0].global_rank(ctx[1])
    return process_rank()


def get_world_size() -> int:
    """W = P x V inside a virtual rank's thread, else P."""
    ctx = _vctx()
    if ctx is not None:
        return ctx[0].world
    return process_world()


def is_main_process() -> bool:
    """Process 0: the only process that writes files, logs and the console summary."""
    return process_rank() == 0


def barrier() -> None:
    """Wait until every rank reaches this point: inside virtual ranks, a collective of the process's
    ranks (whose last arrival waits for the other processes); else ``dist.barrier`` when there are
    several processes (a no-op in one process)."""
    ctx = _vctx()
    if ctx is not None:
        ctx[0].exchange(ctx[1], None, lambda items: (_process_barrier(), None)[1])
        return
    _process_barrier()


def _process_barrier() -> None:
    if process_world() > 1:
        dist.barrier()


# ---------------------------------------------------------------------------------------------
# ordered reductions

def gather_process_rows(local: torch.Tensor) -> torch.Tensor:
    """(k, ...) rows of this process -> (P k, ...) rows of every process in process order (all-gather;
    every process must pass the same shape). In one process: ``local`` itself."""
    p = process_world()
    if p == 1:
        return local
    local = local.contiguous()
    out = local.new_empty((p * local.shape[0],) + tuple(local.shape[1:]))
    parts = list(out.chunk(p))
    dist.all_gather(parts, local)
    return out


def fold_rows(rows: torch.Tensor) -> torch.Tensor:
    """The left fold ``((rows[0] + rows[1]) + rows[2]) + ...`` of a (W, ...) tensor, elementwise, in
    ``rows``' dtype: one fixed order of additions for any W and any machine (each addition is
    correctly rounded per element, so vector width and thread count do not change the result)."""
    acc = rows[0].clone()
    for i in range(1, rows.shape[0]):
        acc.add_(rows[i])
    return acc


def ordered_sum(local: torch.Tensor) -> torch.Tensor:
    """Sum over every rank of the run, in rank order (:func:`fold_rows` of :func:`gather_rows`).

    Args:
        local: (...) this rank's tensor; inside a virtual rank's thread a collective of the W ranks.
    Returns:
        (...) tensor of local's dtype and device, the same on every rank.
    """
    return fold_rows(gather_rows(local.unsqueeze(0)))


def ordered_mean(local: torch.Tensor) -> torch.Tensor:
    """:func:`ordered_sum` divided by the number of ranks (one correctly rounded division)."""
    total = ordered_sum(local)
    return total.div_(get_world_size()) if get_world_size() > 1 else total


def gather_rows(local: torch.Tensor) -> torch.Tensor:
    """(k, ...) rows of this rank -> (W k, ...) rows of all ranks in rank order. Inside a virtual rank's
    thread the V ranks of the process exchange their rows, then the processes all-gather; in the
    process's own thread only the processes do."""
    ctx = _vctx()
    if ctx is None:
        return gather_process_rows(local)
    vr, v = ctx
    rows = vr.exchange(v, local, lambda items: gather_process_rows(torch.cat(items)))
    return rows


def all_reduce(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """In-place all-reduce of ``tensor`` over the ranks with op "sum", "mean" (both folded in rank
    order: :func:`ordered_sum`) or "max" / "min" (exact in any order); returns it."""
    if not is_dist():
        return tensor
    if op in ("max", "min"):
        rows = gather_rows(tensor.unsqueeze(0))
        red = rows.amax(0) if op == "max" else rows.amin(0)
    elif op in ("sum", "mean"):
        red = ordered_sum(tensor)
        if op == "mean":
            red = red.div_(get_world_size())
    else:
        raise ValueError(f"all_reduce op must be sum, mean, max or min, not {op!r}")
    tensor.copy_(red)
    return tensor


def all_gather_object(obj: Any) -> List[Any]:
    """Every rank's ``obj``, in rank order (a one-element list in a single process)."""
    ctx = _vctx()
    if ctx is not None:
        vr, v = ctx
        return vr.exchange(v, obj, _gather_objects)
    return _gather_objects([obj])


def _gather_objects(items: List[Any]) -> List[Any]:
    if process_world() == 1:
        return list(items)
    out: List[Any] = [None] * process_world()
    dist.all_gather_object(out, list(items))
    return [o for part in out for o in part]


def reduce_mean_dict(values: Dict[str, float]) -> Dict[str, float]:
    """Mean over ranks of a dict of floats (same keys on every rank), folded in rank order in float64.

    Used for logged losses: with equal per-rank batches, the mean of the ranks' batch-mean losses is
    the loss of the global batch (docs/alignment.md), so what process 0 logs is what one process
    would log. See :func:`mean_over_ranks` for the rows of several virtual ranks at once.
    """
    keys = sorted(values)
    return mean_over_ranks([{k: values[k] for k in keys}])


def mean_over_ranks(rows: Sequence[Dict[str, float]]) -> Dict[str, float]:
    """Mean over every rank of the run of per-rank dicts of floats (:func:`rows_over_ranks`)."""
    return rows_over_ranks(rows)[1]


def rows_over_ranks(rows: Sequence[Dict[str, float]]):
    """Every rank's dict of floats and their mean, in float64: ``rows`` are this process's ranks (one,
    or its V virtual ranks, in rank order, the same keys everywhere); the processes gather their rows
    (one all-gather) and every process folds the W rows in rank order, then divides by W.

    Returns:
        (all_rows, mean): the W dicts in rank order, and their mean (a dict of the same keys).
    """
    keys = sorted(rows[0])
    t = torch.tensor([[float(r[k]) for k in keys] for r in rows], dtype=torch.float64)
    table = gather_process_rows(t)
    all_rows = [dict(zip(keys, row)) for row in table.tolist()]
    if table.shape[0] == 1:
        return all_rows, dict(all_rows[0])
    mean = fold_rows(table).div_(table.shape[0])
    return all_rows, dict(zip(keys, mean.tolist()))


# ---------------------------------------------------------------------------------------------
# virtual ranks

class VirtualRankError(RuntimeError):
    """The virtual ranks of a step did not call the same collectives (a bug, not a user error)."""


class _Aborted(BaseException):
    """Raised in a virtual rank's thread when another rank failed (the first failure is re-raised)."""


class VirtualRanks:
    """V ranks of one process, each run by its own thread, taking turns (docs/alignment.md).

    :meth:`run` starts one thread per rank. Exactly one of them runs at any time: rank 0 first, until
    it reaches a collective (:meth:`exchange`) or ends; then rank 1; ...; the last rank to reach a
    collective computes it from everyone's contribution (with the other processes, when there are
    several) and rank 0 goes on. So the order of every operation is fixed, each rank computes with
    the process's intra-op thread count as a process of its own would (none competes for the cores),
    and collectives are the same calls as across processes. Every rank must call the same
    collectives in the same order, as processes must.

    Args:
        size: V, the virtual ranks of this process (>= 1).
    """

    def __init__(self, size: int):
        if int(size) < 1:
            raise ValueError(f"virtual ranks must be >= 1, not {size}")
        self.size = int(size)
        self._cond = threading.Condition()
        self._turn = 0
        self._slots: List[Any] = [None] * self.size
        self._waiting = [False] * self.size
        self._done = [False] * self.size
        self._result: Any = None
        self._gen = 0
        self._error: Optional[BaseException] = None

    @property
    def world(self) -> int:
        """W = processes x V."""
        return process_world() * self.size

    def global_rank(self, v: int) -> int:
        """The global rank of virtual rank ``v`` of this process: ``p V + v``."""
        return process_rank() * self.size + v

    # -------------------------------------------------------------- running the ranks
    def run(self, fns: Sequence[Callable[[], Any]]) -> List[Any]:
        """Run ``fns[v]`` as virtual rank v (one thread each, in turns); returns their results in rank
        order. Torch's grad mode and (on CUDA) current device are those of the caller.

        Raises:
            the first exception a rank raised (in rank order of failure), after every thread ended.
        """
        if len(fns) != self.size:
            raise ValueError(f"{len(fns)} functions for {self.size} virtual ranks")
        if _vctx() is not None:
            raise VirtualRankError("virtual ranks cannot be nested")
        self._turn, self._gen, self._error = 0, 0, None
        self._slots = [None] * self.size
        self._waiting = [False] * self.size
        self._done = [False] * self.size
        results: List[Any] = [None] * self.size
        grad = torch.is_grad_enabled()
        cuda_dev = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

        def body(v: int) -> None:
            _TLS.ctx = (self, v)
            try:
                self._wait_turn(v)
                torch.set_grad_enabled(grad)
                if cuda_dev is not None:
                    torch.cuda.set_device(cuda_dev)
                results[v] = fns[v]()
            except _Aborted:
                pass
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                with self._cond:
                    if self._error is None:
                        self._error = exc
                    self._cond.notify_all()
            finally:
                _TLS.ctx = None
                with self._cond:
                    self._done[v] = True
                    if self._turn == v:
                        self._pass_turn(v)
                    if self._turn == -1 and any(self._waiting) and self._error is None:
                        waiting = [r for r in range(self.size) if self._waiting[r]]
                        self._error = VirtualRankError(
                            f"virtual rank(s) {waiting} wait in a collective that the other ranks ended "
                            "without reaching: the ranks ran different code")
                    self._cond.notify_all()

        threads = [threading.Thread(target=body, args=(v,), name=f"virtual-rank-{v}", daemon=True)
                   for v in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if self._error is not None:
            raise self._error
        return results

    def _wait_turn(self, v: int) -> None:
        with self._cond:
            while self._turn != v and self._error is None:
                self._cond.wait()
            if self._error is not None:
                raise _Aborted()

    def _pass_turn(self, v: int) -> None:
        """Hand the turn to the next rank that has not ended (caller holds the lock)."""
        nxt = v + 1
        while nxt < self.size and self._done[nxt]:
            nxt += 1
        self._turn = nxt if nxt < self.size else -1

    def exchange(self, v: int, value: Any, combine: Callable[[List[Any]], Any]) -> Any:
        """A collective of the V ranks: rank v contributes ``value``; the last rank computes
        ``combine([value of rank 0, ..., value of rank V-1])`` (which may call the processes'
        collectives) and every rank gets the result.

        Raises:
            VirtualRankError: a rank ended without reaching this collective.
        """
        with self._cond:
            if self._error is not None:
                raise _Aborted()
            self._slots[v] = value
            gen = self._gen
            if v < self.size - 1:
                self._waiting[v] = True
                self._pass_turn(v)
                self._cond.notify_all()
                while (self._gen == gen or self._turn != v) and self._error is None:
                    self._cond.wait()
                self._waiting[v] = False
                if self._error is not None:
                    raise _Aborted()
                return self._result
            if not all(self._waiting[:v]):
                gone = [r for r in range(v) if not self._waiting[r]]
                raise VirtualRankError(f"virtual rank(s) {gone} ended before a collective that rank {v} reached: "
                                       "the ranks ran different code")
        # the last rank computes outside the lock (it may wait for the other processes)
        result = combine(list(self._slots))
        with self._cond:
            self._result = result
            self._slots = [None] * self.size
            self._gen += 1
            self._turn = 0
            self._cond.notify_all()
            while self._turn != v and self._error is None:
                self._cond.wait()
            if self._error is not None:
                raise _Aborted()
            return result


def current_virtual_ranks() -> Optional[VirtualRanks]:
    """The VirtualRanks whose thread this is, or None."""
    ctx = _vctx()
    return ctx[0] if ctx is not None else None


def virtual_rank() -> Optional[int]:
    """This thread's virtual rank v (0..V-1), or None outside virtual ranks."""
    ctx = _vctx()
    return ctx[1] if ctx is not None else None


# ---------------------------------------------------------------------------------------------
# exact percentile of data spread over ranks

_SIGN_FLIP = 0x7FFFFFFF


def _ordered_keys(x: torch.Tensor) -> torch.Tensor:
    """float32 values -> int64 keys with the same order (IEEE-754 bit trick; -0.0 sorts just below 0.0)."""
    bits = x.detach().float().reshape(-1).contiguous().view(torch.int32).to(torch.int64)
    return torch.where(bits < 0, bits ^ _SIGN_FLIP, bits)


def _key_to_float(key: int) -> torch.Tensor:
    bits = key ^ _SIGN_FLIP if key < 0 else key
    return torch.tensor([bits], dtype=torch.int64).to(torch.int32).view(torch.float32)[0]


def kth_smallest(x: torch.Tensor, k: int, reduce_sum: Callable[[torch.Tensor], torch.Tensor],
                 reduce_min: Callable[[torch.Tensor], torch.Tensor],
                 reduce_max: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The k-th smallest (1-based) of the values held by all ranks together, exactly.

    Bisection on the order-preserving integer keys of float32: each round counts, on every rank,
    the local values <= the candidate key and sums the counts (``reduce_sum``); at most 33 rounds of
    one int64 all-reduce, no gathering of the data, and the result is a value present in the data,
    bit-identical to ``torch.cat(all values).kthvalue(k)`` in one process.

    Args:
        x: this rank's values (any shape, any device; read as float32). May be empty on some ranks.
        k: 1 <= k <= total number of values.
        reduce_sum / reduce_min / reduce_max: in-place all-reduce of a 1-element int64 tensor on
            x's device (identity functions in one process).
    Returns:
        0-d float32 tensor on the CPU.
    """
    keys = _ordered_keys(x)
    dev = keys.device
    big = 2 ** 40
    lo_t = keys.min().reshape(1) if keys.numel() else torch.full((1,), big, dtype=torch.int64, device=dev)
    hi_t = keys.max().reshape(1) if keys.numel() else torch.full((1,), -big, dtype=torch.int64, device=dev)
    lo, hi = int(reduce_min(lo_t)[0]), int(reduce_max(hi_t)[0])
    # invariant: count(keys <= hi) >= k, and the answer lies in [lo, hi]
    while lo < hi:
        mid = (lo + hi) // 2
        cnt = (keys <= mid).sum().reshape(1)
        if int(reduce_sum(cnt)[0]) >= k:
            hi = mid
        else:
            lo = mid + 1
    return _key_to_float(lo)


def _collective(op: str):
    return lambda t: all_reduce(t, op)


def global_percentile(x: torch.Tensor, percentile: float) -> torch.Tensor:
    """The ``percentile``-th percentile (nearest rank) of the values of x over ALL ranks: exactly what
    ``gnetmdk.layers.observers.batch_percentile`` returns in one process for the global batch (same rank formula, same
    fallback to the largest value when the percentile is not positive). A collective: every rank calls
    it with its share of the batch. The percentile observers' function under data parallelism.

    Args:
        x: this rank's pre-ReLU values, any shape, float.
        percentile: in (0, 100].
    Returns:
        0-d float32 tensor on x's device.
    """
    flat = x.detach().float().reshape(-1)
    n = _collective("sum")(torch.full((1,), flat.numel(), dtype=torch.int64, device=flat.device))
    total = int(n[0])
    k = max(1, min(total, int(-(-percentile * total // 100))))
    value = kth_smallest(flat, k, _collective("sum"), _collective("min"), _collective("max"))
    if value <= 0:
        m = flat.max().reshape(1) if flat.numel() else torch.full((1,), float("-inf"), device=flat.device)
        value = _collective("max")(m)[0].cpu()
    return value.to(x.device)

