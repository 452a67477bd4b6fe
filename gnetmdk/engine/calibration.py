"""Calibration, the stage ``cal``: the pass that measures the activation ranges and writes them.

The chip's cap calibration itself (gnetmdk.models.calibration) is what GNetDet's family calibrates with
(GNetDetFamily.calibrate), so it sits on the models' floor; it is re-exported here
for the trainer and the tools. :func:`run_calibration` is the stage as the trainer runs it: the
calibration stage trains nothing, so it is a part of its own beside the training loop
(docs/pipeline.md, "What each edit does").
"""
from __future__ import annotations

import os
import time
from typing import Dict

from gnetmdk.dist.comm import barrier
from gnetmdk.models.calibration import (CAP_HIST_BINS, OUTPUT_BATCHES, OUTPUT_FACTORS, calibrate_caps, measure_caps,
                                        percentile, refine_caps_for_output)

__all__ = ["CAP_HIST_BINS", "OUTPUT_BATCHES", "OUTPUT_FACTORS", "calibrate_caps", "measure_caps", "percentile",
           "refine_caps_for_output", "run_calibration"]


def run_calibration(trainer, t_start: float) -> Dict[str, object]:
    """Run the stage ``cal`` for a trainer whose data and step-2 model are set up (Trainer.run does it).

    With ``eval_before`` the step-2 model is evaluated first (the summary's ``entry_map``). The family
    measures and sets the activation ranges over the training data in order, without augmentation
    (DetectorFamily.calibrate: GNetDet's ReLU caps, PP-YOLO's uint8 ranges); the model is evaluated with
    its activations quantized at those ranges (step 3 before training), and that mAP is the stage's
    best and final mAP (the trainer's evaluation hook records it). cal.pth and the ranges file (GNetDet's
    model/relu_cap.txt for the chip) are written as one set: both new or, on any failure, both as they
    were.

    Args:
        trainer: a gnetmdk.engine.trainer.Trainer after build_data and build_model.
        t_start: the stage's start (time.time()), for the summary's seconds.

    Returns:
        The trainer's summary, updated with best_map, final_map, caps (a list of floats), seconds,
        best_path (cal.pth) and cap_file.
    """
    t, cfg = trainer, trainer.cfg
    if cfg.eval_before:
        res = t.evaluate("entry")
        t.summary["entry_map"] = res["map"]
        t.log(f"[cal] step-2 model mAP {res['map']:.4f}")

    def batches():
        t.train_sampler.set_epoch(0)
        return (images for images, _, _, _ in t.train_loader)

    cal = t.family.calibrate(t.model, batches, cfg, t.device, t._progress)
    caps = cal["caps"]
    how = cal["how"].format(batches=len(t.train_loader))
    t.log(f"[cal] {cal['label']} ({how}): " + " ".join(f"{c:.3g}" for c in caps))
    res = t.evaluate("cal")
    t.evaluation.record(res["map"])
    t.log(f"[cal] mAP with quantized activations and these {cal['label']} (step 3 before training): "
          f"{res['map']:.4f}")
    path, cap_file = os.path.join(t.out_dir, "cal.pth"), os.path.join(cfg.model_root, cal["file"][0])
    if t.main:
        t.outputs.save_set({"cal.pth": t.state(0, 0, False)}, {cap_file: cal["file"][1]})
    barrier()
    t.summary.update(best_map=res["map"], final_map=res["map"], caps=caps, seconds=time.time() - t_start,
                     best_path=path, cap_file=cap_file)
    t.log(f"[cal] wrote {path} and {cap_file}")
    return t.summary
