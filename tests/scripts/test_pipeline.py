"""End to end: every stage on real images (../shared/data/cards), tiny model; resume; CLI refusals."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from gnetmdk.checkpoint.io import load_checkpoint, save_checkpoint
from gnetmdk.models.rebuild import build_model_from_checkpoint
from gnetmdk.config import build_config, load_config_class
from gnetmdk.dataset.voc import convert_voc_to_meta
from gnetmdk.engine import trainer as trainer_mod
from gnetmdk.engine.cli import run_stage
from gnetmdk.engine.stages import STAGES, apply_stage
from repo_paths import REPO

ROOT = REPO
CARDS = os.path.join(os.path.dirname(ROOT), "shared", "data", "cards")
CLASSES = ["nine", "ten", "jack", "queen", "king", "ace"]

CONFIG = '''
from gnetmdk.config import BaseConfig

class Config(BaseConfig):
    DS_NAME = "cards"
    VOC_CLASSES = {classes!r}
    dataset_path = {dataset!r}
    meta_root = {root!r} + "/meta"
    checkpoint_root = {root!r} + "/checkpoint"
    log_root = {root!r} + "/log"
    model_root = {root!r} + "/model"
    image_size = 224
    width_mult = 0.0625
    batch_size = 4
    max_train_images = 8
    max_val_images = 4
    num_workers = 0
    threads = 1
    progress = False
    num_epochs = 1
    warmup_epochs = 0.5
    learning_rate = 1e-3
    device = "cpu"               # CPU behaviour is what these tests check (the cuda lane: test_cuda.py)
'''


def make_cards_workdir(tmp_path_factory, name):
    """A tmp folder with cards meta files and a tiny-model config file; returns (root, config path)."""
    root = str(tmp_path_factory.mktemp(name))
    convert_voc_to_meta(CARDS, CLASSES, os.path.join(root, "meta", "cards_train.txt"),
                        os.path.join(root, "meta", "cards_valid.txt"))
    path = os.path.join(root, "config.py")
    with open(path, "w") as fh:
        fh.write(CONFIG.format(classes=CLASSES, dataset=CARDS, root=root))
    return root, path


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return make_cards_workdir(tmp_path_factory, "pipeline")


def _cfg(path, *over, step=None, cal=False):
    return build_config(load_config_class(path), list(over), step=step, cal=cal)


def _run(args, cwd=ROOT):
    return subprocess.run([sys.executable] + args, cwd=cwd, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def pipeline(workdir):
    root, path = workdir
    torch.set_num_threads(1)
    summaries = {}
    for name in ["step1", "step2", "cal", "step3", "step4"]:
        cfg = _cfg(path, cal=True) if name == "cal" else _cfg(path, step=int(name[-1]))
        summaries[name] = run_stage(cfg)
    return root, path, summaries


def test_every_stage_writes_its_checkpoint(pipeline):
    root, _, summaries = pipeline
    ck = os.path.join(root, "checkpoint")
    for name, rel in [("step1", "step1/best.pth"), ("step2", "step2/best.pth"), ("cal", "step2/cal.pth"),
                      ("step3", "step3/best.pth"), ("step4", "step4/best.pth")]:
        c = load_checkpoint(os.path.join(ck, rel))
        assert c["stage"] == name
        assert 0.0 <= summaries[name]["best_map"] <= 1.0
        assert summaries[name]["entry_map"] is not None
    for step in (1, 2, 3, 4):
        assert os.path.isfile(os.path.join(ck, f"step{step}", "last.pth"))
        with open(os.path.join(ck, f"step{step}", "config.json")) as fh:
            saved = json.load(fh)
        assert saved["step"] == step and saved["DS_NAME"] == "cards"
    # tensorboard event files per stage
    for stage in ("step1", "step3"):
        files = os.listdir(os.path.join(root, "log", stage))
        assert any(f.startswith("events.out.tfevents") for f in files)


def test_summary_says_when_the_best_model_was_reached(pipeline):
    root, _, summaries = pipeline
    for name in ("step1", "step2", "step3", "step4"):
        s = summaries[name]
        best = load_checkpoint(os.path.join(root, "checkpoint", name, "best.pth"))
        assert s["best_epoch"] == best["epoch"]                  # the epoch whose evaluation wrote best.pth
        assert best["best_map"] == s["best_map"]
        assert 0.0 < s["best_seconds"] <= s["seconds"]
    assert "best_epoch" not in summaries["cal"]


def test_pipeline_table_shows_when_best_was_reached():
    spec = importlib.util.spec_from_file_location("run_pipeline", os.path.join(ROOT, "tools", "run_pipeline.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    table = tool.format_table([("step1", 0.0, 0.95, 150, 1541.4, 1643.0), ("cal", 0.95, 0.92, None, None, 15.0)])
    assert table.splitlines()[2].split() == ["step1", "0.0000", "0.9500", "150,", "1541", "1643"]
    assert table.splitlines()[3].split() == ["cal", "0.9500", "0.9200", "-", "15"]


def test_step1_has_bn_and_step2_is_folded(pipeline):
    root = pipeline[0]
    s1 = load_checkpoint(os.path.join(root, "checkpoint/step1/best.pth"))
    s2 = load_checkpoint(os.path.join(root, "checkpoint/step2/best.pth"))
    assert any(".bn." in k for k in s1["model"])
    assert not any(".bn." in k for k in s2["model"])
    assert s1["model_meta"]["use_bn"] and not s2["model_meta"]["use_bn"]


def test_cal_caps_in_checkpoint_and_text_file(pipeline):
    root, _, summaries = pipeline
    cal = load_checkpoint(os.path.join(root, "checkpoint/step2/cal.pth"))
    caps = cal["caps"]
    assert len(caps) == 16 and all(c > 0 for c in caps)
    with open(os.path.join(root, "model", "relu_cap.txt")) as fh:
        lines = [float(x) for x in fh.read().split()]
    assert lines == pytest.approx(caps, rel=1e-6)
    assert summaries["cal"]["caps"] == pytest.approx(caps)


def test_step4_is_gain_edited_integer_model(pipeline):
    root, path, _ = pipeline
    cal = load_checkpoint(os.path.join(root, "checkpoint/step2/cal.pth"))
    s4 = load_checkpoint(os.path.join(root, "checkpoint/step4/best.pth"))
    model = build_model_from_checkpoint(s4)
    apply_stage(model, STAGES["step4"])
    # every cap is 31 and the host-side scale is cap_last / 31 of the step-3 caps
    assert all(float(r.cap) == 31.0 for r in model.relus())
    s3 = load_checkpoint(os.path.join(root, "checkpoint/step3/best.pth"))
    assert float(model.output_scale) == pytest.approx(s3["caps"][-1] / 31, rel=1e-6)
    assert s3["caps"] == pytest.approx(cal["caps"])
    # the caps before gain editing travel with every step-4 checkpoint (also its last.pth) ...
    assert s4["calibrated_caps"] == pytest.approx(s3["caps"], rel=1e-7)
    assert load_checkpoint(os.path.join(root, "checkpoint/step4/last.pth"))["calibrated_caps"] == \
        pytest.approx(s3["caps"], rel=1e-7)
    # ... so the converter needs no relu_cap.txt from calibration to write the chip's
    from gnetmdk.chip.convert import convert_checkpoint
    cm, _ = convert_checkpoint(os.path.join(root, "checkpoint/step4/best.pth"),
                               cap_file=os.path.join(root, "no-such-dir", "relu_cap.txt"))
    assert cm.calibrated_caps() == pytest.approx(s3["caps"], rel=1e-6)
    # weights the model computes with are integer multiples of 2^-shift
    for conv in model.convs():
        w, b, s = conv.quantized_params()
        assert torch.equal(w.detach() * 2 ** s, torch.round(w.detach() * 2 ** s))
        assert torch.equal(b.detach() * 2 ** s, torch.round(b.detach() * 2 ** s))
    # in eval mode every activation is an integer code 0..31
    model.eval()
    x = torch.randint(0, 32, (1, 3, 224, 224)).float()
    _, outs = model.features(x, return_all=True)
    for o in outs:
        assert torch.equal(o, o.round()) and o.min() >= 0 and o.max() <= 31


def test_step4_starts_from_exactly_the_step3_model(pipeline):
    """Gain-aware step 3 computes the step-4 model's arithmetic, so the model step 4 builds from
    step3/best.pth (gain edit) gives the step-3 outputs bit for bit on real images, and step 4's entry
    mAP is step 3's best mAP."""
    import copy
    from gnetmdk.dataset.dataset import build_dataset
    from gnetmdk.chip.cli_util import load_eval_model
    root, path, summaries = pipeline
    cfg = _cfg(path, step=3)
    m3, ck3 = load_eval_model(os.path.join(root, "checkpoint/step3/best.pth"), cfg)
    assert ck3["model_meta"]["gain_aware"]
    m4 = copy.deepcopy(m3)
    for hook in STAGES["step4"].enter:
        hook(m4, "step3")
    apply_stage(m4, STAGES["step4"])
    m4.eval()
    ds = build_dataset(cfg, "valid")
    ds.augment = False
    x = torch.stack([ds[i][0] for i in range(2)])
    with torch.no_grad():
        y3, f3 = m3.features(x, return_all=True)
        y4, f4 = m4.features(x, return_all=True)
        assert torch.equal(m3(x), m4(x))
    assert m3.set_gains() and all(r.code_domain for r in m3.relus())
    assert not m4.set_gains() and not any(r.code_domain for r in m4.relus())
    for a, b in zip(f3, f4):
        assert torch.equal(a, b)
    assert len(torch.unique(torch.cat([a.reshape(-1) for a in f3]))) > 10     # real, varied codes
    assert summaries["step4"]["entry_map"] == summaries["step3"]["best_map"]


def test_step3_learns_the_caps_with_cap_lr(pipeline, tmp_path):
    """cap_lr > 0: step 3 trains the calibrated caps (they move; the EMA off here), best.pth's caps are
    written to model/relu_cap.txt, and the step-4 model made from best.pth still computes step 3's
    outputs bit for bit with those caps."""
    import copy
    from gnetmdk.dataset.dataset import build_dataset
    from gnetmdk.chip.cli_util import load_eval_model
    root, path, _ = pipeline
    out = str(tmp_path)
    over = ["cap_lr", "0.05", "num_epochs", "2", "load", os.path.join(root, "checkpoint/step2/cal.pth"),
            "checkpoint_root", out + "/ck", "log_root", out + "/log", "model_root", out + "/model"]
    summary = run_stage(_cfg(path, *over, step=3))
    cal_caps = load_checkpoint(os.path.join(root, "checkpoint/step2/cal.pth"))["caps"]
    last = load_checkpoint(os.path.join(out, "ck/step3/last.pth"))
    moved = [abs(a - b) for a, b in zip(last["caps"], cal_caps)]
    assert min(moved) > 1e-3, moved                               # every cap trained
    assert [float(last["model"][f"layers.{i}.relu.cap"]) for i in range(16)] == last["caps"]
    best = load_checkpoint(os.path.join(out, "ck/step3/best.pth"))
    with open(os.path.join(out, "model", "relu_cap.txt")) as fh:
        assert [float(v) for v in fh.read().split()] == pytest.approx(best["caps"], rel=1e-7)
    assert summary["best_map"] >= summary["entry_map"]
    # the step-4 model built from best.pth equals it
    cfg = _cfg(path, *over, step=3)
    m3, _ = load_eval_model(os.path.join(out, "ck/step3/best.pth"), cfg)
    m4 = copy.deepcopy(m3)
    for hook in STAGES["step4"].enter:
        hook(m4, "step3")
    apply_stage(m4, STAGES["step4"])
    m4.eval()
    assert m4.calibrated_caps == pytest.approx(best["caps"], rel=1e-7)
    ds = build_dataset(cfg, "valid")
    ds.augment = False
    x = torch.stack([ds[i][0] for i in range(2)])
    with torch.no_grad():
        assert torch.equal(m3(x), m4(x))
    # resuming needs the same optimizer groups: without cap_lr it is refused, naming the fix ...
    longer = ["num_epochs", "3", "resume_changes", "num_epochs", "resume", "true"]
    plain = [v for v in over if v not in ("cap_lr", "0.05")] + longer
    with pytest.raises(Exception, match="cap_lr 0.05 in the checkpoint, 0.0 now"):
        run_stage(_cfg(path, *plain, step=3))
    assert load_checkpoint(os.path.join(out, "ck/step3/last.pth"))["epoch"] == 2      # nothing lost
    # ... and with it, training continues (one more epoch, accepted with resume_changes)
    run_stage(_cfg(path, *over, *longer, step=3))
    assert load_checkpoint(os.path.join(out, "ck/step3/last.pth"))["epoch"] == 3


def test_ten_bit_output_from_a_five_bit_step2_to_a_bit_exact_chip_device_cpu(pipeline, tmp_path, capsys):
    """output_bits 10 set after step 2: cal, step 3 and step 4 from a 5-bit step-2 checkpoint (every conv
    keeps its weight format, the output conv in a major layer of its own), step 4 starts from step 3's
    best model exactly, and its chip model (10-bit output codes) scores the step-4 model's mAP with every
    layer's codes equal. A checkpoint from cal on keeps its output width under a 5-bit config, with a note."""
    from torch.utils.data import DataLoader
    from gnetmdk.chip import ChipEmulator, check_bit_exact, evaluate_chip
    from gnetmdk.chip.convert import convert_checkpoint
    from gnetmdk.dataset.dataset import build_dataset, collate
    from gnetmdk.evaluation.evaluator import evaluate_model
    root, path, _ = pipeline
    out = str(tmp_path)
    over = ["output_bits", "10", "checkpoint_root", out + "/ck", "log_root", out + "/log", "model_root", out + "/model"]
    run_stage(_cfg(path, *over, "load", os.path.join(root, "checkpoint/step2/best.pth"), cal=True))
    assert "caps (MSE-best for 5-bit codes (10-bit in the output layer) over a histogram" in capsys.readouterr().out
    s3 = run_stage(_cfg(path, *over, step=3))
    s4 = run_stage(_cfg(path, *over, step=4))
    cal = load_checkpoint(os.path.join(out, "ck/step2/cal.pth"))
    assert cal["model_meta"]["output_bits"] == 10 and cal["model_meta"]["mask_bits"] == [3, 3, 3, 3, 3, 8, 8]
    assert s4["entry_map"] == s3["best_map"]
    ck4 = load_checkpoint(os.path.join(out, "ck/step4/best.pth"))
    assert ck4["caps"] == [31.0] * 15 + [1023.0]
    assert ck4["model"]["output_scale"].item() == pytest.approx(ck4["calibrated_caps"][-1] / 1023, rel=1e-6)
    cm, model = convert_checkpoint(os.path.join(out, "ck/step4/best.pth"))
    assert cm.output_bits == 10 and cm.layers[-1].max_code == 1023 and len(cm.major_layers()) == 7
    cfg = _cfg(path, *over, step=4)
    val = build_dataset(cfg, "valid")
    ref = evaluate_model(model, DataLoader(val, batch_size=4, collate_fn=collate), val, torch.device("cpu"),
                         conf_thresh=1e-6)
    res = evaluate_chip(ChipEmulator(cm).run, cm, val, conf_thresh=1e-6)
    assert sum(ref["num_det"]) > 0 and res["map"] == ref["map"] and res["num_det"] == ref["num_det"]
    rep = check_bit_exact(model, ChipEmulator(cm).run, cm, dataset=val)
    assert sum(rep.mismatches) == 0 and rep.max_output_diff == 0.0
    capsys.readouterr()
    m3 = build_model_from_checkpoint(load_checkpoint(os.path.join(out, "ck/step3/best.pth")), _cfg(path, step=3), "s3")
    assert m3.output_bits == 10 and m3.relus()[-1].codes == 1023
    assert "(step3) was calibrated with output_bits 10; keeping it" in capsys.readouterr().err


def test_cap_lr_refusals(workdir):
    from gnetmdk.config import ConfigError
    _, path = workdir
    with pytest.raises(ConfigError, match="cap_lr.*finite number >= 0"):
        _cfg(path, "cap_lr", "-1e-3", step=3)
    with pytest.raises(ConfigError, match="cap_lr.*gain_aware true"):
        _cfg(path, "cap_lr", "1e-3", "gain_aware", "false", step=3)


def test_mask_bits_set_after_step1_reach_step2(pipeline, tmp_path, capsys):
    """mask_bits do not touch a float model, so a step-1 checkpoint takes the config's (set in
    configs.py after step 1, they used to be dropped in favour of the step-1 checkpoint's); a
    quantized checkpoint keeps the weight formats it was trained with and says so."""
    root, path, _ = pipeline
    step1 = os.path.join(root, "checkpoint/step1/best.pth")
    cfg = _cfg(path, "mask_bits", "8,3,3,3,3,8", step=2)
    assert load_checkpoint(step1)["model_meta"]["mask_bits"] == [3, 3, 3, 3, 3, 8]
    m = build_model_from_checkpoint(load_checkpoint(step1), cfg)
    assert m.mask_bits() == [8, 3, 3, 3, 3, 8] and [c.weight_format for c in m.convs()][:3] == [8, 8, 3]
    assert build_model_from_checkpoint(load_checkpoint(step1), _cfg(path, step=2)).mask_bits() == [3, 3, 3, 3, 3, 8]
    # a step-2 run from step 1 trains with them, and its checkpoint records them
    out = str(tmp_path)
    run_stage(_cfg(path, "mask_bits", "8,3,3,3,3,8", "load", step1, "checkpoint_root", out + "/ck",
                   "log_root", out + "/log", "model_root", out + "/model", step=2))
    assert load_checkpoint(os.path.join(out, "ck/step2/last.pth"))["model_meta"]["mask_bits"] == [8, 3, 3, 3, 3, 8]
    # a quantized checkpoint keeps its own weight formats, with a note, also when the config asks for the
    # chip's default ([]) and the checkpoint has others
    capsys.readouterr()
    m2 = build_model_from_checkpoint(load_checkpoint(os.path.join(root, "checkpoint/step2/best.pth")), cfg, "s2.pth")
    assert m2.mask_bits() == [3, 3, 3, 3, 3, 8]
    assert "note: checkpoint 's2.pth' (step2) was trained with mask_bits [3, 3, 3, 3, 3, 8]" in capsys.readouterr().err
    other = load_checkpoint(os.path.join(out, "ck/step2/last.pth"))
    assert build_model_from_checkpoint(other, _cfg(path, step=2), "o.pth").mask_bits() == [8, 3, 3, 3, 3, 8]
    assert "(step2) was trained with mask_bits [8, 3, 3, 3, 3, 8]; keeping them (the config's [3, 3, 3, 3, 3, 8]" \
        in capsys.readouterr().err
    # a float checkpoint that recorded other weight formats says the config's apply; equal ones say nothing
    rec = load_checkpoint(step1)
    rec["model_meta"]["mask_bits"] = [8, 3, 3, 3, 3, 8]
    assert build_model_from_checkpoint(rec, _cfg(path, step=2), "f.pth").mask_bits() == [3, 3, 3, 3, 3, 8]
    assert "recorded mask_bits [8, 3, 3, 3, 3, 8]; the config's [3, 3, 3, 3, 3, 8] apply" in capsys.readouterr().err
    build_model_from_checkpoint(load_checkpoint(step1), _cfg(path, step=2), "g.pth")
    assert "mask_bits" not in capsys.readouterr().err
    # a list that does not fit the model is refused by the config, naming the count
    from gnetmdk.config import ConfigError
    with pytest.raises(ConfigError, match="mask_bits.*GNetDet-224 has 6 major layers"):
        _cfg(path, "mask_bits", "8,3,3,3,8", step=2)


def test_resume_gives_the_same_weights(workdir, tmp_path):
    _, path = workdir
    torch.set_num_threads(1)
    over = ["num_epochs", "2", "eval_interval", "5", "eval_before", "false"]
    straight = _cfg(path, *over, "checkpoint_root", str(tmp_path / "a"), "log_root", str(tmp_path / "la"), step=1)
    s_straight = run_stage(straight)
    assert s_straight["best_epoch"] == 2              # no entry evaluation; the only one is after epoch 2
    interrupted = _cfg(path, *over, "checkpoint_root", str(tmp_path / "b"), "log_root", str(tmp_path / "lb"),
                       step=1)
    original = trainer_mod.Trainer.train_one_epoch

    def stop_after_first(self, epoch):
        if epoch == 1:
            raise KeyboardInterrupt
        return original(self, epoch)

    trainer_mod.Trainer.train_one_epoch = stop_after_first
    try:
        with pytest.raises(KeyboardInterrupt):
            run_stage(interrupted)
    finally:
        trainer_mod.Trainer.train_one_epoch = original
    assert not (tmp_path / "b" / "step1" / "last.pth").exists()       # interrupted: nothing published
    half = load_checkpoint(str(tmp_path / "b" / "step1" / "run" / "last.pth"))
    assert half["epoch"] == 1
    assert half["best_epoch"] is None and half["elapsed"] > 0
    half["elapsed"] = 1000.0                           # as if the first part had taken 1000 s
    save_checkpoint(str(tmp_path / "b" / "step1" / "run" / "last.pth"), half)
    resumed = _cfg(path, *over, "checkpoint_root", str(tmp_path / "b"), "log_root", str(tmp_path / "lb"),
                   "resume", "true", step=1)
    s_resumed = run_stage(resumed)
    # the stage clock runs on from the interrupted run's checkpoint: the time before it is counted
    assert s_resumed["best_epoch"] == 2
    assert 1000.0 < s_resumed["best_seconds"] <= s_resumed["seconds"]
    assert s_resumed["seconds"] - 1000.0 < s_straight["seconds"] * 100      # not the wall clock since the kill
    assert load_checkpoint(str(tmp_path / "b" / "step1" / "best.pth"))["best_seconds"] == s_resumed["best_seconds"]
    a = load_checkpoint(str(tmp_path / "a" / "step1" / "last.pth"))
    b = load_checkpoint(str(tmp_path / "b" / "step1" / "last.pth"))
    assert a["iteration"] == b["iteration"] == 4
    for k, v in a["model"].items():
        assert torch.allclose(v.float(), b["model"][k].float(), atol=1e-6, rtol=0), k


def test_cli_refuses_unknown_override(workdir):
    _, path = workdir
    r = _run(["train.py", "--config", path, "--step", "1", "batch-szie", "8"])
    assert r.returncode == 2
    assert "batch_size" in r.stderr and "Traceback" not in r.stderr


def test_cli_refuses_step3_without_calibration(workdir, tmp_path):
    _, path = workdir
    r = _run(["train.py", "--config", path, "--step", "3", "checkpoint_root", str(tmp_path / "empty")])
    assert r.returncode == 2
    assert "--cal" in r.stderr and "Traceback" not in r.stderr
    assert not os.path.exists(tmp_path / "empty" / "step3" / "best.pth")


def test_cli_refuses_missing_meta(workdir, tmp_path):
    _, path = workdir
    r = _run(["train.py", "--config", path, "--step", "1", "meta_root", str(tmp_path / "nometa")])
    assert r.returncode == 2
    assert "xml_2_txt" in r.stderr and "Traceback" not in r.stderr


def test_cli_refuses_checkpoint_of_another_class_count(pipeline, tmp_path):
    root, path, _ = pipeline
    r = _run(["train.py", "--config", path, "--step", "2", "VOC_CLASSES", "nine,ten,jack,queen,king,ace,joker", "checkpoint_root",
              str(tmp_path / "ck"), "load", os.path.join(root, "checkpoint/step1/best.pth")])
    assert r.returncode == 2
    assert "num_classes" in r.stderr


def test_logit_head_mse_scale_pipeline_to_bit_exact_chip(tmp_path_factory):
    """The cards recipe's settings (logit score head, log size head, one box slot, the range term, MSE-best
    weight scale and caps) through every stage: the checkpoints keep the heads and the rule, a later tool
    with a default config still evaluates the step-4 model under them, and the chip model equals it."""
    from torch.utils.data import DataLoader
    from gnetmdk.dataset.dataset import build_dataset, collate
    from gnetmdk.evaluation.evaluator import evaluate_model
    from gnetmdk.chip import ChipEmulator, evaluate_chip
    from gnetmdk.chip.convert import chip_model_from_gnetdet
    root, path = make_cards_workdir(tmp_path_factory, "logit_mse")
    torch.set_num_threads(1)
    over = ["score_head", "logit", "score_offset", "0.5", "score_scale", "10", "weight_scale", "mse",
            "cap_method", "mse", "size_head", "log", "box_slots", "1", "l_range", "1"]
    for name in ["step1", "step2", "cal", "step3", "step4"]:
        cfg = _cfg(path, *over, cal=True) if name == "cal" else _cfg(path, *over, step=int(name[-1]))
        run_stage(cfg)
    cal = load_checkpoint(os.path.join(root, "checkpoint/step2/cal.pth"))
    assert cal["config"]["gnetdet"]["cap_method"] == "mse" and all(c > 0 for c in cal["caps"])
    s4 = load_checkpoint(os.path.join(root, "checkpoint/step4/best.pth"))
    meta = s4["model_meta"]
    assert (meta["score_head"], meta["score_offset"], meta["score_scale"], meta["weight_scale"]) == \
        ("logit", 0.5, 10.0, "mse")
    assert (meta["size_head"], meta["size_min"]) == ("log", 1 / 64)
    plain = _cfg(path)                                   # weight_scale gti, linear heads by default
    model = build_model_from_checkpoint(s4, plain, path="step4/best.pth")
    assert {c.method for c in model.convs()} == {"mse"} and model.score_scale == 10.0
    assert model.size_head == "log"
    apply_stage(model, STAGES["step4"])
    model.eval()
    val = build_dataset(plain, "valid")
    # a threshold low enough that a one-epoch model's scores produce detections to compare
    ref = evaluate_model(model, DataLoader(val, batch_size=4, collate_fn=collate), val, torch.device("cpu"),
                         conf_thresh=1e-6)
    cm = chip_model_from_gnetdet(model, CLASSES)
    assert (cm.score_head, cm.score_scale, cm.size_head) == ("logit", 10.0, "log")
    res = evaluate_chip(ChipEmulator(cm).run, cm, val, conf_thresh=1e-6)
    assert sum(ref["num_det"]) > 0
    assert res["map"] == ref["map"] and res["num_det"] == ref["num_det"]


def test_layer_drift_from_step1_to_the_chip_device_cpu(pipeline, tmp_path, capsys):
    """Per-layer drift of the pipeline's real checkpoints: 0 for step 1, step 4 and the chip model
    equal (the same codes, the same caps), and the last layer's drift equals the relative error of
    the two models' forward outputs computed here without the report; tools/stage_report.py --plots
    writes the chart whose JSON holds the printed numbers."""
    import numpy as np
    from gnetmdk.dataset.dataset import build_dataset
    from gnetmdk.chip import convert_checkpoint
    from gnetmdk.chip.cli_util import load_eval_model
    from gnetmdk.chip.report import layer_drift
    root, path, _ = pipeline
    cfg = _cfg(path, step=4)
    ckpts = {f"step{k}": os.path.join(root, "checkpoint", f"step{k}", "best.pth") for k in range(1, 5)}
    chip, _ = convert_checkpoint(ckpts["step4"], CLASSES)
    ds = build_dataset(cfg, "valid")
    ds.augment = False
    drift = layer_drift(ds, ckpts, chip, batch_size=3, cfg=cfg, max_images=None)
    assert drift.reference == "step1" and drift.num_images == len(ds) == 4 and not drift.skipped
    assert list(drift.stages) == ["step1", "step2", "step3", "step4", "chip"]
    assert len(drift.layers) == 16 and drift.stages["step1"] == [0.0] * 16
    assert drift.stages["chip"] == drift.stages["step4"]
    for stage in ("step2", "step3", "step4"):
        assert all(v > 0 for v in drift.stages[stage])
    x = torch.stack([ds[i][0] for i in range(len(ds))])
    with torch.no_grad():
        p1 = load_eval_model(ckpts["step1"], cfg)[0](x).double()
        p4 = load_eval_model(ckpts["step4"], cfg)[0](x).double()
    expected = float((p4 - p1).norm() / p1.norm())
    # the report scales codes by cap / 31 in float64; forward multiplies by output_scale (cap / 31
    # rounded to float32) and rounds the product to float32: each element of p4 is off by at most
    # 2 u ||p4|| (u = 2^-24), so the ratio is off by at most 2 u ||p4|| / ||p1||; 3e-7 > 2 u
    assert abs(drift.stages["step4"][-1] - expected) <= 3e-7 * float(p4.norm() / p1.norm())

    spec = importlib.util.spec_from_file_location("stage_report", os.path.join(ROOT, "tools", "stage_report.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    assert tool.main(["--config", path, "--plots", str(a_file)]) == 2         # refused before evaluating
    assert "error: plots folder" in capsys.readouterr().err and a_file.read_text() == "x"
    assert tool.main(["--config", path, "--batch-size", "3", "--plots", str(tmp_path / "plots")]) == 0
    text = capsys.readouterr().out
    with open(tmp_path / "plots" / "stage_report.json") as fh:
        data = json.load(fh)
    assert os.path.getsize(tmp_path / "plots" / "stage_report.png") > 0
    table = text[text.index("per-layer output drift"):].splitlines()
    printed = {l.split()[0]: [float(v) for v in l.split()[1:]] for l in table[3:19]}
    assert list(printed) == drift.layers
    for j, stage in enumerate(data["drift"]):
        assert np.allclose([printed[n][j] for n in drift.layers], [100 * v for v in data["drift"][stage]],
                           atol=0.006)
    assert data["drift"]["step4"] == drift.stages["step4"]
    rows = {l.split()[0]: float(l.split()[1]) for l in text.splitlines()
            if l.split() and l.split()[0] in ("step1", "step2", "step3", "step4", "chip") and len(l.split()) > 2
            and l.split()[1][0].isdigit() and "." in l.split()[1] and len(l.split()) >= 6}
    assert data["maps"] == pytest.approx(rows, abs=5e-5)
    # tools/run_pipeline.py --plots draws the same drift (all val images here: 4 < 64)
    spec = importlib.util.spec_from_file_location("run_pipeline", os.path.join(ROOT, "tools", "run_pipeline.py"))
    pipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pipe)
    written = pipe.drift_plot(load_config_class(path), [], str(tmp_path / "pipe"))
    assert [os.path.basename(w) for w in written] == ["layer_drift.png", "layer_drift.json"]
    with open(written[1]) as fh:
        got = json.load(fh)["drift"]
    assert list(got) == list(drift.stages)
    for stage, vals in drift.stages.items():      # batches of 4 there, of 3 here: float64 sums reordered
        # worst case n u for n <= 2e6 summed squares (u = 2^-53): 2.2e-10, halved by the square root
        assert got[stage] == pytest.approx(vals, rel=1e-9)
