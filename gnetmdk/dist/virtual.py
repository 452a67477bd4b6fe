"""Virtual ranks: one process computes, bit for bit, what several processes compute (docs/alignment.md).

A process with V virtual ranks (config ``virtual_ranks V``; a replay of a recording of V x P processes on
P processes sets it) splits its share of the global batch into V chunks in rank order and gives each
chunk to a virtual rank, which runs it through forward and loss as a process of its own would: its
own replica of the model (:func:`replica`), in its own thread, taking turns with the others
(gnetmdk.dist.comm.VirtualRanks), with the process's intra-op thread count. Synchronised BatchNorm
combines the ranks in rank order (gnetmdk.dist.syncbn); one backward pass over every rank's loss
gives each replica its own gradients; :func:`combine_gradients` gathers them from every rank of every
process and folds them in rank order, then divides by W, which is what the ordered DDP communication
hook (gnetmdk.dist.parallel) does across processes. With the same thread count per rank the weights,
optimizer state, EMA, caps, BatchNorm buffers and every loss term are those of the W-process run.
"""
from __future__ import annotations

import copy
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.nn as nn

from .comm import VirtualRanks, fold_rows, gather_process_rows, process_world

_RANKS: Optional[VirtualRanks] = None


def set_virtual_ranks(size: int) -> Optional[VirtualRanks]:
    """Give this process ``size`` virtual ranks (1: none); returns them (None for 1). Process-wide:
    the trainer sets it once per run, and calibration (:func:`forward_batch`) reads it."""
    global _RANKS
    _RANKS = VirtualRanks(size) if int(size) > 1 else None
    return _RANKS


def virtual_ranks() -> Optional[VirtualRanks]:
    """This process's virtual ranks (set by :func:`set_virtual_ranks`), or None."""
    return _RANKS


def split_batch(t: torch.Tensor, parts: int) -> List[torch.Tensor]:
    """``parts`` equal chunks of a batch along dim 0, in rank order, each a tensor of its own (contiguous
    and freshly allocated, as a process receives its batch).

    Raises:
        ValueError: ``parts`` is below 1, or the batch does not split evenly.
    """
    if parts < 1:
        raise ValueError(f"a batch splits over 1 or more virtual ranks, not {parts}")
    if t.shape[0] % parts:
        raise ValueError(f"a batch of {t.shape[0]} does not split over {parts} virtual ranks")
    return [c.clone(memory_format=torch.contiguous_format) for c in t.chunk(parts)]


def forward_batch(model: Callable, images: torch.Tensor) -> torch.Tensor:
    """``model(images)`` as the process's virtual ranks compute it: each rank runs its chunk (in turns,
    so collectives inside the model, such as calibration observers taking the global batch's
    percentile, see every rank), and the outputs are concatenated in rank order. Without virtual ranks
    it is ``model(images)``.

    Args:
        model: a callable of (n, ...) tensors returning an (n, ...) tensor, or a list / tuple / dict of
            them (concatenated per entry).
        images: (B, ...) this process's batch; B divisible by V.
    """
    ranks = _RANKS
    if ranks is None:
        return model(images)
    chunks = split_batch(images, ranks.size)
    outs = ranks.run([(lambda c=c: model(c)) for c in chunks])
    return _cat_outputs(outs)


def _cat_outputs(outs: List):
    """The ranks' outputs concatenated along dim 0: tensors, or lists / tuples / dicts of them (a
    multi-level detector's outputs), in the structure of one rank's output."""
    first = outs[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(outs)
    if isinstance(first, (list, tuple)):
        return type(first)(_cat_outputs([o[i] for o in outs]) for i in range(len(first)))
    if isinstance(first, dict):
        return {k: _cat_outputs([o[k] for o in outs]) for k in first}
    raise TypeError(f"cannot concatenate the virtual ranks' outputs of type {type(first).__name__}")


def replica(model: nn.Module) -> nn.Module:
    """A copy of ``model`` for one virtual rank.

    Every parameter is a new leaf ``nn.Parameter`` on the model's own storage (no copy of the values;
    its own ``.grad``); every buffer is the model's own tensor (BatchNorm running statistics are updated
    once per process, by the joint BatchNorm), except buffers that train (learned caps), which become
    leaves on the model's storage like parameters. Module attributes (switches, caches) are deep
    copies, so references between layers (a conv's gain tensors) point into the replica.
    """
    memo: Dict[int, object] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(p.detach(), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = b.detach().requires_grad_(True) if b.requires_grad else b
    return copy.deepcopy(model, memo)


def trainable_tensors(model: nn.Module) -> List[torch.Tensor]:
    """The tensors whose gradients are averaged over ranks: parameters, then buffers that train (learned
    caps), in registration order (a replica lists its own in the same order)."""
    return list(model.parameters()) + [b for b in model.buffers() if b.requires_grad]


def combine_gradients(model: nn.Module, replicas: Sequence[nn.Module]) -> None:
    """Set each of ``model``'s parameter gradients (and learned caps') to the mean over every rank of the
    run of the replicas' gradients: gathered from every process (one all-gather of all gradients as one
    flat row per rank), folded in rank order, divided by W (gnetmdk.dist.comm.fold_rows), elementwise
    what the ordered DDP communication hook computes over processes. A tensor no rank computed a
    gradient for keeps ``grad`` None. Each result has the layout of the replicas' gradients."""
    own = trainable_tensors(model)
    reps = [trainable_tensors(r) for r in replicas]
    todo = [i for i, t in enumerate(own) if any(rt[i].grad is not None for rt in reps)]
    if not todo:
        return
    world = process_world() * len(replicas)

    def grad_of(rt, i):
        g = rt[i].grad
        return g if g is not None else torch.zeros_like(own[i])

    if process_world() == 1:
        for i in todo:
            rows = [grad_of(rt, i) for rt in reps]
            acc = rows[0].clone()
            for g in rows[1:]:
                acc.add_(g)
            own[i].grad = acc.div_(world)
        return
    flat = torch.stack([torch.cat([grad_of(rt, i).reshape(-1) for i in todo]) for rt in reps])   # (V, n)
    mean = fold_rows(gather_process_rows(flat)).div_(world)
    offset = 0
    for i in todo:
        like = grad_of(reps[0], i)
        g = torch.empty_like(like)
        g.copy_(mean[offset:offset + like.numel()].view(like.shape))
        own[i].grad = g
        offset += like.numel()
