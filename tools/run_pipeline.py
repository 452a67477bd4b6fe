#!/usr/bin/env python3
"""Run every stage of the pipeline in order and print the per-stage mAP table.

    python3 tools/run_pipeline.py --config examples/shapes.py
    python3 tools/run_pipeline.py --config configs.py --stages step1,step2,cal,step3,step4 threads 2

Each stage runs exactly as `train.py --step N` / `train.py --cal` would (same trainer, same
checkpoints), with the config's per_step values; overrides after the options apply to every stage.
`--make-shapes` first generates the synthetic shapes dataset and its meta files (`shapes_objects`
shapes per image, 1-3 unless the config sets it; `shapes_images` train and val images, 240 and 60).
After the table, the line "step 1 plateau" says how far step 1's val mAP moved over the last quarter of
its epochs (gnetmdk.engine.control.plateau_span): under 1 point, the float model had finished training.
`--control` then trains the float control (gnetmdk/engine/control.py): step 1's float model trained on with
the schedules of steps 2, 3 and 4 (as many epochs, the same learning rates and EMA), each from the previous
one's best.pth, its outputs under <checkpoint_root>/control/; the table gets a "control" row and the line
"quantization cost: step 4 - max(step 1, control)".
`--plots DIR` writes stages.png/.json after the table: entry and best mAP per stage as bars; for GNetDet
also layer_drift.png/.json: each sublayer's output drift from step 1 along the stages to the chip model
(converted in memory from step 4) on the first 64 val images, as tools/stage_report.py computes it
(needs matplotlib).
`--json FILE` writes the table's rows; each also holds ``weights_sha256``, a digest of the weights in the
stage's best.pth (gnetmdk.checkpoint.weights_sha256): two runs whose digests agree trained the same bits;
and ``environment``, what that best.pth was trained with (gnetmdk.utils.environment: threads, torch, CPU
kernels, OpenCV, numpy, Python; CUDA, cuDNN and the GPU on a GPU).
"""
import argparse
import json
import os
import sys
import time

from gnetmdk.config import build_config, load_config_class
from gnetmdk.config.cli import Parser, fail
from gnetmdk.engine.cli import run_stage, tool_main, user_errors
from gnetmdk.engine.control import PLATEAU_SPAN, plateau_span

ORDER = ["step1", "step2", "cal", "step3", "step4"]


def stage_config(klass, name, overrides):
    if name == "cal":
        return build_config(klass, overrides, cal=True)
    return build_config(klass, overrides, step=int(name[-1]))


def format_table(rows):
    """Rows of (stage, entry mAP, best mAP, best epoch, seconds to best, seconds[, best.pth]) -> printable table.

    "best at" is the epoch whose evaluation gave the best mAP and the seconds from the stage's start
    until its best.pth was written ("-" for cal, or for a best from before a resume).
    """
    lines = ["stage    entry mAP   best mAP   best at (epoch, s)  seconds",
             "-------  ----------  ---------  ------------------  -------"]
    for name, entry, best, best_epoch, best_secs, secs, *_ in rows:
        e = "-" if entry is None else f"{entry:.4f}"
        b = "-" if best is None else f"{best:.4f}"
        at = "-" if best_epoch is None or best_secs is None else f"{best_epoch}, {best_secs:.0f}"
        lines.append(f"{name:<7}  {e:>10}  {b:>9}  {at:>18}  {secs:7.0f}")
    return "\n".join(lines)


def drift_plot(klass, overrides, folder, max_images=64):
    """Write ``folder``/layer_drift.png/.json from the run's GNetDet checkpoints (step1..step4 best.pth,
    and the chip model converted in memory from step 4); returns the paths written ([] for a family
    without the chip's stages, or when fewer than two stages are there to compare)."""
    from gnetmdk.dataset.dataset import build_dataset
    from gnetmdk.evaluation.plots import plot_layer_drift
    from gnetmdk.chip import convert_checkpoint
    from gnetmdk.chip.report import layer_drift
    cfg = build_config(klass, overrides, step=4)
    from gnetmdk.models import get_family
    if get_family(cfg.model_name).name != "gnetdet":
        return []
    ckpts = {f"step{k}": os.path.join(cfg.checkpoint_dir(k), "best.pth") for k in range(1, 5)}
    ckpts = {k: (v if os.path.isfile(v) else None) for k, v in ckpts.items()}
    chip = convert_checkpoint(ckpts["step4"], list(cfg.VOC_CLASSES))[0] if ckpts["step4"] else None
    if sum(v is not None for v in ckpts.values()) + (chip is not None) < 2:
        return []
    dataset = build_dataset(cfg, "valid")
    dataset.augment = False
    drift = layer_drift(dataset, ckpts, chip, 4, cfg, max_images)
    return plot_layer_drift(drift.layers, drift.stages, os.path.join(folder, "layer_drift.png"), drift.reference,
                            title=f"{cfg.DS_NAME}: output drift per layer from {drift.reference} "
                                  f"({drift.num_images} val images)")


def best_record(path):
    """(weights_sha256 of the ``model`` weights in a stage's best.pth, its ``environment`` record) or
    (None, None) where the stage wrote none. Digests agree exactly when two runs trained the same bits;
    the record (gnetmdk.utils.environment) says what the stage computed with (None in a checkpoint
    written before it was recorded)."""
    if not path or not os.path.isfile(path):
        return None, None
    from gnetmdk.checkpoint import load_checkpoint, weights_sha256
    st = load_checkpoint(path)
    return weights_sha256(st["model"]), st.get("environment")


def parse_args(argv):
    """The command line (module docstring): options first, then config overrides (KEY VALUE / KEY=VALUE).

    Returns:
        (argparse.Namespace, [override words]).
    """
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None)
    p.add_argument("--stages", default=",".join(ORDER), help="comma-separated subset of " + ",".join(ORDER))
    p.add_argument("--make-shapes", action="store_true",
                   help="first generate the synthetic shapes dataset in the config's dataset_dir, and its meta files")
    p.add_argument("--json", default=None, help="also write the table as JSON to this file")
    p.add_argument("--control", action="store_true",
                   help="also train the float control: the float model as long as steps 2-4 train, with their schedules")
    p.add_argument("--plots", default=None, metavar="DIR",
                   help="also write stages.png/.json (entry and best mAP per stage) in DIR after the table "
                        "(created if missing; needs matplotlib)")
    return p.parse_with_overrides(argv)


@tool_main
def main(argv) -> int:
    """Run the tool; returns the exit status (0 ok, 2 a user error)."""
    args, overrides = parse_args(argv)
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    bad = [s for s in stages if s not in ORDER]
    if bad:
        return fail(f"unknown stage(s) {bad}: choose from {ORDER}")
    made_plots = args.plots is not None and not os.path.exists(args.plots)
    if args.plots is not None:                      # refused before any training, not after it
        from gnetmdk.evaluation.plots import prepare_plot_dir, require_matplotlib
        prepare_plot_dir(args.plots)
        require_matplotlib()
    try:
        klass = load_config_class(args.config)
        if args.make_shapes:
            from gnetmdk.dataset.shapes import make_shapes_dataset
            from gnetmdk.dataset.voc import convert_voc_to_meta
            cfg = build_config(klass, overrides)
            lo, hi = cfg.shapes_objects
            num_train, num_val = cfg.shapes_images
            make_shapes_dataset(cfg.dataset_dir, classes=tuple(cfg.VOC_CLASSES), seed=cfg.seed,
                                min_objects=int(lo), max_objects=int(hi), num_train=int(num_train),
                                num_val=int(num_val), upright=bool(cfg.shapes_upright))
            convert_voc_to_meta(cfg.dataset_dir, cfg.VOC_CLASSES, cfg.train_meta, cfg.valid_meta, seed=cfg.seed)
            print(f"made the shapes dataset in {cfg.dataset_dir} and {cfg.train_meta} / {cfg.valid_meta}")
        rows = []
        step1_plateau, step1_epochs = None, 0
        t0 = time.time()
        for name in stages:
            cfg = stage_config(klass, name, overrides)
            print(f"\n===== {name} =====", flush=True)
            s = run_stage(cfg)
            rows.append((name, s.get("entry_map"), s.get("best_map"), s.get("best_epoch"), s.get("best_seconds"),
                         s.get("seconds", 0.0), s.get("best_path")))
            if name == "step1":
                step1_epochs = int(s.get("num_epochs", cfg.num_epochs))      # min_steps may have added epochs
                step1_plateau = plateau_span(s.get("val_maps", []), step1_epochs)
        if args.control:
            from gnetmdk.engine.control import CONTROL_OF, control_configs
            summaries = []
            for k, cfg in zip(CONTROL_OF, control_configs(klass, overrides)):
                print(f"\n===== control (float, step {k}'s schedule) =====", flush=True)
                summaries.append(run_stage(cfg))
            last = summaries[-1]
            rows.append(("control", summaries[0].get("entry_map"), last.get("best_map"), None, None,
                         sum(x.get("seconds", 0.0) for x in summaries), last.get("best_path")))
    except user_errors() as exc:
        if made_plots:                              # the --plots folder this run created stays only if used
            try:
                os.rmdir(args.plots)
            except OSError:
                pass
        return fail(str(exc))
    print("\nPer-stage mAP@0.5 (entry = the loaded model after the stage's entry edits, before training)")
    print(format_table(rows))
    best = {r[0]: r[2] for r in rows}
    if all(best.get(k) is not None for k in ("step1", "control", "step4")):
        from gnetmdk.engine.control import quantization_cost
        cost = quantization_cost(best["step1"], best["control"], best["step4"])
        print(f"quantization cost: step 4 - max(step 1, control) = {100 * cost:+.1f} points")
    if step1_plateau is not None:
        span, first, n = step1_plateau
        verdict = ("at its plateau" if span < PLATEAU_SPAN else
                   "still moving: the float model had not finished training (train step 1 longer, and read the "
                   "quantization cost against the float control, --control)")
        print(f"step 1 plateau: val mAP moved {100 * span:.1f} points over its last quarter (epochs {first}-"
              f"{step1_epochs}, {n} evaluations): {verdict}")
    print(f"total {time.time() - t0:.0f}s")
    records = []
    for r in rows:
        digest, env = best_record(r[6])
        records.append(dict(stage=r[0], entry_map=r[1], best_map=r[2], best_epoch=r[3], best_seconds=r[4],
                            seconds=r[5], weights_sha256=digest, environment=env))
    if step1_plateau is not None:
        records[0]["plateau_span"] = step1_plateau[0]
    if args.json:
        from gnetmdk.utils.atomic import atomic_write_text
        try:
            atomic_write_text(args.json, json.dumps(records, indent=2) + "\n")   # all or nothing
        except OSError as exc:
            return fail(f"--json '{args.json}' cannot be written ({exc}); the table above is the run's result")
    if args.plots is not None:
        from gnetmdk.evaluation.plots import plot_stages
        written = plot_stages(records, os.path.join(args.plots, "stages.png"))
        written += drift_plot(klass, overrides, args.plots)
        print(f"plots: {', '.join(written)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
