"""The trainer's concerns beside training, one hook each (detectron2's engine/hooks.py pattern): the EMA
of the weights, evaluation and best.pth, early stopping, training curves, last.pth and the stage's
outputs, tensorboard, the epoch log line. Record/replay (gnetmdk.engine.align_hook.AlignmentHook) is a hook too.

The trainer (gnetmdk.engine.trainer.Trainer) calls, in the order the hooks are listed:

    before_train()                    model, data and optimizer are set up (and resumed)
    after_step()                      after each optimizer step (its values are not read back yet)
    after_iteration(it)               an iteration's values were read back: it = {"epoch", "iteration",
                                      "values" (mean over ranks), "rank_values" (every rank's, rank
                                      order), "rank_terms" (this process's ranks' tensors), "batch"
                                      (this process's images, targets, indices), "lr"}
    after_epoch(epoch, result)        result = {"train": the epoch's mean loss terms, seconds,
                                      images_per_s}; hooks add to it ("eval", "best", ...)
    after_train()                     the run finished (not after a failure)
    should_stop()                     whether training stops early (max_iters, a replay's end)

A hook owns its state as torch modules and optimizers do: ``state_dict()`` gives the entries it adds
to every checkpoint the trainer writes (the EMA's ``ema``, the curves' ``curves``), and on ``--resume``
the trainer hands the resumed checkpoint to every hook's ``load_state_dict(checkpoint)`` before
``before_train``; a hook reads its own entries there and never reaches into the trainer's resume state.
"""
from __future__ import annotations

import os
import time
import weakref
from typing import Dict, List, Optional

import numpy as np

from .ema import ModelEMA


class HookBase:
    """One concern beside the loop; ``trainer`` is set by Trainer.register and held as a weak reference
    (a hook never keeps its trainer alive; after the trainer is gone it reads None)."""

    _trainer_ref = None

    @property
    def trainer(self):
        """The trainer this hook serves, or None once it is gone (or before registration)."""
        ref = self._trainer_ref
        return ref() if ref is not None else None

    @trainer.setter
    def trainer(self, trainer) -> None:
        """Hold ``trainer`` as a weak reference (None clears it)."""
        self._trainer_ref = weakref.ref(trainer) if trainer is not None else None

    def before_train(self) -> None:
        """Called once when model, data and optimizer are set up (and resumed); does nothing here."""
        pass

    def after_step(self) -> None:
        """Called after each optimizer step, before its values are read back; does nothing here."""
        pass

    def after_iteration(self, it: Dict[str, object]) -> None:
        """Called with an iteration's read-back values (see the module docstring for ``it``); does nothing here."""
        pass

    def after_epoch(self, epoch: int, result: Dict[str, object]) -> None:
        """Called at the end of epoch ``epoch`` (0-based) with its ``result`` dict, which a hook may add to;
        does nothing here."""
        pass

    def after_train(self) -> None:
        """Called when the run finished (not after a failure); does nothing here."""
        pass

    def state_dict(self) -> Dict[str, object]:
        """Entries this hook adds to every checkpoint (best.pth and last.pth), plain data and tensors;
        none here."""
        return {}

    def load_state_dict(self, checkpoint: Dict[str, object]) -> None:
        """Take this hook's entries from a resumed ``checkpoint`` (the whole dict the trainer loaded),
        before ``before_train``; nothing here."""
        pass

    def should_stop(self) -> bool:
        """Whether training stops early after this iteration; never here."""
        return False


class EMAHook(HookBase):
    """``ema true``: an exponential moving average of the weights, updated after every optimizer step,
    evaluated (and so chosen for best.pth) instead of the raw weights, saved beside them
    (checkpoint ``ema``, ``eval_weights "ema"``; docs/training.md)."""

    def __init__(self):
        self.ema: Optional[ModelEMA] = None
        #: set by load_state_dict: the resumed checkpoint's ``ema`` entry (None: it had none), applied
        #: by before_train, when the model exists
        self._resumed: Optional[Dict[str, object]] = None
        self._resuming = False

    def load_state_dict(self, checkpoint: Dict[str, object]) -> None:
        """Keep the resumed checkpoint's ``ema`` entry for before_train (the average needs the model)."""
        self._resuming = True
        ema = checkpoint.get("ema")
        self._resumed = ema if isinstance(ema, dict) else None

    def before_train(self) -> None:
        """Start the EMA from the model's weights (or the resumed checkpoint's EMA); copy the layer switches."""
        t, cfg = self.trainer, self.trainer.cfg
        self.ema = ModelEMA(t.model, cfg.ema_decay, cfg.ema_ramp)
        self.ema.sync_switches(t.model)
        if self._resuming:
            if self._resumed is not None:
                self.ema.load_state_dict(self._resumed)
            else:
                t.log(f"[{t.stage.name}] the resumed checkpoint has no EMA: starting one from its weights")
        t.log(f"[{t.stage.name}] EMA of the weights (decay {cfg.ema_decay}, ramp {cfg.ema_ramp:g} steps): "
              "evaluated and used for best.pth; raw weights kept in 'model'")

    def after_step(self) -> None:
        """Fold the model's new weights into the EMA."""
        self.ema.update(self.trainer.model)

    def state_dict(self) -> Dict[str, object]:
        """The EMA's state as the checkpoint's ``ema`` entry (nothing before the EMA exists)."""
        return {"ema": self.ema.state_dict()} if self.ema is not None else {}


def _quiet_writer_threads() -> None:
    """Keep an OSError of tensorboard's writer thread (a full log disk) from printing a traceback: the
    writer raises it again in the trainer's thread, where :class:`TensorboardHook` reports it in one
    line. Other threads' exceptions are printed as before."""
    import threading
    if getattr(threading.excepthook, "_gnetmdk", False):
        return
    previous = threading.excepthook

    def hook(args):
        if issubclass(args.exc_type, OSError) and type(args.thread).__name__ == "_AsyncWriterThread":
            return
        previous(args)

    hook._gnetmdk = True
    threading.excepthook = hook


class TensorboardHook(HookBase):
    """The scalars of the trainer's event storage (gnetmdk.engine.events: loss terms and learning rate
    per iteration, val mAP and loss per evaluation) and the prediction images, into
    ``<log_root>/<stage>`` (rank 0 only; the folder was checked writable before any work). When the log
    cannot be written later (a full or read-only disk), the curves stop with one warning and training
    goes on: checkpoints have their own checks, and the log is not worth a run."""

    def __init__(self):
        self.writer = None
        self.failed = False

    def _guard(self, fn) -> None:
        """Run a writer call; an OSError (tensorboard re-raises its writer thread's) ends the log with
        one warning."""
        if self.failed:
            return
        try:
            fn()
        except OSError as exc:
            self.failed = True
            t = self.trainer
            t.log(f"[{t.stage.name}] warning: the tensorboard log stops here: cannot write '{t.cfg.log_dir}' "
                  f"({exc.strerror or exc}); training goes on (free disk space, or set log_root, to keep the curves)")
            writer, self.writer = self.writer, None
            if writer is not None:
                try:
                    writer.close()
                except Exception:  # noqa: BLE001 - the log is already given up
                    pass

    def _open(self) -> None:
        """Open the writer on ``<log_dir>`` (rank 0) if it is not open yet."""
        if self.writer is None:
            from torch.utils.tensorboard import SummaryWriter
            _quiet_writer_threads()
            self.writer = SummaryWriter(self.trainer.cfg.log_dir)

    def scalar(self, tag: str, value: float, step: int) -> None:
        """Write one scalar ``tag`` = ``value`` at ``step`` (rank 0; the writer opens on the first call;
        nothing once the log has failed)."""
        t = self.trainer
        if not t.main or self.failed:
            return

        def write():
            self._open()
            self.writer.add_scalar(tag, value, step)
        self._guard(write)

    def write_events(self) -> None:
        """Write the scalars put into the trainer's event storage since the last call (every rank takes
        them, so that none piles up; rank 0 writes them)."""
        for tag, value, step in self.trainer.storage.take_unwritten():
            self.scalar(tag, value, step)

    def before_train(self) -> None:
        """Write what was reported before training (the entry evaluation's mAP at step 0)."""
        self.write_events()

    def after_iteration(self, it: Dict[str, object]) -> None:
        """Write the iteration's loss terms (mean over ranks) and learning rate, put by the trainer."""
        self.write_events()

    def after_epoch(self, epoch: int, result: Dict[str, object]) -> None:
        """Write what the epoch reported (after an evaluation: val mAP, COCO mAP, val loss at step
        ``epoch + 1``) and, after an evaluation, the prediction images."""
        self.write_events()
        res = result.get("eval")
        if res is not None:
            self.predictions(res, epoch + 1)

    def predictions(self, res: Dict[str, object], step: int) -> None:
        """The first ``tb_images`` val images (dataset order: the same images at every evaluation) with
        their ground truth (white) and the detections scoring at least ``predict_thresh`` (class
        colours, name and score), as ``<stage>/predictions/<image>``; at most 640 pixels a side."""
        t = self.trainer
        n = min(t.cfg.tb_images, len(res.get("detections", ())))
        if not t.main or n == 0:
            return
        import cv2
        from gnetmdk.dataset.image_io import decode_image
        from gnetmdk.evaluation.draw import draw_detections
        self._guard(self._open)
        for i in range(n):
            det, gt = res["detections"][i], res["truths"][i]
            keep = det["scores"] >= t.cfg.predict_thresh
            img = decode_image(t.val_set.image_path(i))
            thick = max(1, round(min(img.shape[:2]) / 300))
            for x1, y1, x2, y2 in np.asarray(gt["boxes"]).round().astype(int).tolist():
                cv2.rectangle(img, (x1, y1), (x2, y2), (255, 255, 255), thick)
            img = draw_detections(img, {k: v[keep] for k, v in det.items()}, t.cfg.VOC_CLASSES)
            scale = 640 / max(img.shape[:2])
            if scale < 1:
                img = cv2.resize(img, (round(img.shape[1] * scale), round(img.shape[0] * scale)),
                                 interpolation=cv2.INTER_AREA)
            name = os.path.splitext(os.path.basename(t.val_set.image_path(i)))[0]
            if self.writer is None:
                return
            self._guard(lambda: self.writer.add_image(f"{t.stage.name}/predictions/{name}", img[:, :, ::-1].copy(),
                                                      step, dataformats="HWC"))

    def after_train(self) -> None:
        """Flush and close the writer."""
        if self.writer is not None:
            def close():
                self.writer.flush()
                self.writer.close()
                self.writer = None
            self._guard(close)


def evaluates_after(epoch: int, cfg) -> bool:
    """Whether the stage evaluates after ``epoch`` (counted from 1): every ``eval_interval`` epochs from
    ``eval_from`` on (0: from the first), and always after the last (``num_epochs``).

    Args:
        epoch: the epoch just trained, an int counted from 1.
        cfg: the stage's config (reads ``num_epochs``, ``eval_interval``, ``eval_from``; validated by
            gnetmdk.config.overrides, so an interval below 1 is read as 1 here and nothing is raised).
    Returns:
        True when the stage evaluates after that epoch (docs/training.md, "When a stage evaluates")."""
    if epoch == cfg.num_epochs:
        return True
    return epoch % max(cfg.eval_interval, 1) == 0 and epoch >= cfg.eval_from


class EvalHook(HookBase):
    """Evaluation (VOC mAP on the val split) before training (``eval_before``: the entry model is the
    stage's first candidate for best.pth) and after every ``eval_interval`` epochs from ``eval_from`` on
    and after the last (:func:`evaluates_after`); the
    best is written as best.pth (:meth:`save_best`). Each evaluation's mAP (COCO mAP, val loss) goes
    into the trainer's event storage (gnetmdk.engine.events).

    The hook owns the stage's record of its best model (detectron2's BestCheckpointer): ``best_map``
    (mAP@0.5 of best.pth; -1.0 until something was evaluated), ``last_map`` (the latest evaluation),
    ``best_epoch`` (the epoch best.pth was written after, 0 for the entry model), ``best_seconds``
    (stage seconds until then) and ``best_caps`` (its activation caps: step 3's learned caps publish
    relu_cap.txt from them). All but the caps go into every checkpoint (:meth:`state_dict`) and come back on
    ``--resume`` (:meth:`load_state_dict`). After an evaluation, ``result["best_map"]`` and
    ``result["best_epoch"]`` tell the later hooks (early stopping) where the best stands."""

    def __init__(self):
        self.best_map: float = -1.0
        self.last_map: Optional[float] = None
        self.best_epoch: Optional[int] = None
        self.best_seconds: Optional[float] = None
        #: the activation caps of the model best.pth holds (step 3's learned caps: relu_cap.txt follows them)
        self.best_caps: Optional[List[float]] = None

    def state_dict(self) -> Dict[str, object]:
        """``best_map``, ``best_epoch``, ``best_seconds`` and ``map`` (the latest evaluation's mAP)."""
        return {"best_map": self.best_map, "best_epoch": self.best_epoch, "best_seconds": self.best_seconds,
                "map": self.last_map}

    def load_state_dict(self, checkpoint: Dict[str, object]) -> None:
        """Take over a resumed checkpoint's best mAP, its epoch and seconds (-1.0 / None where absent)."""
        best = checkpoint.get("best_map")
        self.best_map = -1.0 if best is None else float(best)
        self.best_epoch, self.best_seconds = checkpoint.get("best_epoch"), checkpoint.get("best_seconds")

    def record(self, map_value: float) -> None:
        """An evaluation outside the loop that is the stage's result (the calibration pass): both the
        best and the latest mAP."""
        self.best_map = self.last_map = float(map_value)

    def evaluated_best(self) -> Optional[float]:
        """The best mAP, or None when nothing was evaluated (a run stopped before its first evaluation)."""
        return None if self.best_map < 0 else self.best_map

    def save_best(self, epoch: int, iteration: int) -> None:
        """Write best.pth for ``epoch``, recording that epoch and the stage seconds so far in it."""
        t = self.trainer
        self.best_epoch, self.best_seconds = epoch, time.time() - t.t_start
        t.save("best.pth", epoch, iteration)
        self.best_caps = t.caps()

    def before_train(self) -> None:
        """With ``eval_before`` (and not resuming): evaluate the entry model, take its mAP as the best so
        far and write it as best.pth."""
        t, cfg = self.trainer, self.trainer.cfg
        if cfg.resume or not cfg.eval_before:
            return
        res = t.evaluate("entry")
        t.summary["entry_map"] = res["map"]
        self.last_map = res["map"]
        coco = f", COCO mAP {res['coco']['map']:.4f}" if "coco" in res else ""
        tiles = f" (whole images; tiles {res['tile_map']:.4f})" if "tile_map" in res else ""
        t.log(f"[{t.stage.name}] entry mAP {res['map']:.4f}{tiles}{coco} (before training, {res['seconds']:.1f}s)")
        t.storage.put_scalar(f"{t.stage.name}/mAP", res["map"], 0)
        # the entry model is this stage's first candidate: fine-tuning must beat it to replace it
        self.best_map = res["map"]
        if "coco" in res:
            t.summary["best_coco_map"] = res["coco"]["map"]
        self.save_best(0, 0)

    def after_epoch(self, epoch: int, result: Dict[str, object]) -> None:
        """Every ``eval_interval`` epochs from ``eval_from`` on and after the last: evaluate, put the result in ``result["eval"]``,
        write best.pth (``result["best"]``) when the mAP beats the best so far, and put the best's mAP
        and epoch in ``result["best_map"]`` / ``result["best_epoch"]``."""
        t, cfg = self.trainer, self.trainer.cfg
        if not evaluates_after(epoch + 1, cfg):
            return
        res = t.evaluate(f"epoch{epoch + 1}")
        result["eval"] = res
        self.last_map = res["map"]
        name = t.stage.name
        t.storage.put_scalar(f"{name}/mAP", res["map"], epoch + 1)
        if "coco" in res:
            t.storage.put_scalar(f"{name}/COCO_mAP", res["coco"]["map"], epoch + 1)
        t.storage.put_scalar(f"{name}/val_loss", res["loss"].get("total", 0.0), epoch + 1)
        if res["map"] > self.best_map:
            if "coco" in res:
                t.summary["best_coco_map"] = res["coco"]["map"]     # of the model best.pth holds
            self.best_map = res["map"]
            self.save_best(epoch + 1, t.iteration)
            result["best"] = True
        result["best_map"], result["best_epoch"] = self.best_map, self.best_epoch


class EarlyStopHook(HookBase):
    """Early stopping on val mAP (``patience`` epochs, 0: off): after an evaluation, when the best
    mAP is ``patience`` or more epochs old (counted from the epoch of best.pth, 0 for the entry model;
    the evaluation hook puts both in the epoch's result), the epoch's result gets ``stop`` and the
    trainer ends the stage after this epoch's last.pth and log line. Every rank takes the same
    decision: the mAP is computed from detections gathered from all ranks."""

    def after_epoch(self, epoch: int, result: Dict[str, object]) -> None:
        """Set ``result["stop"]`` (the reason, for the log) when the best mAP is ``patience`` or more epochs old
        after this epoch's evaluation (never after the last epoch)."""
        t, patience = self.trainer, self.trainer.cfg.patience
        if patience <= 0 or "eval" not in result or epoch + 1 >= t.cfg.num_epochs:
            return
        best_epoch = result.get("best_epoch") or 0
        if epoch + 1 - best_epoch >= patience:
            result["stop"] = (f"early stop after epoch {epoch + 1}: no better val mAP than {result['best_map']:.4f} "
                              f"(epoch {best_epoch}) for {epoch + 1 - best_epoch} epochs (patience {patience})")


class CurvesHook(HookBase):
    """Training curves of the stage (gnetmdk.evaluation.plots.plot_training_curves):
    ``<log_root>/<stage>/curves.png`` and ``curves.json``, redrawn after every evaluation and at the
    end (rank 0). The epochs' history goes into every checkpoint (``curves``), so a resumed run draws
    the whole stage. Without matplotlib the run goes on and says once that no curves are drawn."""

    def __init__(self):
        self.history: List[Dict[str, object]] = []
        self.warned = False

    def load_state_dict(self, checkpoint: Dict[str, object]) -> None:
        """Take over a resumed checkpoint's epoch history (its ``curves`` entry)."""
        if isinstance(checkpoint.get("curves"), list):
            self.history = [dict(h) for h in checkpoint["curves"]]

    def after_epoch(self, epoch: int, result: Dict[str, object]) -> None:
        """Append the epoch's entry (epoch, iteration, lr, mean training loss terms, val mAP / COCO mAP
        when evaluated) and redraw after an evaluation."""
        t = self.trainer
        tr = result["train"]
        entry: Dict[str, object] = {"epoch": epoch + 1, "iteration": t.iteration,
                                    "lr": float(t.optimizer.param_groups[0]["lr"]),
                                    "train": {k: float(v) for k, v in tr.items() if k not in ("seconds", "images_per_s")}}
        res = result.get("eval")
        if res is not None:
            entry["val_map"] = float(res["map"])
            if "tile_map" in res:
                entry["tile_map"] = float(res["tile_map"])      # eval_stitch: val_map is the whole images'
            if "coco" in res:
                entry["coco_map"] = float(res["coco"]["map"])
        self.history.append(entry)
        if res is not None:
            self.draw()

    def after_train(self) -> None:
        """Put the stage's ``[epoch, val mAP]`` pairs into the trainer's summary and draw the curves a last time."""
        # the stage's val mAPs in its summary (with a resumed run's earlier epochs): run_pipeline's
        # plateau test reads them (gnetmdk.engine.control.plateau_span)
        self.trainer.summary["val_maps"] = [[int(h["epoch"]), float(h["val_map"])]
                                            for h in self.history if "val_map" in h]
        if self.history:
            self.draw()

    def draw(self) -> None:
        """Draw the history into ``<log_dir>/curves.png`` (rank 0); a failure (no matplotlib, an unwritable
        folder) is noted once and training goes on."""
        t = self.trainer
        if not t.main:
            return
        from gnetmdk.evaluation.plots import PlotError, plot_training_curves
        try:
            os.makedirs(t.cfg.log_dir, exist_ok=True)
            plot_training_curves(self.history, os.path.join(t.cfg.log_dir, "curves.png"),
                                 title=f"{t.stage.name}: {t.cfg.DS_NAME}")
        except (PlotError, OSError) as exc:
            if not self.warned:
                t.log(f"[{t.stage.name}] note: training curves not drawn ({exc})")
                self.warned = True

    def state_dict(self) -> Dict[str, object]:
        """The epoch history as the checkpoint's ``curves`` entry."""
        return {"curves": [dict(h) for h in self.history]}


class CheckpointHook(HookBase):
    """last.pth at every epoch end (and every ``checkpoint_interval`` iterations inside the epoch, by
    the trainer: a mid-epoch save must wait for the iteration's read-back); when the run finishes,
    its files become the stage's outputs together (gnetmdk.checkpoint.outputs.StageOutputs.publish,
    with model/relu_cap.txt when step 3 learned the caps)."""

    def after_epoch(self, epoch: int, result: Dict[str, object]) -> None:
        """Save a full, resumable last.pth at the end of the epoch."""
        t = self.trainer
        t.save("last.pth", epoch + 1, t.iteration, full=True)

    def after_train(self) -> None:
        """Publish the stage's outputs together, with the learned caps' relu_cap.txt when step 3 trained them."""
        t = self.trainer
        learned = t.evaluation.best_caps if t.learned_caps else None
        t.outputs.publish({t.caps_file(): t.caps_text(learned)} if learned else None)


class LoggerHook(HookBase):
    """The epoch line: losses (the family's terms), lr, images/s, val mAP and val loss when evaluated,
    ``*best*`` when best.pth was written, minutes since the stage started."""

    def after_epoch(self, epoch: int, result: Dict[str, object]) -> None:
        """Log the epoch line (and the early-stop reason, if any)."""
        t, cfg = self.trainer, self.trainer.cfg
        tr = result["train"]
        terms = {k: v for k, v in tr.items() if k not in ("seconds", "images_per_s")}
        msg = (f"[{t.stage.name}] epoch {epoch + 1}/{cfg.num_epochs} {t.family.loss_line(terms)} "
               f"lr {t.optimizer.param_groups[0]['lr']:.2e} {tr['images_per_s']:.1f} img/s")
        res = result.get("eval")
        if res is not None:
            msg += f" | val mAP {res['map']:.4f}"
            if "tile_map" in res:
                msg += f" (whole images; tiles {res['tile_map']:.4f})"
            if "coco" in res:
                msg += f" COCO mAP {res['coco']['map']:.4f}"
            msg += f" loss {res['loss'].get('total', float('nan')):.4f}"
            if result.get("best"):
                msg += " *best*"
        t.log(f"{msg} ({(time.time() - t.t_start) / 60:.1f} min)")
        if result.get("stop"):
            t.log(f"[{t.stage.name}] {result['stop']}")
