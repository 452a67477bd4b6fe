"""Plots (gnetmdk.evaluation.plots) and the tools' --plots options: files written atomically, PNGs that
decode, JSON numbers equal to the printed ones, a hand-counted confusion matrix, refusals. Device cpu."""
import json
import os
import sys

import numpy as np
import pytest
import torch

from chip_helpers import (DATASETS, REPO, build_step4_model, have, load_images,  # noqa: E402
                          save_step4_checkpoint, write_config)

from gnetmdk.evaluation import plots  # noqa: E402
from gnetmdk.evaluation.voc import evaluate_detections, voc_ap  # noqa: E402
from repo_paths import REPO, load_tool

pytest.importorskip("matplotlib")

CAT, DOG, BG = 0, 1, 2




def decodes_as_image(path):
    """The file is non-empty and matplotlib reads it as an image with pixels."""
    import matplotlib.image
    assert os.path.getsize(path) > 0
    img = matplotlib.image.imread(path)
    assert img.ndim == 3 and img.shape[0] > 0 and img.shape[1] > 0
    return img


def hand_case():
    """Three images, classes cat (0) and dog (1); see test_confusion_matrix_hand_counted_device_cpu."""
    dets = [
        # image 0: the cat found; the dog detected as a cat (a wrong class)
        {"boxes": [[0, 0, 10, 10], [20, 20, 40, 40]], "scores": [0.9, 0.8], "labels": [CAT, CAT]},
        # image 1: the dog found, the cat missed (its only detection scores 0.2, below 0.3); a dog on a
        # difficult object (counted nowhere)
        {"boxes": [[0, 0, 10, 10], [50, 50, 60, 60], [200, 200, 220, 220]], "scores": [0.7, 0.2, 0.9],
         "labels": [DOG, CAT, DOG]},
        # image 2: a false positive (0.95, far from everything); a cat (0.65, IoU 0.9) takes the dog before
        # the exact dog box (0.6, IoU 1: greedy by score, not by IoU), which is then a false detection; a
        # score of exactly 0.3 is not above the threshold
        {"boxes": torch.tensor([[100, 100, 110, 110], [0, 0, 10, 9], [0, 0, 10, 10], [0, 0, 10, 10]],
                               dtype=torch.float32),
         "scores": torch.tensor([0.95, 0.65, 0.6, 0.3]), "labels": torch.tensor([DOG, CAT, DOG, CAT])},
    ]
    truths = [
        {"boxes": [[0, 0, 10, 10], [20, 20, 40, 40]], "labels": [CAT, DOG]},
        {"boxes": [[0, 0, 10, 10], [50, 50, 60, 60], [200, 200, 220, 220], [300, 300, 310, 310]],
         "labels": [DOG, CAT, DOG, CAT], "difficult": [False, False, True, True]},
        {"boxes": np.array([[0, 0, 10, 10]], np.float32), "labels": np.array([DOG])},
    ]
    return dets, truths


def test_confusion_matrix_hand_counted_device_cpu():
    dets, truths = hand_case()
    m = plots.confusion_matrix(dets, truths, 2)
    want = np.array([
        # predicted: cat dog background
        [1, 0, 1],       # true cat: image 0 found; image 1 missed
        [2, 1, 0],       # true dog: image 0 called a cat, image 2 taken by the cat; image 1 found
        [0, 2, 0],       # background: image 2's far dog and the exact dog box left without a ground truth
    ])
    assert m.dtype == np.int64 and m.shape == (3, 3)
    np.testing.assert_array_equal(m, want)
    # row sums: the non-difficult ground truths per class
    assert m[:2].sum(axis=1).tolist() == evaluate_detections(dets, truths, 2)["num_gt"]
    # the threshold is an argument: at 0.1 image 1's cat detection (0.2) finds its cat
    m01 = plots.confusion_matrix(dets, truths, 2, conf_thresh=0.1)
    assert m01[CAT].tolist() == [2, 0, 0]
    with pytest.raises(ValueError, match="same length"):
        plots.confusion_matrix(dets, truths[:2], 2)
    with pytest.raises(ValueError, match="labels must be integers"):
        plots.confusion_matrix(dets, truths, 1)


def test_evaluate_detections_curves_are_the_ap_arrays_device_cpu():
    dets, truths = hand_case()
    plain = evaluate_detections(dets, truths, 3)
    full = evaluate_detections(dets, truths, 3, return_curves=True)
    assert "curves" not in plain
    assert {k: v for k, v in full.items() if k != "curves"}.keys() == plain.keys()
    np.testing.assert_array_equal(full["ap"], plain["ap"])              # nan for class 2 in both
    assert full["map"] == plain["map"] and full["num_gt"] == plain["num_gt"] and full["num_det"] == plain["num_det"]
    assert sorted(full["curves"]) == [CAT, DOG]                         # class 2 has no ground truth
    for c, (rec, prec) in full["curves"].items():
        assert rec.dtype == np.float64 and rec.shape == prec.shape
        assert voc_ap(rec, prec) == full["ap"][c]


def test_plot_files_written_and_decode_device_cpu(tmp_path):
    dets, truths = hand_case()
    res = evaluate_detections(dets, truths, 3, return_curves=True)
    names = ["cat", "dog", "bird"]
    written = plots.write_eval_plots(str(tmp_path / "new" / "dir"), res, dets, truths, names)
    assert [os.path.basename(p) for p in written] == ["pr_curves.png", "pr_curves.json",
                                                       "confusion_matrix.png", "confusion_matrix.json"]
    for p in written[::2]:
        decodes_as_image(p)
    with open(written[1]) as fh:
        pr = json.load(fh)
    assert [c["name"] for c in pr["classes"]] == names and pr["classes"][2]["ap"] is None
    for c in pr["classes"][:2]:
        assert voc_ap(np.array(c["recall"]), np.array(c["precision"])) == c["ap"] == res["ap"][c["index"]]
    with open(written[3]) as fh:
        cm = json.load(fh)
    assert cm["labels"] == names + ["background"] and cm["conf_thresh"] == 0.3
    np.testing.assert_array_equal(cm["matrix"], plots.confusion_matrix(dets, truths, 3))

    rows = [{"stage": "step1", "entry_map": 0.0, "best_map": 0.91}, {"stage": "cal", "entry_map": 0.88,
                                                                     "best_map": None}]
    png, js = plots.plot_stages(rows, str(tmp_path / "stages.png"))
    decodes_as_image(png)
    with open(js) as fh:
        assert json.load(fh) == {"stages": rows}
    with pytest.raises(ValueError, match="return_curves"):
        plots.plot_pr_curves(evaluate_detections(dets, truths, 3), names, str(tmp_path / "x.png"))


def test_a_failed_write_leaves_no_file_device_cpu(tmp_path, monkeypatch):
    def full_disk(fd):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(plots.PlotError, match="No space left"):
        plots.plot_stages([{"stage": "step1", "entry_map": 0.5, "best_map": 0.6}], str(tmp_path / "stages.png"))
    assert os.listdir(tmp_path) == []                                   # no PNG, no JSON, no temporary file


def test_missing_matplotlib_names_the_install_device_cpu(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)                # import matplotlib raises ImportError
    with pytest.raises(plots.PlotError, match="pip install matplotlib"):
        plots.require_matplotlib()


# ------------------------------------------------------------------ the tools, end to end
def _setup(tmp_path_factory, name):
    """A tiny step-4 checkpoint of a shared dataset (no training: chip_helpers' initialisation gives
    ranked detections; on raccoon, one large object per image, some of them right), its chip model, and
    a config evaluating 8 val images."""
    if not have(name):
        pytest.skip(f"shared {name} dataset not present")
    from gnetmdk.config import load_config
    from gnetmdk.dataset.dataset import build_dataset
    from gnetmdk.chip import chip_model_from_gnetdet
    torch.set_num_threads(1)
    folder = str(tmp_path_factory.mktemp(f"plots_{name}"))
    config = write_config(folder, name, max_val_images=8)
    cfg = load_config(config)
    model, caps = build_step4_model(len(DATASETS[name]), load_images(build_dataset(cfg, "train"), 8))
    ckpt = save_step4_checkpoint(os.path.join(folder, "checkpoint", "step4", "best.pth"), model, config)
    chip = chip_model_from_gnetdet(model, DATASETS[name], calibrated_caps=caps).save(
        os.path.join(folder, "chip_model.json"))
    return {"name": name, "dir": folder, "config": config, "ckpt": ckpt, "chip": chip}


@pytest.fixture(scope="module")
def cards(tmp_path_factory):
    return _setup(tmp_path_factory, "cards")


@pytest.fixture(scope="module")
def raccoon(tmp_path_factory):
    return _setup(tmp_path_factory, "raccoon")


def _table_aps(text, names):
    """class -> AP string of the AP table in ``text``."""
    rows = {}
    for line in text.splitlines():
        parts = line.split()
        if parts and parts[0] in names:
            rows[parts[0]] = parts[1]
    assert sorted(rows) == sorted(names), text
    return rows


def _check_pr_json(path, printed, names):
    """The PR JSON's curves give, through voc_ap, the AP the table printed for every class."""
    with open(path) as fh:
        pr = json.load(fh)
    assert [c["name"] for c in pr["classes"]] == names
    got = {}
    for c in pr["classes"]:
        ap = voc_ap(np.array(c["recall"]), np.array(c["precision"]))
        assert c["ap"] is None or ap == c["ap"]
        got[c["name"]] = "n/a" if c["ap"] is None else f"{ap:.4f}"
    assert got == printed
    assert all(len(c["recall"]) for c in pr["classes"])                # there were detections to draw
    return pr


@pytest.mark.parametrize("dataset", ["raccoon", "cards"])
def test_eval_voc_plots_end_to_end_device_cpu(dataset, request, tmp_path, capsys):
    s = request.getfixturevalue(dataset)
    names = DATASETS[dataset]
    tool = load_tool("eval_voc")
    assert tool.main([s["ckpt"], "--config", s["config"]]) == 0
    plain = capsys.readouterr().out
    out_dir = tmp_path / "plots"
    assert tool.main([s["ckpt"], "--config", s["config"], "--plots", str(out_dir)]) == 0
    text = capsys.readouterr().out
    # the printed table is the same with --plots (the first line holds the timing)
    table = plain.splitlines()[1:]
    assert text.splitlines()[1:1 + len(table)] == table
    assert text.splitlines()[-1].startswith("plots: ")
    for name in ("pr_curves.png", "confusion_matrix.png"):
        decodes_as_image(str(out_dir / name))
    pr = _check_pr_json(str(out_dir / "pr_curves.json"), _table_aps(plain, names), names)
    if dataset == "raccoon":
        assert pr["classes"][0]["ap"] > 0                                # a curve that is not all zero
    with open(out_dir / "confusion_matrix.json") as fh:
        cm = json.load(fh)
    m = np.array(cm["matrix"])
    assert m.shape == (len(names) + 1,) * 2 and cm["labels"] == names + ["background"]
    assert m[:-1].sum(axis=1).tolist() == [c["num_gt"] for c in pr["classes"]]   # every ground truth, once


@pytest.mark.parametrize("dataset", ["raccoon", "cards"])
def test_chip_eval_plots_are_of_the_chip_detections_device_cpu(dataset, request, tmp_path, capsys):
    s = request.getfixturevalue(dataset)
    names = DATASETS[dataset]
    tool = load_tool("chip_eval")
    assert tool.main([s["chip"], "--config", s["config"]]) == 0
    plain = capsys.readouterr().out
    out_dir = tmp_path / "chip"
    assert tool.main([s["chip"], "--config", s["config"], "--plots", str(out_dir)]) == 0
    text = capsys.readouterr().out
    assert text.split("images/s")[1].splitlines()[1:] == plain.split("images/s")[1].splitlines()[1:] + \
        [text.splitlines()[-1]]                                          # the same table, then the plots line
    for name in ("pr_curves.png", "confusion_matrix.png"):
        decodes_as_image(str(out_dir / name))
    _check_pr_json(str(out_dir / "pr_curves.json"), _table_aps(plain, names), names)


def test_eval_voc_bootstrap_against_a_checkpoint_device_cpu(cards, tmp_path, capsys):
    """--against itself: the same mAP twice, a difference of 0 on every resample; --json holds it; the
    single-model interval holds the mAP; --bootstrap 0 with --against and a missing --against file are
    refused in one line before anything is evaluated."""
    tool = load_tool("eval_voc")
    out = tmp_path / "boot.json"
    assert tool.main([cards["ckpt"], "--config", cards["config"], "--against", cards["ckpt"], "--bootstrap", "200",
                      "--json", str(out)]) == 0
    text = capsys.readouterr().out
    doc = json.loads(out.read_text())
    b = doc["bootstrap"]
    assert b["resamples"] == 200 and b["images"] == "valid" and b["num_images"] == 8
    assert b["map_a"] == b["map_b"] == doc["map"] and b["diff"] == 0.0
    assert b["interval_diff"] == [0.0, 0.0] and b["share_below"] == 0.0
    assert b["samples_diff"] == [0.0] * 200                              # every resample's difference
    assert 0.0 <= b["interval_a"][0] <= b["interval_a"][1] <= 1.0
    assert "difference +0.0000, 95% paired interval [+0.0000, +0.0000]" in text
    for argv, word in (([ "--against", cards["ckpt"], "--bootstrap", "0"], "--bootstrap"),
                       (["--against", str(tmp_path / "missing.pth")], "missing.pth"),
                       (["--bootstrap", "10", "--level", "1.5"], "--level")):
        assert tool.main([cards["ckpt"], "--config", cards["config"], *argv]) == 2
        captured = capsys.readouterr()
        err = captured.err.strip().splitlines()
        assert len(err) == 1 and word in err[0], captured
        assert captured.out == ""


def _refused(cards, target, capsys):
    """eval_voc and chip_eval with --plots ``target``: one ``error:`` line, exit 2, nothing evaluated;
    returns the two lines."""
    lines = []
    for tool, model in (("eval_voc", cards["ckpt"]), ("chip_eval", cards["chip"])):
        rc = load_tool(tool).main([model, "--config", cards["config"], "--plots", target])
        captured = capsys.readouterr()
        assert rc == 2, captured
        err = captured.err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: plots folder") and target in err[0], err
        assert captured.out == ""                                        # refused before evaluating
        lines.append(err[0])
    return lines


def test_tools_refuse_a_file_as_plots_dir_device_cpu(cards, tmp_path, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    _refused(cards, str(a_file), capsys)                                 # a file
    _refused(cards, str(a_file / "below"), capsys)                       # a folder that cannot be made


def test_tools_refuse_a_read_only_plots_dir_device_cpu(cards, tmp_path, capsys):
    read_only = tmp_path / "read_only"
    read_only.mkdir()
    read_only.chmod(0o500)
    try:
        if os.access(str(read_only), os.W_OK):
            pytest.skip("chmod has no effect here (running as root): a read-only folder is writable")
        with pytest.raises(plots.PlotError, match="not writable"):
            plots.prepare_plot_dir(str(read_only))
        _refused(cards, str(read_only), capsys)
        _refused(cards, str(read_only / "plots"), capsys)
        assert os.listdir(read_only) == []
    finally:
        read_only.chmod(0o700)


def test_tools_refuse_a_plots_dir_on_a_read_only_file_system_device_cpu(cards, tmp_path, capsys, monkeypatch):
    """EROFS for every file created in the folder (what a read-only mount gives, and what root gets too)."""
    import errno
    import tempfile
    folder = tmp_path / "mounted_ro"
    folder.mkdir()
    real_mkstemp = tempfile.mkstemp

    def read_only_mkstemp(*a, dir=None, **k):
        if dir is not None and os.path.abspath(dir).startswith(str(folder)):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), dir)
        return real_mkstemp(*a, dir=dir, **k)
    monkeypatch.setattr(tempfile, "mkstemp", read_only_mkstemp)
    assert all("Read-only file system" in line for line in _refused(cards, str(folder), capsys))
    with pytest.raises(plots.PlotError, match="not writable .Read-only file system"):
        plots.prepare_plot_dir(str(folder))
    assert os.listdir(folder) == []


def test_run_pipeline_plots_stages_after_the_table_device_cpu(tmp_path, capsys, monkeypatch):
    """tools/run_pipeline.py --plots with the stages' training replaced by fixed summaries (the trainer
    itself: tests/scripts/test_pipeline.py); a bad folder is refused before any stage runs."""
    tool = load_tool("run_pipeline")
    summaries = {"step1": dict(entry_map=0.01, best_map=0.93, best_epoch=3, best_seconds=9.0, seconds=10.0),
                 "step2": dict(entry_map=0.90, best_map=0.92, best_epoch=1, best_seconds=2.0, seconds=3.0)}
    ran = []

    def fake_run_stage(cfg):
        name = f"step{cfg.step}"
        ran.append(name)
        return summaries[name]
    monkeypatch.setattr(tool, "run_stage", fake_run_stage)
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    assert tool.main(["--config", os.path.join(REPO, "examples", "shapes.py"), "--stages", "step1,step2",
                      "--plots", str(a_file)]) == 2
    assert ran == [] and capsys.readouterr().err.startswith("error: plots folder")
    # a config the run refuses leaves no --plots folder behind (one that was there before stays)
    fresh, kept = tmp_path / "fresh", tmp_path / "kept"
    kept.mkdir()
    for folder in (fresh, kept):
        assert tool.main(["--config", os.path.join(REPO, "examples", "shapes.py"), "--stages", "step1",
                          "--plots", str(folder), "image_size", "300"]) == 2
        assert "image_size" in capsys.readouterr().err
    assert ran == [] and not fresh.exists() and kept.is_dir()
    out_dir = tmp_path / "p"
    assert tool.main(["--config", os.path.join(REPO, "examples", "shapes.py"), "--stages", "step1,step2",
                      "--plots", str(out_dir), "checkpoint_root", str(tmp_path / "no-checkpoints")]) == 0
    text = capsys.readouterr().out
    assert ran == ["step1", "step2"]
    assert text.index("Per-stage mAP") < text.index("plots: ")
    decodes_as_image(str(out_dir / "stages.png"))
    assert sorted(os.listdir(out_dir)) == ["stages.json", "stages.png"]     # no checkpoints: no drift chart
    with open(out_dir / "stages.json") as fh:
        data = json.load(fh)
    assert data == {"stages": [{"stage": s, "entry_map": summaries[s]["entry_map"],
                                "best_map": summaries[s]["best_map"]} for s in ("step1", "step2")]}


def test_training_curves_of_a_stage_and_of_its_resume_device_cpu(tmp_path_factory):
    """A 2-epoch step 1 draws log/step1/curves.png with one JSON entry per epoch, the val mAP the
    checkpoint holds and the mean loss terms; a run cut inside epoch 2 and resumed draws both epochs
    again (the history of finished epochs travels in last.pth)."""
    from test_pipeline import make_cards_workdir
    from gnetmdk.checkpoint.io import load_checkpoint
    from gnetmdk.config import build_config, load_config_class
    from gnetmdk.engine.cli import run_stage
    torch.set_num_threads(1)
    root, path = make_cards_workdir(tmp_path_factory, "curves")
    tmp = tmp_path_factory.mktemp("curves-runs")

    def cfg(name, *over):
        return build_config(load_config_class(path), ["checkpoint_root", str(tmp / name), "log_root",
                                                      str(tmp / ("log-" + name)), "num_epochs", "2",
                                                      "eval_interval", "1", *over], step=1)
    summary = run_stage(cfg("full"))
    png = tmp / "log-full" / "step1" / "curves.png"
    decodes_as_image(str(png))
    data = json.loads(png.with_suffix(".json").read_text())["epochs"]
    assert [e["epoch"] for e in data] == [1, 2]
    assert max(e["val_map"] for e in data) == pytest.approx(summary["best_map"], abs=0)
    last = load_checkpoint(str(tmp / "full" / "step1" / "last.pth"))
    assert [e["epoch"] for e in last["curves"]] == [1, 2]
    assert {"total", "loc", "cls"} <= set(data[0]["train"]) and data[0]["lr"] > 0
    run_stage(cfg("cut", "max_iters", "3", "eval_before", "false"))     # epoch 1 (2 iterations) and 1 more
    assert [e["epoch"] for e in load_checkpoint(str(tmp / "cut" / "step1" / "last.pth"))["curves"]] == [1]
    run_stage(cfg("cut", "resume", "true", "eval_before", "false"))
    cut = json.loads((tmp / "log-cut" / "step1" / "curves.json").read_text())["epochs"]
    assert [e["epoch"] for e in cut] == [1, 2]


def test_predictions_drawn_into_tensorboard_at_each_evaluation_device_cpu(tmp_path_factory):
    """tb_images 2: after each of 2 evaluations tensorboard holds the same 2 val images (named by file)
    as RGB images at most 640 px a side; tb_images 0 writes none."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from test_pipeline import make_cards_workdir
    from gnetmdk.config import build_config, load_config_class
    from gnetmdk.engine.cli import run_stage
    torch.set_num_threads(1)
    root, path = make_cards_workdir(tmp_path_factory, "tbimages")
    tmp = tmp_path_factory.mktemp("tb-runs")
    tags = {}
    for n in (2, 0):
        cfg = build_config(load_config_class(path), ["checkpoint_root", str(tmp / f"c{n}"), "log_root",
                                                     str(tmp / f"l{n}"), "num_epochs", "2", "eval_interval", "1",
                                                     "eval_before", "false", "tb_images", str(n)], step=1)
        run_stage(cfg)
        acc = EventAccumulator(str(tmp / f"l{n}" / "step1"), size_guidance={"images": 0})
        acc.Reload()
        tags[n] = acc.Tags()["images"]
        if n:
            names = [os.path.splitext(os.path.basename(l.split()[0]))[0]
                     for l in open(os.path.join(root, "meta", "cards_valid.txt")).read().splitlines()[:2]]
            assert sorted(tags[n]) == sorted(f"step1/predictions/{m}" for m in names)
            for tag in tags[n]:
                events = acc.Images(tag)
                assert [e.step for e in events] == [1, 2]
                assert max(events[0].width, events[0].height) <= 640 and events[0].encoded_image_string
    assert tags[0] == []
