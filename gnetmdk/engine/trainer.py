"""The one trainer behind train.py and train-dist.py (a single process is world size 1).

A run of one stage: load the stage's starting checkpoint, run the stage's entry edits, evaluate it (so
the cost of each quantization step is visible), train for ``num_epochs`` (or, for cal, measure the
caps), keep best.pth (by val mAP) and last.pth, and make them the stage's outputs in
checkpoint/step<N> when the run finishes. The trainer owns the loop (data, forward, loss, backward,
optimizer step, one read-back per iteration); what happens beside it is one hook per concern
(gnetmdk.engine.hooks: EMA, evaluation, checkpoints, tensorboard, the log line; record and replay in
gnetmdk.engine.align_hook, on gnetmdk.align.record's format), and calibration is gnetmdk.engine.calibration. The model is known only through
its family (gnetmdk.models).
"""
from __future__ import annotations

import contextlib
import itertools
import math
import os
import random
import time
from typing import Dict, List, Optional

import numpy as np
import torch
from torch.profiler import record_function
from torch.utils.data import DataLoader

from gnetmdk.checkpoint.io import CheckpointError, load_checkpoint, load_matching
from gnetmdk.checkpoint.lock import OutputLock
from gnetmdk.checkpoint.outputs import StageOutputs, check_writable, file_sha256, manifest_source
from gnetmdk.dataset.dataset import build_dataset, collate, seed_worker
from gnetmdk.dist.comm import (all_reduce, barrier, get_rank, get_world_size, is_dist, is_main_process,
                               rows_over_ranks)
from gnetmdk.dist.virtual import combine_gradients, replica, set_virtual_ranks, split_batch
from .align_hook import AlignmentHook
from .calibration import run_calibration
from .distill import Distillation
from .freezing import Finetune, freeze_leading
from .learned_caps import LearnedCaps
from .events import EventStorage
from .hooks import CheckpointHook, CurvesHook, EarlyStopHook, EMAHook, EvalHook, LoggerHook, TensorboardHook
from gnetmdk.dist.parallel import wrap_ddp
from gnetmdk.layers.prepare import prepare_model
from .device import configure_backends, resolve_device
from gnetmdk.dist.sampler import EpochBatches, GlobalBatchSampler, ShardSampler, check_batch_split
from gnetmdk.evaluation.evaluator import eval_batch, evaluate_model
from gnetmdk.models import get_family, model_from_config
from gnetmdk.models.rebuild import build_model_from_checkpoint, check_compatible
from gnetmdk.utils.environment import describe as describe_environment, run_environment
from .resume import restore_run, rng_state
from .schedule import build_optimizer, build_scheduler, stage_epochs
from .runtime import Precision, estimate_checkpoint_bytes, free_bytes, keep_freed_memory, optimizer_slots
from .stages import Stage, apply_stage, get_stage, source_path


#: the named spans of one training iteration (torch.profiler.record_function), in the order they run:
#: the batch's copy to the device, forward + loss, backward, the optimizer step (gradient clipping, the
#: scheduler), the hooks' after_step (the EMA), the read-back and logging of the iteration before
SPANS = {k: "gnetmdk." + k for k in ("to_device", "forward", "backward", "optimizer", "hooks", "read_back")}

class TrainingError(RuntimeError):
    """A run that cannot go on (non-finite loss, ...); the message names the iteration and the last good checkpoint."""


def set_seed(seed: int) -> None:
    """Seed python's, numpy's (``seed mod 2^32``) and torch's random generators."""
    random.seed(seed)
    np.random.seed(seed % 2 ** 32)
    torch.manual_seed(seed)


class Trainer:
    """Run one stage of the pipeline for a resolved config.

    Args:
        cfg: resolved config (gnetmdk.config.build_config).
        device: torch device (default from cfg.device).
        log: print function of rank 0 (others stay silent).
    """

    def __init__(self, cfg, device: Optional[torch.device] = None):
        self.cfg = cfg
        self.stage: Stage = get_stage(cfg)
        self.family = get_family(cfg.model_name)   # what the trainer knows of the model (gnetmdk.models)
        self.rank = get_rank()
        self.world_size = get_world_size()
        self.main = is_main_process()
        self.device = device or resolve_device(cfg)
        # record / replay / max_iters (gnetmdk.align); a replay takes its recording's ranks per process
        # (virtual_ranks) and threads per rank
        self.align = AlignmentHook(cfg, self.world_size)
        self.cfg = cfg = self.align.cfg                    # a replay's settings (AlignmentHook), read from here on
        if cfg.threads > 0:
            torch.set_num_threads(cfg.threads)
        self.threads = torch.get_num_threads()
        #: V virtual ranks in this process (None for one): ranks = processes x V (gnetmdk.dist.virtual)
        self.virtual = set_virtual_ranks(cfg.virtual_ranks)
        self.ranks = self.world_size * cfg.virtual_ranks
        self.parallel_notes = [f"{self.threads} intra-op thread(s) per rank"]
        if self.virtual is not None:
            self.parallel_notes.append(
                f"virtual ranks: {self.virtual.size} per process, run in turns by threads ({self.ranks} ranks in "
                f"all): each rank's chunk through forward and backward as a process of its own, every sum over "
                "ranks in rank order")
        if self.device.type == "cpu" and cfg.cpu_keep_memory:
            self.parallel_notes.append(keep_freed_memory())
        self.out_dir = cfg.checkpoint_dir(self.stage.output_step)
        self.outputs = StageOutputs(self.out_dir, self.stage.name, self.main)   # run/ until the run finishes
        self.summary: Dict[str, object] = {"stage": self.stage.name}
        self.distill: Optional[Distillation] = None         # distill > 0 in steps 2-4 (gnetmdk.engine.distill)
        self.parallel_notes += configure_backends(cfg, self.device)  # before the datasets: may turn augmentation off
        #: what the run computes with (gnetmdk.utils.environment): logged, and saved in every checkpoint
        self.environment = run_environment(self.device.type, self.threads)
        self.parallel_notes.append(f"environment: {describe_environment(self.environment)}")
        # set by the setup steps (build_data, build_model, setup_optimizer) and the loop; every attribute
        # the trainer has exists from here on
        self.train_set = self.val_set = self.train_loader = self.val_loader = self.train_sampler = None
        self.local_batch = self.micro_batch = 0             # build_data: images per rank, per micro-batch
        self.model = self.ddp_model = None                  # build_model / setup_optimizer
        self.resume_state: Optional[Dict[str, object]] = None
        self.source_stage = None
        self.optimizer = self.scheduler = self.precision = None
        self.iters_per_epoch = 0
        self._chain = None                      # the loader's iteration over the epochs (_epoch_batches)
        self._chain_next: Optional[tuple] = None
        self.learned_caps = LearnedCaps([])                 # caps trained in step 3 (cap_lr > 0; learned_caps.py)
        self.finetune = Finetune(self.family, cfg.section())  # finetune N (gnetmdk.engine.freezing)
        self._epoch_mode: Optional[str] = None  # the family's epoch_mode line last logged
        self.frozen_at: List[torch.nn.Parameter] = []
        self.t_start: Optional[float] = None
        self.start_epoch = self.start_batch = 0
        self.iteration = 0
        self.batch_in_epoch = 0
        self._epoch_t0: Optional[float] = None
        self._bar = None
        self._sums: Dict[str, object] = {}
        self._count = 0
        #: the stage's scalars (loss terms, learning rate, evaluations), read by the tensorboard hook
        self.storage = EventStorage()
        self.tensorboard = TensorboardHook()
        self.ema_hook = EMAHook() if cfg.ema else None
        # in call order: the EMA is updated before anything reads it; the evaluation writes best.pth
        # before last.pth; the log line comes last
        #: evaluation and best.pth; owns the best mAP, its epoch and the latest mAP (gnetmdk.engine.hooks)
        self.evaluation = EvalHook()
        self.hooks = []
        for hook in (self.ema_hook, self.align, self.evaluation, EarlyStopHook(), CurvesHook(), CheckpointHook(),
                     self.tensorboard, LoggerHook()):
            if hook is not None:
                self.register(hook)

    def register(self, hook) -> None:
        """Add a hook (gnetmdk.engine.hooks.HookBase) after those already registered."""
        hook.trainer = self
        self.hooks.append(hook)

    # ------------------------------------------------------------------ logging
    def log(self, msg: str) -> None:
        """Print ``msg`` to stdout on the main process (process 0) only."""
        if self.main:
            print(msg, flush=True)

    @property
    def writer(self):
        """The tensorboard writer (None until the first scalar, and after the run)."""
        return self.tensorboard.writer

    @property
    def ema(self):
        """The EMA of the weights (gnetmdk.engine.ema.ModelEMA) when ``ema`` is on, else None."""
        return self.ema_hook.ema if self.ema_hook is not None else None

    # ------------------------------------------------------------------ data
    def build_data(self) -> None:
        """Build the training and validation sets and loaders: the training loader draws this process's
        part of each global batch (GlobalBatchSampler: micro-batches of ``batch_size / world size / accumulate``;
        no shuffling, no augmentation and no accumulation for calibration), the validation loader its shard of the
        images (ShardSampler).

        Raises:
            ConfigError: ``batch_size`` does not split over the ranks and micro-batches.
        """
        cfg = self.cfg
        accumulate = 1 if self.stage.calibration else cfg.accumulate
        check_batch_split(cfg.batch_size, self.ranks, accumulate)
        self.local_batch = cfg.batch_size // self.world_size      # this process's share (all its ranks)
        self.micro_batch = self.local_batch // accumulate
        self.train_set = build_dataset(cfg, "train")
        self.val_set = build_dataset(cfg, "valid")
        if cfg.eval_stitch:     # refused before training, not at the first evaluation
            from gnetmdk.dataset.tiling import load_manifest
            from gnetmdk.evaluation.stitch import whole_image_truths
            whole_image_truths(load_manifest(cfg.dataset_dir), cfg.VOC_CLASSES)
        g = torch.Generator().manual_seed(cfg.seed + 1000 * self.rank)
        shuffle = not self.stage.calibration
        self.train_sampler = GlobalBatchSampler(len(self.train_set), cfg.batch_size, self.rank, self.world_size,
                                                shuffle=shuffle, seed=cfg.seed, accumulate=accumulate,
                                                virtual=cfg.virtual_ranks)
        if self.stage.calibration:
            self.train_set.augment = False
        # workers persist over the epochs (no start-up per epoch: the epoch travels with each index,
        # EpochBatches) and, on CUDA, fill pinned memory so the copies to the device do not block
        workers = dict(num_workers=cfg.num_workers, collate_fn=collate, worker_init_fn=seed_worker,
                       pin_memory=self.device.type == "cuda", persistent_workers=cfg.num_workers > 0)
        if cfg.num_workers > 0:
            workers["prefetch_factor"] = 4
        self.train_loader = DataLoader(self.train_set, batch_sampler=EpochBatches(self.train_sampler),
                                       generator=g, **workers)
        # evaluation: forwards of eval_batch_size images on every rank, the last one padded
        # (evaluator.predict_loader), so an image's outputs do not depend on the process count. Its own
        # generator: a DataLoader without one draws its base seed from torch's global generator each time
        # it is iterated, so every evaluation would move the stream that training's random layers draw
        # from (PP-YOLO's DropBlock) and the weights would depend on eval_interval
        self.val_loader = DataLoader(self.val_set, batch_size=self.eval_batch,
                                     sampler=ShardSampler(len(self.val_set), self.rank, self.world_size),
                                     generator=torch.Generator().manual_seed(cfg.seed), **workers)

    # ------------------------------------------------------------------ model
    def build_model(self) -> None:
        """Load the stage's starting checkpoint (or resume), run entry hooks, set layer switches."""
        cfg, stage = self.cfg, self.stage
        self.resume_state = None
        self.source_stage = None
        set_seed(cfg.seed)
        last = self.outputs.resume_path()
        if cfg.resume:
            if stage.calibration:
                raise CheckpointError("--resume does not apply to calibration (one pass): run --cal again")
            ckpt = load_checkpoint(last, f"nothing to resume: no {last}; start the stage without --resume")
            if ckpt.get("stage") != stage.name:
                raise CheckpointError(f"'{last}' is a {ckpt.get('stage')} checkpoint, not {stage.name}")
            check_compatible(ckpt, cfg, last)
            self.model = build_model_from_checkpoint(ckpt, cfg, last, weights="model")
            self.resume_state = ckpt
            self.source_stage = stage.name
            self.outputs.source = ckpt.get("source")          # the interrupted run's own start
            self.log(f"[{stage.name}] resuming from {last} (epoch {ckpt['epoch']}, iteration {ckpt['iteration']})")
        else:
            path = source_path(cfg, stage)
            if path and os.path.exists(path):      # a folder is refused by load_checkpoint, by name
                ckpt = load_checkpoint(path)
                if not cfg.load:
                    self.check_provenance(path)
                self.outputs.source = {"path": path, "sha256": file_sha256(path)}
                self.source_stage = ckpt.get("stage")
                if stage.partial_source and not cfg.load:
                    # a pretrained step0 model: take what fits (another class count keeps its backbone)
                    self.model = model_from_config(cfg)
                    res = load_matching(self.model, ckpt["model"])
                    self.log(f"[{stage.name}] pretrained {path}: loaded {len(res['loaded'])} tensors, "
                             f"skipped {len(res['skipped'])}")
                else:
                    check_compatible(ckpt, cfg, path)
                    if int(ckpt.get("step", 0)) > stage.step:
                        raise CheckpointError(
                            f"checkpoint '{path}' is a {self.source_stage} checkpoint (step {ckpt.get('step')}), "
                            f"later than {stage.name} (step {stage.step}): its BatchNorm is folded / caps are "
                            f"set; start {stage.name} from a step-{stage.step - 1 or 1} checkpoint")
                    self.model = build_model_from_checkpoint(ckpt, cfg, path)
                    self.log(f"[{stage.name}] starting from {path} ({self.source_stage})")
            elif stage.source_required:
                raise CheckpointError(f"{stage.name} starts from '{path}', which does not exist: {stage.fresh_hint}")
            else:
                self.model = model_from_config(cfg)
                self.log(f"[{stage.name}] starting from a fresh {cfg.model_name} "
                         f"({sum(p.numel() for p in self.model.parameters())} parameters)")
            for msg in self.family.enter_stage(self.model, stage, self.source_stage, cfg):
                self.log(f"[{stage.name}] {msg}")
        self.model.to(self.device)
        if cfg.channels_last:
            self.model.to(memory_format=torch.channels_last)
        self.parallel_notes += self.family.configure(self.model, cfg)
        apply_stage(self.model, stage)
        self.model.train()
        self.distill = Distillation.from_config(cfg, stage, self.family, self.device)
        if self.distill is not None:
            self.log(f"[{stage.name}] {self.distill.describe()}")
        self.setup_parallel()

    def check_provenance(self, path: str) -> None:
        """Refuse to start from a stage's default input when that input was made from a checkpoint that
        has been replaced since (cal.pth after step 2 was trained again, step 3's best.pth after a new
        calibration): its set's manifest records the checkpoint it started from, with its SHA-256.

        Raises:
            CheckpointError: naming both files and the fixes (run the earlier stage again, or ``load
                PATH`` to start from the input anyway).
        """
        src = manifest_source(path)
        if src is None or not os.path.isfile(src["path"]):
            return
        if file_sha256(src["path"]) != src["sha256"]:
            made = src.get("stage", "")
            again = ("train.py --cal" if made == "cal" else f"train.py --step {made[4:]}" if made.startswith("step")
                     else "the stage that wrote it")
            raise CheckpointError(
                f"'{path}' was made from an earlier '{src['path']}', which has been replaced since (its SHA-256 "
                f"differs from the one recorded in {path}'s manifest): run {again} again, or set 'load {path}' to "
                "start from it anyway")

    def setup_parallel(self) -> None:
        """World size > 1: synchronised BatchNorm and global-batch calibration percentiles
        (gnetmdk.dist.parallel); logs what was done, and the deterministic / replay notes."""
        notes = self.parallel_notes + self.align.notes + prepare_model(self.model, self.cfg, self.device)
        for note in notes:
            self.log(f"[{self.stage.name}] {note}")

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, tag: str) -> Dict[str, object]:
        """Evaluate the evaluation weights (:attr:`eval_model`) on the validation set: evaluate_model's dict
        (VOC mAP@0.5, per-class AP, mean loss terms, ...) plus ``seconds``, the time it took. ``tag`` names the
        evaluation (``entry``, ``cal``, ``epoch<N>``) and is not used in the computation. With ``eval_stitch``
        "map" and "ap" are those of the whole val images of the tiled dataset (gnetmdk.evaluation.stitch:
        every tile run, the detections merged across the seams), the tiles' own in "tile_map" and
        "tile_ap", the counts in "whole_images" and "num_tiles"."""
        cfg = self.cfg
        t0 = time.time()
        res = evaluate_model(self.eval_model, self.val_loader, self.val_set, self.device, cfg.conf_thresh,
                             cfg.nms_thresh, cfg.max_detections, coco=cfg.eval_coco,
                             keep_detections=cfg.tb_images > 0, pad_to=self.eval_batch)
        if cfg.eval_stitch:
            # the whole val images' mAP replaces the tiles' (which stays beside it as tile_map / tile_ap); the
            # loss terms and the drawn detections stay the tiles'
            from gnetmdk.evaluation.stitch import evaluate_stitched
            whole = evaluate_stitched(self.eval_model, cfg, self.device, self.eval_batch, rank=self.rank,
                                      world_size=self.world_size)
            res.update(tile_map=res["map"], tile_ap=res["ap"], map=whole["map"], ap=whole["ap"],
                       whole_images=whole["num_images"], num_tiles=whole["num_tiles"])
        res["seconds"] = time.time() - t0
        return res

    @property
    def eval_model(self):
        """The weights evaluated (and so chosen for best.pth): the EMA when ``ema`` is on."""
        ema = self.ema
        return ema.module if ema is not None else self.model

    @property
    def eval_batch(self) -> int:
        """Images per evaluation forward on every rank: ``eval_batch_size``, or ``batch_size`` when 0."""
        return eval_batch(self.cfg)

    # ------------------------------------------------------------------ checkpoints
    def state(self, epoch: int, iteration: int, full: bool) -> Dict[str, object]:
        """The checkpoint dict at ``epoch`` / ``iteration``: stage, model meta, weights (on CPU), caps, config,
        best mAP and timing, and what the hooks add (EMA, curves); ``full`` adds what a resume needs (optimizer,
        scheduler, RNG and GradScaler states, the sampler's position and a mid-epoch's loss sums)."""
        m = self.model
        st = {"stage": self.stage.name, "step": self.stage.step, "model_meta": m.meta(),
              "model": {k: v.detach().cpu() for k, v in m.state_dict().items()},
              "caps": self.caps(),
              "config": self.cfg.to_dict(),
              "epoch": epoch, "iteration": iteration,
              "elapsed": time.time() - self.t_start if self.t_start is not None else None,
              "entry_map": self.summary.get("entry_map"),
              "world_size": self.ranks, "source": self.outputs.source, "environment": dict(self.environment)}
        if getattr(m, "calibrated_caps", None):
            st["calibrated_caps"] = [float(c) for c in m.calibrated_caps]   # step 4: caps before gain editing
        st["eval_weights"] = "ema" if self.ema is not None else "model"
        for hook in self.hooks:                     # the EMA beside the raw weights, never in their place
            st.update(hook.state_dict())
        if full:
            st["optimizer"] = self.optimizer.state_dict()
            st["scheduler"] = self.scheduler.state_dict()
            st["rng"] = rng_state()
            st["scaler"] = self.precision.state_dict()
            ipe = self.iters_per_epoch or 1
            st["sampler"] = {"epoch": epoch, "start_batch": iteration - epoch * ipe}
            st["accumulate"] = self.cfg.accumulate
            if 0 < iteration - epoch * ipe < ipe and self._epoch_t0 is not None:
                # mid-epoch: the epoch's loss sums so far, so that a resumed epoch's line averages all of it
                st["epoch_sums"] = {"sums": {k: float(v) for k, v in self._sums.items()}, "count": int(self._count),
                                    "seconds": time.time() - self._epoch_t0}
        return st

    def caps(self) -> List[float]:
        """The activation caps of the evaluated model (the EMA's where there is one), one per ReLU in
        order; empty for a model without caps (PP-YOLO)."""
        if not hasattr(self.model, "relus"):
            return []
        return [float(r.cap.detach()) for r in self.eval_model.relus()]

    def save(self, name: str, epoch: int, iteration: int, full: bool = False) -> Optional[str]:
        """Write checkpoint ``name`` of this run (into checkpoint/step<N>/run/, published when the run
        finishes; gnetmdk.checkpoint.outputs), with the resolved config beside it.

        Raises:
            TrainingError: non-finite weights (the file is not written).
            CheckpointError: the disk is full or the folder not writable.
        """
        if not self.main:
            return None
        state = self.state(epoch, iteration, full)
        bad = [k for k, v in state["model"].items() if v.is_floating_point() and not torch.isfinite(v).all()]
        if bad:   # a diverged model (e.g. BatchNorm statistics overflowed) never replaces a good checkpoint
            raise TrainingError(
                f"non-finite values in {', '.join(bad[:3])}{' ...' if len(bad) > 3 else ''} after "
                f"iteration {iteration}; {name} not written; {self.last_good_checkpoint()}: lower learning_rate "
                "or check the data")
        return self.outputs.save(name, state, iteration, config=self.cfg.to_dict())

    def check_output_dir(self) -> None:
        """Fail before any work if an output folder (checkpoints, tensorboard log, model files) cannot
        be written; nothing is written then."""
        if not self.main:
            return
        check_writable(self.out_dir, "checkpoints", "checkpoint_root")
        check_writable(self.cfg.log_dir, "the tensorboard log", "log_root")
        check_writable(self.cfg.model_root, "model files (relu_cap.txt)", "model_root")

    def check_disk_space(self) -> None:
        """Fail before training if the checkpoints this run writes would not fit on the disk."""
        if not self.main:
            return
        cfg = self.cfg
        need = estimate_checkpoint_bytes(self.model, optimizer_slots(cfg.optimizer), cfg.ema)
        reserve = int(cfg.disk_reserve_mb * 2 ** 20)
        free = free_bytes(self.out_dir)
        if free < need + reserve:
            raise CheckpointError(
                f"not enough free disk for checkpoints in '{self.out_dir}': {free / 2 ** 20:.1f} MiB free, the "
                f"checkpoints need about {need / 2 ** 20:.1f} MiB + disk_reserve_mb {cfg.disk_reserve_mb:g}: "
                "free disk space or set checkpoint_root to another disk")

    # ------------------------------------------------------------------ calibration
    def caps_file(self) -> str:
        """model/relu_cap.txt: one cap per conv (the chip files' caps)."""
        return os.path.join(self.cfg.model_root, "relu_cap.txt")

    @staticmethod
    def caps_text(caps: List[float]) -> str:
        """The text of relu_cap.txt: one cap a line, 8 significant digits."""
        return "".join(f"{c:.8g}\n" for c in caps)

    # ------------------------------------------------------------------ loop
    def _progress(self, iterable, desc: str, total: Optional[int] = None):
        """A tqdm bar over ``iterable`` on rank 0 with ``progress`` on, and only when stderr is a
        terminal (``disable=None``): output sent to a file keeps the epoch lines without the bar's
        carriage-return frames."""
        if self.main and self.cfg.progress:
            from tqdm import tqdm
            return tqdm(iterable, desc=desc, leave=False, dynamic_ncols=True, disable=None, total=total)
        return iterable

    def _epoch_batches(self, epoch: int):
        """The loader batches of ``epoch`` (the sampler set to it), and how many there are.

        With loader workers, every epoch's batches come from one iteration of the loader over the
        epochs left (EpochBatches.chain_to): the workers prepare the next epoch's first batches while
        this epoch ends and while the model is evaluated, where a new iteration per epoch would wait
        for them (a whole batch's loading, at every epoch). The batches are the same ones: each
        carries its epoch and the sampler's order depends only on (seed, epoch). A new iteration is
        started at the first epoch, after a resume, and after an epoch left early.
        """
        loader = self.align.replay if self.align.replay is not None else self.train_loader
        n = len(loader)
        chained = (isinstance(loader, DataLoader) and loader.num_workers > 0
                   and isinstance(loader.batch_sampler, EpochBatches))
        if not chained:
            return loader, n
        if self._chain is None or self._chain_next != (epoch, self.batch_in_epoch):
            loader.batch_sampler.chain_to = max(self.cfg.num_epochs, epoch + 1)
            self._chain = iter(loader)          # the iteration has read chain_to
            loader.batch_sampler.chain_to = None
        self._chain_next = None                 # set again when this epoch's batches are all taken
        return itertools.islice(self._chain, n), n

    def train_one_epoch(self, epoch: int) -> Dict[str, float]:
        """Train one epoch (or what is left of it after a resume); returns the epoch's mean loss terms,
        ``seconds`` and ``images_per_s``, over the whole epoch also when it was resumed from a mid-epoch
        checkpoint (whose ``epoch_sums`` carry the iterations before the interruption).

        Nothing in an iteration waits for the device: loss terms, the gradient norm and each
        micro-batch's total loss stay on the device in one packed tensor, read back once, one
        iteration later (:meth:`_finish_step`), while the next iteration's work is already queued;
        the checks of that read (a non-finite loss or gradient stops the run) therefore come one
        iteration late, before anything is written. Alignment runs (record, replay, max_iters) read
        every iteration back as it ends.
        """
        cfg, model = self.cfg, self.model
        model.train()
        mode = self.family.epoch_mode(model, self.stage, epoch, cfg)
        if mode and mode != self._epoch_mode:
            self.log(f"[{self.stage.name}] epoch {epoch + 1}: {mode}")
        self._epoch_mode = mode
        self.apply_finetune(epoch)
        self.batch_in_epoch = self.start_batch if epoch == self.start_epoch else 0
        self.train_sampler.set_epoch(epoch, self.batch_in_epoch)
        self.train_set.set_epoch(epoch)
        batches, n_batches = self._epoch_batches(epoch)
        self._sums: Dict[str, float] = {}
        self._count = 0
        t0 = time.time()
        part = (self.resume_state or {}).get("epoch_sums") if epoch == self.start_epoch else None
        if part and self.batch_in_epoch > 0:
            # resumed mid-epoch: the iterations before the interruption count in this epoch's means and
            # images/s (the checkpoint's sums; the pause between the runs is not counted)
            self._sums = {k: float(v) for k, v in part["sums"].items()}
            self._count = int(part["count"])
            t0 -= float(part["seconds"])
        self._epoch_t0 = t0
        accumulate = cfg.accumulate
        micro = 0
        n_ranks = self.virtual.size if self.virtual is not None else 1     # ranks of this process
        acc: List[Dict[str, torch.Tensor]] = [{} for _ in range(n_ranks)]
        micro_totals: List[torch.Tensor] = []
        reps = None                                  # virtual ranks: the replicas of this optimizer step
        pending = None
        lag = not self.align.active
        self.optimizer.zero_grad(set_to_none=True)
        self._bar = bar = self._progress(batches, f"{self.stage.name} {epoch + 1}/{cfg.num_epochs}", n_batches)
        taken = 0
        # the named spans (record_function, a no-op unless a profiler runs) are what
        # benchmarks/profile_trainer.py splits an iteration's host time into
        for images, targets, indices, _ in bar:
            taken += 1
            with record_function(SPANS["to_device"]):
                images = images.to(self.device, non_blocking=True).float()   # the loader sends uint8 codes
                targets = targets.to(self.device, non_blocking=True)
            micro += 1
            last_micro = micro == accumulate
            if self.virtual is not None:
                if reps is None:
                    reps = [replica(model) for _ in range(n_ranks)]
                rank_terms = self._virtual_micro_batch(reps, images, targets, accumulate)
            else:
                # DDP: gradients are all-reduced on the last micro-batch of the step only
                sync = contextlib.nullcontext() if last_micro or not hasattr(self.ddp_model, "no_sync") \
                    else self.ddp_model.no_sync()
                with sync:
                    with record_function(SPANS["forward"]):
                        terms = self._forward_loss(self.ddp_model, model, images, targets)
                        loss = terms["total"]
                    with record_function(SPANS["backward"]):
                        self.precision.backward(loss / accumulate if accumulate > 1 else loss)
                rank_terms = [terms]
            for v, terms in enumerate(rank_terms):
                micro_totals.append(terms["total"].detach().float())
                for k, t in terms.items():
                    t = t.detach().float()
                    a = acc[v]
                    a[k] = a[k] + t / accumulate if k in a else (t / accumulate if accumulate > 1 else t)
            if not last_micro:
                continue
            micro = 0
            rows, acc = acc, [{} for _ in range(n_ranks)]
            with record_function(SPANS["optimizer"]):
                if reps is not None:                    # virtual ranks: the mean of every rank's gradients
                    combine_gradients(model, reps)
                    reps = None
                else:                                   # DDP averages parameters' gradients; caps are buffers
                    self.learned_caps.average_gradients()
                norm = self.precision.step(self.optimizer, list(model.parameters()) + self.learned_caps.caps,
                                           cfg.grad_clip)
                self.learned_caps.clamp_()
                self.optimizer.zero_grad(set_to_none=True)
                lr_step = self.optimizer.param_groups[0]["lr"]        # the rate of this step (recorded)
                self.scheduler.step()
            with record_function(SPANS["hooks"]):
                for hook in self.hooks:             # the EMA's update
                    hook.after_step()
            self.iteration += 1
            self.batch_in_epoch += 1
            keys = sorted(rows[0])
            step = {"epoch": epoch, "iteration": self.iteration, "keys": keys, "rank_terms": rows,
                    "packed": torch.stack([r[k] for r in rows for k in keys] + [norm.float()] + micro_totals),
                    "batch": (images, targets, indices), "lr": self.optimizer.param_groups[0]["lr"],
                    "lr_step": lr_step}
            micro_totals = []
            with record_function(SPANS["read_back"]):
                if pending is not None:
                    self._finish_step(pending)
                pending = step
                if not lag:
                    self._finish_step(pending)
                    pending = None
            if (cfg.checkpoint_interval and self.iteration % cfg.checkpoint_interval == 0
                    and self.batch_in_epoch < self.iters_per_epoch):
                if pending is not None:
                    self._finish_step(pending)
                    pending = None
                self.save("last.pth", epoch, self.iteration, full=True)   # mid-epoch: resumable here
            if self.should_stop():
                break
        if pending is not None:
            self._finish_step(pending)
        if taken == n_batches:                  # the chained iteration goes on with the next epoch
            self._chain_next = (epoch + 1, 0)
        sums, count = self._sums, self._count
        mean = {k: v / max(count, 1) for k, v in sums.items()}
        if is_dist():
            t = torch.tensor([mean.get(k, 0.0) for k in sorted(mean)], dtype=torch.float64)
            all_reduce(t, "mean")
            mean = dict(zip(sorted(mean), t.tolist()))
        mean["seconds"] = time.time() - t0
        mean["images_per_s"] = count * cfg.batch_size / max(mean["seconds"], 1e-9)
        return mean

    def _forward_loss(self, net, model, images: torch.Tensor, targets: torch.Tensor) -> Dict[str, torch.Tensor]:
        """One rank's forward pass and loss terms (with the distillation term when a teacher is set):
        ``net`` computes (the DDP wrapper, the model or a virtual rank's replica), ``model`` gives the
        loss. Returns {term: 0-d tensor}, "total" among them."""
        with self.precision.autocast():
            pred = net(images)
            terms = model.loss(pred, targets)
            if self.distill is not None:
                self.distill.add_term(images, pred, terms)
        return terms

    def _virtual_micro_batch(self, reps, images: torch.Tensor, targets: torch.Tensor,
                             accumulate: int) -> List[Dict[str, torch.Tensor]]:
        """This process's micro-batch as its virtual ranks compute it: chunk v (rank order) through
        replica v's forward and loss in virtual rank v's thread (gnetmdk.dist.virtual), then one backward
        pass over every rank's loss (each replica gets its own gradients; synchronised BatchNorm is one
        node over all ranks). Returns each rank's loss terms, in rank order."""
        v_all = len(reps)
        img, tgt = split_batch(images, v_all), split_batch(targets, v_all)
        rank_terms = self.virtual.run([(lambda v=v: self._forward_loss(reps[v], reps[v], img[v], tgt[v]))
                                       for v in range(v_all)])
        losses = [t["total"] / accumulate if accumulate > 1 else t["total"] for t in rank_terms]
        self.precision.backward_all(losses)
        return rank_terms

    def _finish_step(self, step: Dict[str, object]) -> None:
        """Read one iteration's packed values back (the one wait for the device per iteration), stop the
        run on a non-finite loss or gradient, and log: mean over ranks, tensorboard, progress bar, the
        alignment hook, the epoch sums.

        Raises:
            TrainingError: a non-finite loss (naming the micro-batch with gradient accumulation) or
                gradient norm, with the iteration and the last good checkpoint. The weights of that
                iteration are never written (:meth:`save` also refuses non-finite weights).
        """
        keys, n, rows = step["keys"], len(step["keys"]), len(step["rank_terms"])
        vals = step["packed"].tolist()
        local = [dict(zip(keys, vals[r * n:(r + 1) * n])) for r in range(rows)]
        norm, micro = vals[rows * n], vals[rows * n + 1:]
        epoch, iteration, accumulate = step["epoch"], step["iteration"], self.cfg.accumulate
        for m, total in enumerate(micro):          # per micro-batch, each rank of this process in turn
            if not math.isfinite(total):
                where = [f"micro-batch {m // rows + 1}/{accumulate}"] if accumulate > 1 else []
                where += [f"virtual rank {m % rows}"] if rows > 1 else []
                detail = f" ({', '.join(where)})" if where else ""
                raise TrainingError(
                    f"non-finite loss ({total}) at epoch {epoch + 1}, iteration {iteration}{detail}; "
                    f"{self.last_good_checkpoint()}: lower learning_rate or check the data")
        if not math.isfinite(norm) and self.precision.scaler is None:
            raise TrainingError(
                f"non-finite gradient (norm {norm}) at epoch {epoch + 1}, iteration {iteration}; the run "
                f"stops before these weights are written; {self.last_good_checkpoint()}: lower learning_rate "
                "or check the data")
        # every rank's terms (one small all-gather) and their mean, folded in rank order
        rank_values, values = rows_over_ranks(local)
        for k, v in values.items():
            self._sums[k] = self._sums.get(k, 0.0) + v
        self._count += 1
        it = {"epoch": epoch, "iteration": iteration, "values": values, "rank_values": rank_values,
              "rank_terms": step["rank_terms"], "batch": step["batch"], "lr": step["lr"], "lr_step": step["lr_step"]}
        name = self.stage.name
        for k, v in values.items():
            self.storage.put_scalar(f"{name}/loss_{k}", v, iteration)
        self.storage.put_scalar(f"{name}/lr", step["lr"], iteration)
        for hook in self.hooks:                     # record / replay, tensorboard
            hook.after_iteration(it)
        if self.main and hasattr(self._bar, "set_postfix"):
            self._bar.set_postfix(loss=f"{values['total']:.4f}", lr=f"{step['lr']:.2e}")

    def should_stop(self) -> bool:
        """A hook asks to stop early (max_iters reached, the replayed recording ended)."""
        return any(hook.should_stop() for hook in self.hooks)

    def resolve_epochs(self) -> None:
        """Apply ``min_steps``: where ``num_epochs`` epochs hold fewer optimizer steps, the stage trains
        the epochs that hold them (gnetmdk.engine.schedule.stage_epochs), and the resolved config (saved
        with the checkpoints, compared on a resume) says so. Calibration trains nothing."""
        cfg = self.cfg
        if self.stage.calibration or not cfg.min_steps:
            return
        ipe = len(self.train_set) // cfg.batch_size
        epochs = stage_epochs(cfg.num_epochs, cfg.min_steps, ipe)
        if epochs != cfg.num_epochs:
            self.log(f"[{self.stage.name}] min_steps {cfg.min_steps}: {epochs} epochs of {ipe} steps instead of "
                     f"num_epochs {cfg.num_epochs}")
            cfg.num_epochs = epochs

    def setup_optimizer(self) -> None:
        """Build the optimizer, the learning-rate schedule and the mixed-precision state; freeze the first
        ``freeze_at`` sublayers for the whole run, make the caps trainable in step 3 with ``cap_lr > 0``, and wrap
        the model for data parallelism.

        Raises:
            ConfigError: ``freeze_at`` (or ``freeze_convs`` with ``finetune``) exceeds the model's sublayer count.
        """
        cfg = self.cfg
        sec = cfg.section()
        self.frozen_at = freeze_leading(self.model, self.family, sec)
        if self.frozen_at:
            self.log(f"[{self.stage.name}] freeze_at {sec.freeze_at}: {len(self.frozen_at)} parameters of the first "
                     f"{sec.freeze_at} sublayers frozen (not optimized)")
        self.finetune = Finetune(self.family, sec)
        # step 3 with cap_lr > 0: the calibrated caps train too (LSQ-like gradients through the gains)
        self.learned_caps = LearnedCaps.for_stage(self.model, self.stage, sec)
        if self.learned_caps:
            self.log(f"[{self.stage.name}] {self.learned_caps.describe()}")
        self.optimizer = build_optimizer(self.model, cfg, self.learned_caps.caps, self.learned_caps.lr)
        self.iters_per_epoch = len(self.train_set) // cfg.batch_size
        self.scheduler = build_scheduler(self.optimizer, cfg, self.iters_per_epoch)
        self.precision = Precision(cfg, self.device)
        for note in self.precision.notes:
            self.log(f"[{self.stage.name}] {note}")
        if cfg.accumulate > 1:
            self.log(f"[{self.stage.name}] gradient accumulation: {cfg.accumulate} micro-batches of "
                     f"{self.micro_batch} per process and optimizer step")
        self.ddp_model = self.wrap_model(self.model)

    def apply_finetune(self, epoch: int) -> None:
        """``finetune N`` (gnetmdk.engine.freezing.Finetune): freeze or unfreeze the leading sublayers for
        ``epoch``, and wrap the model for DDP again when what is trainable changed."""
        msg, changed = self.finetune.apply(self.model, epoch)
        if msg:
            self.log(f"[{self.stage.name}] {msg}")
        if changed and is_dist():
            self.ddp_model = self.wrap_model(self.model)   # DDP registers the trainable parameters at wrap time

    def last_good_checkpoint(self) -> str:
        """The checkpoint to go back to after a failure now (this run's run/last.pth, or none)."""
        return self.outputs.last_good()

    def wrap_model(self, model):
        """Data-parallel wrapper: DistributedDataParallel when there are several processes (with the
        ordered gradient mean in ``--deterministic`` runs), none with virtual ranks (their gradients are
        combined by gnetmdk.dist.virtual.combine_gradients) or in one process."""
        if not is_dist() or self.virtual is not None:
            return model
        return wrap_ddp(model, self.device, ordered=bool(self.cfg.deterministic))

    def run(self) -> Dict[str, object]:
        """Run the stage; returns a summary (entry_map, best_map, final_map, caps, timings, paths).

        ``best_epoch`` / ``best_seconds``: the epoch whose evaluation set best_map (0: the entry model)
        and the seconds from the stage's start until that best.pth was written, so the time a run took
        to reach its accuracy can be read apart from the time its schedule took. Stage seconds (these,
        ``seconds`` and the minutes on each epoch line) run on across a ``--resume``: the checkpoint
        carries the seconds spent before it (``elapsed``), and the time between the interruption and
        the resume is not counted. None for a checkpoint written before these keys existed.
        """
        self.check_output_dir()
        lock = None
        if self.main:
            # one writer per output folder for the run's life (a second run is refused, naming this one)
            lock = OutputLock(self.out_dir, f"the {self.stage.name} outputs", "set checkpoint_root to another folder")
            note = lock.acquire()
            if note:
                self.log(f"[{self.stage.name}] note: {note}")
        try:
            return self._run()
        finally:
            if lock is not None:
                lock.release()
            self.align.release()

    def _run(self) -> Dict[str, object]:
        cfg, stage = self.cfg, self.stage
        t_start = self.t_start = time.time()
        note = self.outputs.repair()          # a set an interrupted run was publishing: complete it first
        if note:
            self.log(f"[{stage.name}] note: {note}")
        self.build_data()
        self.resolve_epochs()
        self.build_model()
        self.evaluation.__init__()           # no best yet: -1.0, nothing evaluated
        self.iteration = 0
        self.start_epoch = 0
        self.start_batch = 0
        self.check_disk_space()
        self.log(f"[{stage.name}] {len(self.train_set)} train / {len(self.val_set)} val images, "
                 f"batch {cfg.batch_size} ({self.ranks} x {cfg.batch_size // self.ranks}"
                 f"{f': {self.virtual.size} virtual ranks in each of {self.world_size} process(es)' if self.virtual else ''}), "
                 f"device {self.device}, model {cfg.model_name} {self.family.describe(cfg)}")
        if stage.calibration:
            return run_calibration(self, t_start)
        stale = self.outputs.interrupted() if not cfg.resume and self.main else None
        if stale is not None:
            self.log(f"[{stage.name}] note: {self.outputs.run_dir} holds an interrupted run (iteration {stale}); this "
                     "run starts over and replaces it (--resume would continue it instead)")
        self.outputs.start()
        self.setup_optimizer()
        if self.resume_state is not None:
            t_start = restore_run(self, self.resume_state, t_start)
        for hook in self.hooks:          # the EMA, the recording / replay, the entry evaluation
            hook.before_train()
        if cfg.num_epochs == 0 and self.resume_state is None:
            self.log(f"[{stage.name}] num_epochs 0: nothing to train; the entry model becomes this stage's "
                     f"best.pth and last.pth in {self.out_dir} (the set it replaces moves to "
                     f"{self.outputs.previous_dir})")
            if not cfg.eval_before:
                self.evaluation.save_best(0, 0)
            self.save("last.pth", 0, 0, full=True)
        for epoch in range(self.start_epoch, cfg.num_epochs):
            result = {"train": self.train_one_epoch(epoch)}
            if self.should_stop():      # max_iters reached or the replayed recording ended
                self.align.finish(epoch)
                break
            for hook in self.hooks:     # evaluation and best.pth, last.pth, tensorboard, the epoch line
                hook.after_epoch(epoch, result)
            if result.get("stop"):      # early stopping (patience)
                break
        barrier()
        for hook in self.hooks:         # tensorboard closed; the run's files become the stage's outputs
            hook.after_train()
        # a run stopped early without an evaluation (max_iters, a replay's end) writes last.pth alone
        ev = self.evaluation
        wrote_best = ev.best_epoch is not None or not self.align.stopped
        # a run stopped before its first evaluation (max_iters, a replay's end): the summary says n/a, not -1
        best_map = ev.evaluated_best() if self.align.stopped else ev.best_map
        self.summary.update(best_map=best_map, final_map=ev.last_map, seconds=time.time() - t_start,
                            num_epochs=cfg.num_epochs,
                            best_path=os.path.join(self.out_dir, "best.pth") if wrote_best else None,
                            last_path=os.path.join(self.out_dir, "last.pth"), best_epoch=ev.best_epoch,
                            best_seconds=ev.best_seconds)
        when = "" if ev.best_epoch is None else f" (epoch {ev.best_epoch}, {ev.best_seconds:.0f}s)"
        where = (self.summary["best_path"] if wrote_best else
                 f"{self.summary['last_path']} (stopped after iteration {self.iteration}; no best.pth)")
        self.log(f"[{stage.name}] done in {self.summary['seconds']:.0f}s: entry mAP "
                 f"{_fmt(self.summary.get('entry_map'))}, best mAP {_fmt(best_map)}{when} -> {where}")
        if stage.step == 1 and not stage.calibration and not self.align.stopped:
            self.log_plateau()
        return self.summary

    def log_plateau(self) -> Optional[float]:
        """After a float stage that ran all its epochs: log how far its val mAP moved over the last
        quarter of them (gnetmdk.engine.control.plateau_span, the check tools/run_pipeline.py prints)
        and whether the float model finished training. A model still climbing hands the quantized
        stages training they are then credited with (docs/pipeline.md, "The float control").

        Returns:
            the span (mAP as a fraction), or None where nothing was logged: a run that stopped before
            its last epoch (early stopping), or fewer than two evaluations in the window (then a line
            says so).
        """
        from .control import PLATEAU_SPAN, plateau_span
        maps = self.summary.get("val_maps") or []
        epochs = int(self.cfg.num_epochs)
        if not maps or int(maps[-1][0]) < epochs:
            return None
        name = self.stage.name
        got = plateau_span(maps, epochs)
        if got is None:
            self.log(f"[{name}] plateau: fewer than two evaluations in the last quarter of the epochs; set "
                     f"eval_interval / eval_from so that it holds some, to see whether the float model finished "
                     f"training")
            return None
        span, first, n = got
        verdict = ("at its plateau" if span < PLATEAU_SPAN else
                   "still moving: the float model had not finished training (more num_epochs; the float "
                   "control, tools/run_pipeline.py --control, measures quantization against it trained on)")
        self.log(f"[{name}] plateau: val mAP moved {100 * span:.1f} points over the last quarter (epochs "
                 f"{first}-{epochs}, {n} evaluations): {verdict}")
        return span


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.4f}"
