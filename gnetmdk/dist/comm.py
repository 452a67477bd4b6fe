"""Rank helpers and collectives that are no-ops in a single process (world size 1)."""
from __future__ import annotations

from typing import Any, Callable, Dict, List

import torch
import torch.distributed as dist


def is_dist() -> bool:
    """True inside an initialised process group of more than one process."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def get_rank() -> int:
    return dist.get_rank() if is_dist() else 0


def get_world_size() -> int:
    return dist.get_world_size() if is_dist() else 1


def is_main_process() -> bool:
    """Rank 0: the only process that writes files, logs and the console summary."""
    return get_rank() == 0


def barrier() -> None:
    if is_dist():
        dist.barrier()


def all_gather_object(obj: Any) -> List[Any]:
    """Every rank's ``obj``, in rank order (a one-element list in a single process)."""
    if not is_dist():
        return [obj]
    out: List[Any] = [None] * get_world_size()
    dist.all_gather_object(out, obj)
    return out


def all_reduce(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """In-place all-reduce of ``tensor`` with op "sum", "mean" or "max"; returns it."""
    if not is_dist():
        return tensor
    if op == "max":
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    else:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        if op == "mean":
            tensor /= get_world_size()
    return tensor


def reduce_mean_dict(values: Dict[str, float]) -> Dict[str, float]:
    """Mean over ranks of a dict of floats (same keys on every rank); the dict itself in one process.

    Used for logged losses: with equal per-rank batches, the mean of the ranks' batch-mean losses is
    the loss of the global batch (alignment.md), so what rank 0 logs is what one process would log.
    """
    if not is_dist():
        return dict(values)
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
    all_reduce(t, "mean")
    return dict(zip(keys, t.tolist()))


# ---------------------------------------------------------------------------------------------
# exact percentile of data spread over processes

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
    """The k-th smallest (1-based) of the values held by all processes together, exactly.

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


def _collective(op):
    def f(t: torch.Tensor) -> torch.Tensor:
        if is_dist():
            dist.all_reduce(t, op=op)
        return t
    return f


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
    n = _collective(dist.ReduceOp.SUM)(torch.full((1,), flat.numel(), dtype=torch.int64, device=flat.device))
    total = int(n[0])
    k = max(1, min(total, int(-(-percentile * total // 100))))
    value = kth_smallest(flat, k, _collective(dist.ReduceOp.SUM), _collective(dist.ReduceOp.MIN),
                         _collective(dist.ReduceOp.MAX))
    if value <= 0:
        m = flat.max().reshape(1) if flat.numel() else torch.full((1,), float("-inf"), device=flat.device)
        value = _collective(dist.ReduceOp.MAX)(m)[0].cpu()
    return value.to(x.device)
