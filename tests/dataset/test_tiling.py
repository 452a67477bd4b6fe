"""Tiling a VOC dataset (gnetmdk.dataset.tiling, tools/tile_voc.py) and scoring a model trained on the
tiles on the whole images (gnetmdk.evaluation.stitch, tools/eval_voc.py --stitch). Everything runs
on the CPU (device cpu) on small synthetic sets written under tmp_path."""
import glob
import json
import os
import subprocess
import sys

import cv2
import numpy as np
import pytest
import torch

from gnetmdk.dataset.image_io import decode_image
from gnetmdk.dataset.shapes import make_shapes_dataset
from gnetmdk.dataset.tiling import MANIFEST, crop_boxes, load_manifest, tile_rects, tile_voc_dataset
from gnetmdk.dataset.voc import VOCFormatError, convert_voc_to_meta, parse_voc_xml
from gnetmdk.evaluation.stitch import merge_tiles, stitch_detections, whole_image_truths
from gnetmdk.evaluation.voc import evaluate_detections
from repo_paths import REPO

SHAPES = ["circle", "square", "triangle"]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A small shapes set: 3 train and 5 val images of 150-200 px with up to 6 shapes of 8-30 px."""
    d = str(tmp_path_factory.mktemp("tiling") / "src")
    make_shapes_dataset(d, num_train=3, num_val=5, image_size=(150, 200), seed=3, min_objects=3, max_objects=6,
                        side_px=(8, 30))
    return d


def test_tile_rects_size_overlap_and_cover_device_cpu():
    r = tile_rects(448, 448, 2, 16)
    assert r == [(0, 0, 232, 232), (216, 0, 448, 232), (0, 216, 232, 448), (216, 216, 448, 448)]
    assert tile_rects(100, 60, 1, 0) == [(0, 0, 100, 60)]
    r = tile_rects(101, 50, 3, 5)                      # width 37 = ceil((101 + 10) / 3), height 20
    xs = sorted({(a, c) for a, _, c, _ in r})
    assert xs == [(0, 37), (32, 69), (64, 101)]
    assert all(xs[i][1] - xs[i + 1][0] >= 5 for i in range(2))   # the overlap is at least 5 px
    assert {(b, d) for _, b, _, d in r} == {(0, 20), (15, 35), (30, 50)}
    for bad in ((100, 100, 0, 0), (100, 100, 2, -1), (20, 20, 2, 25)):
        with pytest.raises(ValueError):
            tile_rects(*bad)


def test_crop_boxes_keeps_the_visible_share_device_cpu():
    boxes = np.array([[10, 10, 20, 20],      # whole in the tile
                      [45, 0, 55, 10],       # half inside (x 45-50 of 45-55)
                      [46, 20, 56, 30],      # 40% inside
                      [70, 70, 80, 80]])     # outside
    cropped, idx = crop_boxes(boxes, (0, 0, 50, 50), 0.5)
    assert idx.tolist() == [0, 1]
    assert cropped.tolist() == [[10, 10, 20, 20], [45, 0, 50, 10]]
    cropped, idx = crop_boxes(boxes, (40, 0, 90, 50), 0.5)     # shifted into the tile's pixels
    assert idx.tolist() == [1, 2] and cropped.tolist() == [[5, 0, 15, 10], [6, 20, 16, 30]]
    assert crop_boxes(boxes, (0, 0, 50, 50), 0.3)[1].tolist() == [0, 1, 2]


def test_tile_voc_writes_tiles_labels_split_and_manifest_device_cpu(source, tmp_path):
    dst = str(tmp_path / "tiles")
    rep = tile_voc_dataset(source, dst, SHAPES, tiles=2, overlap=32)
    assert rep["images"] == 8 and rep["tiles"] == 32 and rep["not_whole"] == 0 and rep["max_side"] <= 32
    m = load_manifest(dst)
    assert m["tiles"] == 2 and m["overlap"] == 32 and m["classes"] == SHAPES
    with open(os.path.join(source, "ImageSets", "Main", "val.txt")) as fh:
        src_val = fh.read().split()
    with open(os.path.join(dst, "ImageSets", "Main", "val.txt")) as fh:
        tile_val = fh.read().split()
    assert tile_val == [f"{s}_r{r}c{c}" for s in src_val for r in range(2) for c in range(2)]
    for sid, entry in m["images"].items():
        assert entry["split"] == ("val" if sid in src_val else "train")
        ann = parse_voc_xml(os.path.join(source, "Annotations", sid + ".xml"), SHAPES)
        assert [o[1:5] for o in entry["objects"]] == ann["boxes"]
        img = decode_image(glob.glob(os.path.join(source, "JPEGImages", sid + ".*"))[0])
        for tid, (x0, y0, x1, y1) in entry["tiles"].items():
            tile = cv2.imread(os.path.join(dst, "JPEGImages", tid + ".png"))
            assert np.array_equal(tile, img[y0:y1, x0:x1])                    # lossless crops
            t = parse_voc_xml(os.path.join(dst, "Annotations", tid + ".xml"), SHAPES)
            want, idx = crop_boxes(np.array(ann["boxes"]), (x0, y0, x1, y1), 0.5)
            assert t["boxes"] == np.rint(want).astype(int).tolist()
            assert t["labels"] == [ann["labels"][i] for i in idx]
    # the tiled set converts like any VOC set, each tile in its image's split
    tr, va = str(tmp_path / "m_train.txt"), str(tmp_path / "m_valid.txt")
    convert_voc_to_meta(dst, SHAPES, tr, va)
    with open(va) as fh:
        assert {line.split()[0][:-len("_r0c0.png")] for line in fh} <= set(src_val)


def test_stitching_the_tile_labels_gives_back_the_image_labels_device_cpu(source, tmp_path):
    """The tiles' own boxes as detections (score 1): after the merge every whole-image box is found
    exactly once (a box in two tiles, whole or cut at a seam, becomes one), so mAP is 1."""
    dst = str(tmp_path / "tiles")
    tile_voc_dataset(source, dst, SHAPES, tiles=2, overlap=32)
    m = load_manifest(dst)
    dets = {}
    for tid in (t for e in m["images"].values() for t in e["tiles"]):
        a = parse_voc_xml(os.path.join(dst, "Annotations", tid + ".xml"), SHAPES)
        n = len(a["boxes"])
        dets[tid] = {"boxes": torch.tensor(a["boxes"], dtype=torch.float32).reshape(-1, 4),
                     "scores": torch.ones(n), "labels": torch.tensor(a["labels"], dtype=torch.int64)}
    ids, merged = stitch_detections(dets, m, nms_thresh=0.5)
    truths = whole_image_truths(m, SHAPES)
    assert ids == [k for k, e in m["images"].items() if e["split"] == "val"] and len(ids) == 5
    tile_count = sum(len(dets[t]["scores"]) for s in ids for t in m["images"][s]["tiles"])
    assert tile_count > sum(len(t["labels"]) for t in truths)          # there were duplicates to merge
    assert [len(d["scores"]) for d in merged] == [len(t["labels"]) for t in truths]
    assert evaluate_detections(merged, truths, 3)["map"] == 1.0
    # plain NMS alone keeps a cut part whose IoU with the whole box is at most 0.5; the merge does not
    parts = merge_tiles(torch.tensor([[0., 0, 10, 10], [0, 0, 5, 10]]), torch.tensor([0.9, 0.8]),
                        torch.tensor([1, 1]), torch.tensor([0, 1]), 0.5)
    assert parts.tolist() == [0]
    same_tile = merge_tiles(torch.tensor([[0., 0, 10, 10], [0, 0, 5, 10]]), torch.tensor([0.9, 0.8]),
                            torch.tensor([1, 1]), torch.tensor([0, 0]), 0.5)
    other_class = merge_tiles(torch.tensor([[0., 0, 10, 10], [0, 0, 10, 10]]), torch.tensor([0.9, 0.8]),
                              torch.tensor([1, 2]), torch.tensor([0, 1]), 0.5)
    assert same_tile.tolist() == [0, 1] and other_class.tolist() == [0, 1]


def _config(folder, dataset_dir):
    body = {"DS_NAME": "tiles", "VOC_CLASSES": SHAPES, "dataset_path": dataset_dir,
            "meta_root": os.path.join(folder, "meta"), "image_size": 224, "width_mult": 0.0625, "use_bn": False,
            "chip": "5801", "batch_size": 4, "num_workers": 0, "threads": 1, "device": "cpu", "progress": False,
            "weight_scale": "gti", "checkpoint_root": os.path.join(folder, "checkpoint")}
    path = os.path.join(folder, "config_tiles.py")
    with open(path, "w") as fh:
        fh.write("from gnetmdk.config import BaseConfig\n\n\nclass Config(BaseConfig):\n")
        fh.write("".join(f"    {k} = {v!r}\n" for k, v in body.items()))
    return path


def test_one_tile_stitched_equals_the_plain_evaluation_device_cpu(source, tmp_path, one_thread):
    """With 1 x 1 tiles the stitched evaluation must reproduce eval_voc's numbers on the same images."""
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from chip_helpers import build_step4_model, load_images
    from torch.utils.data import DataLoader
    from gnetmdk.config import load_config
    from gnetmdk.dataset.dataset import build_dataset, collate
    from gnetmdk.evaluation.evaluator import evaluate_model
    from gnetmdk.evaluation.stitch import evaluate_stitched
    dst = str(tmp_path / "tiles1")
    tile_voc_dataset(source, dst, SHAPES, tiles=1)
    cfg = load_config(_config(str(tmp_path), dst))
    convert_voc_to_meta(dst, SHAPES, cfg.train_meta, cfg.valid_meta)
    val = build_dataset(cfg, "valid")
    model, _ = build_step4_model(3, load_images(val))
    plain = evaluate_model(model, DataLoader(val, batch_size=4, collate_fn=collate), val, "cpu",
                           cfg.conf_thresh, cfg.nms_thresh, cfg.max_detections, keep_detections=True)
    st = evaluate_stitched(model, cfg, "cpu", keep_detections=True)
    assert st["num_images"] == st["num_tiles"] == plain["num_images"] == 5
    assert sum(plain["num_det"]) > 0
    assert st["ids"] == [os.path.basename(val.records[i][0])[:-len("_r0c0.png")] for i in range(len(val))]
    for a, b, ta, tb in zip(plain["detections"], st["detections"], plain["truths"], st["truths"]):
        assert len(a["scores"]) > 0 and torch.equal(a["labels"], b["labels"])   # the same boxes, same order
        assert torch.allclose(a["boxes"], b["boxes"], atol=1e-4) and torch.equal(a["scores"], b["scores"])
        assert np.array_equal(ta["boxes"], tb["boxes"]) and np.array_equal(ta["labels"], tb["labels"])
    # the command line: eval_voc --stitch --json on the model saved as a step-4 checkpoint
    import importlib.util
    from chip_helpers import save_step4_checkpoint
    config = os.path.join(str(tmp_path), "config_tiles.py")
    ckpt = save_step4_checkpoint(str(tmp_path / "step4.pth"), model, config)
    spec = importlib.util.spec_from_file_location("tiling_eval_voc", os.path.join(REPO, "tools", "eval_voc.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    out = tmp_path / "res" / "eval.json"
    assert tool.main([ckpt, "--config", config, "--stitch", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["stage"] == "step4" and doc["num_images"] == 5 and doc["stitched"]["num_tiles"] == 5
    assert doc["map"] == pytest.approx(plain["map"], abs=1e-12) and doc["stitched"]["map"] == doc["map"]
    assert doc["ap"] == [None if np.isnan(a) else pytest.approx(a, abs=1e-12) for a in plain["ap"]]
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    before = out.read_bytes()
    assert tool.main([ckpt, "--config", config, "--json", str(blocker / "eval.json")]) == 2   # its folder is a file
    assert out.read_bytes() == before and blocker.read_text() == "x"
    for key in ("map", "ap", "num_gt", "num_det"):
        assert st[key] == pytest.approx(plain[key], abs=1e-12, nan_ok=True), key


def test_tile_voc_cli_refusals_leave_nothing_device_cpu(source, tmp_path):
    tool = os.path.join(REPO, "tools", "tile_voc.py")

    def run(*args):
        return subprocess.run([sys.executable, tool, *map(str, args)], capture_output=True, text=True, timeout=120)
    dst = tmp_path / "t"
    r = run(source, dst, "--tiles", "2", "--classes", "circle,square")          # triangle is not a class
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "triangle" in r.stderr
    assert os.listdir(tmp_path) == []                                           # no tiles, no temporary folder
    r = run(source, dst, "--tiles", "2", "--classes", ",".join(SHAPES))
    assert r.returncode == 0, r.stderr
    assert "lie whole in no tile" in r.stderr and "--overlap" in r.stderr      # cut boxes are reported
    r = run(source, dst, "--tiles", "2", "--classes", ",".join(SHAPES))
    assert r.returncode == 2 and "exists" in r.stderr
    r = run(source, tmp_path / "u", "--tiles", "2", "--overlap", "250", "--classes", ",".join(SHAPES))
    assert r.returncode == 2 and "do not fit" in r.stderr and not os.path.exists(tmp_path / "u")
    with open(dst / MANIFEST, "w") as fh:
        json.dump({"format": "other"}, fh)
    with pytest.raises(VOCFormatError, match="not a gnetmdk-tiles/1 manifest"):
        load_manifest(str(dst))
    with pytest.raises(FileNotFoundError, match="tile_voc.py"):
        load_manifest(source)


def _tiled_step4(source, tmp_path, *over):
    """A 2 x 2 tiled copy of ``source``, its meta files, and a step-4 config over it that starts from an
    untrained step-4 model saved as a checkpoint (its detections are few but not none)."""
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from chip_helpers import build_step4_model, load_images, save_step4_checkpoint
    from gnetmdk.config import build_config, load_config, load_config_class
    from gnetmdk.dataset.dataset import build_dataset
    dst = str(tmp_path / "tiles2")
    tile_voc_dataset(source, dst, SHAPES, tiles=2, overlap=32)
    path = _config(str(tmp_path), dst)
    cfg = load_config(path)
    convert_voc_to_meta(dst, SHAPES, cfg.train_meta, cfg.valid_meta)
    model, _ = build_step4_model(3, load_images(build_dataset(cfg, "valid")))
    ckpt = save_step4_checkpoint(str(tmp_path / "start.pth"), model, path)
    return build_config(load_config_class(path), ["load", ckpt, "log_root", str(tmp_path / "log"),
                                                  *map(str, over)], step=4)


def test_evaluation_with_eval_stitch_scores_the_whole_images_device_cpu(source, tmp_path, one_thread):
    """eval_stitch: the trainer's evaluation reports the whole val images' mAP (what evaluate_stitched
    gives for the same weights, bit for bit), the tiles' mAP beside it (evaluate_model's), and the log
    line says which is which; a tiled run split over 3 ranks stitches the same detections."""
    from gnetmdk.engine.trainer import Trainer
    from gnetmdk.evaluation.evaluator import evaluate_model
    from gnetmdk.evaluation.stitch import evaluate_stitched, predict_tiles
    cfg = _tiled_step4(source, tmp_path, "eval_stitch", "true")
    t = Trainer(cfg)
    t.build_data()
    t.build_model()
    res = t.evaluate("entry")
    whole = evaluate_stitched(t.eval_model, cfg, "cpu", t.eval_batch, keep_detections=True)
    tiles = evaluate_model(t.eval_model, t.val_loader, t.val_set, "cpu", cfg.conf_thresh, cfg.nms_thresh,
                           cfg.max_detections, pad_to=t.eval_batch)
    assert sum(len(d["scores"]) for d in whole["detections"]) > 0
    assert res["map"] == whole["map"] and res["ap"] == whole["ap"]
    assert res["tile_map"] == tiles["map"] and res["loss"] == tiles["loss"]
    assert res["map"] != res["tile_map"]                 # the two measures differ here, so the test can tell
    assert res["whole_images"] == 5 and res["num_tiles"] == 20 and res["num_images"] == tiles["num_images"]
    # the tiles sharded over 3 ranks (ShardSampler's order), each forward padded to the evaluation batch:
    # together the same bits as one rank running them all
    from gnetmdk.dataset.tiling import load_manifest
    manifest = load_manifest(cfg.dataset_dir)
    one = predict_tiles(t.eval_model, cfg, "cpu", manifest)
    parts = [predict_tiles(t.eval_model, cfg, "cpu", manifest, rank=r, world_size=3) for r in range(3)]
    assert sorted(parts[1]) == list(range(1, 20, 3))
    merged = {k: v for p in parts for k, v in p.items()}
    assert sorted(merged) == sorted(one) == list(range(20))
    for k, d in one.items():
        assert all(torch.equal(d[f], merged[k][f]) for f in ("boxes", "scores", "labels")), k


def test_eval_stitch_picks_best_pth_on_the_whole_images_device_cpu(source, tmp_path, one_thread, monkeypatch,
                                                                   capsys):
    """best.pth follows the whole images' mAP, not the tiles': with the whole-image numbers of the entry and
    the two epochs set to 0.30, 0.50, 0.40 the stage keeps epoch 1, and its summary, the epoch lines and the
    curves carry those numbers with the tiles' beside them."""
    import gnetmdk.evaluation.stitch as stitch
    from gnetmdk.engine.cli import run_stage
    seq = iter([0.30, 0.50, 0.40])
    real = stitch.evaluate_stitched

    def scripted(*args, **kwargs):
        r = real(*args, **kwargs)
        r["map"] = next(seq)
        return r
    monkeypatch.setattr(stitch, "evaluate_stitched", scripted)
    cfg = _tiled_step4(source, tmp_path, "eval_stitch", "true", "num_epochs", 2, "eval_interval", 1,
                       "learning_rate", 1e-5, "checkpoint_root", tmp_path / "ck", "model_root", tmp_path / "md")
    summary = run_stage(cfg)
    assert summary["entry_map"] == 0.30 and summary["best_map"] == 0.50
    assert [m for _, m in summary["val_maps"]] == [0.50, 0.40]
    best = torch.load(str(tmp_path / "ck" / "step4" / "best.pth"), map_location="cpu", weights_only=True)
    assert best["epoch"] == 1
    log = capsys.readouterr().out
    assert "entry mAP 0.3000 (whole images; tiles " in log and "val mAP 0.5000 (whole images; tiles " in log
    assert "val mAP 0.4000 (whole images; tiles " in log


def test_eval_stitch_refusals_are_one_line_before_training_device_cpu(source, tmp_path):
    """eval_stitch on a dataset that is not tiled, or together with eval_coco / a PP-YOLO model: one clear
    error naming the field, before any training."""
    from gnetmdk.config import ConfigError, build_config, load_config_class
    from gnetmdk.engine.trainer import Trainer
    path = _config(str(tmp_path), source)                  # the untiled source set
    with pytest.raises(ConfigError, match="eval_stitch.*eval_coco"):
        build_config(load_config_class(path), ["eval_stitch", "true", "eval_coco", "true"])
    pp = tmp_path / "config_pp.py"
    pp.write_text("from gnetmdk.config import BaseConfig\n\n\nclass Config(BaseConfig):\n"
                  "    model_name = 'ppyolo'\n    VOC_CLASSES = ['circle']\n")
    with pytest.raises(ConfigError, match="eval_stitch.*ppyolo"):
        build_config(load_config_class(str(pp)), ["eval_stitch", "true"])
    cfg = build_config(load_config_class(path), ["eval_stitch", "true", "log_root", str(tmp_path / "log"),
                                                 "checkpoint_root", str(tmp_path / "ck")])
    convert_voc_to_meta(source, SHAPES, cfg.train_meta, cfg.valid_meta)
    from gnetmdk.engine.cli import run_stage
    with pytest.raises(FileNotFoundError, match="not a tiled dataset"):
        run_stage(cfg)
    assert not glob.glob(str(tmp_path / "ck" / "**" / "*.pth"), recursive=True)    # nothing was trained or written


def test_tile_voc_fold_puts_the_tiles_of_that_folds_photos_in_val_device_cpu(source, tmp_path):
    """fold (I, K) (tools/tile_voc.py --fold I/K): the val tiles are those of the photos in the I-th of K
    val folds of the random split, the photos xml_2_txt --fold I/K puts in val; refused with one line
    where ImageSets lists decide the split, and nothing is written."""
    import shutil
    import subprocess
    import sys
    from gnetmdk.dataset.voc import _split_ids
    src = str(tmp_path / "nolists")
    shutil.copytree(source, src, ignore=shutil.ignore_patterns("ImageSets"))
    _, want, how = _split_ids(src, os.path.join(src, "Annotations"), 0.2, 5, (1, 4))
    assert len(want) == 2 and how.endswith("val fold 1/4)")             # round(8 * 2 / 4) - round(8 / 4)
    rep = tile_voc_dataset(src, str(tmp_path / "t"), SHAPES, tiles=2, overlap=32, seed=5, fold=(1, 4))
    assert rep["split_source"] == how
    with open(os.path.join(tmp_path, "t", "ImageSets", "Main", "val.txt")) as fh:
        assert fh.read().split() == [f"{s}_r{r}c{c}" for s in want for r in range(2) for c in range(2)]
    res = subprocess.run([sys.executable, os.path.join(REPO, "tools", "tile_voc.py"), source, str(tmp_path / "u"),
                          "--tiles", "2", "--classes", ",".join(SHAPES), "--fold", "0/4"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "decide the split" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "u").exists()
