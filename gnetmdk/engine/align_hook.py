"""The trainer's record / replay / max_iters hook (docs/alignment.md, "1. A run against its replay").

The record format, its checks and the replay loader live in gnetmdk.align.record, below the engine;
this hook is the engine's side of them.
"""
from __future__ import annotations

import copy
import glob
import json
import os
from typing import Dict, List, Optional

import numpy as np
import torch

from gnetmdk.align.record import (RECORD_FORMAT, _RELEVANT, AlignmentError, ReplayLoader, _norm, _npz_bytes,
                                  cfg_true, check_alignment_config, cpu_kernels, read_meta)
from gnetmdk.checkpoint.io import save_checkpoint
from gnetmdk.utils.atomic import atomic_write_bytes, atomic_write_text
from gnetmdk.dist.comm import gather_process_rows, get_rank, get_world_size, is_dist, is_main_process

from .hooks import HookBase


class AlignmentHook(HookBase):
    """The trainer's alignment hook (gnetmdk.engine.hooks): record (save_npz), replay (replay_npz),
    stop (max_iters).

    Every method is a no-op when none of the three is set: ``before_train`` starts the recording or the
    replay, ``after_iteration`` records an iteration or compares it with the recording,
    ``should_stop`` ends training early, ``finish`` (called by the trainer then) saves last.pth and
    the replay report.

    Args:
        cfg: the resolved config. It is never changed: a replay's settings go into a copy,
            :attr:`cfg`, which the trainer takes as its config before it reads any of them:
            ``virtual_ranks`` (the recorded ranks over this run's processes, unless ``replay_merged`` or
            they do not divide), ``threads`` (the recorded threads per rank) and ``load`` (the recorded
            start). The replay's batches are :attr:`replay`, which the trainer draws from in place of
            its own loader.
        processes: this run's process count.
    Raises:
        AlignmentError: a replay that cannot run (check_alignment_config, virtual ranks asked for that
            differ from the recording's).
    """

    def __init__(self, cfg, processes: int = 1):
        if getattr(cfg, "replay_npz", ""):
            cfg = copy.copy(cfg)           # the replay's settings, in the run's own config (above)
        self.cfg = cfg
        self.save_dir = getattr(cfg, "save_npz", "") or ""
        self.replay_dir = getattr(cfg, "replay_npz", "") or ""
        self.max_iters = int(getattr(cfg, "max_iters", 0) or 0)
        self.stopped = False
        self.replay: Optional[ReplayLoader] = None
        self.report: List[Dict[str, object]] = []
        self.notes: List[str] = []
        self.exact = False                 # a replay on virtual ranks: every value should be equal
        check_alignment_config(cfg)
        if self.replay_dir:
            self._plan_replay(cfg, int(processes))
            if not cfg.load:
                start = os.path.join(self.replay_dir, "start.pth")
                if os.path.isfile(start):
                    cfg.load = start
                    self.notes.append(f"replay: starting from the recorded weights {start}")

    def _plan_replay(self, cfg, processes: int) -> None:
        """How this run replays the recording: virtual ranks (exact) or merged batches (a comparison)."""
        meta = read_meta(self.replay_dir)
        rec_world = int(meta.get("world_size", 1))
        if "reference" in meta or not meta.get("config"):
            # another implementation's recording (tools/paddle_reference.py): compared, never equal
            self.notes.append("replay: the recording comes from another implementation "
                              f"({meta.get('reference', {}).get('model', 'no gnetmdk config')}): a comparison, "
                              "judged with the notes' rule (docs/alignment.md)")
            return
        asked = int(getattr(cfg, "virtual_ranks", 1) or 1)
        rec_cfg = meta.get("config") or {}
        blockers = [k for k in ("inplace_abn", "recompute_stem") if cfg_true(cfg, rec_cfg, k)]
        if not getattr(cfg, "sync_bn", True) or rec_cfg.get("sync_bn") is False:
            blockers.append("sync_bn false")
        if meta.get("complete") is False:
            self.notes.append(f"replay: warning: '{self.replay_dir}' is incomplete (its recording run did not "
                              "finish); the iterations it holds are replayed")
        merged = bool(getattr(cfg, "replay_merged", False))
        if merged or rec_world % processes or blockers:
            if asked > 1:
                raise AlignmentError(f"virtual_ranks {asked} with a merged replay of '{self.replay_dir}': drop "
                                     "virtual_ranks (a replay sets it) or replay_merged")
            why = ("replay_merged" if merged else
                   f"{', '.join(blockers)} (virtual ranks need synchronised DistBatchNorm2d)" if blockers else
                   f"{processes} processes do not divide the recording's {rec_world} ranks")
            self.notes.append(f"replay: each process trains on its share of the recorded ranks' batches as one "
                              f"batch ({why}): a comparison, round-off expected (docs/alignment.md)")
            return
        v = rec_world // processes
        if asked not in (1, v):
            raise AlignmentError(f"virtual_ranks {asked}: '{self.replay_dir}' records {rec_world} ranks, which "
                                 f"{processes} process(es) replay with {v} virtual ranks each; drop virtual_ranks "
                                 "(the replay sets it)")
        cfg.virtual_ranks = v
        self.exact = True
        rec_threads = int(meta.get("threads", 0) or 0)
        if rec_threads:
            if cfg.threads not in (0, rec_threads):
                self.notes.append(f"replay: threads {cfg.threads} -> {rec_threads}, the recording's threads per rank")
            cfg.threads = rec_threads
        if "config" in meta and not rec_cfg.get("deterministic", False) and rec_world > 2:
            self.notes.append("replay: warning: the recording was not made with --deterministic, so its gradients "
                              "were all-reduced in the backend's order; this replay sums in rank order")
        kernels, now = meta.get("kernels"), cpu_kernels()
        if kernels and kernels != now:
            diff = ", ".join(f"{k} {kernels.get(k)!r} recorded, {now[k]!r} now" for k in now
                             if kernels.get(k) != now[k])
            self.notes.append(f"replay: warning: other CPU kernels than the recording's ({diff}): float sums "
                              "inside operators may be ordered differently")

    @property
    def active(self) -> bool:
        """Whether anything is asked of the hook: a recording, a replay or an iteration limit."""
        return bool(self.save_dir or self.replay_dir or self.max_iters)

    # ---------------------------------------------------------------- start
    def before_train(self) -> None:
        """Start the replay (load and check the recording, make its loader) and/or the recording."""
        if self.replay_dir:
            self._start_replay(self.trainer)
        if self.save_dir:
            self._start_record(self.trainer)

    def _start_record(self, trainer) -> None:
        cfg = trainer.cfg
        if is_main_process():
            from gnetmdk.checkpoint.lock import OutputLock
            self.lock = OutputLock(self.save_dir, "a recording", "record into another folder (--save-npz DIR)")
            note = self.lock.acquire()
            if note:
                trainer.log(f"[{trainer.stage.name}] note: {note}")
            os.makedirs(self.save_dir, exist_ok=True)
            for old in glob.glob(os.path.join(self.save_dir, "iter_*_rank*.npz")):
                os.unlink(old)

            start = os.path.join(self.save_dir, "start.pth")
            try:
                save_checkpoint(start, trainer.state(trainer.start_epoch, trainer.iteration, False))
            except OSError as exc:
                raise self._write_error(exc) from None
            meta = {"format": RECORD_FORMAT, "version": 2, "stage": trainer.stage.name,
                    "world_size": trainer.ranks, "processes": get_world_size(),
                    "virtual_ranks": trainer.ranks // get_world_size(), "threads": trainer.threads,
                    "global_batch": cfg.batch_size, "local_batch": cfg.batch_size // trainer.ranks,
                    "iters_per_epoch": trainer.iters_per_epoch, "image_size": cfg.image_size, "seed": cfg.seed,
                    "start": "start.pth", "torch": torch.__version__, "kernels": cpu_kernels(),
                    "complete": False, "config": cfg.to_dict()}
            self.meta = meta
            try:
                atomic_write_text(os.path.join(self.save_dir, "meta.json"), json.dumps(meta, indent=2, default=str) + "\n")
            except OSError as exc:
                raise self._write_error(exc) from None
            trainer.log(f"[{trainer.stage.name}] recording batches, losses and starting weights into {self.save_dir} "
                        f"({trainer.ranks} rank(s), {trainer.threads} thread(s) per rank)")

    def _start_replay(self, trainer) -> None:
        cfg = trainer.cfg
        loader = ReplayLoader(self.replay_dir, trainer, get_rank(), get_world_size())
        meta = loader.meta
        if int(meta["global_batch"]) != cfg.batch_size:
            raise AlignmentError(f"'{self.replay_dir}' was recorded with batch_size {meta['global_batch']} "
                                 f"({meta['world_size']} x {meta['local_batch']}); replay with batch_size "
                                 f"{meta['global_batch']} (any process count that divides it)")
        if cfg.model_name == "gnetdet" and meta.get("image_size") not in (None, cfg.image_size):
            raise AlignmentError(f"'{self.replay_dir}' was recorded at image_size {meta['image_size']}, this run's model "
                                 f"takes {cfg.image_size}: replay with image_size {meta['image_size']}")
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
        for d in diffs:
            trainer.log(f"[replay] warning: config differs from the recording ({d})")
        # the recorded learning rate of each step is compared as the replay goes (a schedule that differs)
        self.check_lr = int(meta.get("version", 1)) >= 2 or "reference" in meta
        self.replay = loader               # the trainer draws its batches from here (Trainer._epoch_batches)
        how = (f"{trainer.ranks} rank(s) ({trainer.ranks // get_world_size()} per process, "
               f"{trainer.threads} thread(s) per rank): exact, every value should be equal"
               if self.exact else
               f"{get_world_size()} process(es) x {cfg.batch_size // get_world_size()}: a comparison")
        threads = f", {meta['threads']} thread(s) per rank" if meta.get("threads") else ""
        trainer.log(f"[replay] feeding {len(loader.iterations)} recorded iterations of a {meta['world_size']}-rank "
                    f"run ({meta['world_size']} x {meta['local_batch']}{threads}) to {how}")

    # ---------------------------------------------------------------- every iteration
    def after_iteration(self, it: Dict[str, object]) -> None:
        """Record this iteration (save_npz) and compare its losses with the recording (replay_npz).

        ``it``: the trainer's iteration record: "batch" (this process's images, targets, indices as fed to
        the model), "rank_terms" (this process's ranks' loss terms, 0-d tensors), "values" (their mean over
        every rank), "rank_values" (every rank's, rank order), "epoch", "iteration", "lr_step".
        """
        trainer, iteration = self.trainer, int(it["iteration"])
        images, targets, indices = it["batch"]
        reduced = it["values"]
        if self.save_dir:
            self._record(trainer, images, targets, indices, it["rank_terms"], it["epoch"], iteration,
                         float(it.get("lr_step", it["lr"])))
        if self.replay is not None:
            rec = self.replay.recorded.pop(iteration, None)
            if rec is not None:
                self._compare(trainer, iteration, it, rec)
        if self.max_iters and iteration >= self.max_iters:
            self.stopped = True
        if self.replay is not None and iteration >= self.replay.last_iteration:
            self.stopped = True

    def _compare(self, trainer, iteration: int, it: Dict[str, object], rec: Dict[str, object]) -> None:
        reduced, mean = it["values"], rec["losses"]
        diff = {k: reduced[k] - mean[k] for k in mean if k in reduced}
        row = {"iteration": iteration, "loss": reduced.get("total"), "recorded": mean.get("total"), "diff": diff,
               "max_abs_diff": max((abs(v) for v in diff.values()), default=0.0)}
        ranks, rec_ranks = it.get("rank_values") or [], rec.get("rank_losses") or []
        if len(ranks) == len(rec_ranks):          # the same ranks: compare each rank's terms
            per = [max((abs(a[k] - b[k]) for k in b if k in a), default=0.0) for a, b in zip(ranks, rec_ranks)]
            row["rank_max_abs_diff"] = per
            row["max_abs_diff"] = max([row["max_abs_diff"]] + per)
        lr = float(it.get("lr_step", it["lr"]))
        if getattr(self, "check_lr", False) and rec.get("lr") is not None:
            row["lr"], row["recorded_lr"] = lr, rec["lr"]
            if lr != rec["lr"]:
                trainer.log(f"[replay] warning: iteration {iteration} steps with learning rate {lr:.8g}, the "
                            f"recording with {rec['lr']:.8g}: use the recording's learning_rate and schedule")
        self.report.append(row)
        worst = max(diff, key=lambda k: abs(diff[k])) if diff else "total"
        per_rank = (f", every rank's terms within {max(row['rank_max_abs_diff']):.3e}"
                    if "rank_max_abs_diff" in row else "")
        trainer.log(f"[replay] iteration {iteration}: loss {reduced.get('total', float('nan')):.8g} "
                    f"recorded {mean.get('total', float('nan')):.8g} diff {diff.get('total', 0.0):+.3e} "
                    f"(largest term diff {diff.get(worst, 0.0):+.3e}, {worst}{per_rank})")

    def _record(self, trainer, images, targets, indices, rank_terms, epoch, iteration, lr: float) -> None:
        """Write one file per rank of the run: this process's batch is split into its ranks' chunks (rank
        order) and gathered to process 0 with every process's."""
        v_all = len(rank_terms)
        keys = sorted(rank_terms[0])
        loss = torch.tensor([[float(t[k].detach()) for k in keys] for t in rank_terms], dtype=torch.float64)
        parts = [images.detach().cpu().float(), targets.detach().cpu().float(),
                 indices.detach().cpu().to(torch.int64)]
        # (ranks of this process, per-rank batch, ...) rows, gathered over the processes in rank order
        rows = [t.reshape((v_all, t.shape[0] // v_all) + tuple(t.shape[1:])).contiguous() for t in parts] + [loss]
        if is_dist():
            rows = [gather_process_rows(t) for t in rows]
        if not is_main_process():
            return
        for r in range(rows[0].shape[0]):
            img = rows[0][r]
            exact = bool(torch.all((img >= 0) & (img <= 255) & (img == img.round())))
            arrays = {"images": img.numpy().astype(np.uint8) if exact else img.numpy(),
                      "images_float": np.array(not exact), "targets": rows[1][r].numpy(),
                      "indices": rows[2][r].numpy(), "epoch": np.array(epoch, dtype=np.int64),
                      "iteration": np.array(iteration, dtype=np.int64), "rank": np.array(r, dtype=np.int64),
                      "world_size": np.array(rows[0].shape[0], dtype=np.int64), "lr": np.array(lr, dtype=np.float64)}
            for k, v in zip(keys, rows[3][r].tolist()):
                arrays[f"loss_{k}"] = np.array(v, dtype=np.float64)
            path = os.path.join(self.save_dir, f"iter_{iteration:06d}_rank{r}.npz")
            try:
                atomic_write_bytes(path, _npz_bytes(arrays))
            except OSError as exc:
                raise self._write_error(exc) from None

    def _write_error(self, exc: OSError) -> AlignmentError:
        """One line for a recording that cannot be written (a full or read-only disk): the folder stays
        marked incomplete (meta.json's ``complete`` is false), the training's own outputs are unaffected."""
        return AlignmentError(f"cannot write the recording into '{self.save_dir}' ({exc.strerror or exc}): free disk "
                              "space or record into another folder (--save-npz DIR); what was written stays marked "
                              "incomplete")

    def should_stop(self) -> bool:
        """Stop after this iteration: ``max_iters`` reached, or the recording's last iteration replayed."""
        return self.stopped

    # ---------------------------------------------------------------- end
    def finish(self, epoch: int) -> Optional[str]:
        """After an early stop: save last.pth (full, resumable) and the replay report; returns last.pth's path."""
        trainer = self.trainer
        path = trainer.save("last.pth", epoch, trainer.iteration, full=True)
        why = "max_iters" if not (self.replay is not None and trainer.iteration >= self.replay.last_iteration) \
            else "end of the recording"
        trainer.log(f"[{trainer.stage.name}] stopped after {trainer.iteration} iterations ({why}): "
                    f"{os.path.join(trainer.out_dir, 'last.pth')} is written when the run ends")
        self.write_report(trainer)
        self.complete_recording()
        return path

    def complete_recording(self) -> None:
        """Mark the recording whole: meta.json says ``complete`` once its last iteration file is written."""
        if self.save_dir and is_main_process() and getattr(self, "meta", None) is not None:
            self.meta["complete"] = True
            self.meta["iterations"] = self.trainer.iteration
            try:
                atomic_write_text(os.path.join(self.save_dir, "meta.json"),
                                  json.dumps(self.meta, indent=2, default=str) + "\n")
            except OSError as exc:
                raise self._write_error(exc) from None

    def after_train(self) -> None:
        """Mark the recording (if any) complete in its meta.json."""
        self.complete_recording()

    def release(self) -> None:
        """Give back the recording folder's lock (the trainer calls it when the run ends, however)."""
        lock = getattr(self, "lock", None)
        if lock is not None:
            lock.release()

    def write_report(self, trainer) -> None:
        """Process 0 of a replay: write replay_report.json (per iteration the loss differences against the
        recording, and the largest) into the run's staged outputs, and log a one-line verdict."""
        if self.replay is None or not is_main_process():
            return
        worst = max((r["max_abs_diff"] for r in self.report), default=0.0)
        path = trainer.outputs.staged("replay_report.json")      # published with the run's checkpoints
        final = os.path.join(trainer.out_dir, "replay_report.json")
        atomic_write_text(path, json.dumps({"recording": self.replay_dir, "recorded_world_size": self.replay.rec_world,
                                            "world_size": trainer.ranks, "processes": get_world_size(),
                                            "virtual_ranks": trainer.ranks // get_world_size(),
                                            "exact": self.exact, "threads": trainer.threads,
                                            "iterations": self.report, "max_abs_loss_diff": worst}, indent=2) + "\n")
        verdict = ("every loss term equal" if worst == 0 else f"largest loss difference {worst:.3e}")
        trainer.log(f"[replay] {len(self.report)} iterations compared: {verdict}; report {final}")
