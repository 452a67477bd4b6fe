"""Record and replay of training iterations (alignment.md, "The three checks").

Record (``save_npz DIR`` / ``--save-npz DIR``): before the first iteration rank 0 writes the
starting weights ``DIR/start.pth`` (a gnetmdk checkpoint) and ``DIR/meta.json``; after every
iteration the ranks' batches are gathered to rank 0, which writes one file per iteration and rank,
``DIR/iter_<iteration:06d>_rank<r>.npz``, holding:

    images   (b, 3, S, S) uint8 when every value is an integer in 0..255 (the chip codes always are),
             else float32; ``images_float`` says which
    targets  (b, G, G, 10 + C) float32      indices (b,) int64 dataset indices
    loss_<term>  float64 scalars: this rank's batch-mean loss terms (total, loc, conf, ...)
    epoch, iteration, rank, world_size, lr   int64 / float64 scalars

Replay (``replay_npz DIR``): the data loader is replaced by the recorded batches. Iteration i's
global batch is the concatenation, in rank order, of the recorded ranks' batches; a run with W
processes gives rank r the slice ``[r * B/W, (r + 1) * B/W)`` of it, so one process replays an
N-process recording by concatenation and N processes replay a one-process recording by slicing.
The starting weights default to ``DIR/start.pth`` (unless ``load`` is set). After each iteration the
loss terms (mean over this run's ranks) are compared with the recorded ones (mean over the recorded
ranks: with equal per-rank batches that is the global batch's loss); the differences are printed and
written to ``<checkpoint dir>/replay_report.json``.

``max_iters K`` stops training after K iterations and saves ``last.pth`` (full state, resumable).
A replay stops when the recording ends.
"""
from __future__ import annotations

import glob
import io
import json
import os
import re
from typing import Dict, List, Optional

import numpy as np
import torch

from gnetmdk.checkpoint.io import atomic_write_bytes, atomic_write_text, save_checkpoint
from gnetmdk.config.base import ConfigError
from gnetmdk.dist.comm import get_rank, get_world_size, is_dist, is_main_process
from gnetmdk.engine.hooks import HookBase

RECORD_FORMAT = "gnetmdk-npz-record"
_NAME = re.compile(r"iter_(\d{6,})_rank(\d+)\.npz$")
#: config fields that change what an iteration computes: a replay that differs warns about them
_RELEVANT = ("model_name", "image_size", "width_mult", "use_bn", "chip", "mask_bits", "weight_scale", "l_coord",
             "l_noobj", "l_class", "batch_size", "learning_rate", "optimizer", "momentum", "nesterov",
             "weight_decay",
             "grad_clip", "num_epochs", "lr_scheduler", "warmup_epochs", "warmup_factor", "min_lr_ratio",
             "lr_step_size", "lr_milestones", "lr_gamma", "sync_bn")


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
    with open(path, encoding="utf-8") as fh:
        meta = json.load(fh)
    if meta.get("format") != RECORD_FORMAT:
        raise AlignmentError(f"'{path}' is not a gnetmdk recording (format tag '{RECORD_FORMAT}' missing)")
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
         "epoch" int, "losses" {term: mean over ranks}}.
    Raises:
        AlignmentError: a rank's file is missing or unreadable (read_npz).
    """
    missing = [r for r in range(world) if r not in files]
    if missing:
        raise AlignmentError(f"recording incomplete: no file of rank(s) {missing} for one iteration "
                             f"({sorted(files.values())[0] if files else '?'})")
    images, targets, indices, losses, epochs = [], [], [], {}, []
    for r in range(world):
        z = read_npz(files[r])
        images.append(torch.from_numpy(z["images"].astype(np.float32)))
        targets.append(torch.from_numpy(z["targets"].astype(np.float32)))
        indices.append(torch.from_numpy(z["indices"].astype(np.int64)))
        epochs.append(int(z["epoch"]))
        for k, v in z.items():
            if k.startswith("loss_"):
                losses.setdefault(k[5:], []).append(float(v))
    return {"images": torch.cat(images), "targets": torch.cat(targets), "indices": torch.cat(indices),
            "epoch": epochs[0], "losses": {k: float(np.mean(v)) for k, v in losses.items()}}


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
        self.recorded: Dict[int, Dict[str, float]] = {}
        self._epochs: Dict[int, int] = {}
        for it in self.iterations:
            self._epochs[it] = int(read_npz(self.files[it][min(self.files[it])])["epoch"])

    @property
    def last_iteration(self) -> int:
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
            self.recorded[it] = batch["losses"]
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


class AlignmentHook(HookBase):
    """The trainer's alignment hook (gnetmdk.engine.hooks): record (save_npz), replay (replay_npz),
    stop (max_iters).

    Every method is a no-op when none of the three is set: ``before_train`` starts the recording or the
    replay, ``after_iteration`` records an iteration or compares it with the recording,
    ``should_stop`` ends training early, ``finish`` (called by the trainer then) saves last.pth and
    the replay report.
    """

    def __init__(self, cfg):
        self.cfg = cfg
        self.save_dir = getattr(cfg, "save_npz", "") or ""
        self.replay_dir = getattr(cfg, "replay_npz", "") or ""
        self.max_iters = int(getattr(cfg, "max_iters", 0) or 0)
        self.stopped = False
        self.replay: Optional[ReplayLoader] = None
        self.report: List[Dict[str, object]] = []
        self.notes: List[str] = []
        check_alignment_config(cfg)
        if self.replay_dir and not cfg.load:
            start = os.path.join(self.replay_dir, "start.pth")
            if os.path.isfile(start):
                cfg.load = start
                self.notes.append(f"replay: starting from the recorded weights {start}")

    @property
    def active(self) -> bool:
        return bool(self.save_dir or self.replay_dir or self.max_iters)

    # ---------------------------------------------------------------- start
    def before_train(self) -> None:
        if self.replay_dir:
            self._start_replay(self.trainer)
        if self.save_dir:
            self._start_record(self.trainer)

    def _start_record(self, trainer) -> None:
        cfg = trainer.cfg
        if is_main_process():
            os.makedirs(self.save_dir, exist_ok=True)
            for old in glob.glob(os.path.join(self.save_dir, "iter_*_rank*.npz")):
                os.unlink(old)
            start = os.path.join(self.save_dir, "start.pth")
            save_checkpoint(start, trainer.state(trainer.start_epoch, trainer.iteration, False))
            meta = {"format": RECORD_FORMAT, "version": 1, "stage": trainer.stage.name,
                    "world_size": get_world_size(), "global_batch": cfg.batch_size,
                    "local_batch": cfg.batch_size // get_world_size(), "iters_per_epoch": trainer.iters_per_epoch,
                    "image_size": cfg.image_size, "seed": cfg.seed, "start": "start.pth",
                    "torch": torch.__version__, "config": cfg.to_dict()}
            atomic_write_text(os.path.join(self.save_dir, "meta.json"), json.dumps(meta, indent=2, default=str) + "\n")
            trainer.log(f"[{trainer.stage.name}] recording batches, losses and starting weights into {self.save_dir}")

    def _start_replay(self, trainer) -> None:
        cfg = trainer.cfg
        loader = ReplayLoader(self.replay_dir, trainer, get_rank(), get_world_size())
        meta = loader.meta
        if int(meta["global_batch"]) != cfg.batch_size:
            raise AlignmentError(f"'{self.replay_dir}' was recorded with batch_size {meta['global_batch']} "
                                 f"({meta['world_size']} x {meta['local_batch']}); replay with batch_size "
                                 f"{meta['global_batch']} (any process count that divides it)")
        last_epoch = max(loader._epochs.values())
        if last_epoch >= cfg.num_epochs:
            raise AlignmentError(f"'{self.replay_dir}' records iterations of epoch {last_epoch + 1}, this run trains "
                                 f"num_epochs {cfg.num_epochs}: replay with num_epochs {last_epoch + 1} or more")
        if meta.get("stage") != trainer.stage.name:
            raise AlignmentError(f"'{self.replay_dir}' records stage {meta.get('stage')}, this run is "
                                 f"{trainer.stage.name}: use the same --step / --cal")
        from gnetmdk.config import config_from_dict, config_value
        raw = meta.get("config", {})
        rec_cfg = config_from_dict(raw) if raw else None
        diffs = []
        for k in _RELEVANT if rec_cfg is not None else ():
            was, now = config_value(rec_cfg, k), config_value(cfg, k)
            if was is not None and now is not None and _norm(was) != _norm(now):
                diffs.append(f"{k}: recorded {was!r}, now {now!r}")
        if int(meta.get("iters_per_epoch", trainer.iters_per_epoch)) != trainer.iters_per_epoch:
            diffs.append(f"iterations per epoch: recorded {meta['iters_per_epoch']}, now {trainer.iters_per_epoch} "
                         "(the learning-rate schedule differs: use the same training set)")
        for d in diffs:
            trainer.log(f"[replay] warning: config differs from the recording ({d})")
        trainer.train_loader = loader
        self.replay = loader
        trainer.log(f"[replay] feeding {len(loader.iterations)} recorded iterations of a {meta['world_size']}-process "
                    f"run ({meta['world_size']} x {meta['local_batch']}) to {get_world_size()} process(es) "
                    f"({get_world_size()} x {cfg.batch_size // get_world_size()})")

    # ---------------------------------------------------------------- every iteration
    def after_iteration(self, it: Dict[str, object]) -> None:
        """Record this iteration (save_npz) and compare its losses with the recording (replay_npz).

        ``it``: the trainer's iteration record: "batch" (this rank's images, targets, indices as fed to
        the model), "terms" (this rank's loss terms, 0-d tensors), "values" (their mean over ranks),
        "epoch", "iteration".
        """
        trainer, iteration = self.trainer, int(it["iteration"])
        images, targets, indices = it["batch"]
        reduced = it["values"]
        if self.save_dir:
            self._record(trainer, images, targets, indices, it["terms"], it["epoch"], iteration)
        if self.replay is not None:
            rec = self.replay.recorded.pop(iteration, None)
            if rec is not None:
                diff = {k: reduced[k] - rec[k] for k in rec if k in reduced}
                row = {"iteration": iteration, "loss": reduced.get("total"), "recorded": rec.get("total"),
                       "diff": diff, "max_abs_diff": max((abs(v) for v in diff.values()), default=0.0)}
                self.report.append(row)
                worst = max(diff, key=lambda k: abs(diff[k])) if diff else "total"
                trainer.log(f"[replay] iteration {iteration}: loss {reduced.get('total', float('nan')):.8g} "
                            f"recorded {rec.get('total', float('nan')):.8g} diff {diff.get('total', 0.0):+.3e} "
                            f"(largest term diff {diff.get(worst, 0.0):+.3e}, {worst})")
        if self.max_iters and iteration >= self.max_iters:
            self.stopped = True
        if self.replay is not None and iteration >= self.replay.last_iteration:
            self.stopped = True

    def _record(self, trainer, images, targets, indices, terms, epoch, iteration) -> None:
        keys = sorted(terms)
        loss = torch.tensor([float(terms[k].detach()) for k in keys], dtype=torch.float64)
        parts = [images.detach().cpu().float().contiguous(), targets.detach().cpu().float().contiguous(),
                 indices.detach().cpu().to(torch.int64).contiguous(), loss]
        world = get_world_size()
        if is_dist():
            import torch.distributed as dist
            gathered = []
            for t in parts:
                bucket = [torch.empty_like(t) for _ in range(world)] if is_main_process() else None
                dist.gather(t, bucket, dst=0)
                gathered.append(bucket)
        else:
            gathered = [[t] for t in parts]
        if not is_main_process():
            return
        lr = float(trainer.optimizer.param_groups[0]["lr"])
        for r in range(world):
            img = gathered[0][r]
            exact = bool(torch.all((img >= 0) & (img <= 255) & (img == img.round())))
            arrays = {"images": img.numpy().astype(np.uint8) if exact else img.numpy(),
                      "images_float": np.array(not exact), "targets": gathered[1][r].numpy(),
                      "indices": gathered[2][r].numpy(), "epoch": np.array(epoch, dtype=np.int64),
                      "iteration": np.array(iteration, dtype=np.int64), "rank": np.array(r, dtype=np.int64),
                      "world_size": np.array(world, dtype=np.int64), "lr": np.array(lr, dtype=np.float64)}
            for k, v in zip(keys, gathered[3][r].tolist()):
                arrays[f"loss_{k}"] = np.array(v, dtype=np.float64)
            path = os.path.join(self.save_dir, f"iter_{iteration:06d}_rank{r}.npz")
            atomic_write_bytes(path, _npz_bytes(arrays))

    def should_stop(self) -> bool:
        return self.stopped

    # ---------------------------------------------------------------- end
    def finish(self, epoch: int) -> Optional[str]:
        """After an early stop: save last.pth (full, resumable) and the replay report; returns last.pth's path."""
        trainer = self.trainer
        path = trainer.save("last.pth", epoch, trainer.iteration, full=True)
        why = "max_iters" if not (self.replay is not None and trainer.iteration >= self.replay.last_iteration) \
            else "end of the recording"
        trainer.log(f"[{trainer.stage.name}] stopped after {trainer.iteration} iterations ({why}): "
                    f"last.pth goes to {trainer.out_dir} with the run's other files")
        if trainer.best_map is not None and trainer.best_map < 0:
            trainer.best_map = None          # nothing was evaluated: the summary says n/a, not -1
        self.write_report(trainer)
        return path

    def write_report(self, trainer) -> None:
        if self.replay is None or not is_main_process():
            return
        worst = max((r["max_abs_diff"] for r in self.report), default=0.0)
        path = trainer.outputs.staged("replay_report.json")      # published with the run's checkpoints
        atomic_write_text(path, json.dumps({"recording": self.replay_dir, "recorded_world_size": self.replay.rec_world,
                                            "world_size": get_world_size(), "iterations": self.report,
                                            "max_abs_loss_diff": worst}, indent=2) + "\n")
        trainer.log(f"[replay] {len(self.report)} iterations compared: largest loss difference {worst:.3e}; "
                    f"report {path}")


def _norm(v):
    return list(v) if isinstance(v, tuple) else v
