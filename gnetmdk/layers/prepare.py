"""Preparing a built model's layers for a run: what it needs to compute under data parallelism what it
computes in one process, and the memory-saving layer conversions the config asks for.

Called by the trainer once the model is built (:func:`prepare_model`): BatchNorm -> synchronised
BatchNorm (``cfg.sync_bn``; torch.nn.SyncBatchNorm on CUDA when world size > 1, the project's
DistBatchNorm2d on CPU for every world size), then in-place activated BatchNorm
(gnetmdk.layers.inplace_abn) and the recomputed stem (gnetmdk.layers.stem), and the conv biases that
feed a BatchNorm frozen (gnetmdk.dist.parallel.freeze_biases_before_bn). Gradient averaging is
DistributedDataParallel's (gnetmdk.dist.parallel.wrap_ddp).
"""
from __future__ import annotations

from typing import List

import torch

from gnetmdk.dist.comm import get_world_size
from gnetmdk.dist.parallel import freeze_biases_before_bn
from gnetmdk.dist.syncbn import DistBatchNorm2d, convert_sync_batchnorm, count_sync_batchnorm
from gnetmdk.layers.inplace_abn import BatchNormAct2d, convert_inplace_abn, count_inplace_abn
from gnetmdk.layers.stem import convert_recompute_stem


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
        convert_inplace_abn(model)
        n = count_inplace_abn(model)
        if n:
            notes.append(f"in-place activated BatchNorm: {n} BatchNorm + activation pairs fused "
                         "(the same function; less kept for the backward pass)")
    if getattr(cfg, "recompute_stem", False):
        if convert_recompute_stem(model):
            notes.append("recomputed stem: 1 block (the first conv -> BatchNorm -> activation keeps only its "
                          "input; its conv runs again in the backward pass)")
    if biased:
        for m in model.modules():
            if isinstance(m, (DistBatchNorm2d, BatchNormAct2d)):
                m.unbiased_running_var = False
        notes.append("BatchNorm running variance from the biased batch variance (bn_running_var biased, "
                     "as PaddlePaddle)")
    frozen = freeze_biases_before_bn(model)
    if frozen:
        notes.append(f"froze the bias of {frozen} convs followed by BatchNorm (zero gradient in exact arithmetic)")
    return notes
