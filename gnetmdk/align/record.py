"""Record and replay of training iterations (docs/alignment.md, "1. A run against its replay").

Record (``save_npz DIR`` / ``--save-npz DIR``): before the first iteration rank 0 writes the
starting weights ``DIR/start.pth`` (a gnetmdk checkpoint) and ``DIR/meta.json``; after every
iteration the ranks' batches are gathered to rank 0, which writes one file per iteration and rank,
``DIR/iter_<iteration:06d>_rank<r>.npz``, holding:

    images   (b, 3, S, S) uint8 when every value is an integer in 0..255 (the chip codes always are),
             else float32; ``images_float`` says which
    targets  (b, G, G, 10 + C) float32      indices (b,) int64 dataset indices
    loss_<term>  float64 scalars: this rank's batch-mean loss terms (total, loc, conf, ...)
    epoch, iteration, rank, world_size   int64 scalars
    lr           float64: the learning rate of this iteration's optimizer step

``meta.json`` also holds the ranks (processes x virtual ranks), the intra-op threads per rank, and the
CPU kernels in use (torch's CPU capability, ONEDNN_MAX_CPU_ISA), which a replay must share to compute
the same bits.

Replay (``replay_npz DIR``): the data loader is replaced by the recorded batches. Iteration i's
global batch is the concatenation, in rank order, of the recorded ranks' batches; a run of P processes
gives process p the slice ``[p B/P, (p + 1) B/P)`` of it. When P divides the recorded ranks W, each
process runs W / P virtual ranks (gnetmdk.dist.virtual): every recorded rank's batch goes through
forward and backward as its own chunk, with the recorded threads per rank, and the run computes
what the recording computed, bit for bit (docs/alignment.md). Otherwise, or with ``replay_merged``,
each process trains on its slice as one batch: the notes' plain comparison, which differs by
round-off. The starting weights default to ``DIR/start.pth`` (unless ``load`` is set). After each
iteration every rank's loss terms are compared with the recorded ones (and their means over the
ranks); the differences are printed and written to ``<checkpoint dir>/replay_report.json``.

``max_iters K`` stops training after K iterations and saves ``last.pth`` (full state, resumable).
A replay stops when the recording ends.

This module holds the record format, its checks and the replay loader; the trainer's hook that drives
them is gnetmdk.engine.align_hook.AlignmentHook (this package imports nothing from the engine).
"""
from __future__ import annotations

import glob
import io
import json
import os
import re
from typing import Dict, List

import numpy as np
import torch

from gnetmdk.config.base import ConfigError
from gnetmdk.utils import environment

RECORD_FORMAT = "gnetmdk-npz-record"
_NAME = re.compile(r"iter_(\d{6,})_rank(\d+)\.npz$")
#: config fields that change what an iteration computes: a replay that differs warns about them
_RELEVANT = ("model_name", "image_size", "width_mult", "head_width_mult", "output_bits", "use_bn", "step2_bn",
             "step3_bn", "step3_bn_freeze", "mask_bits", "weight_scale", "l_coord", "l_noobj", "l_class", "batch_size",
             "learning_rate", "optimizer", "momentum", "nesterov", "weight_decay", "grad_clip", "num_epochs",
             "lr_scheduler", "warmup_epochs", "warmup_factor", "min_lr_ratio", "lr_step_size",
             "lr_milestones", "lr_gamma", "sync_bn")


class AlignmentError(ConfigError):
    """A recording that cannot be replayed by this run; the message names the folder and the fix."""


def check_alignment_config(cfg) -> None:
    """Refuse alignment settings that cannot work, before any process starts.

    Raises:
        AlignmentError: replay folder missing or not a recording, the same folder to record and replay,
        negative max_iters, gradient accumulation (accumulate > 1) with recording or replay.
    """
    if getattr(cfg, "max_iters", 0) < 0:
        raise AlignmentError(f"max_iters {cfg.max_iters} must be >= 0 (0 = no limit)")
    save, replay = getattr(cfg, "save_npz", ""), getattr(cfg, "replay_npz", "")
    if (save or replay) and int(getattr(cfg, "accumulate", 1) or 1) > 1:
        raise AlignmentError(f"save_npz / replay_npz record whole optimizer steps, not the {cfg.accumulate} "
                             "micro-batches of gradient accumulation: set accumulate 1 for the alignment run")
    if save and replay and os.path.abspath(save) == os.path.abspath(replay):
        raise AlignmentError(f"save_npz and replay_npz are the same folder '{save}': record into another one")
    if replay:
        read_meta(replay)


def read_meta(folder: str) -> Dict[str, object]:
    """The meta.json of a recording.

    Raises:
        AlignmentError: no such folder, or it holds no gnetmdk recording.
    """
    path = os.path.join(folder, "meta.json")
    if not os.path.isfile(path):
        raise AlignmentError(f"replay_npz '{folder}' holds no recording (no meta.json): record one first with "
                             "--save-npz DIR (and the same config)")
    try:
        with open(path, encoding="utf-8") as fh:
            meta = json.load(fh)
    except (OSError, ValueError) as exc:
        raise AlignmentError(f"'{path}' cannot be read ({exc}: cut, or not JSON): record again with --save-npz") from None
    if not isinstance(meta, dict) or meta.get("format") != RECORD_FORMAT:
        raise AlignmentError(f"'{path}' is not a gnetmdk recording (format tag '{RECORD_FORMAT}' missing)")
    bad = [k for k, kind in (("world_size", int), ("global_batch", int), ("local_batch", int), ("stage", str))
           if not isinstance(meta.get(k), kind) or isinstance(meta.get(k), bool)]
    if bad or meta["world_size"] < 1 or meta["global_batch"] < 1:
        raise AlignmentError(f"'{path}' lacks or has no valid {', '.join(bad) or 'world_size / global_batch'}: an "
                             "incomplete recording; record again with --save-npz")
    return meta


def list_iterations(folder: str) -> Dict[int, Dict[int, str]]:
    """{iteration: {rank: path}} of the .npz files of a recording."""
    out: Dict[int, Dict[int, str]] = {}
    for path in glob.glob(os.path.join(folder, "iter_*_rank*.npz")):
        m = _NAME.search(os.path.basename(path))
        if m:
            out.setdefault(int(m.group(1)), {})[int(m.group(2))] = path
    return out


#: what every iteration file must hold
NPZ_FIELDS = ("images", "targets", "indices", "epoch")


def read_npz(path: str) -> Dict[str, np.ndarray]:
    """All arrays of one recorded iteration file, read without unpickling anything.

    Raises:
        AlignmentError: naming the file: not a readable .npz (truncated, corrupted), an array of Python
            objects (never unpickled: a recording holds numbers only), or a missing field.
    """
    import zipfile
    try:
        with np.load(path, allow_pickle=False) as z:
            out = {k: z[k] for k in z.files}
    except ValueError as exc:
        if "pickle" in str(exc).lower() or "object" in str(exc).lower():
            raise AlignmentError(f"recording file '{path}' holds an array of Python objects, which is never "
                                 "unpickled (a gnetmdk recording holds numbers only): record again with --save-npz") from None
        raise AlignmentError(f"recording file '{path}' cannot be read ({exc}): record again with --save-npz") from None
    except (OSError, EOFError, zipfile.BadZipFile, KeyError) as exc:
        raise AlignmentError(f"recording file '{path}' cannot be read ({type(exc).__name__}: truncated or not an "
                             ".npz): record again with --save-npz") from None
    missing = [k for k in NPZ_FIELDS if k not in out]
    if missing:
        raise AlignmentError(f"recording file '{path}' lacks {', '.join(missing)}: not a gnetmdk recording; "
                             "record again with --save-npz")
    return out


def load_iteration(files: Dict[int, str], world: int) -> Dict[str, object]:
    """Concatenate one iteration's per-rank files (rank order) into the global batch.

    Returns:
        {"images" (B,3,S,S) float32, "targets" (B,G,G,10+C) float32, "indices" (B,) int64,
         "epoch" int, "lr" float or None, "losses" {term: mean over ranks, the float64 sum in rank order
         divided by the ranks (as the trainer averages)}, "rank_losses" [{term: value} per rank]}.
    Raises:
        AlignmentError: a rank's file is missing or unreadable (read_npz).
    """
    missing = [r for r in range(world) if r not in files]
    if missing:
        raise AlignmentError(f"recording incomplete: no file of rank(s) {missing} for one iteration "
                             f"({sorted(files.values())[0] if files else '?'})")
    images, targets, indices, losses, epochs, rank_losses, lrs = [], [], [], {}, [], [], []
    for r in range(world):
        z = read_npz(files[r])
        shape = tuple(np.shape(z["images"]))
        first = tuple(images[0].shape)[1:] if images else shape[1:]
        if len(shape) != 4 or shape[1] != 3 or shape[1:] != first:
            raise AlignmentError(f"recording file '{files[r]}' holds images of shape {shape}, rank 0's of this iteration "
                                 f"(3, H, W) = {first}: every rank of an iteration records one size; record again with "
                                 "--save-npz")
        images.append(torch.from_numpy(z["images"].astype(np.float32)))
        targets.append(torch.from_numpy(z["targets"].astype(np.float32)))
        indices.append(torch.from_numpy(z["indices"].astype(np.int64)))
        epochs.append(int(z["epoch"]))
        lrs.append(float(z["lr"]) if "lr" in z else None)
        rank_losses.append({k[5:]: float(v) for k, v in z.items() if k.startswith("loss_")})
        for k, v in rank_losses[-1].items():
            losses.setdefault(k, []).append(v)
    return {"images": torch.cat(images), "targets": torch.cat(targets), "indices": torch.cat(indices),
            "epoch": epochs[0], "lr": lrs[0], "rank_losses": rank_losses,
            "losses": {k: _fold_mean(v) for k, v in losses.items()}}


def _fold_mean(values: List[float]) -> float:
    """The float64 sum of ``values`` in order, divided by their count: the trainer's mean over ranks
    (gnetmdk.dist.comm.rows_over_ranks), so a recorded mean and a replayed one are comparable bit for bit."""
    acc = values[0]
    for v in values[1:]:
        acc += v
    return acc / len(values) if len(values) > 1 else acc


class ReplayLoader:
    """Drop-in for the training DataLoader that yields recorded batches.

    Yields, for the trainer's current epoch (read from ``trainer.train_sampler.epoch``) and starting
    after ``trainer.iteration``, this rank's slice of each recorded global batch as
    (images (b,3,S,S) float32, targets (b,G,G,10+C) float32, indices (b,) int64, sizes (b,2) int64 zeros).
    """

    def __init__(self, folder: str, trainer, rank: int, world: int):
        self.folder = folder
        self.trainer = trainer
        self.rank = rank
        self.world = world
        self.meta = read_meta(folder)
        self.rec_world = int(self.meta["world_size"])
        self.files = list_iterations(folder)
        if not self.files:
            raise AlignmentError(f"replay_npz '{folder}' holds no iteration files (iter_*_rank*.npz)")
        self.iterations = sorted(self.files)
        #: iteration -> the recorded batch's "losses", "rank_losses" and "lr" (load_iteration)
        self.recorded: Dict[int, Dict[str, object]] = {}
        self._epochs: Dict[int, int] = {}
        for it in self.iterations:
            self._epochs[it] = int(read_npz(self.files[it][min(self.files[it])])["epoch"])

    @property
    def last_iteration(self) -> int:
        """The highest recorded iteration number (the replay stops after it)."""
        return self.iterations[-1]

    def _todo(self) -> List[int]:
        epoch = int(self.trainer.train_sampler.epoch)
        start = int(self.trainer.iteration)
        return [it for it in self.iterations if it > start and self._epochs[it] == epoch]

    def __len__(self) -> int:
        return len(self._todo())

    def __iter__(self):
        for it in self._todo():
            batch = load_iteration(self.files[it], self.rec_world)
            self.recorded[it] = {k: batch[k] for k in ("losses", "rank_losses", "lr")}
            n = batch["images"].shape[0]
            b = n // self.world
            sl = slice(self.rank * b, (self.rank + 1) * b)
            idx = batch["indices"][sl]
            yield (batch["images"][sl].contiguous(), batch["targets"][sl].contiguous(), idx,
                   torch.zeros((len(idx), 2), dtype=torch.int64))


def _npz_bytes(arrays: Dict[str, np.ndarray]):
    def write(fh):
        buf = io.BytesIO()
        np.savez(buf, **arrays)
        fh.write(buf.getvalue())
    return write


def cpu_kernels() -> Dict[str, str]:
    """What selects this machine's CPU kernels, and so the order of float sums inside an operator:
    torch's CPU capability and the ONEDNN_MAX_CPU_ISA / ATEN_CPU_CAPABILITY settings
    (gnetmdk.utils.environment.cpu_kernels, the record every checkpoint holds)."""
    return environment.cpu_kernels()


def cfg_true(cfg, rec_cfg: Dict[str, object], key: str) -> bool:
    """Whether ``key`` is on in this run's config or in the recording's."""
    return bool(getattr(cfg, key, False)) or bool(rec_cfg.get(key, False))


def _norm(v):
    return list(v) if isinstance(v, tuple) else v
