"""What a model needs to compute under data parallelism what it computes in one process.

Called by the trainer once the model is built:
  - BatchNorm -> synchronised BatchNorm (``cfg.sync_bn``; torch.nn.SyncBatchNorm on CUDA when world
    size > 1, our DistBatchNorm2d on CPU for every world size): statistics of the global batch.
  - conv biases that feed a BatchNorm are frozen (their gradient is round-off only; see
    :func:`freeze_biases_before_bn`), in every run.
Gradient averaging is DistributedDataParallel's (Trainer.wrap_model).

The deterministic mode of alignment runs is set with the other backend switches in
:func:`gnetmdk.engine.device.configure_backends`.
"""
from __future__ import annotations

import inspect
from typing import List

import torch

from .comm import get_world_size
from .syncbn import convert_sync_batchnorm, count_sync_batchnorm


def prepare_model(model: torch.nn.Module, cfg, device: torch.device) -> List[str]:
    """Make ``model`` compute under data parallelism what one process computes; returns log lines.

    BatchNorm (``cfg.sync_bn``): on CPU every run, a single process included, uses DistBatchNorm2d,
    so that 1 and N processes share one arithmetic (float64 statistics; torch's CPU BatchNorm
    accumulates channels-last statistics in float32 and would differ from N processes by ~1e-4);
    on CUDA, world size > 1 converts to torch.nn.SyncBatchNorm. (Calibration takes the global batch's
    percentiles itself: gnetmdk.engine.calibration.)

    In-place activated BatchNorm (``cfg.inplace_abn``): every BatchNorm followed by a ReLU / leaky
    ReLU becomes a :class:`gnetmdk.layers.inplace_abn.BatchNormAct2d` (synchronised when the
    BatchNorm was), converted after the synchronisation above.

    Recomputed stem (``cfg.recompute_stem``): the first conv -> BatchNorm -> activation (-> pool) block,
    which reads the image, is marked for :mod:`gnetmdk.layers.stem` (keeps its input only).

    ``cfg.bn_running_var == "biased"``: every BatchNorm becomes DistBatchNorm2d (on CUDA too) and its
    running variance takes the biased batch variance, as PaddlePaddle's BatchNorm (the training
    forward and backward do not change).

    ``cfg.deterministic`` or ``cfg.virtual_ranks`` > 1: DistBatchNorm2d on CUDA too, whose sums over ranks
    are folded in rank order (torch.nn.SyncBatchNorm's all-reduce is not), so that virtual ranks of one
    process compute what the processes compute.
    """
    notes: List[str] = []
    world = get_world_size() * max(1, int(getattr(cfg, "virtual_ranks", 1) or 1))
    has_bn = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())
    biased = getattr(cfg, "bn_running_var", "unbiased") == "biased"
    ordered = bool(getattr(cfg, "deterministic", False)) or world > get_world_size()
    if getattr(cfg, "sync_bn", True) and has_bn and (device.type != "cuda" or world > 1 or biased):
        # bn_running_var biased: DistBatchNorm2d on CUDA too (torch's kernels update with the unbiased one)
        cuda_kernel = device.type == "cuda" and not biased and not ordered
        convert_sync_batchnorm(model, use_cuda=cuda_kernel)
        kind = ("torch.nn.SyncBatchNorm" if cuda_kernel else
                "DistBatchNorm2d, the same arithmetic for any process count")
        notes.append(f"BatchNorm: {count_sync_batchnorm(model)} layers synchronised over {world} rank(s) ({kind})")
    if getattr(cfg, "inplace_abn", False):
        # after the synchronised conversion, which would replace the fused layers by plain BatchNorm
        from gnetmdk.layers.inplace_abn import convert_inplace_abn, count_inplace_abn
        convert_inplace_abn(model)
        n = count_inplace_abn(model)
        if n:
            notes.append(f"in-place activated BatchNorm: {n} BatchNorm + activation pairs fused "
                         "(the same function; less kept for the backward pass)")
    if getattr(cfg, "recompute_stem", False):
        from gnetmdk.layers.stem import convert_recompute_stem
        if convert_recompute_stem(model):
            notes.append("recomputed stem: 1 block (the first conv -> BatchNorm -> activation keeps only its "
                          "input; its conv runs again in the backward pass)")
    if biased:
        from gnetmdk.dist.syncbn import DistBatchNorm2d
        from gnetmdk.layers.inplace_abn import BatchNormAct2d
        for m in model.modules():
            if isinstance(m, (DistBatchNorm2d, BatchNormAct2d)):
                m.unbiased_running_var = False
        notes.append("BatchNorm running variance from the biased batch variance (bn_running_var biased, "
                     "as PaddlePaddle)")
    frozen = freeze_biases_before_bn(model)
    if frozen:
        notes.append(f"froze the bias of {frozen} convs followed by BatchNorm (zero gradient in exact arithmetic)")
    return notes


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
