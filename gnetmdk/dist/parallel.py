"""What a model needs to compute under data parallelism what it computes in one process.

  - conv biases that feed a BatchNorm are frozen (their gradient is round-off only; see
    :func:`freeze_biases_before_bn`), in every run;
  - gradient averaging is DistributedDataParallel's (:func:`wrap_ddp`, Trainer.wrap_model).
The conversion of a built model's layers (synchronised BatchNorm, in-place activated BatchNorm, the
recomputed stem), which calls :func:`freeze_biases_before_bn`, is gnetmdk.layers.prepare.prepare_model.

The deterministic mode of alignment runs is set with the other backend switches in
:func:`gnetmdk.engine.device.configure_backends`.
"""
from __future__ import annotations

import inspect

import torch


def freeze_biases_before_bn(model: torch.nn.Module) -> int:
    """Stop training the bias of every conv that feeds a BatchNorm; returns how many were frozen.

    BatchNorm subtracts the batch mean, so such a bias has no effect on the training loss: its
    gradient is zero in exact arithmetic and pure round-off in float32 (of the order of 1e-4 of the
    weight gradients for GNetDet at initialisation). Adam divides that noise by its own running size
    and turns it into steps of about the learning rate, a random walk that moves running_mean and
    makes two runs (1 and N processes, or a run and its replay) differ by ~lr per iteration. Frozen,
    the bias keeps its value; BN's beta carries the offset, and folding on entry to step 2 reads both.
    Models without ``layers`` of (conv, bn) are left alone.
    """
    n = 0
    for layer in getattr(model, "layers", []):
        conv, bn = getattr(layer, "conv", None), getattr(layer, "bn", None)
        if bn is not None and conv is not None and getattr(conv, "bias", None) is not None:
            if conv.bias.requires_grad:
                conv.bias.requires_grad_(False)
                n += 1
    return n


def wrap_ddp(model: torch.nn.Module, device: torch.device, ordered: bool = False):
    """DistributedDataParallel around ``model``, with buffers synchronised once at construction only.

    Every buffer (BatchNorm statistics through synchronised BN, ReLU caps) is equal on every rank, so
    DDP's broadcast of rank 0's buffers before each forward is skipped. Torch names that switch
    differently across the supported versions: ``forward_sync_buffers=False`` where it exists (2.13),
    ``broadcast_buffers=False`` before (2.11); both keep the one broadcast at construction.

    ``ordered`` (``--deterministic``): the gradients are averaged by :func:`ordered_mean_hook` (every
    rank's bucket gathered, summed in rank order, divided by the world size) instead of DDP's
    all-reduce, whose order of additions depends on the backend and the world size.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP
    ids = [device.index] if device.type == "cuda" else None
    params = inspect.signature(DDP.__init__).parameters
    kw = {"forward_sync_buffers": False} if "forward_sync_buffers" in params else {"broadcast_buffers": False}
    ddp = DDP(model, device_ids=ids, **kw)
    if ordered:
        ddp.register_comm_hook(None, ordered_mean_hook)
    return ddp


def ordered_mean_hook(state, bucket):
    """DDP communication hook: the mean over the processes of a gradient bucket, as one fixed
    computation: every process's bucket is all-gathered and the rows are folded in rank order, then
    divided by the world size (gnetmdk.dist.comm.fold_rows; DDP does not divide when a hook is
    registered). Elementwise it is what virtual ranks compute (gnetmdk.dist.virtual.combine_gradients),
    so a recording made with it replays bit for bit on fewer processes. Costs an all-gather (W times
    the bucket's memory) instead of an all-reduce; used in ``--deterministic`` runs only.

    Returns a completed ``torch.futures.Future[torch.Tensor]`` holding the bucket's mean (the return
    annotation is left out: DDP compares it with the class object, and this module's annotations are
    strings)."""
    from .comm import fold_rows, gather_process_rows, process_world
    buf = bucket.buffer()
    mean = fold_rows(gather_process_rows(buf.unsqueeze(0))).div_(process_world())
    fut = torch.futures.Future()
    fut.set_result(mean)
    return fut
