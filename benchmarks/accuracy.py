#!/usr/bin/env python3
"""The accuracy matrix: datasets x seeds x stages, each cell a full pipeline run, and the table of it.

    python3 benchmarks/accuracy.py                   # cards, raccoon, shapes, dense, dense_tiles; seeds 0 1 2
    python3 benchmarks/accuracy.py --datasets shapes,dense --seeds 0,1 --out runs/acc threads 1
    python3 benchmarks/accuracy.py --table-only --out runs/acc       # the table of runs already made
    python3 benchmarks/accuracy.py --datasets plates=my_configs/plates.py --seeds 0,1,2   # your own config

Every (dataset, seed) runs `tools/run_pipeline.py --config examples/<config> seed K` as its own
process, with its checkpoints, logs and chip files under OUT/<dataset>/seed<K> and the stage table in
OUT/<dataset>/seed<K>/stages.json (a run whose stages.json exists is not run again: delete it to
rerun). Overrides after the options apply to every run. The shapes sets are generated first when
missing (`make_shapes.py`, `--dense` for the dense one) with their meta files, once, with make_shapes'
seed 0: every seed trains on the same images, so the seeds vary the training only (README command (a)
and benchmarks/demo_check.py make each seed's own images with that seed); dense_tiles is the dense
set cut into 2 x 2 tiles with 16 px overlap (`tools/tile_voc.py`, examples/shapes_dense_tiles.py);
cards and raccoon read ../shared/data; roadsigns and facemask (not run by default) read data/roadsigns and
data/facemask, whose images docs/results/roadsigns.md and docs/results/facemask.md say where to get. A
dataset given as NAME=CONFIG is any config of your own (a copy of configs.py with the dataset fields
changed), run like the examples. Each run's step-4 best.pth is converted into the chip model and
checked against it (tools/convert_to_chip.py, tools/chip_eval.py --check; OUT/<dataset>/seed<K>/chip.json,
left out with --no-chip; a run with a chip.json is not checked again). For a tiled set each run's step-1 and step-4 best.pth are also
scored on the whole images (`tools/eval_voc.py --stitch --json`, OUT/<dataset>/seed<K>/whole_<stage>.json),
and a second table holds those. Each run's step-4 best.pth is also scored against the better of step 1
and the float control with a paired bootstrap over the val images (`tools/eval_voc.py --against`, with
`--stitch` where the config scores the whole images; OUT/<dataset>/seed<K>/cost_interval.json): the 95%
interval of the quantization cost as the val images drawn move it (docs/pipeline.md, "How far a mAP can
move with the val images"). Then OUT/accuracy.md and OUT/accuracy.json: per dataset and stage the mean, min and
max best mAP@0.5 over the seeds, and the quantization cost per seed, step 4 - max(step 1, control) (mean,
worst), the goal being a mean within 1 point and no seed more than 2 points below. Every run trains the float
control too (`run_pipeline.py --control`: the float model trained as long as steps 2-4, with their
schedules; gnetmdk/engine/control.py), unless --no-control.
Long runs (about 20 minutes per cell on 2 CPU cores); never part of the tests.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

from gnetmdk.config.cli import Parser
from gnetmdk.engine.cli import tool_main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: dataset name -> (example config, how to make it when missing: None, "shapes", "dense" or "dense_tiles")
DATASETS = {"cards": ("examples/cards.py", None), "raccoon": ("examples/raccoon.py", None),
            "shapes": ("examples/shapes.py", "shapes"), "dense": ("examples/shapes_dense.py", "dense"),
            "dense_tiles": ("examples/shapes_dense_tiles.py", "dense_tiles"),
            "roadsigns": ("examples/roadsigns.py", None), "facemask": ("examples/facemask.py", None)}
#: the datasets run when --datasets is not given (roadsigns and facemask need their images fetched first)
DEFAULT_DATASETS = ("cards", "raccoon", "shapes", "dense", "dense_tiles")
#: a real set that is not in the repository -> the page that says where to get it
FETCHED = {"roadsigns": "docs/results/roadsigns.md", "facemask": "docs/results/facemask.md"}
#: a tiled set: (the set it is cut from, tiles per side, overlap in pixels)
TILED = {"dense_tiles": ("dense", 2, 16)}
#: the stages a tiled set's runs are scored at on the whole images
WHOLE_STAGES = ("step1", "step4")
STAGES = ("step1", "step2", "cal", "step3", "step4", "control")


def run_dir(out: str, dataset: str, seed: int) -> str:
    return os.path.join(out, dataset, f"seed{seed}")


def pipeline_command(dataset: str, seed: int, out: str, overrides: Sequence[str], control: bool = True) -> List[str]:
    """The run_pipeline command of one cell (its outputs under run_dir), with the float control
    (``--control``) unless ``control`` is False."""
    d = run_dir(out, dataset, seed)
    return [sys.executable, os.path.join(ROOT, "tools", "run_pipeline.py"), "--config",
            os.path.join(ROOT, DATASETS[dataset][0]), "--json", os.path.join(d, "stages.json"),
            *(["--control"] if control else []),
            "seed", str(seed), "progress", "false", "checkpoint_root", os.path.join(d, "checkpoint"),
            "log_root", os.path.join(d, "log"), "model_root", os.path.join(d, "model"), *overrides]


def _dataset_dir(dataset: str) -> str:
    from gnetmdk.config import build_config, load_config_class
    return build_config(load_config_class(os.path.join(ROOT, DATASETS[dataset][0])), []).dataset_dir


def prepare(dataset: str) -> None:
    """Generate a synthetic set (and its meta files) when its folder is missing, cut a tiled set from its
    source; xml_2_txt for all."""
    config, make = DATASETS[dataset]
    from gnetmdk.config import build_config, load_config_class
    cfg = build_config(load_config_class(os.path.join(ROOT, config)), [])
    if dataset in FETCHED and not os.path.isdir(cfg.dataset_dir):
        raise FileNotFoundError(f"dataset {dataset}: {cfg.dataset_dir} is missing: {FETCHED[dataset]} says where to "
                                f"get the images and annotations")
    if dataset in TILED and not os.path.isdir(cfg.dataset_dir):
        source, n, overlap = TILED[dataset]
        src_dir = _dataset_dir(source)
        if not os.path.isdir(src_dir):
            subprocess.run([sys.executable, os.path.join(ROOT, "tools", "make_shapes.py"), src_dir, "--dense"],
                           check=True, cwd=ROOT)
        subprocess.run([sys.executable, os.path.join(ROOT, "tools", "tile_voc.py"), src_dir, cfg.dataset_dir,
                        "--tiles", str(n), "--overlap", str(overlap), "--classes", ",".join(cfg.VOC_CLASSES)],
                       check=True, cwd=ROOT)
    elif make and not os.path.isdir(cfg.dataset_dir):
        lo, hi = cfg.shapes_objects                                 # shapes per image (config shapes_objects)
        n_train, n_val = cfg.shapes_images                          # train and val images (config shapes_images)
        cmd = [sys.executable, os.path.join(ROOT, "tools", "make_shapes.py"), cfg.dataset_dir, "--objects", str(lo), str(hi),
               "--num-train", str(n_train), "--num-val", str(n_val)] + (["--upright"] if cfg.shapes_upright else [])
        subprocess.run(cmd + (["--dense"] if make == "dense" else []), check=True, cwd=ROOT)
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "xml_2_txt.py"), "--config",
                    os.path.join(ROOT, config)], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)


def whole_image_command(dataset: str, seed: int, out: str, stage: str, overrides: Sequence[str]) -> List[str]:
    """The eval_voc --stitch command scoring one run's ``stage`` best.pth on the whole images."""
    d = run_dir(out, dataset, seed)
    return [sys.executable, os.path.join(ROOT, "tools", "eval_voc.py"),
            os.path.join(d, "checkpoint", stage, "best.pth"), "--config", os.path.join(ROOT, DATASETS[dataset][0]),
            "--stitch", "--json", os.path.join(d, f"whole_{stage}.json"), "seed", str(seed), "progress", "false",
            *overrides]


def interval_command(dataset: str, seed: int, out: str, rows: Sequence[dict],
                     overrides: Sequence[str]) -> Optional[List[str]]:
    """The eval_voc command giving one run's quantization cost a paired bootstrap interval: its step-4
    best.pth ``--against`` the better of step 1's and the float control's (the model the cost is taken
    against), with ``--stitch`` where the config scores whole images (``eval_stitch``), the JSON in
    OUT/<dataset>/seed<K>/cost_interval.json. None when ``rows`` (run_pipeline's) lack step 1 or step 4."""
    from gnetmdk.config import build_config, load_config_class
    from gnetmdk.engine.control import control_configs
    best = {r["stage"]: r.get("best_map") for r in rows}
    if best.get("step1") is None or best.get("step4") is None:
        return None
    d = run_dir(out, dataset, seed)
    config = os.path.join(ROOT, DATASETS[dataset][0])
    klass = load_config_class(config)
    where = ["checkpoint_root", os.path.join(d, "checkpoint")]
    first = build_config(klass, where, step=1)
    ref = os.path.join(first.checkpoint_dir(1), "best.pth")
    if best.get("control") is not None and best["control"] >= best["step1"]:
        ref = os.path.join(control_configs(klass, where)[-1].checkpoint_dir(1), "best.pth")
    step4 = os.path.join(build_config(klass, where, step=4).checkpoint_dir(4), "best.pth")
    return [sys.executable, os.path.join(ROOT, "tools", "eval_voc.py"), step4, "--config", config, "--against", ref,
            *(["--stitch"] if first.eval_stitch else []), "--json", os.path.join(d, "cost_interval.json"),
            "seed", str(seed), "progress", "false", *overrides]


def cost_interval(dataset: str, seed: int, out: str) -> Optional[dict]:
    """One run's cost_interval.json: {"interval": the paired 95% interval (low, high) of step 4 - reference
    mAP, "samples": every resample's difference (a list, in draw order), "num_images", "seed" (the
    bootstrap's)}, mAP as fractions; None when the run has none."""
    path = os.path.join(run_dir(out, dataset, seed), "cost_interval.json")
    if not os.path.isfile(path):
        return None
    with open(path) as fh:
        b = json.load(fh)["bootstrap"]
    return {"interval": tuple(float(x) for x in b["interval_diff"]), "samples": b.get("samples_diff"),
            "num_images": b.get("num_images"), "seed": b.get("seed")}


def mean_interval(found: Sequence[Optional[dict]], level: float = 0.95) -> Optional[Tuple[float, float]]:
    """The interval of the mean cost over the seeds: every run scored on the same images with the same
    bootstrap seed drew the same resamples, so each resample's differences are averaged over the runs and
    the percentile interval taken of those means (gnetmdk.evaluation.voc.bootstrap_map). None unless every
    run has its samples from the same draws."""
    import numpy as np
    if not found or any(f is None or not f.get("samples") for f in found):
        return None
    if len({(f["num_images"], f["seed"], len(f["samples"])) for f in found}) != 1:
        return None
    means = np.mean(np.array([f["samples"] for f in found], dtype=np.float64), axis=0)
    lo, hi = np.quantile(means, [(1.0 - level) / 2.0, (1.0 + level) / 2.0])
    return float(lo), float(hi)


def chip_check(dataset: str, seed: int, out: str, overrides: Sequence[str]) -> dict:
    """Convert one run's step-4 best.pth into the chip model (OUT/<dataset>/seed<K>/model) and compare it
    with the checkpoint on the val split (tools/chip_eval.py --check: every activation code of every
    layer, and the mAP); the output in chip_check.log and returned:
    {"rc": chip_eval's exit status (0 equal, 1 not; 2 the check could not run), "codes", "mismatches",
    "chip_map", "step4_map"}. Only a verdict (rc 0 or 1) is kept in chip.json, so a check that could not
    run (a refused checkpoint, a missing file) is tried again on the next run of the matrix."""
    import re
    d = run_dir(out, dataset, seed)
    config = os.path.join(ROOT, DATASETS[dataset][0])
    model_dir = os.path.join(d, "model")
    with open(os.path.join(d, "chip_check.log"), "w") as log:
        rc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "convert_to_chip.py"),
                             os.path.join(d, "checkpoint", "step4", "best.pth"), "--config", config, "--out", model_dir,
                             "--no-onnx"], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode
        if rc == 0:
            res = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "chip_eval.py"),
                                  os.path.join(model_dir, "chip_model.json"), "--config", config, "--check",
                                  "seed", str(seed), *overrides], cwd=ROOT, capture_output=True, text=True)
            rc = res.returncode
            log.write(res.stdout + res.stderr)
    with open(os.path.join(d, "chip_check.log")) as fh:
        text = fh.read()
    total = re.search(r"^total\s+(\d+)\s+(\d+)$", text, re.M)
    maps = re.search(r"step-4 checkpoint mAP ([0-9.]+) \| chip mAP ([0-9.]+)", text)
    verdict = {"rc": rc, "codes": int(total.group(1)) if total else None,
               "mismatches": int(total.group(2)) if total else None,
               "step4_map": float(maps.group(1)) if maps else None, "chip_map": float(maps.group(2)) if maps else None}
    path = os.path.join(d, "chip.json")
    if rc in (0, 1):
        with open(path + ".tmp", "w") as fh:
            json.dump(verdict, fh, indent=2)
        os.replace(path + ".tmp", path)
    elif os.path.isfile(path):
        os.remove(path)                       # an older verdict no longer describes this run's model
    return verdict


def chip_lines(out: str, runs: Dict[str, List[int]]) -> List[str]:
    """One line per run with a chip.json: the chip model against step 4 (codes, mismatches, mAP); a run
    whose check could not run (a chip_check.log and no chip.json) is named as not checked."""
    lines = []
    for ds, seeds in runs.items():
        for seed in seeds:
            path = os.path.join(run_dir(out, ds, seed), "chip.json")
            if not os.path.isfile(path) and os.path.isfile(os.path.join(run_dir(out, ds, seed), "chip_check.log")):
                lines.append(f"- {ds} seed {seed}: chip model not checked: the check could not run (its output is in "
                             f"{os.path.join(run_dir(out, ds, seed), 'chip_check.log')}; the next run tries again)")
            if os.path.isfile(path):
                with open(path) as fh:
                    v = json.load(fh)
                verdict = "equal" if v["rc"] == 0 else f"NOT equal (exit {v['rc']})"
                lines.append(f"- {ds} seed {seed}: chip model {verdict}: {v['mismatches']} mismatches over {v['codes']} "
                             f"codes, chip mAP {v['chip_map']} (step 4 {v['step4_map']})")
    return lines


def whole_rows(dataset: str, seed: int, out: str) -> List[dict]:
    """run_pipeline-like rows ({"stage", "best_map"}) of the whole-image scores present for one run."""
    rows = []
    for stage in WHOLE_STAGES:
        path = os.path.join(run_dir(out, dataset, seed), f"whole_{stage}.json")
        if os.path.isfile(path):
            with open(path) as fh:
                rows.append({"stage": stage, "best_map": json.load(fh)["stitched"]["map"]})
    return rows


def aggregate(results: Dict[str, Dict[int, List[dict]]],
              intervals: Optional[Dict[str, Dict[int, Optional[dict]]]] = None) -> Dict[str, dict]:
    """Per dataset: {"seeds", "stages": {stage: {"mean", "min", "max"}}, "delta": [the quantization cost per
    seed], "delta_mean", "delta_worst", "goal", "delta_interval": [per seed the cost's paired 95% bootstrap
    interval (low, high) over the val images, or None], "delta_mean_interval": that of the mean cost or None}
    from {dataset: {seed: run_pipeline's --json rows}} and {dataset: {seed: :func:`cost_interval`'s dict}};
    mAP as fractions. The quantization cost is step4 - max(step1, control) when the run has the float control
    (gnetmdk/engine/control.py), else step4 - step1. "goal": its mean at least -0.01 and every seed's
    at least -0.02."""
    table = {}
    for ds, runs in results.items():
        stages: Dict[str, dict] = {}
        deltas = []
        for seed in sorted(runs):
            best = {r["stage"]: r.get("best_map") for r in runs[seed]}
            if best.get("step1") is not None and best.get("step4") is not None:
                ref = max(best["step1"], best["control"]) if best.get("control") is not None else best["step1"]
                deltas.append(best["step4"] - ref)
        for st in STAGES:
            vals = [r.get("best_map") for seed in sorted(runs) for r in runs[seed] if r["stage"] == st]
            vals = [v for v in vals if v is not None]
            if vals:
                stages[st] = {"mean": statistics.fmean(vals), "min": min(vals), "max": max(vals)}
        got = (intervals or {}).get(ds, {})
        found = [got.get(seed) for seed in sorted(runs)]
        table[ds] = {"seeds": sorted(runs), "stages": stages, "delta": deltas,
                     "delta_interval": [None if f is None else f["interval"] for f in found],
                     "delta_mean_interval": mean_interval(found),
                     "delta_mean": statistics.fmean(deltas) if deltas else None,
                     "delta_worst": min(deltas) if deltas else None,
                     "goal": bool(deltas) and statistics.fmean(deltas) >= -0.01 and min(deltas) >= -0.02}
    return table


def format_table(table: Dict[str, dict]) -> str:
    """Markdown: one row per dataset, mean [min-max] per stage, the cost in points (mean, worst), the goal,
    and per seed the cost's paired 95% interval over the val images where there is one."""
    head = ("| dataset | seeds | " + " | ".join(STAGES) +
            " | step 4 - max(step 1, control) (points): mean, worst | goal | its 95% interval over the val images: "
            "the mean's; per seed (points) |")
    lines = [head, "|" + "---|" * (len(STAGES) + 5)]
    for ds, row in table.items():
        cells = []
        for st in STAGES:
            s = row["stages"].get(st)
            cells.append("" if s is None else f"{s['mean']:.3f} [{s['min']:.3f}-{s['max']:.3f}]")
        d = ("" if row["delta_mean"] is None else
             f"{100 * row['delta_mean']:+.1f}, {100 * row['delta_worst']:+.1f}")
        ivs = row.get("delta_interval") or []
        iv = "; ".join("-" if v is None else f"[{100 * v[0]:+.1f}, {100 * v[1]:+.1f}]" for v in ivs) \
            if any(v is not None for v in ivs) else ""
        m = row.get("delta_mean_interval")
        if iv:
            iv = ("-" if m is None else f"mean [{100 * m[0]:+.1f}, {100 * m[1]:+.1f}]") + "; " + iv
        lines.append(f"| {ds} | {','.join(map(str, row['seeds']))} | " + " | ".join(cells) +
                     f" | {d} | {'met' if row['goal'] else 'not met'} | {iv} |")
    return "\n".join(lines)


def parse_args(argv):
    """The command line (module docstring): options first, then config overrides (KEY VALUE / KEY=VALUE).

    Returns:
        (argparse.Namespace, [override words]).
    """
    p = Parser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
               epilog=__doc__)
    p.add_argument("--datasets", default=",".join(DEFAULT_DATASETS),
                   help="comma-separated subset of " + ",".join(DATASETS) + ", or NAME=CONFIG for a config of your own")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "accuracy"))
    p.add_argument("--table-only", action="store_true", help="only aggregate the runs already in --out")
    p.add_argument("--no-chip", action="store_true", help="do not convert and check the chip models")
    p.add_argument("--no-control", action="store_true",
                   help="do not train the float control (the cost is then step 4 - step 1)")
    return p.parse_with_overrides(argv)


@tool_main
def main(argv) -> int:
    """Run (or only tabulate) the matrix (module docstring); returns the exit status (0, or 2 for bad input)."""
    args, overrides = parse_args(argv)
    datasets, bad = [], []
    for item in (d.strip() for d in args.datasets.split(",") if d.strip()):
        name, eq, config = item.partition("=")
        if eq and name and os.path.isfile(config) and name not in DATASETS:
            DATASETS[name] = (os.path.abspath(config), None)
        elif eq:
            bad.append(item)
            continue
        elif name not in DATASETS:
            bad.append(item)
            continue
        datasets.append(name)
    if bad:
        print(f"error: --datasets {bad}: choose from {list(DATASETS)}, or give NAME=CONFIG with a new name and an "
              f"existing config file", file=sys.stderr)
        return 2
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        print(f"error: --seeds {args.seeds!r}: comma-separated integers", file=sys.stderr)
        return 2
    results: Dict[str, Dict[int, List[dict]]] = {}
    intervals: Dict[str, Dict[int, Optional[Tuple[float, float]]]] = {}
    whole: Dict[str, Dict[int, List[dict]]] = {}
    for ds in datasets:
        if not args.table_only:
            try:
                prepare(ds)
            except FileNotFoundError as e:
                print(f"error: {e}", file=sys.stderr)
                return 2
        for seed in seeds:
            js = os.path.join(run_dir(args.out, ds, seed), "stages.json")
            if not os.path.isfile(js) and not args.table_only:
                os.makedirs(os.path.dirname(js), exist_ok=True)
                t0 = time.time()
                with open(os.path.join(os.path.dirname(js), "pipeline.log"), "w") as log:
                    rc = subprocess.run(pipeline_command(ds, seed, args.out, overrides, not args.no_control), cwd=ROOT,
                                        stdout=log,
                                        stderr=subprocess.STDOUT).returncode
                print(f"{ds} seed {seed}: exit {rc}, {time.time() - t0:.0f}s", flush=True)
            if os.path.isfile(js):
                with open(js) as fh:
                    results.setdefault(ds, {})[seed] = json.load(fh)
            if (os.path.isfile(js) and not args.table_only and not args.no_chip
                    and not os.path.isfile(os.path.join(run_dir(args.out, ds, seed), "chip.json"))):
                chip_check(ds, seed, args.out, overrides)
            if (os.path.isfile(js) and not args.table_only
                    and not os.path.isfile(os.path.join(run_dir(args.out, ds, seed), "cost_interval.json"))):
                cmd = interval_command(ds, seed, args.out, results[ds][seed], overrides)
                if cmd is not None:
                    subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, check=False)
            intervals.setdefault(ds, {})[seed] = cost_interval(ds, seed, args.out)
            if ds in TILED and os.path.isfile(js) and not args.table_only:
                for stage in WHOLE_STAGES:
                    if not os.path.isfile(os.path.join(run_dir(args.out, ds, seed), f"whole_{stage}.json")):
                        subprocess.run(whole_image_command(ds, seed, args.out, stage, overrides), cwd=ROOT,
                                       stdout=subprocess.DEVNULL, check=False)
            if ds in TILED:
                rows = whole_rows(ds, seed, args.out)
                if rows:
                    whole.setdefault(f"{ds} (whole images)", {})[seed] = rows
    table = aggregate(results, intervals)
    text = format_table(table)
    if whole:
        table.update(aggregate(whole))
        text += "\n\nTiled sets scored on the whole images (tools/eval_voc.py --stitch):\n\n" + \
            format_table(aggregate(whole))
    chips = chip_lines(args.out, {ds: seeds for ds in datasets})
    if chips:
        text += "\n\nChip models against step 4 (tools/chip_eval.py --check on the val split):\n\n" + "\n".join(chips)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "accuracy.md"), "w") as fh:
        fh.write(text + "\n")
    with open(os.path.join(args.out, "accuracy.json"), "w") as fh:
        json.dump(table, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
