"""The benchmark scripts' own logic (their numbers are machine-dependent and not asserted)."""
import importlib.util
import json
import os

import pytest
import torch
import torch.nn as nn
from repo_paths import REPO

ROOT = REPO


def _load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "benchmarks", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _Recorder(nn.Module):
    """A one-parameter 'model' that logs each forward under its tag."""

    def __init__(self, tag, log):
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))
        self.tag, self.log = tag, log

    def forward(self, x):
        self.log.append(self.tag)
        return x * self.w

    def loss(self, out, targets):
        return {"total": (out - targets).square().sum()}


def test_step_time_blocks_alternate_and_every_round_is_timed():
    bench = _load("bench_step_time")
    log = []
    a, b = _Recorder("a", log), _Recorder("b", log)
    batch = (torch.ones(2, 1), torch.zeros(2, 1))
    times = bench.time_interleaved([a, b], batch, iters=6, rounds=3, warmup=1)
    # warm-up one step each, then blocks of 2 steps: a b | b a | a b
    assert log == ["a", "b"] + ["a", "a", "b", "b"] + ["b", "b", "a", "a"] + ["a", "a", "b", "b"]
    assert [len(t) for t in times] == [3, 3]
    assert all(t > 0 for ts in times for t in ts)
    assert float(a.w.detach()) < 1.0 and float(b.w.detach()) < 1.0         # the steps really trained (optimizer ran)


def test_step_time_ratio_is_the_median_of_the_rounds_ratios():
    bench = _load("bench_step_time")
    base = [1.0, 2.0, 1.0, 1.0]                  # round 2: a burst slowed both blocks
    other = [1.1, 2.4, 1.3, 1.2]
    t1, t3, ratio, low, high = bench.summarize_rounds(base, other)
    assert (t1, t3) == (1.0, 1.25)
    assert abs(ratio - 1.2) < 1e-12 and abs(low - 1.1) < 1e-12 and abs(high - 1.3) < 1e-12


def test_step_time_refuses_zero_rounds_with_one_message():
    import subprocess
    import sys
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_step_time.py"), "--rounds", "0"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "--rounds must be at least 1" in r.stderr and "Traceback" not in r.stderr


def test_step_time_device_cuda_without_a_gpu_is_one_message_device_cpu():
    import subprocess
    import sys
    if torch.cuda.is_available():
        import pytest
        pytest.skip("a GPU is visible")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_step_time.py"), "--device", "cuda"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "torch sees no GPU" in r.stderr and "Traceback" not in r.stderr


def test_step_time_autocast_applies_to_the_named_model_only():
    bench = _load("bench_step_time")
    seen = []

    class M(_Recorder):
        def forward(self, x):
            seen.append((self.tag, torch.is_autocast_enabled("cpu")))
            return super().forward(x)

    a, b = M("a", []), M("b", [])
    bench.AUTOCAST[id(b)] = torch.bfloat16
    batch = (torch.ones(2, 1), torch.zeros(2, 1))
    bench.train_step(a, torch.optim.SGD(a.parameters(), lr=0.1), *batch)
    bench.train_step(b, torch.optim.SGD(b.parameters(), lr=0.1), *batch)
    assert seen == [("a", False), ("b", True)]


def test_accuracy_matrix_aggregates_seeds_and_checks_the_goal():
    acc = _load("accuracy")
    rows = lambda s1, s4: [{"stage": "step1", "best_map": s1}, {"stage": "cal", "best_map": None},
                           {"stage": "step4", "best_map": s4}]
    table = acc.aggregate({"a": {0: rows(0.90, 0.895), 1: rows(0.80, 0.79)},
                           "b": {0: rows(0.90, 0.85), 1: rows(0.90, 0.91)}})
    assert table["a"]["stages"]["step1"] == pytest.approx({"mean": 0.85, "min": 0.80, "max": 0.90})
    assert table["a"]["delta_worst"] == pytest.approx(-0.01) and table["a"]["goal"]
    assert table["b"]["delta_mean"] == pytest.approx(-0.02) and not table["b"]["goal"]   # one seed 5 points down
    assert "cal" not in table["a"]["stages"]
    text = acc.format_table(table)
    assert "| a | 0,1 | 0.850 [0.800-0.900] |" in text and "not met" in text
    cmd = acc.pipeline_command("cards", 2, "/o", ["threads", "1"])
    assert cmd[-2:] == ["threads", "1"] and "seed" in cmd and cmd[cmd.index("seed") + 1] == "2"
    assert cmd[cmd.index("--json") + 1] == os.path.join("/o", "cards", "seed2", "stages.json")
    assert "--control" in cmd and "--control" not in acc.pipeline_command("cards", 2, "/o", [], control=False)
    # with the float control the cost is step 4 - max(step 1, control): a control that trained on to
    # 0.93 makes a step 4 of 0.92 one point below, where step 1's 0.90 alone would show it two above
    ctl = acc.aggregate({"c": {0: rows(0.90, 0.92) + [{"stage": "control", "best_map": 0.93}]}})
    assert ctl["c"]["delta"] == [pytest.approx(-0.01)] and ctl["c"]["stages"]["control"]["mean"] == 0.93
    assert "step 4 - max(step 1, control)" in acc.format_table(ctl)


def test_accuracy_matrix_tables_a_tiled_set_on_the_whole_images_too(tmp_path, capsys):
    """--table-only on runs of dense_tiles: the tile table from stages.json, and the whole-image table from
    the whole_<stage>.json files eval_voc --stitch --json writes."""
    acc = _load("accuracy")
    for seed, (t1, t4, w1, w4) in enumerate([(0.60, 0.59, 0.55, 0.50), (0.62, 0.62, 0.57, 0.575)]):
        d = tmp_path / "dense_tiles" / f"seed{seed}"
        d.mkdir(parents=True)
        (d / "stages.json").write_text(json.dumps([{"stage": "step1", "best_map": t1},
                                                   {"stage": "step4", "best_map": t4}]))
        for stage, m in (("step1", w1), ("step4", w4)):
            (d / f"whole_{stage}.json").write_text(json.dumps({"map": 0.0, "stitched": {"map": m}}))
    assert acc.main(["--datasets", "dense_tiles", "--seeds", "0,1", "--table-only", "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "| dense_tiles | 0,1 | 0.610 [0.600-0.620] |" in text and "| -0.5, -1.0 | met |" in text
    assert "| dense_tiles (whole images) | 0,1 | 0.560 [0.550-0.570] |" in text
    assert "| -2.3, -5.0 | not met |" in text                     # (-5 + 0.5) / 2 points
    saved = json.loads((tmp_path / "accuracy.json").read_text())
    assert saved["dense_tiles (whole images)"]["delta"] == pytest.approx([-0.05, 0.005])
    cmd = acc.whole_image_command("dense_tiles", 1, "/o", "step4", ["threads", "1"])
    assert cmd[2] == os.path.join("/o", "dense_tiles", "seed1", "checkpoint", "step4", "best.pth")
    assert "--stitch" in cmd and cmd[cmd.index("--json") + 1].endswith(os.path.join("seed1", "whole_step4.json"))
    # the float control is scored on the whole images too, from its last stage's best.pth
    cmd = acc.whole_image_command("dense_tiles", 1, "/o", "control", [])
    assert cmd[2] == os.path.join("/o", "dense_tiles", "seed1", "checkpoint", "control", "as_step4", "step1", "best.pth")
    assert cmd[cmd.index("--json") + 1].endswith(os.path.join("seed1", "whole_control.json"))
    (tmp_path / "dense_tiles" / "seed0" / "whole_control.json").write_text(json.dumps({"stitched": {"map": 0.58}}))
    assert acc.main(["--datasets", "dense_tiles", "--seeds", "0", "--table-only", "--out", str(tmp_path)]) == 0
    assert "| -8.0, -8.0 | not met |" in capsys.readouterr().out.split("(whole images)")[1]   # 0.50 - 0.58


def test_accuracy_matrix_gives_each_cost_its_interval_over_the_val_images(tmp_path, capsys, monkeypatch):
    """interval_command scores step 4 against the better of step 1 and the control (--stitch where the
    config scores whole images); the table gives each seed's interval from cost_interval.json."""
    acc = _load("accuracy")
    rows = [{"stage": "step1", "best_map": 0.80}, {"stage": "step4", "best_map": 0.79},
            {"stage": "control", "best_map": 0.82}]
    cmd = acc.interval_command("cards", 1, "/o", rows, ["threads", "1"])
    d = os.path.join("/o", "cards", "seed1", "checkpoint")
    assert cmd[2] == os.path.join(d, "step4", "best.pth") and "--stitch" not in cmd
    assert cmd[cmd.index("--against") + 1] == os.path.join(d, "control", "as_step4", "step1", "best.pth")
    assert cmd[cmd.index("--json") + 1] == os.path.join("/o", "cards", "seed1", "cost_interval.json")
    assert cmd[-2:] == ["threads", "1"]
    rows[2]["best_map"] = 0.78                                          # the control below step 1: step 1
    assert acc.interval_command("cards", 1, "/o", rows, [])[5:7] == ["--against", os.path.join(d, "step1", "best.pth")]
    assert acc.interval_command("cards", 1, "/o", rows[1:], []) is None    # no step 1
    config = tmp_path / "whole.py"
    config.write_text("from gnetmdk.config import BaseConfig\nclass Config(BaseConfig):\n    eval_stitch = True\n")
    monkeypatch.setitem(acc.DATASETS, "whole", (str(config), None))
    assert "--stitch" in acc.interval_command("whole", 0, "/o", rows, [])
    # seeds 0 and 1 drew the same 5 resamples (bootstrap seed 0, 40 images): the mean's samples are the
    # means per resample, -0.02, -0.01, 0.0, 0.01, 0.02 -> its 95% interval (linear quantiles at 0.025 and
    # 0.975 of 5 sorted values: positions 0.1 and 3.9) [-0.019, +0.019]
    samples = {0: [-0.03, -0.02, 0.0, 0.0, 0.03], 1: [-0.01, 0.0, 0.0, 0.02, 0.01], 2: None}
    for seed, iv in ((0, [-0.044, 0.014]), (1, [-0.01, 0.02]), (2, None)):
        d = tmp_path / "out" / "whole" / f"seed{seed}"
        d.mkdir(parents=True)
        (d / "stages.json").write_text(json.dumps(rows))
        if iv:
            (d / "cost_interval.json").write_text(json.dumps({"bootstrap": {
                "interval_diff": iv, "samples_diff": samples[seed], "num_images": 40, "seed": 0}}))
    assert acc.main(["--datasets", "whole", "--seeds", "0,1", "--table-only", "--out", str(tmp_path / "out")]) == 0
    assert "| -1.0, -1.0 | not met | mean [-1.9, +1.9]; [-4.4, +1.4]; [-1.0, +2.0] |" in capsys.readouterr().out
    saved = json.loads((tmp_path / "out" / "accuracy.json").read_text())
    assert saved["whole"]["delta_interval"] == [[-0.044, 0.014], [-0.01, 0.02]]
    assert saved["whole"]["delta_mean_interval"] == pytest.approx([-0.019, 0.019])
    assert acc.main(["--datasets", "whole", "--seeds", "0,1,2", "--table-only", "--out", str(tmp_path / "out")]) == 0
    assert "| not met | -; [-4.4, +1.4]; [-1.0, +2.0]; - |" in capsys.readouterr().out   # seed 2 has none


def test_accuracy_matrix_refuses_unknown_datasets_and_seeds(capsys):
    acc = _load("accuracy")
    assert acc.main(["--datasets", "cards,coco", "--table-only"]) == 2
    assert "--datasets ['coco']" in capsys.readouterr().err
    assert acc.main(["--datasets", "mine=no/such/config.py", "--table-only"]) == 2
    assert "NAME=CONFIG" in capsys.readouterr().err
    assert acc.main(["--seeds", "0,a", "--table-only"]) == 2
    assert "--seeds" in capsys.readouterr().err


def test_accuracy_matrix_runs_a_config_of_your_own(tmp_path, capsys):
    """--datasets NAME=CONFIG: the runs of a user's config go under OUT/NAME and its pipeline command
    names that config."""
    acc = _load("accuracy")
    config = tmp_path / "mine.py"
    config.write_text("from gnetmdk.config import BaseConfig\nclass Config(BaseConfig):\n    pass\n")
    d = tmp_path / "out" / "mine" / "seed0"
    d.mkdir(parents=True)
    (d / "stages.json").write_text(json.dumps([{"stage": "step1", "best_map": 0.8},
                                               {"stage": "step4", "best_map": 0.79},
                                               {"stage": "control", "best_map": 0.82}]))
    assert acc.main(["--datasets", f"mine={config}", "--seeds", "0", "--table-only",
                     "--out", str(tmp_path / "out")]) == 0
    assert "| mine | 0 | 0.800 [0.800-0.800] |" in capsys.readouterr().out
    cmd = acc.pipeline_command("mine", 0, "/o", [])
    assert cmd[cmd.index("--config") + 1] == str(config)
    acc.DATASETS.pop("mine")


def test_accuracy_matrix_runs_each_val_fold_and_pools_them(tmp_path, monkeypatch, capsys):
    """--folds: the folds parse (K, or I,J/K); each fold's meta files are written by xml_2_txt --fold under
    <DS_NAME>_fold<I>of<K> and its runs are pointed at them; the table has a row per fold and a pooled
    row whose mean interval averages each resample over folds of different sizes; a tiled set's fold is
    its source tiled again with that fold's split (the same val photos); a bad spec is refused with one
    line."""
    acc = _load("accuracy")
    assert acc.parse_folds("3") == [(0, 3), (1, 3), (2, 3)] and acc.parse_folds("1,4/5") == [(1, 5), (4, 5)]
    for bad in ("1", "5/5", "1,1/3", "a/3", "0/x"):
        with pytest.raises(ValueError, match="--folds"):
            acc.parse_folds(bad)
    from gnetmdk.dataset.shapes import make_shapes_dataset
    import shutil
    make_shapes_dataset(str(tmp_path / "voc"), num_train=6, num_val=4, seed=0)
    shutil.rmtree(tmp_path / "voc" / "ImageSets")                   # a random split, which has folds
    config = tmp_path / "mine.py"
    config.write_text("from gnetmdk.config import BaseConfig\nclass Config(BaseConfig):\n"
                      f"    DS_NAME = 'mine'\n    dataset_path = {str(tmp_path / 'voc')!r}\n"
                      f"    meta_root = {str(tmp_path / 'meta')!r}\n"
                      "    VOC_CLASSES = ['circle', 'square', 'triangle']\n")
    monkeypatch.setitem(acc.DATASETS, "mine", (str(config), None))
    assert acc.fold_overrides("mine", (1, 5)) == ["DS_NAME", "mine_fold1of5", "dataset_path", str(tmp_path / "voc")]
    assert acc.fold_overrides("mine", None) == []
    acc.prepare("mine", (1, 5))
    val = (tmp_path / "meta" / "mine_fold1of5_valid.txt").read_text().split("\n")
    assert len([v for v in val if v]) == 2                              # round(10 * 2 / 5) - round(10 / 5)
    # a tiled set's fold: its source cut again with that fold's split, the tiles of the same val photos
    tiles_config = tmp_path / "mine_tiles.py"
    tiles_config.write_text(config.read_text().replace("'mine'", "'mine_tiles'").replace(
        repr(str(tmp_path / "voc")), repr(str(tmp_path / "voc_tiles"))))
    monkeypatch.setitem(acc.DATASETS, "mine_tiles", (str(tiles_config), None))
    monkeypatch.setitem(acc.TILED, "mine_tiles", ("mine", 2, 8))
    fold_dir = str(tmp_path / "voc_tiles") + "_fold1of5"
    assert acc.fold_overrides("mine_tiles", (1, 5)) == ["DS_NAME", "mine_tiles_fold1of5", "dataset_path", fold_dir]
    acc.prepare("mine_tiles", (1, 5))
    stem = lambda line: line.split(" ")[0].rsplit(".", 1)[0]
    photos = sorted(stem(v) for v in val if v)
    listed = open(os.path.join(fold_dir, "ImageSets", "Main", "val.txt")).read().split()
    assert sorted(listed) == sorted(f"{p}_r{r}c{c}" for p in photos for r in (0, 1) for c in (0, 1))
    tiles_val = [stem(t) for t in (tmp_path / "meta" / "mine_tiles_fold1of5_valid.txt").read_text().split("\n") if t]
    assert tiles_val and set(tiles_val) <= set(listed)           # xml_2_txt drops the tiles without a box
    manifest = json.loads(open(os.path.join(fold_dir, "tiles.json")).read())
    assert sorted(k for k, v in manifest["images"].items() if v["split"] == "val") == photos
    assert not (tmp_path / "voc_tiles").exists()                 # only the fold's tiles were cut
    out = tmp_path / "out"
    rows = lambda s1, s4: [{"stage": "step1", "best_map": s1}, {"stage": "step4", "best_map": s4}]
    for fold, seed, s4, n, samples in ((0, 0, 0.79, 10, [-0.02, 0.0, 0.0, 0.01]), (1, 0, 0.78, 9, [-0.04, -0.02, 0.0, -0.01]),
                                       (1, 1, 0.80, 9, [0.0, 0.0, 0.02, 0.01])):
        d = out / "mine" / f"fold{fold}of2" / f"seed{seed}"
        d.mkdir(parents=True)
        (d / "stages.json").write_text(json.dumps(rows(0.80, s4)))
        (d / "cost_interval.json").write_text(json.dumps({"bootstrap": {
            "interval_diff": [min(samples), max(samples)], "samples_diff": samples, "num_images": n, "seed": 0}}))
    assert acc.main(["--datasets", "mine", "--seeds", "0,1", "--folds", "2", "--table-only", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| mine/fold0of2 | 0 |" in text and "| mine/fold1of2 | 0,1 |" in text
    assert "| mine (folds pooled) | 0:0,1:0,1:1 | 0.800 [0.800-0.800] |" in text
    saved = json.loads((out / "accuracy.json").read_text())
    assert saved["mine (folds pooled)"]["delta"] == pytest.approx([-0.01, -0.02, 0.0])
    # the pooled mean's resamples: (-0.02 - 0.04 + 0.0) / 3, ... = -0.02, -0.00667, 0.00667, 0.00333
    means = sorted([-0.02, -0.02 / 3, 0.02 / 3, 0.01 / 3])
    import numpy as np
    assert saved["mine (folds pooled)"]["delta_mean_interval"] == pytest.approx(list(np.quantile(means, [0.025, 0.975])))
    assert saved["mine/fold1of2"]["delta_mean_interval"] is not None     # one fold's seeds: the same images
    assert acc.mean_interval([{"samples": [0.0], "num_images": 9, "seed": 0},
                              {"samples": [0.0], "num_images": 10, "seed": 0}]) is None   # same images asked
    assert acc.main(["--datasets", "mine", "--folds", "2/2", "--table-only", "--out", str(out)]) == 2
    assert "--folds" in capsys.readouterr().err
    ran = []                                       # a fold without runs yet: what main would run for it

    class Done:
        returncode = 0
    monkeypatch.setattr(acc.subprocess, "run", lambda cmd, **kw: ran.append([str(c) for c in cmd]) or Done())
    assert acc.main(["--datasets", "mine", "--seeds", "3", "--folds", "1/2", "--no-chip", "--out", str(out),
                     "threads", "1"]) == 0
    assert ran[0][1].endswith("xml_2_txt.py") and ran[0][-4:] == ["--fold", "1/2", "--name", "mine_fold1of2"]
    pipe = ran[1]
    assert pipe[1].endswith("run_pipeline.py") and pipe[pipe.index("--json") + 1] == str(
        out / "mine" / "fold1of2" / "seed3" / "stages.json")
    assert pipe[-6:] == ["threads", "1", "DS_NAME", "mine_fold1of2", "dataset_path", str(tmp_path / "voc")]
    done = out / "mine_tiles" / "fold1of2" / "seed3"                # a tiled fold's run: scored on its whole photos
    done.mkdir(parents=True)
    (done / "stages.json").write_text(json.dumps(rows(0.8, 0.79)))
    ran.clear()
    assert acc.main(["--datasets", "mine_tiles", "--seeds", "3", "--folds", "1/2", "--no-chip", "--out", str(out)]) == 0
    assert ran[0][1].endswith("tile_voc.py") and ran[0][3] == str(tmp_path / "voc_tiles") + "_fold1of2"
    stitched = [c for c in ran if c[1].endswith("eval_voc.py") and "--stitch" in c and "--against" not in c]
    assert len(stitched) == 2 and all(c[-2:] == ["dataset_path", str(tmp_path / "voc_tiles") + "_fold1of2"]
                                      for c in stitched)
    # a tiled config that scores every evaluation on the whole photos itself (eval_stitch): not scored again
    assert not acc.scores_whole_images("mine_tiles", []) and acc.scores_whole_images("facemask_tiles", [])
    ran.clear()
    assert acc.main(["--datasets", "mine_tiles", "--seeds", "3", "--folds", "1/2", "--no-chip", "--out", str(out),
                     "eval_stitch", "true"]) == 0
    assert not [c for c in ran if c[1].endswith("eval_voc.py") and "--against" not in c]


def test_accuracy_matrix_names_where_to_get_a_missing_fetched_set(tmp_path, monkeypatch, capsys):
    """A real set that is not in the repository and not fetched yet: exit 2 and one line naming its folder
    and the page that says where to get it; nothing is run or written."""
    acc = _load("accuracy")
    config = tmp_path / "fetched.py"
    config.write_text("from gnetmdk.config import BaseConfig\nclass Config(BaseConfig):\n"
                      f"    dataset_path = {str(tmp_path / 'absent')!r}\n")
    monkeypatch.setitem(acc.DATASETS, "fetched", (str(config), None))
    monkeypatch.setitem(acc.FETCHED, "fetched", "docs/results/fetched.md")
    assert acc.main(["--datasets", "fetched", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "absent is missing" in err and "docs/results/fetched.md" in err
    assert not (tmp_path / "out").exists()
    for fetched in ("roadsigns", "facemask"):
        assert fetched in acc.DATASETS and fetched not in acc.DEFAULT_DATASETS
        assert os.path.isfile(os.path.join(acc.ROOT, acc.FETCHED[fetched]))
    # the face masks' tiles are cut as their example config says, from the fetched photos
    source, n, overlap = acc.TILED["facemask_tiles"]
    example = open(os.path.join(acc.ROOT, acc.DATASETS["facemask_tiles"][0])).read()
    assert source == "facemask" and f"--tiles {n} --overlap {overlap}" in example
    monkeypatch.setitem(acc.TILED, "fetched_tiles", ("fetched", 2, 8))
    monkeypatch.setitem(acc.DATASETS, "fetched_tiles", (str(config), None))
    with pytest.raises(FileNotFoundError, match="absent is missing: docs/results/fetched.md"):
        acc.prepare("fetched_tiles", (0, 5))
    assert not any(tmp_path.glob("absent*"))


def test_memory_benchmark_variants_build_what_they_name_device_cpu():
    """Each variant of benchmarks/bench_memory.py converts the model it says (device cpu)."""
    from gnetmdk.dist.syncbn import count_sync_batchnorm
    from gnetmdk.layers.inplace_abn import BatchNormAct2d, count_inplace_abn
    from gnetmdk.layers.stem import count_recompute_stem
    bench = _load("bench_memory")
    got = {}
    for v in bench.ALL_VARIANTS:
        m = bench.build("gnetdet", v, "cpu")
        synced = count_sync_batchnorm(m) > 0 or any(x.sync for x in m.modules() if isinstance(x, BatchNormAct2d))
        got[v] = (synced, count_inplace_abn(m), count_recompute_stem(m))
    assert got["bn"] == (False, 0, 0) and got["ckpt"] == (False, 0, 0)
    assert got["dist_bn"] == (True, 0, 0)
    assert got["abn"] == (False, 15, 0)
    assert got["stem"] == (True, 0, 1)
    assert got["abn_stem"] == (True, 15, 1)                    # BatchNormAct2d with DistBatchNorm2d's statistics
    assert got["ckpt_stem"] == (True, 0, 0)
    with pytest.raises(ValueError, match="unknown variant"):
        bench.build("gnetdet", "fused", "cpu")


def test_small_objects_bands_parse_and_bad_ones_are_one_message(capsys):
    bench = _load("small_objects")
    assert bench.parse_bands("4-16:8-20,30-95:1-3") == [(4, 16, 8, 20), (30, 95, 1, 3)]
    for bad in ("4-16", "16-4:1-3", "4-16:0-3", "a-b:1-2"):
        with pytest.raises(ValueError, match="--bands"):
            bench.parse_bands(bad)
    assert bench.main(["--bands", "4-16"]) == 2
    assert bench.main(["--iters", "10"]) == 2
    err = capsys.readouterr().err
    assert "LO-HI:NMIN-NMAX" in err and "--iters must be at least 50" in err


def test_small_objects_refused_override_is_one_message_device_cpu(tmp_path, capsys):
    bench = _load("small_objects")
    assert bench.main(["--bands", "4-8:1-2", "--out", str(tmp_path), "no_such_field", "1"]) == 2
    assert "no_such_field" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())                     # refused before any set is written


def test_accuracy_matrix_from_a_base_reruns_only_the_quantized_stages(tmp_path, monkeypatch, capsys):
    """--from BASE: a cell copies BASE's step-1 folder, step-2 best.pth and control folder, runs only cal,
    step 3 and step 4 with the overrides, and its stages.json holds BASE's step 1, step 2 and control rows
    with the rerun's cal, step 3 and step 4 (the cost against BASE's control); a base without the run is
    refused with one line naming the file, and a rerun that fails writes no stages.json."""
    import subprocess
    acc = _load("accuracy")
    base, out = tmp_path / "base", tmp_path / "out"
    d = base / "cards" / "seed1"
    for rel in ("checkpoint/step1/best.pth", "checkpoint/step1/last.pth", "checkpoint/step2/best.pth",
                "checkpoint/step2/cal.pth", "checkpoint/control/as_step4/step1/best.pth"):
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_text(rel)
    base_rows = [{"stage": "step1", "best_map": 0.80, "plateau_span": 0.004}, {"stage": "step2", "best_map": 0.81},
                 {"stage": "cal", "best_map": 0.70}, {"stage": "step3", "best_map": 0.76},
                 {"stage": "step4", "best_map": 0.76}, {"stage": "control", "best_map": 0.82}]
    (d / "stages.json").write_text(json.dumps(base_rows))
    ran, rerun_rows = [], [2]                             # the first rerun loses its step-4 row

    def fake_run(cmd, **kw):
        ran.append(list(cmd))
        if "--stages" in cmd:                              # the rerun: it finds what was copied in
            cell = out / "cards" / "seed1"
            assert (cell / "checkpoint/step1/last.pth").read_text() == "checkpoint/step1/last.pth"
            assert (cell / "checkpoint/step2/best.pth").read_text() == "checkpoint/step2/best.pth"
            assert not (cell / "checkpoint/step2/cal.pth").exists()       # calibration runs again
            assert (cell / "checkpoint/control/as_step4/step1/best.pth").is_file()
            rows = [{"stage": "cal", "best_map": 0.79}, {"stage": "step3", "best_map": 0.815},
                    {"stage": "step4", "best_map": 0.815}][:rerun_rows[0]]
            (cell / "branch.json").write_text(json.dumps(rows))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(acc.subprocess, "run", fake_run)
    assert acc.main(["--datasets", "cards", "--seeds", "1", "--no-chip", "--from", str(base), "--out", str(out),
                     "threads", "1", "output_bits", "10"]) == 0
    assert not (out / "cards" / "seed1" / "stages.json").exists()
    assert "cards seed 1: the rerun of cal, step3, step4 has no row for step4" in capsys.readouterr().err
    out, rerun_rows[0] = tmp_path / "ok", 3
    assert acc.main(["--datasets", "cards", "--seeds", "1", "--no-chip", "--from", str(base), "--out", str(out),
                     "threads", "1", "output_bits", "10"]) == 0
    pipeline = [c for c in ran if "--stages" in c][-1]
    assert pipeline[pipeline.index("--stages") + 1] == "cal,step3,step4" and pipeline[-4:] == \
        ["threads", "1", "output_bits", "10"]
    assert pipeline[pipeline.index("checkpoint_root") + 1] == str(out / "cards" / "seed1" / "checkpoint")
    rows = json.loads((out / "cards" / "seed1" / "stages.json").read_text())
    assert [(r["stage"], r["best_map"]) for r in rows] == [("step1", 0.80), ("step2", 0.81), ("cal", 0.79),
                                                             ("step3", 0.815), ("step4", 0.815), ("control", 0.82)]
    assert rows[0]["plateau_span"] == 0.004
    saved = json.loads((out / "accuracy.json").read_text())
    assert saved["cards"]["delta"] == pytest.approx([-0.005])          # 0.815 - max(0.80, 0.82)
    assert acc.main(["--datasets", "cards", "--seeds", "2", "--from", str(base), "--out", str(out)]) == 2
    assert f"--from {base}: {base / 'cards' / 'seed2' / 'stages.json'} is missing: run the base first" in \
        capsys.readouterr().err


def test_accuracy_matrix_checks_each_chip_model_against_step_4_device_cpu(tmp_path, monkeypatch, capsys):
    """chip_check converts a run's step-4 best.pth into the chip model and compares every code and the mAP
    (chip.json: exit 0, 0 mismatches, equal mAP); a checkpoint that is not step 4 is a failed check, and
    the table's chip lines say which."""
    import sys
    from chip_helpers import (DATASETS, build_step4_model, have, load_images, save_step4_checkpoint,
                              write_config)
    from gnetmdk.config import load_config
    from gnetmdk.dataset.dataset import build_dataset
    if not have("raccoon"):
        pytest.skip("raccoon dataset not present")
    torch.set_num_threads(1)
    acc = _load("accuracy")
    config = write_config(str(tmp_path), "raccoon", max_val_images=3, size_head="log")
    monkeypatch.setitem(acc.DATASETS, "raccoon", (config, None))
    cfg = load_config(config)
    model, _ = build_step4_model(len(DATASETS["raccoon"]), load_images(build_dataset(cfg, "train"), 4),
                                 size_head="log")
    for seed, stage in ((0, "step4"), (1, "step3")):
        ck = tmp_path / "raccoon" / f"seed{seed}" / "checkpoint" / "step4"
        ck.mkdir(parents=True)
        save_step4_checkpoint(str(ck / "best.pth"), model, config, stage=stage)
    good = acc.chip_check("raccoon", 0, str(tmp_path), ["threads", "1"])
    assert good["rc"] == 0 and good["mismatches"] == 0 and good["codes"] > 0
    assert good["chip_map"] == good["step4_map"] is not None
    assert json.loads((tmp_path / "raccoon" / "seed0" / "chip.json").read_text()) == good
    bad = acc.chip_check("raccoon", 1, str(tmp_path), [])
    assert bad["rc"] == 2 and bad["mismatches"] is None               # convert_to_chip refuses a step-3 checkpoint
    assert not (tmp_path / "raccoon" / "seed1" / "chip.json").exists()    # no verdict: tried again next time
    lines = acc.chip_lines(str(tmp_path), {"raccoon": [0, 1, 2]})
    assert len(lines) == 2 and "seed 0: chip model equal: 0 mismatches" in lines[0]
    assert "seed 1: chip model not checked: the check could not run" in lines[1]


def test_accuracy_names_what_each_run_trained_with_device_cpu():
    """environment_lines: one line per run, the stages that share a record named together, nothing for
    rows written before runs were recorded."""
    acc = _load("accuracy")
    here = {"threads": "2", "torch": "2.13.0+cpu", "cpu_capability": "AVX2", "opencv": "5.1.0", "numpy": "2.4.6",
            "python": "3.11.7"}
    there = dict(here, cpu_capability="AVX512")
    one = [dict(stage=s, environment=here) for s in ("step1", "step2", "cal", "step3", "step4", "control")]
    branch = [dict(stage="step1", environment=there), dict(stage="step2", environment=there),
              dict(stage="cal", environment=here), dict(stage="control", environment=there)]
    mixed = [dict(stage="step1"), dict(stage="cal", environment=here), dict(stage="step4", environment=here)]
    lines = acc.environment_lines({"facemask": {0: one, 1: branch, 2: [dict(stage="step1")], 3: mixed}})
    assert lines == ["- facemask seed 0: threads 2, torch 2.13.0+cpu, CPU kernels AVX2, OpenCV 5.1.0, numpy 2.4.6, "
                     "Python 3.11.7",
                     "- facemask seed 1: (step1, step2, control) threads 2, torch 2.13.0+cpu, CPU kernels AVX512, "
                     "OpenCV 5.1.0, numpy 2.4.6, Python 3.11.7; (cal) threads 2, torch 2.13.0+cpu, CPU kernels AVX2, "
                     "OpenCV 5.1.0, numpy 2.4.6, Python 3.11.7",
                     "- facemask seed 3: (cal, step4) threads 2, torch 2.13.0+cpu, CPU kernels AVX2, OpenCV 5.1.0, "
                     "numpy 2.4.6, Python 3.11.7; (step1) not recorded"]


def test_step_time_trainer_runs_the_hooks_ema_included_device_cpu(tmp_path, monkeypatch):
    """time_trainer runs the trainer as a user does: its hooks set up (the EMA when the config has it),
    then timed epochs; it returns images per second. Given a batch, its reference is the bare step of a
    copy of the trainer's own model: on a CPU every BatchNorm there is the trainer's DistBatchNorm2d."""
    from dist_helpers import make_workspace
    from gnetmdk.config import build_config, load_config_class
    from gnetmdk.dataset.dataset import build_dataset, collate
    from gnetmdk.dist.syncbn import DistBatchNorm2d
    bench = _load("bench_step_time")
    path = make_workspace(str(tmp_path), num_train=16, num_val=2)
    over = ["ema", "true", "ema_ramp", "2", "batch_size", "8", "num_workers", "0", "threads", "1"]
    cfg = build_config(load_config_class(path), over, step=1)
    rate, bare = bench.time_trainer(cfg, over, 2)
    assert rate > 0 and bare is None
    images, targets, _, _ = collate([build_dataset(cfg, "train")[i] for i in range(8)])
    seen, real = [], bench.time_interleaved
    monkeypatch.setattr(bench, "time_interleaved", lambda models, *a, **k: seen.extend(models) or real(models, *a, **k))
    rate, bare = bench.time_trainer(cfg, over, 2, (images.float(), targets), rounds=1)
    assert rate > 0 and bare > 0 and len(seen) == 1
    bns = [m for m in seen[0].modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert bns and all(isinstance(m, DistBatchNorm2d) for m in bns)


def test_pipeline_control_trains_the_float_model_with_steps_2_to_4_schedules_device_cpu(tmp_path):
    """run_pipeline.py --control: after step 1, three float stages with the schedules of steps 2, 3 and 4
    (learning rate, epochs), each from the previous best.pth, the first from step 1's; their outputs
    under checkpoint/control/, step 1's untouched; the table and its JSON get a "control" row."""
    import hashlib
    import json as _json
    from dist_helpers import make_workspace, run
    root = str(tmp_path)
    extra = ("    per_step = {2: dict(learning_rate=1e-5, num_epochs=1), 3: dict(learning_rate=2e-5, num_epochs=1),\n"
             "                4: dict(learning_rate=3e-5, num_epochs=2)}\n")
    cfg = make_workspace(root, num_train=16, num_val=4, extra=extra)
    tool = os.path.join(ROOT, "tools", "run_pipeline.py")
    js = os.path.join(root, "stages.json")
    r = run([tool, "--config", cfg, "--stages", "step1", "--control", "--json", js, "batch_size", "8",
             "num_epochs", "1"], root, timeout=600)
    r.check()
    ck = os.path.join(root, "out", "checkpoint")
    step1 = os.path.join(ck, "step1", "best.pth")
    digest = hashlib.sha256(open(step1, "rb").read()).hexdigest()
    rows = {row["stage"]: row for row in _json.load(open(js))}
    assert set(rows) == {"step1", "control"} and rows["control"]["best_map"] is not None
    for k, lr, epochs in ((2, 1e-5, 1), (3, 2e-5, 1), (4, 3e-5, 1)):     # num_epochs 1 on the command line
        d = os.path.join(ck, "control", f"as_step{k}", "step1")
        conf = _json.load(open(os.path.join(d, "config.json")))
        assert conf["learning_rate"] == lr and conf["num_epochs"] == epochs and conf["step"] == 1
        assert os.path.isfile(os.path.join(d, "best.pth"))
    last = torch.load(os.path.join(ck, "control", "as_step4", "step1", "best.pth"), weights_only=True)
    assert last["stage"] == "step1" and any(".bn." in k for k in last["model"])          # the float model
    assert hashlib.sha256(open(step1, "rb").read()).hexdigest() == digest
    assert "===== control (float, step 4's schedule) =====" in r.stdout
    # each row's weights digest is that of its own best.pth's weights: step 1's, the control's last stage's
    from gnetmdk.checkpoint import weights_sha256
    assert rows["step1"]["weights_sha256"] == weights_sha256(torch.load(step1, weights_only=True)["model"])
    assert rows["control"]["weights_sha256"] == weights_sha256(last["model"]) != rows["step1"]["weights_sha256"]
    # and what its best.pth was trained with (gnetmdk.utils.environment), as the checkpoint records it
    import cv2
    first = torch.load(step1, weights_only=True)
    assert rows["step1"]["environment"] == first["environment"] and rows["control"]["environment"] == last["environment"]
    env = rows["step1"]["environment"]
    assert env["torch"] == torch.__version__ and env["opencv"] == cv2.__version__ and int(env["threads"]) >= 1


def test_pipeline_make_shapes_writes_the_configured_images_device_cpu(tmp_path):
    """run_pipeline.py --make-shapes: the dataset has ``shapes_images`` train and val images with
    ``shapes_objects`` shapes each, its meta files list them, and step 1 trains on it."""
    from dist_helpers import make_workspace, run
    root = str(tmp_path)
    cfg = make_workspace(root, num_train=8, num_val=2)
    tool = os.path.join(ROOT, "tools", "run_pipeline.py")
    r = run([tool, "--config", cfg, "--make-shapes", "--stages", "step1", "DS_NAME", "made", "shapes_images", "5,3",
             "shapes_objects", "2,2", "batch_size", "5", "num_epochs", "1", "max_iters", "1"], root, timeout=600)
    r.check()
    sets = os.path.join(root, "data", "made", "ImageSets", "Main")
    assert [len(open(os.path.join(sets, f"{k}.txt")).read().split()) for k in ("train", "val")] == [5, 3]
    meta = os.path.join(root, "data", "meta")
    lines = {k: open(os.path.join(meta, f"made_{k}.txt")).read().splitlines() for k in ("train", "valid")}
    assert [len(lines["train"]), len(lines["valid"])] == [5, 3]
    boxes = [(len(line.split()) - 1) // 5 for line in lines["train"] + lines["valid"]]
    assert boxes == [2] * 8                                   # 2 shapes per image, 5 numbers a box
    assert os.path.isfile(os.path.join(root, "out", "checkpoint", "step1", "last.pth"))


def test_gpu_check_reads_what_the_parts_print_device_cpu(capsys):
    """gpu_check's parsers on the parts' own printing: pytest's summary and failures, the step-time
    ratios against their goals, bench_memory's GPU table (a variant meets -35% at +10% or none does),
    run_pipeline's table; the suite's shards are balanced by file size."""
    gc = _load("gpu_check")
    text = ("..F.s\nFAILED tests/test_a.py::test_x - AssertionError\nERROR tests/test_b.py::test_y\n"
            "=== 3 passed, 1 failed, 1 skipped, 1 error, 2 deselected in 4.20s ===\n")
    s = gc.pytest_summary(text)
    assert (s["passed"], s["failed"], s["skipped"], s["errors"], s["deselected"]) == (3, 1, 1, 1, 2)
    assert s["failures"] == ["tests/test_a.py::test_x", "tests/test_b.py::test_y"]
    cut = gc.pytest_summary("[gw0] [  5%] PASSED tests/test_a.py::test_x \n[gw1] [  6%] FAILED tests/test_b.py::"
                            "test_y[1] \ntests/test_c.py::test_z SKIPPED (no GPU) [  7%]\n"
                            "48.11s call     tests/test_a.py::test_x\n")      # -v lines of a run cut short
    assert (cut["passed"], cut["failed"], cut["skipped"]) == (1, 1, 1)
    assert cut["failures"] == ["tests/test_b.py::test_y[1]"]
    merged = gc.merge_summaries([s, gc.pytest_summary("1 passed in 0.1s\n")])
    assert merged["passed"] == 4 and len(merged["failures"]) == 2
    ratios = gc.step_time_ratios("ratio step3/step1      1.216   (median ...; goal <= 1.15)\n"
                                 "speed bf16/fp32        3.070   (fp32 time / bf16 time ...)\n"
                                 "ratio trainer/step      0.93   (against ...)\n"
                                 "ratio loop/step         0.78   (1: ...)\n"
                                 "ratio torch.ao QAT     1.354   (torch.ao's QAT ...)\n")
    assert ratios["step3/step1"]["met"] is False and ratios["bf16/fp32"]["met"] is True
    assert ratios["trainer/step"]["value"] == 0.93 and ratios["loop/step"]["met"] is None
    assert ratios["torch.ao QAT/float"]["met"] is True         # the peer's 1.354 against our 1.216
    mem = _load("bench_memory")
    mem.report("GPU H100: GNetDet 448 x1.0, batch 64, max_memory_allocated:",
               {"bn": (1000.0, 1.0, ""), "stem": (500.0, 1.75, ""), "ckpt": (600.0, 1.05, "")}, "bn")
    mem.report("GPU H100: PP-YOLO r50vd 608 px, batch 8, max_memory_allocated:",
               {"bn": (1000.0, 1.0, ""), "abn": (870.0, 2.4, "")}, "bn")
    rows = gc.memory_rows(capsys.readouterr().out)
    g, p = rows["GPU H100: GNetDet 448 x1.0, batch 64, max_memory_allocated"], rows[
        "GPU H100: PP-YOLO r50vd 608 px, batch 8, max_memory_allocated"]
    assert g["rows"]["stem"] == [500.0, -50.0, 1.75, 75.0]
    assert g["met"] and g["best"] == "ckpt" and not p["met"] and p["best"] is None
    spec = importlib.util.spec_from_file_location("run_pipeline", os.path.join(ROOT, "tools", "run_pipeline.py"))
    rp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rp)
    table = rp.format_table([("step1", 0.0, 0.9286, 40, 50.0, 61.0), ("cal", 0.9191, 0.9179, None, None, 9.0),
                             ("step4", 0.92, 0.9203, 1, 3.0, 12.0)])
    stages = gc.pipeline_rows(table)
    assert stages == {"step1": {"entry": 0.0, "best": 0.9286, "seconds": 61.0},
                      "cal": {"entry": 0.9191, "best": 0.9179, "seconds": 9.0},
                      "step4": {"entry": 0.92, "best": 0.9203, "seconds": 12.0}}
    files = gc.test_files()
    assert os.path.join(ROOT, "tests", "gti", "test_quantize.py") in files and len(files) > 40
    bins = gc.shards(files, 3)
    assert sorted(f for b in bins for f in b) == sorted(files) and len(bins) == 3
    sizes = [sum(os.path.getsize(f) for f in b) for b in bins]
    assert max(sizes) - min(sizes) <= max(os.path.getsize(f) for f in files)


def test_gpu_check_without_a_gpu_says_so_and_runs_the_cpu_parts_device_cpu(tmp_path):
    """No GPU: the dry run names the GPU parts as not run; a run of the CUDA lane writes its log and a
    summary whose GPU parts are skipped and whose all_met is false; bad parts are one message."""
    import subprocess
    import sys
    script = os.path.join(ROOT, "benchmarks", "gpu_check.py")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    r = subprocess.run([sys.executable, script, "--dry-run"], cwd=str(tmp_path), capture_output=True, text=True)
    assert r.returncode == 0 and "no GPU: running what a CPU can" in r.stdout
    assert "memory: not run without a GPU" in r.stdout and "pipeline: not run without a GPU" in r.stdout
    r = subprocess.run([sys.executable, script, "--parts", "cuda_lane,memory", "--out", str(tmp_path / "o")],
                       cwd=str(tmp_path), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    summary = json.load(open(tmp_path / "o" / "summary.json"))
    lane = summary["parts"]["cuda_lane"]
    assert summary["cuda"] is False and summary["all_met"] is False
    assert lane["failed"] == 0 and lane["skipped"] > 0 and lane["passed"] == 0
    assert summary["parts"]["memory"] == {"not_run": "no GPU"}
    assert os.path.isfile(tmp_path / "o" / "cuda_lane.log")
    r = subprocess.run([sys.executable, script, "--parts", "gpu"], capture_output=True, text=True)
    assert r.returncode == 2 and "unknown part(s) ['gpu']" in r.stderr
    gc = _load("gpu_check")
    assert gc.parse_timeouts("suite=240,pipeline=150.5") == {"suite": 240.0, "pipeline": 150.5}
    for bad in ("suite=0", "suite=x", "gpu=10"):
        r = subprocess.run([sys.executable, script, "--timeouts", bad, "--dry-run"], capture_output=True, text=True)
        assert r.returncode == 2 and f"{bad!r}: write PART=SECONDS" in r.stderr


def test_torch_ao_peer_is_the_same_float_model_under_torch_qat_device_cpu():
    """bench_step_time's peer: the twin computes what the float GNetDet computes (plain convs and ReLUs
    holding the same weights), and its torch.ao QAT copy carries fused conv + ReLU modules with
    per-channel weight fake quantization and fused activation fake-quantize modules."""
    from gnetmdk.config import BaseConfig, build_config
    from gnetmdk.engine.stages import STAGES, apply_stage
    from gnetmdk.models import model_from_config
    bench = _load("bench_step_time")
    cfg = build_config(BaseConfig, ["image_size", "224", "width_mult", "0.25", "device", "cpu"], step=1)
    torch.manual_seed(0)
    model = model_from_config(cfg, use_bn=False)
    apply_stage(model, STAGES["step1"])
    twin, qat = bench.ao_peer(model)
    x = torch.rand(2, 3, 224, 224) * 31
    model.eval(), twin.eval()
    with torch.no_grad():
        assert torch.equal(model(x), twin(x))
    kinds = {type(m).__name__ for m in qat.modules()}
    assert "ConvReLU2d" in kinds and "FusedMovingAvgObsFakeQuantize" in kinds
    w_fq = qat.layers[0].conv.weight_fake_quant
    assert w_fq.qscheme == torch.per_channel_symmetric and w_fq.ch_axis == 0
    qat.train()
    out = qat(x)
    assert out.shape == twin(x).shape
    for m in (twin, qat):              # a GPU run quantizes weights in one pass: the plain convs have none
        m.batch_weight_quant = True
        assert m(x).shape == out.shape


def test_plateau_span_reads_the_last_quarter_of_the_epochs():
    """plateau_span: max - min of the val mAPs evaluated after 3/4 of the epochs (the last included);
    None with fewer than two there."""
    from gnetmdk.engine.control import plateau_span
    maps = [(10, 0.30), (20, 0.60), (30, 0.70), (32, 0.745), (36, 0.76), (40, 0.752)]
    span, first, n = plateau_span(maps, 40)
    assert (round(span, 6), first, n) == (0.015, 32, 3)                  # epochs 32, 36, 40 (> 30)
    assert plateau_span(maps, 40, fraction=0.5)[2] == 4                  # > 20: 30, 32, 36, 40
    assert plateau_span([(10, 0.5), (40, 0.6)], 40) is None              # one evaluation in the window
    assert plateau_span([], 40) is None


def test_pipeline_prints_whether_step_1_reached_its_plateau_device_cpu(tmp_path):
    """run_pipeline.py: after the table, how far step 1's val mAP moved over its last quarter of epochs,
    from the stage's own evaluations, and in the JSON as step 1's plateau_span."""
    import json as _json
    from dist_helpers import make_workspace, run
    from gnetmdk.engine.control import plateau_span
    root = str(tmp_path)
    cfg = make_workspace(root, num_train=16, num_val=4)
    js = os.path.join(root, "stages.json")
    r = run([os.path.join(ROOT, "tools", "run_pipeline.py"), "--config", cfg, "--stages", "step1", "--json", js,
             "batch_size", "8", "num_epochs", "8", "eval_interval", "1", "threads", "1"], root, timeout=600)
    r.check()
    curves = _json.load(open(os.path.join(root, "out", "log", "step1", "curves.json")))["epochs"]
    maps = [(e["epoch"], e["val_map"]) for e in curves if e.get("val_map") is not None]
    assert [e for e, _ in maps] == list(range(1, 9))
    span, first, n = plateau_span(maps, 8)
    assert (first, n) == (7, 2)
    row = _json.load(open(js))[0]
    assert row["stage"] == "step1" and row["plateau_span"] == span
    assert f"step 1 plateau: val mAP moved {100 * span:.1f} points over its last quarter (epochs 7-8, 2 evaluations)" \
        in r.stdout
    # the stage's own log says it too, as train.py --step 1 prints it
    assert f"[step1] plateau: val mAP moved {100 * span:.1f} points over the last quarter (epochs 7-8, 2 evaluations): " \
        in r.stdout


def test_a_float_stage_logs_its_plateau_only_after_its_last_epoch():
    """Trainer.log_plateau: the span and verdict after the last epoch; a line asking for evaluations when
    the last quarter holds one; nothing for a run stopped early (patience) or never evaluated."""
    from types import SimpleNamespace
    from gnetmdk.engine.trainer import Trainer

    def run(maps, epochs=40):
        lines = []
        t = SimpleNamespace(summary={"val_maps": maps}, cfg=SimpleNamespace(num_epochs=epochs),
                            stage=SimpleNamespace(name="step1"), log=lines.append)
        return Trainer.log_plateau(t), lines

    span, lines = run([[30, 0.70], [32, 0.745], [36, 0.76], [40, 0.752]])
    assert round(span, 6) == 0.015 and len(lines) == 1
    assert lines[0].startswith("[step1] plateau: val mAP moved 1.5 points over the last quarter (epochs 32-40, "
                               "3 evaluations): still moving")
    span, lines = run([[35, 0.75], [40, 0.752]])
    assert round(span, 6) == 0.002 and lines[0].endswith(": at its plateau")
    span, lines = run([[10, 0.5], [40, 0.6]])                   # one evaluation in the last quarter
    assert span is None and len(lines) == 1 and "fewer than two evaluations" in lines[0]
    assert run([[30, 0.5], [35, 0.6]]) == (None, [])          # stopped early: its last epoch never came
    assert run([]) == (None, [])


def test_demo_check_summarizes_runs_and_judges_the_goals_device_cpu():
    """demo_check: a variant's numbers from run_pipeline's JSON rows (the demo's seconds without the
    control, the cost against the better float model), and every goal it names, each missed once; the
    8 minutes only for a variant run as command (a) is (the demo's 2 threads, the default kernels)."""
    dc = _load("demo_check")
    rows = [dict(stage="step1", best_map=0.88, seconds=200.0, plateau_span=0.004),
            dict(stage="step2", best_map=0.87, seconds=100.0), dict(stage="cal", best_map=0.86, seconds=5.0),
            dict(stage="step3", best_map=0.87, seconds=100.0), dict(stage="step4", best_map=0.875, seconds=50.0),
            dict(stage="control", best_map=0.888, seconds=300.0)]
    s = dc.summarize(rows)
    assert s["seconds"] == 455.0 and s["plateau"] == 0.004 and abs(s["cost"] - (0.875 - 0.888)) < 1e-12
    assert dc.verdicts({"a": s}, timed=True) == []
    far = dict(s, step1=0.84, plateau=0.02, cost=-0.02, seconds=500.0)
    missed = dc.verdicts({"a": s, "b": far}, timed=True)
    assert len(missed) == 4 and missed[0].startswith("step 1 ranges over 4.0 points")
    assert any("b: step 1 moved 2.0 points" in m for m in missed) and any("b: step 4 is 2.0 points" in m for m in missed)
    assert any("b: the demo took 500 s" in m for m in missed)
    assert len(dc.verdicts({"a": s, "b": far}, timed=False)) == 3          # --jobs > 1: times are not judged
    assert dc.demo_threads() == 2                                            # command (a) runs examples/shapes.py's
    for other in (dict(far, threads=1, kernels="default"), dict(far, threads=2, kernels="avx2")):
        assert len(dc.verdicts({"a": s, "b": other}, timed=True)) == 3       # not command (a): seconds not judged
    assert len(dc.verdicts({"a": s, "b": dict(far, threads=2, kernels="default")}, timed=True)) == 4
    assert "| a | 455 | 0.8800 | 0.4 | 0.8750 | 0.8880 | -1.3 |" in dc.format_table({"a": s})
    cmd = dc.command("/o", 2, 1)
    assert cmd[cmd.index("seed"):cmd.index("seed") + 4] == ["seed", "2", "threads", "1"] and "--control" in cmd
    assert dc.command("/o", 2, 1, ["gnetdet.box_slots", "1"])[-2:] == ["gnetdet.box_slots", "1"]
    assert dc.main(["--kernels", "avx512"]) == 2


def test_demo_check_keeps_runs_of_other_config_overrides_apart_device_cpu(tmp_path, capsys, monkeypatch):
    """demo_check KEY VALUE ...: the overrides reach every variant's command and its overrides.json; a
    folder made with another resolved config (config.json; none at all: an older demo_check's) is refused
    (exit 2, nothing run) rather than resumed or read, while an override that repeats the demo's own value
    is the same config; an override without its value, or naming no field, is refused; runs of other
    overrides are never compared by digest."""
    dc = _load("demo_check")
    out = tmp_path / "o"
    s0, s1 = out / "seed0-t1-avx2", out / "seed1-t1-avx2"
    s0.mkdir(parents=True)                                      # empty: nothing to resume
    v = [(0, 1, "avx2"), (1, 1, "avx2")]
    assert dc.stale_variants(str(out), v, ["num_epochs", "48"]) == []
    with open(s0 / "config.json", "w") as fh:                   # made without overrides
        json.dump(dc.resolved_config(0, 1, []), fh)
    assert dc.stale_variants(str(out), v, []) == []
    assert dc.stale_variants(str(out), v, ["shapes_upright", "true"]) == []
    assert dc.stale_variants(str(out), v, ["num_epochs", "48"]) == [str(s0)]
    s1.mkdir()
    (s1 / "overrides.json").write_text("[]")                   # an older demo_check's folder: no config.json
    assert dc.stale_variants(str(out), v, []) == [str(s1)]
    (s1 / "config.json").write_text("{not json")
    assert dc.stale_variants(str(out), v, []) == [str(s1)]
    for f in os.listdir(s1):
        os.unlink(s1 / f)
    s1.rmdir()
    assert dc.main(["--seeds", "0", "--threads", "1", "--kernels", "avx2", "--out", str(out),
                    "num_epochs", "48"]) == 2
    assert "another config" in capsys.readouterr().err
    assert sorted(os.listdir(s0)) == ["config.json"]
    assert dc.main(["--out", str(tmp_path / "p"), "no_such_field", "1"]) == 2
    assert "no_such_field" in capsys.readouterr().err and not (tmp_path / "p").exists()
    assert dc.main(["--out", str(tmp_path / "p"), "num_epochs"]) == 2
    assert "'num_epochs' has no value" in capsys.readouterr().err and not (tmp_path / "p").exists()
    seen, real = [], dc.subprocess.run

    def fake_run(cmd, **kw):                  # the pipeline's run faked; kernel_identity's child runs
        if "--json" not in cmd:
            return real(cmd, **kw)
        seen.append(cmd)
        d = os.path.dirname(cmd[cmd.index("--json") + 1])
        rows = [dict(stage="step1", best_map=0.9, seconds=1.0, plateau_span=0.0), dict(stage="step4", best_map=0.9,
                seconds=1.0), dict(stage="control", best_map=0.9, seconds=1.0)]
        json.dump(rows, open(os.path.join(d, "stages.json"), "w"))
        return dc.subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(dc.subprocess, "run", fake_run)
    js = tmp_path / "q.json"
    assert dc.main(["--seeds", "1", "--threads", "1", "--kernels", "avx2", "--out", str(tmp_path / "q"),
                    "gnetdet.box_slots", "1", "--json", str(js)]) == 0
    assert len(seen) == 1 and seen[0][-2:] == ["gnetdet.box_slots", "1"]
    assert json.load(open(tmp_path / "q" / "seed1-t1-avx2" / "overrides.json")) == ["gnetdet.box_slots", "1"]
    recorded = json.load(open(tmp_path / "q" / "seed1-t1-avx2" / "config.json"))
    assert recorded == dc.resolved_config(1, 1, ["gnetdet.box_slots", "1"]) and recorded["gnetdet"]["box_slots"] == 1
    assert recorded["seed"] == 1 and recorded["shapes_upright"] is True and "data_root" not in recorded
    r = json.load(open(js))["results"]["seed1-t1-avx2"]
    assert r["overrides"] == ["gnetdet.box_slots", "1"]
    import cv2
    assert r["opencv"] == cv2.__version__ and r["cpu_capability"] == "AVX2"     # read under the kernel set
    old = {"seed1-t1-avx2": {k: x for k, x in r.items() if k != "overrides"}}      # a file from before overrides
    notes, missed = dc.compare_reference({"seed1-t1-avx2": r}, old)
    assert missed == [] and notes[0].endswith("and overrides gnetdet.box_slots 1)")


def test_demo_check_compares_weights_with_a_reference_where_kernels_and_torch_agree_device_cpu(tmp_path):
    """demo_check --reference: digests compared only against the run with the same seed, threads, torch and
    CPU capability; equal digests give a note, one differing stage a missed goal that names it, a variant
    without such a run a "not compared" note; a file that is not a demo_check JSON is refused (exit 2)
    before anything runs."""
    dc = _load("demo_check")
    rows = [dict(stage="step1", best_map=0.9, seconds=1.0, weights_sha256="a1"),
            dict(stage="step4", best_map=0.9, seconds=1.0, weights_sha256="a4"),
            dict(stage="control", best_map=0.9, seconds=1.0, weights_sha256="ac")]
    s = dc.summarize(rows)
    assert s["digests"] == {"step1": "a1", "step4": "a4", "control": "ac"}
    ident = dict(torch="2.13.0+cpu", cpu_capability="AVX2", opencv="5.1.0")
    mine = {"seed0-t2-default": dict(s, seed=0, threads=2, **ident),
            "seed1-t1-avx2": dict(s, seed=1, threads=1, **ident),
            "seed2-t1-avx2": dict(s, seed=2, threads=1, **ident),
            "seed3-t1-avx2": dict(s, seed=3, threads=1, **ident),
            "seed4-t1-avx2": dict(s, seed=4, threads=1, **ident)}
    other = dict(s["digests"], step4="b4")
    ref = {"seed0-t2-avx2": dict(s, seed=0, threads=2, **ident),                      # same bits
           "seed1-t1-default": dict(s, seed=1, threads=1, digests=other, **ident),    # step 4 differs
           "seed2-t1-default": dict(s, seed=2, threads=1, **dict(ident, torch="2.11.0")),
           "seed3-t1-default": dict(s, seed=3, threads=1, digests=other, **dict(ident, opencv="4.14.0")),
           "seed4-t1-default": dict(s, seed=4, threads=1, digests=other, torch="2.13.0+cpu", cpu_capability="AVX2")}
    notes, missed = dc.compare_reference(mine, ref)
    assert notes[0] == "seed0-t2-default: step1, step4, control equal bit for bit to the reference's seed0-t2-avx2"
    assert missed == ["seed1-t1-avx2: the weights of step4 differ from the reference's seed1-t1-default (same seed, "
                      "threads, torch 2.13.0+cpu, CPU capability AVX2 and OpenCV 5.1.0)"]
    assert notes[1].startswith("seed2-t1-avx2: not compared (no reference run with seed 2, threads 1, torch 2.13.0+cpu")
    # another OpenCV makes other augmented pixels, and a reference that does not record its OpenCV is unknown:
    # neither is compared (their step 4 differs, which would otherwise be a miss)
    assert notes[2].startswith("seed3-t1-avx2: not compared") and notes[2].endswith("and OpenCV 5.1.0)")
    assert notes[3].startswith("seed4-t1-avx2: not compared")
    no_digests = {"seed0-t2-avx2": dict(ref["seed0-t2-avx2"], digests={})}
    assert "not compared (no weights digests" in dc.compare_reference(mine, no_digests)[0][0]
    bad = tmp_path / "bad.json"
    bad.write_text('{"table": []}')
    assert dc.main(["--reference", str(bad), "--out", str(tmp_path / "o")]) == 2
    assert dc.main(["--reference", str(tmp_path / "missing.json"), "--out", str(tmp_path / "o")]) == 2
    assert not (tmp_path / "o").exists()


def test_demo_check_compares_references_by_the_config_they_ran_not_the_words_device_cpu():
    """An override that repeats the demo's own value (``shapes_upright true`` once examples/shapes.py draws
    upright triangles) is no override: a bundled upright reference compares with a run made without it; the
    older references, drawn either way up (``shapes_upright false``), do not; another override keeps a run
    apart. The x0.25 references carry ``gnetdet.width_mult 0.25``, the demo's width when they were made."""
    dc = _load("demo_check")
    assert dc.effective_overrides([]) == {} and dc.effective_overrides(["shapes_upright", "true"]) == {}
    assert dc.effective_overrides(["shapes_upright", "false"]) == {"shapes_upright": "False"}
    assert dc.effective_overrides(["gnetdet.box_slots", "1"]) == {"gnetdet.box_slots": "1"}
    assert dc.effective_overrides(["no_such_field", "1"]) == {"0": "no_such_field", "1": "1"}
    refs = {}
    for name in ("demo_upright_avx2_seeds012_t1", "demo_avx2_seeds12_t1"):
        with open(os.path.join(REPO, "benchmarks", "reference", name + ".json"), encoding="utf-8") as fh:
            refs[name] = json.load(fh)["results"]
    up, old = refs["demo_upright_avx2_seeds012_t1"]["seed1-t1-default"], refs["demo_avx2_seeds12_t1"]["seed1-t1-default"]
    v240 = ["shapes_images", "240,240", "eval_interval", "2", "eval_from", "0"]     # the val split they had
    x025 = ["gnetdet.width_mult", "0.25"]
    no_range = ["gnetdet.l_range", "0"]          # no range term in steps 2-4 then
    assert up["overrides"] == ["shapes_upright", "true"] + x025 + v240 + no_range
    assert old["overrides"] == ["shapes_upright", "false"] + x025 + v240 + no_range
    # the demo sets the range term from step 2 on: l_range 0 changes steps 2-4, so it counts
    assert dc.effective_overrides(no_range) == {"gnetdet.l_range": "[0.0, 0.0, 0.0, 0.0]"}
    assert dc.effective_overrides(["gnetdet.l_range", "1"]) == {"gnetdet.l_range": "1.0"}      # step 1 changes
    x025 += v240
    assert dc.effective_overrides(x025) == {"gnetdet.width_mult": "0.25", "shapes_images": "[240, 240]",
                                            "eval_interval": "[2, 2, 2, 2]", "eval_from": "0"}
    # a field the demo sets per stage counts where only a later stage changes: steps 2-4 evaluate every 5, 5, 3
    assert dc.effective_overrides(["eval_interval", "2"]) == {"eval_interval": "[2, 2, 2, 2]"}
    assert dc.effective_overrides(["eval_from", "32"]) == {"eval_from": "[32, 32, 32, 32]"}
    assert dc.effective_overrides(["shapes_images", "240,960", "eval_interval", "2", "eval_from", "32"]) == {
        "eval_interval": "[2, 2, 2, 2]", "eval_from": "[32, 32, 32, 32]"}
    x025 += no_range
    plain = dict(up, overrides=x025)      # the same run, made after the demo's default changed to upright
    notes, missed = dc.compare_reference({"mine": plain}, {"up": up, "old": old})
    assert missed == [] and notes == ["mine: step1, step4, control equal bit for bit to the reference's up"]
    notes, missed = dc.compare_reference({"mine": dict(plain, digests=old["digests"])}, {"up": up})
    assert missed and "differ from the reference's up" in missed[0]
    for other in (["gnetdet.box_slots", "1"] + x025, []):           # another change, or the x0.125 demo
        notes, _ = dc.compare_reference({"mine": dict(plain, overrides=other)}, {"up": up})
        assert "not compared" in notes[0]


def test_every_bundled_demo_reference_can_be_compared_device_cpu():
    """Each JSON under benchmarks/reference is a demo_check --json with a note: every variant names its
    seed, threads, torch and CPU capability and holds a 64-hex digest per DIGEST_STAGES stage, its numbers
    agree with its own cost and verdict, and the references of the demo as it is now (no override that
    changes it) compare with a run of it: a run with their digests is equal, one with another step 4 is a miss."""
    dc = _load("demo_check")
    folder = os.path.join(REPO, "benchmarks", "reference")
    names = sorted(n for n in os.listdir(folder) if n.endswith(".json"))
    assert {"demo_w125_avx2_t1.json", "demo_w125_avx512_t2.json", "demo_v960_avx512_t2.json", "demo_v960_avx2_t2.json",
            "demo_v960_t1.json", "demo_v960r_avx512_t2.json", "demo_v960r_avx2_t2.json", "demo_v960r_t1.json"} <= set(names)
    current = 0
    for name in names:
        with open(os.path.join(folder, name), encoding="utf-8") as fh:
            data = json.load(fh)
        assert data["note"] and data["results"], name
        for variant, r in data["results"].items():
            assert r["seed"] >= 0 and r["threads"] in (1, 2) and r["torch"] and r["cpu_capability"], (name, variant)
            assert all(len(r["digests"][k]) == 64 and int(r["digests"][k], 16) >= 0 for k in dc.DIGEST_STAGES)
            assert r["cost"] == r["step4"] - max(r["step1"], r["control"])      # the same float expression
            moved = r["plateau"] >= 0.01
            assert moved == any(m.startswith(variant + ": step 1 moved") for m in data.get("missed", [])), (name, variant)
            if dc.effective_overrides(r.get("overrides")) == {}:
                current += 1
                notes, missed = dc.compare_reference({"mine": dict(r)}, {variant: r})
                assert missed == [] and "equal bit for bit" in notes[0]
                other = dict(r, digests=dict(r["digests"], step4="0" * 64))
                assert dc.compare_reference({"mine": other}, {variant: r})[1]
    # the demo as it is (960 val images, the range term from step 2 on): seeds 0-2 x threads 2, 1 x AVX-512, AVX2,
    # seed 0 at threads 2 on a CPU without AVX-512 under OpenCV 5.1, and there seeds 0-2 x threads 1, 2; every
    # earlier reference carries the overrides that repeat its config
    assert current == 3 + 3 + 6 + 1 + 6
    six = json.load(open(os.path.join(folder, "demo_v960r_avx2only_opencv51_t12.json")))["results"]
    assert sorted((r["seed"], r["threads"]) for r in six.values()) == [(s, t) for s in (0, 1, 2) for t in (1, 2)]
    assert {r["opencv"] for r in six.values()} == {"5.1.0"}
    # the newest records its OpenCV version, and it compares only with a run under the same one
    cv51 = json.load(open(os.path.join(folder, "demo_v960r_avx2only_opencv51_seed0_t2.json")))["results"]
    (variant, r), = cv51.items()
    assert r["opencv"] == "5.1.0" and r["cpu_capability"] == "AVX2"
    assert "not compared" in dc.compare_reference({"mine": dict(r, opencv="4.14.0")}, {variant: r})[0][0]


def test_gpu_check_runs_lane_and_suite_at_once_on_a_gpu_and_keeps_each_result_device_cpu(tmp_path, monkeypatch):
    """With a GPU (faked here) the CUDA lane and the suite run at the same time, the timed parts after
    them one by one in PARTS order, and summary.json is rewritten after each part: a run killed midway
    keeps what finished."""
    import threading
    gc = _load("gpu_check")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "Fake GPU")
    seen, lock, both = [], threading.Lock(), threading.Barrier(2, timeout=20)
    summaries = []

    def fake_run(self, part):
        with lock:
            seen.append(part)
            if os.path.isfile(tmp_path / "o" / "summary.json"):
                summaries.append(sorted(json.load(open(tmp_path / "o" / "summary.json"))["parts"]))
        if part in ("cuda_lane", "suite"):
            both.wait()                       # raises BrokenBarrierError unless the other runs meanwhile
        return {"seconds": 1.0, "met": True, "passed": 1, "failed": 0, "errors": 0, "skipped": 0,
                "failures": [], "timed_out": False, "ratios": {}, "models": {}, "stages": {}}

    monkeypatch.setattr(gc.Check, "run", fake_run)
    monkeypatch.setattr(gc.Check, "prepare", lambda self: seen.append("prepare") or True)
    assert gc.main(["--out", str(tmp_path / "o")]) == 0
    # the annotation files the step-time benchmark reads are made first, outside every timing
    assert seen[0] == "prepare" and sorted(seen[1:3]) == ["cuda_lane", "suite"]
    assert seen[3:] == ["step_time", "memory", "pipeline"]
    assert summaries == [["cuda_lane", "suite"], ["cuda_lane", "step_time", "suite"],
                         ["cuda_lane", "memory", "step_time", "suite"]]
    assert json.load(open(tmp_path / "o" / "summary.json"))["all_met"] is True


def test_profile_trainer_splits_an_iteration_into_the_trainers_spans_device_cpu(tmp_path):
    """profile_trainer: the spans' host time per iteration from profiler events (the loader's by its
    prefix), the rest of the wall as "outside"; only computing aten operators called from outside
    other aten operators are counted; a real run on a tiny set writes every span, forward and
    backward taking time, and a positive operator count."""
    import subprocess
    import sys
    from types import SimpleNamespace as E
    pt = _load("profile_trainer")
    tr = pt.SPANS
    events = [E(name=tr["forward"], cpu_time_total=3000.0), E(name=tr["backward"], cpu_time_total=5000.0),
              E(name=tr["forward"], cpu_time_total=1000.0),
              E(name="enumerate(DataLoader)#_MultiProcessingDataLoaderIter.__next__", cpu_time_total=2000.0),
              E(name="aten::conv2d", cpu_time_total=900.0)]
    s = pt.split_spans(events, wall_us=20000.0, iters=2)
    assert s["wall_ms"] == 10.0 and s["spans"]["forward"] == 2.0 and s["spans"]["backward"] == 2.5
    assert s["spans"]["loader"] == 1.0 and s["outside_ms"] == 10.0 - 5.5 and s["share"]["outside"] == 0.45
    with pytest.raises(ValueError, match="must be positive"):
        pt.split_spans(events, wall_us=0.0, iters=2)
    span = E(name=tr["forward"], cpu_parent=None)
    conv = E(name="aten::conv2d", cpu_parent=span)
    inner = E(name="aten::convolution", cpu_parent=conv)
    view = E(name="aten::view", cpu_parent=span)
    assert pt.top_level_ops([span, conv, inner, view, E(name="aten::add_", cpu_parent=None)]) == 2
    from dist_helpers import make_workspace
    path = make_workspace(str(tmp_path), num_train=8, num_val=2)
    script = os.path.join(ROOT, "benchmarks", "profile_trainer.py")
    for bad, says in ((["--iters", "0"], "--iters must be at least 1"),
                      (["--config", str(tmp_path / "none.py")], "none.py"),
                      (["--config", path, "batch_size", "x"], "batch_size")):
        r = subprocess.run([sys.executable, script, *bad], capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, r.stderr
    out = tmp_path / "split.json"
    assert pt.main(["--config", path, "--device", "cpu", "--iters", "2", "--top", "0", "--json", str(out),
                    "batch_size", "4", "num_workers", "0", "threads", "1", "ema", "true"]) == 0
    got = json.load(open(out))
    assert got["iters"] == 2 and set(got["spans"]) == set(tr) | {"loader"}
    assert got["spans"]["forward"] > 0 and got["spans"]["backward"] > 0 and got["spans"]["hooks"] > 0
    assert got["ops_per_iter"] > 0 and 0 <= got["share"]["outside"] < 1


def test_gpu_check_runs_the_step_time_settings_in_turn_and_labels_their_ratios_device_cpu(tmp_path, monkeypatch):
    """The step-time part runs its settings one after the other (timings alone) and names each ratio
    by its setting; a setting cut by the part's time limit leaves the part unmet and later settings
    unrun."""
    import sys
    from types import SimpleNamespace
    gc = _load("gpu_check")
    say = lambda text: [sys.executable, "-c", f"print({text!r})"]          # noqa: E731
    args = SimpleNamespace(out=str(tmp_path), timeouts={}, part_timeout=60.0, workers=1)
    check = gc.Check(args, cuda=True)
    monkeypatch.setattr(gc.Check, "step_time_runs", lambda self: {"448": [], "cards": []})
    monkeypatch.setattr(gc.Check, "commands", lambda self, part: [say("ratio step3/step1      1.100   (...)"),
                                                                   say("ratio step3/step1      3.000   (...)")])
    res = check.run("step_time")
    assert res["ratios"]["448: step3/step1"]["value"] == 1.1 and res["ratios"]["448: step3/step1"]["met"]
    assert res["ratios"]["cards: step3/step1"]["met"] is False and res["met"] is False
    assert (tmp_path / "step_time.log").read_text().count("ratio step3/step1") == 2
    args.timeouts = {"step_time": 1.0}
    slow = [sys.executable, "-c", "import time; time.sleep(30)"]
    monkeypatch.setattr(gc.Check, "commands", lambda self, part: [slow, say("ratio step3/step1  1.0 (...)")])
    res = check.run("step_time")
    assert res["timed_out"] and res["met"] is False and res["exit"][1] is None and not res["ratios"]


def test_step_time_counts_the_operators_an_accelerator_launches_device_cpu():
    """bench_step_time --ops: one training step's computing operators on the device path. Step 3's
    quantizers (one pass per weight format, one straight-through node per format, the code domain's
    one-pass gradient mask) add 181 operators to step 1's with torch 2.13, here and on the cards
    model alike (591 -> 772: the 16 convs are the same, only the loss differs); one straight-through
    node per parameter and the five-operator mask added 310. The bound, 200, leaves room for another
    torch version's decompositions, not for a pass per conv."""
    from gnetmdk.engine.stages import STAGES, apply_stage
    from gnetmdk.models.gnetdet.model import GNetDet
    bench = _load("bench_step_time")
    torch.manual_seed(0)
    f = GNetDet(3, 224, 0.0625, use_bn=False, weight_scale="mse", gain_aware=True)
    apply_stage(f, STAGES["step1"])
    q = GNetDet(3, 224, 0.0625, use_bn=False, weight_scale="mse", gain_aware=True)
    q.load_state_dict(f.state_dict())
    for i, r in enumerate(q.relus()):
        r.cap.fill_(2.0 + i % 3)
    apply_stage(q, STAGES["step3"])
    t = torch.zeros(2, 14, 14, 13)
    t[:, 3, 4, 0:5] = torch.tensor([0.5, 0.5, 0.2, 0.3, 1.0])
    t[:, 3, 4, 5:10] = t[:, 3, 4, 0:5]
    t[:, 3, 4, 10] = 1.0
    batch = (torch.randint(0, 32, (2, 3, 224, 224)).float(), t)
    n1, n3 = bench.count_ops(f, batch), bench.count_ops(q, batch)
    assert 0 < n1 < n3 <= n1 + 200, (n1, n3)
    assert q.batch_weight_quant is None                 # the model's own setting is restored


def test_gpu_check_hands_the_slowest_test_files_out_first_device_cpu(monkeypatch):
    """With pytest-xdist the suite's command names the multi-process test files before the rest of
    tests/ (pytest collects a path given twice once), so the workers start on them first; every named
    file exists."""
    gc = _load("gpu_check")
    monkeypatch.setattr(gc, "have_xdist", lambda: True)
    args = type("A", (), {"workers": 12})()
    (cmd,) = gc.Check(args, cuda=True).commands("suite")
    named = [w for w in cmd if w.startswith("tests")]
    assert named == list(gc.SLOW_FIRST) + ["tests"]
    assert all(os.path.isfile(os.path.join(ROOT, f)) for f in gc.SLOW_FIRST)
    assert cmd[cmd.index("-n") + 1] == "12" and cmd[cmd.index("not cuda") - 1] == "-m"


def test_bench_nms_times_both_passes_and_fails_when_they_keep_other_boxes_device_cpu(monkeypatch, capsys):
    """benchmarks/bench_nms.py prints a row per size and exits 0 while greedy_keep keeps what the torch loop
    keeps; a greedy pass that keeps other boxes makes it exit 1 and say so."""
    import sys
    bench = _load("bench_nms")
    monkeypatch.setattr(sys, "argv", ["bench_nms.py", "--sizes", "5,60", "--repeats", "1"])
    assert bench.main() == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert [r[0] for r in rows] == ["5", "60"] and all(float(r[4]) > 0 for r in rows)
    monkeypatch.setattr(bench, "greedy_keep", lambda sup: torch.arange(sup.shape[0]))
    assert bench.main() == 1
    assert "KEPT OTHER BOXES" in capsys.readouterr().out
    for bad in (["--sizes", "5,x"], ["--sizes", "0"], ["--repeats", "0"], ["--iou", "1.5"]):
        monkeypatch.setattr(sys, "argv", ["bench_nms.py", *bad])
        assert bench.main() == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("bench_nms: --sizes must be")
