#!/usr/bin/env python3
"""The accuracy matrix: datasets x seeds x stages, each cell a full pipeline run, and the table of it.

    python3 benchmarks/accuracy.py                   # cards, raccoon, shapes, dense, dense_tiles; seeds 0 1 2
    python3 benchmarks/accuracy.py --datasets shapes,dense --seeds 0,1 --out runs/acc threads 1
    python3 benchmarks/accuracy.py --table-only --out runs/acc       # the table of runs already made
    python3 benchmarks/accuracy.py --datasets plates=my_configs/plates.py --seeds 0,1,2   # your own config
    python3 benchmarks/accuracy.py --datasets facemask --seeds 0 --folds 5   # 5-fold cross-validation

Every (dataset, seed) runs `tools/run_pipeline.py --config examples/<config> seed K` as its own
process, with its checkpoints, logs and chip files under OUT/<dataset>/seed<K> and the stage table in
OUT/<dataset>/seed<K>/stages.json (a run whose stages.json exists is not run again: delete it to
rerun). Overrides after the options apply to every run. The shapes sets are generated first when
missing (`make_shapes.py`, `--dense` for the dense one) with their meta files, once, with make_shapes'
seed 0: every seed trains on the same images, so the seeds vary the training only (README command (a)
and benchmarks/demo_check.py make each seed's own images with that seed); dense_tiles is the dense
set cut into 2 x 2 tiles with 16 px overlap (`tools/tile_voc.py`, examples/shapes_dense_tiles.py);
cards and raccoon read ../shared/data; roadsigns and facemask (not run by default) read data/roadsigns and
data/facemask, whose images docs/results/roadsigns.md and docs/results/facemask.md say where to get;
facemask_tiles (examples/facemask_tiles.py) is facemask cut into 2 x 2 tiles with 64 px overlap, cut
when missing. A
dataset given as NAME=CONFIG is any config of your own (a copy of configs.py with the dataset fields
changed), run like the examples. Each run's step-4 best.pth is converted into the chip model and
checked against it (tools/convert_to_chip.py, tools/chip_eval.py --check; OUT/<dataset>/seed<K>/chip.json,
left out with --no-chip; a run with a chip.json is not checked again). For a tiled set each run's step-1 and step-4 best.pth are also
scored on the whole images (`tools/eval_voc.py --stitch --json`, OUT/<dataset>/seed<K>/whole_<stage>.json),
and a second table holds those, unless its config scores every evaluation on the whole images itself
(`eval_stitch`, as facemask_tiles: its stage table is the whole-image table). Each run's step-4 best.pth is also scored against the better of step 1
and the float control with a paired bootstrap over the val images (`tools/eval_voc.py --against`, with
`--stitch` where the config scores the whole images; OUT/<dataset>/seed<K>/cost_interval.json): the 95%
interval of the quantization cost as the val images drawn move it (docs/pipeline.md, "How far a mAP can
move with the val images"). Then OUT/accuracy.md and OUT/accuracy.json: per dataset and stage the mean, min and
max best mAP@0.5 over the seeds, and the quantization cost per seed, step 4 - max(step 1, control) (mean,
worst), the goal being a mean within 1 point and no seed more than 2 points below; accuracy.md also names
what each run's stages were trained with (threads, torch, CPU kernels, OpenCV, ...: the record in their
best.pth, gnetmdk.utils.environment), since a seed repeats its numbers only where that agrees. Every run trains the float
control too (`run_pipeline.py --control`: the float model trained as long as steps 2-4, with their
schedules; gnetmdk/engine/control.py), unless --no-control.
With --folds K (or I,J/K for some of them) every dataset is run once per val fold of K-fold
cross-validation instead of on its own split (`tools/xml_2_txt.py --fold I/K`, meta files named
<DS_NAME>_fold<I>of<K>, runs under OUT/<dataset>/fold<I>of<K>/seed<S>): the K folds of one split seed
score disjoint val images that together cover every image once, so a set too small for one val split to
resolve a point or two is scored on all its images (docs/pipeline.md, "Cross-validation folds"). The
table then has a row per fold and a row "<dataset> (folds pooled)" over every fold and seed, whose mean
cost's interval averages each resample over the runs (independent draws on the disjoint folds). A set
whose split comes from ImageSets/Main lists has no folds (xml_2_txt refuses them). A tiled set's fold is
its source cut again with that fold's split (`tools/tile_voc.py --fold I/K` into <its folder>_fold<I>of<K>):
facemask_tiles' fold I holds the tiles of facemask's fold-I photos (dense_tiles has no folds: its
source's split comes from make_shapes' ImageSets lists, and tile_voc refuses a fold there).
With --from BASE a variant of the quantized stages is measured against the same float models: each
cell copies BASE's step-1 folder and step-2 best.pth (and its control folder) of the same dataset and seed,
reruns only cal, step 3 and step 4 with the overrides (`run_pipeline.py --stages cal,step3,step4`), and
takes BASE's step-1, step-2 and control rows into its stages.json, so the cost is read against the very
control the base run has (BASE must hold those runs, made with the same dataset, fold, seed and other
overrides). For example, the 10-bit output from the recipe's own step-2 models:

    python3 benchmarks/accuracy.py --datasets raccoon --seeds 0,1,2 --out runs/acc threads 1
    python3 benchmarks/accuracy.py --datasets raccoon --seeds 0,1,2 --out runs/acc10 --from runs/acc threads 1 \
        output_bits 10

Long runs (about 20 minutes per cell on 2 CPU cores); never part of the tests.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
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
            "roadsigns": ("examples/roadsigns.py", None), "facemask": ("examples/facemask.py", None),
            "facemask_tiles": ("examples/facemask_tiles.py", None)}
#: the datasets run when --datasets is not given (roadsigns and the face masks need their images fetched first)
DEFAULT_DATASETS = ("cards", "raccoon", "shapes", "dense", "dense_tiles")
#: a real set that is not in the repository -> the page that says where to get it
FETCHED = {"roadsigns": "docs/results/roadsigns.md", "facemask": "docs/results/facemask.md"}
#: a tiled set: (the set it is cut from, tiles per side, overlap in pixels), as its example config says
TILED = {"dense_tiles": ("dense", 2, 16), "facemask_tiles": ("facemask", 2, 64)}
#: the stages a tiled set's runs are scored at on the whole images (the control where the run has one)
WHOLE_STAGES = ("step1", "step4", "control")
STAGES = ("step1", "step2", "cal", "step3", "step4", "control")


def run_dir(out: str, dataset: str, seed: int) -> str:
    """OUT/<dataset>/seed<K>; a fold's dataset name "<dataset>/fold<I>of<K>" puts it one folder deeper."""
    return os.path.join(out, dataset, f"seed{seed}")


def parse_folds(spec: str) -> List[Tuple[int, int]]:
    """--folds: "5" -> [(0, 5), ..., (4, 5)]; "1,3/5" -> [(1, 5), (3, 5)] (val fold I of K).

    Raises:
        ValueError: not K or I,J,.../K with K >= 2 and each 0 <= I < K, or an I given twice.
    """
    text = str(spec).strip()
    head, slash, k_text = text.rpartition("/")
    try:
        k = int(k_text if slash else text)
        folds = [int(v) for v in head.split(",")] if slash else list(range(k))
    except ValueError:
        raise ValueError(f"--folds {spec!r}: give K (every fold of K) or I,J/K (those folds of K), e.g. 5 or 0,1/5") from None
    if k < 2 or not folds or any(not 0 <= i < k for i in folds) or len(set(folds)) != len(folds):
        raise ValueError(f"--folds {spec!r}: needs K >= 2 and distinct folds I with 0 <= I < K")
    return [(i, k) for i in folds]


def fold_name(dataset: str, fold: Tuple[int, int]) -> str:
    """The table's and the run folder's name of one fold of a dataset: "<dataset>/fold<I>of<K>"."""
    return f"{dataset}/fold{fold[0]}of{fold[1]}"


def fold_overrides(dataset: str, fold: Optional[Tuple[int, int]]) -> List[str]:
    """The config overrides that point a run at a fold's meta files: DS_NAME <DS_NAME>_fold<I>of<K> and
    dataset_path the dataset's own folder (its images stay where they are), or for a tiled set the
    folder of that fold's tiles (:func:`tiled_fold_dir`); [] without a fold."""
    if fold is None:
        return []
    from gnetmdk.config import build_config, load_config_class
    cfg = build_config(load_config_class(os.path.join(ROOT, DATASETS[dataset][0])), [])
    folder = tiled_fold_dir(dataset, fold) if dataset in TILED else os.path.abspath(cfg.dataset_dir)
    return ["DS_NAME", f"{cfg.DS_NAME}_fold{fold[0]}of{fold[1]}", "dataset_path", folder]


def tiled_fold_dir(dataset: str, fold: Tuple[int, int]) -> str:
    """The folder of a tiled set's val fold I of K: <its dataset folder>_fold<I>of<K> (absolute), the
    source cut again with ``tools/tile_voc.py --fold I/K``. A tiled set's split is its source photos'
    (the tiles of one photo never straddle train and val), so each fold is a tiling of its own."""
    return os.path.abspath(_dataset_dir(dataset)) + f"_fold{fold[0]}of{fold[1]}"


def pipeline_command(dataset: str, seed: int, out: str, overrides: Sequence[str], control: bool = True) -> List[str]:
    """The run_pipeline command of one cell (its outputs under run_dir), with the float control
    (``--control``) unless ``control`` is False."""
    d = run_dir(out, dataset, seed)
    return [sys.executable, os.path.join(ROOT, "tools", "run_pipeline.py"), "--config",
            os.path.join(ROOT, DATASETS[dataset][0]), "--json", os.path.join(d, "stages.json"),
            *(["--control"] if control else []),
            "seed", str(seed), "progress", "false", "checkpoint_root", os.path.join(d, "checkpoint"),
            "log_root", os.path.join(d, "log"), "model_root", os.path.join(d, "model"), *overrides]


#: the stages a --from run reruns; the others (and the control) are the base run's
BRANCH_STAGES = ("cal", "step3", "step4")


def prepare_branch(dataset: str, seed: int, base: str, out: str) -> None:
    """Copy into OUT/<dataset>/seed<K> what a --from run starts from: BASE's step-1 folder, its step-2
    best.pth and its control folder (if it has one: the cost interval's reference may be the control).

    Raises:
        FileNotFoundError: BASE has no finished run of this dataset and seed (no stages.json, or no step-1
        or step-2 checkpoint), naming the folder and the command that makes it.
    """
    src, dst = run_dir(base, dataset, seed), run_dir(out, dataset, seed)
    need = [os.path.join(src, "stages.json"), os.path.join(src, "checkpoint", "step1", "best.pth"),
            os.path.join(src, "checkpoint", "step2", "best.pth")]
    missing = [p for p in need if not os.path.isfile(p)]
    if missing:
        raise FileNotFoundError(f"--from {base}: {missing[0]} is missing: run the base first (benchmarks/accuracy.py "
                                f"--datasets {dataset.split('/')[0]} --seeds {seed} --out {base} ...)")
    ck = os.path.join(dst, "checkpoint")
    for name in ("step1", "control"):
        if os.path.isdir(os.path.join(src, "checkpoint", name)):
            shutil.copytree(os.path.join(src, "checkpoint", name), os.path.join(ck, name), dirs_exist_ok=True)
    os.makedirs(os.path.join(ck, "step2"), exist_ok=True)
    shutil.copy2(need[2], os.path.join(ck, "step2", "best.pth"))


def branch_command(dataset: str, seed: int, out: str, overrides: Sequence[str]) -> List[str]:
    """The run_pipeline command of a --from cell: cal, step 3 and step 4 only, from the copied checkpoints, its
    rows in OUT/<dataset>/seed<K>/branch.json."""
    d = run_dir(out, dataset, seed)
    return [sys.executable, os.path.join(ROOT, "tools", "run_pipeline.py"), "--config",
            os.path.join(ROOT, DATASETS[dataset][0]), "--stages", ",".join(BRANCH_STAGES), "--json",
            os.path.join(d, "branch.json"), "seed", str(seed), "progress", "false",
            "checkpoint_root", os.path.join(d, "checkpoint"), "log_root", os.path.join(d, "log"),
            "model_root", os.path.join(d, "model"), *overrides]


def merge_branch_rows(base_rows: Sequence[dict], branch_rows: Sequence[dict]) -> List[dict]:
    """A --from cell's stages.json rows: the base run's step 1, step 2 and control with the branch's cal,
    step 3 and step 4, in the order of :data:`STAGES`.

    Raises:
        ValueError: the branch lacks one of its stages (the run failed; its pipeline.log says why).
    """
    have = {r["stage"]: r for r in branch_rows}
    lost = [s for s in BRANCH_STAGES if s not in have]
    if lost:
        raise ValueError(f"the rerun of {', '.join(BRANCH_STAGES)} has no row for {', '.join(lost)}")
    rows = {r["stage"]: r for r in base_rows if r["stage"] not in BRANCH_STAGES}
    rows.update(have)
    return [rows[s] for s in STAGES if s in rows]


def write_branch_rows(dataset: str, seed: int, base: str, out: str) -> bool:
    """Write a --from cell's stages.json from BASE's stages.json and the cell's branch.json
    (:func:`merge_branch_rows`); on a branch without its rows say so on stderr and write nothing.
    Returns whether it was written."""
    from gnetmdk.utils.atomic import atomic_write_text
    d = run_dir(out, dataset, seed)
    try:
        with open(os.path.join(run_dir(base, dataset, seed), "stages.json")) as fh:
            base_rows = json.load(fh)
        with open(os.path.join(d, "branch.json")) as fh:
            rows = merge_branch_rows(base_rows, json.load(fh))
    except (OSError, ValueError) as e:
        print(f"error: {dataset} seed {seed}: {e} (see {os.path.join(d, 'pipeline.log')})", file=sys.stderr)
        return False
    atomic_write_text(os.path.join(d, "stages.json"), json.dumps(rows, indent=2) + "\n")
    return True


def _dataset_dir(dataset: str) -> str:
    from gnetmdk.config import build_config, load_config_class
    return build_config(load_config_class(os.path.join(ROOT, DATASETS[dataset][0])), []).dataset_dir


def prepare(dataset: str, fold: Optional[Tuple[int, int]] = None) -> None:
    """Generate a synthetic set (and its meta files) when its folder is missing, cut a tiled set from its
    source; xml_2_txt for all, with ``fold`` (I, K) the meta files of that val fold
    (:func:`fold_overrides` names them). A fold of a tiled set is its source cut again with that fold's
    split (``tools/tile_voc.py --fold I/K`` into :func:`tiled_fold_dir`, once): the same val photos as
    the untiled set's fold I, in tiles.

    Raises:
        FileNotFoundError: a fetched set (or a tiled set's fetched source) whose folder is missing.
        subprocess.CalledProcessError: a tool failed (xml_2_txt refuses a fold where ImageSets lists
            decide the split; its message is on stderr).
    """
    config, make = DATASETS[dataset]
    from gnetmdk.config import build_config, load_config_class
    cfg = build_config(load_config_class(os.path.join(ROOT, config)), [])
    source = TILED[dataset][0] if dataset in TILED else dataset
    src_dir = _dataset_dir(source)
    if source in FETCHED and not os.path.isdir(src_dir):
        raise FileNotFoundError(f"dataset {source}: {src_dir} is missing: {FETCHED[source]} says where to "
                                f"get the images and annotations")
    name_args = [] if fold is None else ["--name", fold_overrides(dataset, fold)[1]]
    if dataset in TILED:
        _, n, overlap = TILED[dataset]
        dst = cfg.dataset_dir if fold is None else tiled_fold_dir(dataset, fold)
        if not os.path.isdir(src_dir):
            subprocess.run([sys.executable, os.path.join(ROOT, "tools", "make_shapes.py"), src_dir, "--dense"],
                           check=True, cwd=ROOT)
        if not os.path.isdir(dst):
            fold_args = [] if fold is None else ["--fold", f"{fold[0]}/{fold[1]}"]
            subprocess.run([sys.executable, os.path.join(ROOT, "tools", "tile_voc.py"), src_dir, dst,
                            "--tiles", str(n), "--overlap", str(overlap), "--classes", ",".join(cfg.VOC_CLASSES),
                            *fold_args], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        # the tiles' ImageSets lists carry the (fold's) split
        subprocess.run([sys.executable, os.path.join(ROOT, "tools", "xml_2_txt.py"), "--config",
                        os.path.join(ROOT, config), "--dataset-dir", dst, *name_args],
                       check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        return
    if make and not os.path.isdir(cfg.dataset_dir):
        lo, hi = cfg.shapes_objects                                 # shapes per image (config shapes_objects)
        n_train, n_val = cfg.shapes_images                          # train and val images (config shapes_images)
        cmd = [sys.executable, os.path.join(ROOT, "tools", "make_shapes.py"), cfg.dataset_dir, "--objects", str(lo), str(hi),
               "--num-train", str(n_train), "--num-val", str(n_val)] + (["--upright"] if cfg.shapes_upright else [])
        subprocess.run(cmd + (["--dense"] if make == "dense" else []), check=True, cwd=ROOT)
    fold_args = [] if fold is None else ["--fold", f"{fold[0]}/{fold[1]}"]
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "xml_2_txt.py"), "--config",
                    os.path.join(ROOT, config), *fold_args, *name_args], check=True, cwd=ROOT,
                   stdout=subprocess.DEVNULL)


def scores_whole_images(dataset: str, overrides: Sequence[str]) -> bool:
    """Whether ``dataset``'s config (with ``overrides``) already scores every evaluation on the whole images
    (``eval_stitch``, as examples/facemask_tiles.py does): its stage table is then the whole-image table,
    and scoring its best.pth files again with ``--stitch`` would repeat it. Raises
    gnetmdk.config.ConfigError for an override the config does not take."""
    from gnetmdk.config import build_config, load_config_class
    return bool(build_config(load_config_class(os.path.join(ROOT, DATASETS[dataset][0])), list(overrides)).eval_stitch)


def stage_best(dataset: str, seed: int, out: str, stage: str) -> str:
    """The best.pth of one run's ``stage``: checkpoint/<stage>/best.pth, and for ``control`` its last
    float stage's (gnetmdk.engine.control.control_configs: control/as_step4/step1/best.pth)."""
    d = run_dir(out, dataset, seed)
    if stage != "control":
        return os.path.join(d, "checkpoint", stage, "best.pth")
    from gnetmdk.config import load_config_class
    from gnetmdk.engine.control import control_configs
    klass = load_config_class(os.path.join(ROOT, DATASETS[dataset][0]))
    last = control_configs(klass, ["checkpoint_root", os.path.join(d, "checkpoint")])[-1]
    return os.path.join(last.checkpoint_dir(1), "best.pth")


def whole_image_command(dataset: str, seed: int, out: str, stage: str, overrides: Sequence[str]) -> List[str]:
    """The eval_voc --stitch command scoring one run's ``stage`` best.pth (:func:`stage_best`) on the whole
    images."""
    d = run_dir(out, dataset, seed)
    return [sys.executable, os.path.join(ROOT, "tools", "eval_voc.py"), stage_best(dataset, seed, out, stage),
            "--config", os.path.join(ROOT, DATASETS[dataset][0]), "--stitch", "--json",
            os.path.join(d, f"whole_{stage}.json"), "seed", str(seed), "progress", "false", *overrides]


def interval_command(dataset: str, seed: int, out: str, rows: Sequence[dict],
                     overrides: Sequence[str]) -> Optional[List[str]]:
    """The eval_voc command giving one run's quantization cost a paired bootstrap interval: its step-4
    best.pth ``--against`` the better of step 1's and the float control's (the model the cost is taken
    against), with ``--stitch`` where the config scores whole images (``eval_stitch``), the JSON in
    OUT/<dataset>/seed<K>/cost_interval.json. None when ``rows`` (run_pipeline's) lack step 1 or step 4."""
    from gnetmdk.config import build_config, load_config_class
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
        ref = stage_best(dataset, seed, out, "control")
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


def mean_interval(found: Sequence[Optional[dict]], level: float = 0.95,
                  same_images: bool = True) -> Optional[Tuple[float, float]]:
    """The interval of the mean cost over the seeds: every run scored on the same images with the same
    bootstrap seed drew the same resamples, so each resample's differences are averaged over the runs and
    the percentile interval taken of those means (gnetmdk.evaluation.voc.bootstrap_map). None unless every
    run has its samples from the same draws. With ``same_images`` False (the pooled folds) the runs may
    score different images: runs on disjoint val folds are independent, and averaging their independent
    resamples draw by draw resamples the mean of independent costs; the runs of one fold still share
    their draws. None unless every run has as many samples, with the same bootstrap seed."""
    import numpy as np
    if not found or any(f is None or not f.get("samples") for f in found):
        return None
    key = (lambda f: (f["num_images"], f["seed"], len(f["samples"]))) if same_images else \
        (lambda f: (f["seed"], len(f["samples"])))
    if len({key(f) for f in found}) != 1:
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


def environment_lines(results: Dict[str, Dict[int, List[dict]]]) -> List[str]:
    """One line per run whose stages.json rows carry ``environment`` (run_pipeline.py --json): what its
    stages were trained with (gnetmdk.utils.environment), stages that share one record named together,
    e.g. ``- facemask seed 2: threads 2, torch 2.13.0+cpu, CPU kernels AVX2, OpenCV 5.1.0, numpy 2.4.6,
    Python 3.11.7``, or ``(step1, step2, control) ...; (cal, step3, step4) ...`` where a --from cell's
    stages ran elsewhere; stages without a record (written before runs were recorded) are named as ``not
    recorded`` beside those with one, and a run none of whose rows has one gives no line."""
    from gnetmdk.utils.environment import describe

    lines = []
    for ds, seeds in results.items():
        for seed, rows in seeds.items():
            groups: Dict[str, List[str]] = {}
            for r in rows:
                env = r.get("environment")
                if env:
                    text = f"threads {env['threads']}, {describe(env)}" if env.get("threads") else describe(env)
                    groups.setdefault(text, []).append(r["stage"])
            bare = [r["stage"] for r in rows if not r.get("environment")]
            if bare and groups:          # a --from cell on a base run made before runs were recorded
                groups["not recorded"] = bare
            if len(groups) == 1:
                lines.append(f"- {ds} seed {seed}: {next(iter(groups))}")
            elif groups:
                lines.append(f"- {ds} seed {seed}: " + "; ".join(f"({', '.join(st)}) {text}" for text, st in groups.items()))
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
              intervals: Optional[Dict[str, Dict[int, Optional[dict]]]] = None,
              same_images: bool = True) -> Dict[str, dict]:
    """Per dataset: {"seeds", "stages": {stage: {"mean", "min", "max"}}, "delta": [the quantization cost per
    seed], "delta_mean", "delta_worst", "goal", "delta_interval": [per seed the cost's paired 95% bootstrap
    interval (low, high) over the val images, or None], "delta_mean_interval": that of the mean cost or None}
    from {dataset: {seed: run_pipeline's --json rows}} and {dataset: {seed: :func:`cost_interval`'s dict}};
    mAP as fractions. The quantization cost is step4 - max(step1, control) when the run has the float control
    (gnetmdk/engine/control.py), else step4 - step1. "goal": its mean at least -0.01 and every seed's
    at least -0.02. ``same_images`` False: the runs of a dataset score different val folds (the pooled
    row of --folds; :func:`mean_interval`); the "seeds" keys are then "<fold>:<seed>" strings."""
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
                     "delta_mean_interval": mean_interval(found, same_images=same_images),
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
    p.add_argument("--folds", default=None, metavar="K | I,J/K",
                   help="run every dataset on each val fold of K-fold cross-validation (all K, or folds I,J of K) "
                        "instead of its own split; a row per fold and one pooled over the folds")
    p.add_argument("--from", dest="from_out", default=None, metavar="BASE",
                   help="rerun only cal, step 3 and step 4 (with the overrides) from the step-1 and step-2 models of "
                        "BASE's runs of the same datasets and seeds, keeping BASE's step 1, step 2 and control")
    return p.parse_with_overrides(argv)


@tool_main
def main(argv) -> int:
    """Run (or only tabulate) the matrix (module docstring); returns the exit status (0, or 2 for bad input)."""
    args, base_overrides = parse_args(argv)
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
    try:
        folds: List[Optional[Tuple[int, int]]] = [None] if args.folds is None else parse_folds(args.folds)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cells = []                                  # (name in the table and under OUT, dataset, fold)
    for ds in datasets:
        for fold in folds:
            name = ds if fold is None else fold_name(ds, fold)
            if fold is not None:
                DATASETS[name] = DATASETS[ds]
            cells.append((name, ds, fold))
    results: Dict[str, Dict[int, List[dict]]] = {}
    intervals: Dict[str, Dict[int, Optional[dict]]] = {}
    whole: Dict[str, Dict[int, List[dict]]] = {}
    for ds, source, fold in cells:
        if not args.table_only:
            try:
                prepare(source, fold)
            except (FileNotFoundError, ValueError) as e:
                print(f"error: {e}", file=sys.stderr)
                return 2
            except subprocess.CalledProcessError:
                print(f"error: {ds}: the meta files could not be written (the tool's message is above)", file=sys.stderr)
                return 2
        overrides = list(base_overrides) + fold_overrides(source, fold)
        stitched = None                 # a tiled set whose config scores the whole images itself: no second table
        for seed in seeds:
            js = os.path.join(run_dir(args.out, ds, seed), "stages.json")
            if not os.path.isfile(js) and not args.table_only:
                os.makedirs(os.path.dirname(js), exist_ok=True)
                t0 = time.time()
                if args.from_out:
                    try:
                        prepare_branch(ds, seed, args.from_out, args.out)
                    except FileNotFoundError as e:
                        print(f"error: {e}", file=sys.stderr)
                        return 2
                    command = branch_command(ds, seed, args.out, overrides)
                else:
                    command = pipeline_command(ds, seed, args.out, overrides, not args.no_control)
                with open(os.path.join(os.path.dirname(js), "pipeline.log"), "w") as log:
                    rc = subprocess.run(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode
                if args.from_out and rc == 0:
                    write_branch_rows(ds, seed, args.from_out, args.out)
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
            if source in TILED and stitched is None:
                stitched = scores_whole_images(ds, overrides)
            if source in TILED and not stitched and os.path.isfile(js) and not args.table_only:
                for stage in WHOLE_STAGES:
                    if stage == "control" and not os.path.isfile(stage_best(ds, seed, args.out, stage)):
                        continue                                    # a run without the control (--no-control)
                    if not os.path.isfile(os.path.join(run_dir(args.out, ds, seed), f"whole_{stage}.json")):
                        subprocess.run(whole_image_command(ds, seed, args.out, stage, overrides), cwd=ROOT,
                                       stdout=subprocess.DEVNULL, check=False)
            if source in TILED and not stitched:
                rows = whole_rows(ds, seed, args.out)
                if rows:
                    whole.setdefault(f"{ds} (whole images)", {})[seed] = rows
    for ds in datasets:
        pooled = {f"{fold[0]}:{seed}": results[fold_name(ds, fold)][seed]
                  for fold in folds if fold is not None and fold_name(ds, fold) in results
                  for seed in results[fold_name(ds, fold)]}
        if pooled:
            results[f"{ds} (folds pooled)"] = pooled
            intervals[f"{ds} (folds pooled)"] = {
                f"{fold[0]}:{seed}": intervals.get(fold_name(ds, fold), {}).get(seed)
                for fold in folds if fold is not None for seed in results.get(fold_name(ds, fold), {})}
        pooled_whole = {f"{fold[0]}:{seed}": rows for fold in folds if fold is not None
                        for seed, rows in whole.get(f"{fold_name(ds, fold)} (whole images)", {}).items()}
        if pooled_whole:
            whole[f"{ds} (folds pooled) (whole images)"] = pooled_whole
    table = aggregate({k: v for k, v in results.items() if not k.endswith("(folds pooled)")}, intervals)
    table.update(aggregate({k: v for k, v in results.items() if k.endswith("(folds pooled)")}, intervals,
                           same_images=False))
    text = format_table(table)
    if whole:
        table.update(aggregate(whole))
        text += "\n\nTiled sets scored on the whole images (tools/eval_voc.py --stitch):\n\n" + \
            format_table(aggregate(whole))
    envs = environment_lines({k: v for k, v in results.items() if not k.endswith("(folds pooled)")})
    if envs:
        text += "\n\nWhat each run's stages were trained with (their best.pth's record, gnetmdk.utils.environment):\n\n" + \
            "\n".join(envs)
    chips = chip_lines(args.out, {name: seeds for name, _, _ in cells})
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
