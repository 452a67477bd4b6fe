"""tools/sensitivity.py and gnetmdk.gti.sensitivity on a tiny GNetDet (device cpu)."""
from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

from gnetmdk.config import build_config, load_config_class
from gnetmdk.engine.cli import run_stage
from gnetmdk.gti.sensitivity import Sensitivity, suggest_mask_bits

from test_pipeline import ROOT, make_cards_workdir


def _tool():
    spec = importlib.util.spec_from_file_location("sensitivity", os.path.join(ROOT, "tools", "sensitivity.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_suggest_mask_bits_takes_the_fewest_bits_within_the_tolerance():
    s = Sensitivity(base_map=0.80, layers=["1.1", "2.1", "3.1"], majors=[0, 1, 2], weights=[(0.8, 0.0)] * 3,
                    weight_formats={0: {1: (0.70, 0.3), 3: (0.797, 0.1), 8: (0.80, 0.0)},
                             1: {1: (0.799, 0.2), 3: (0.80, 0.1), 8: (0.80, 0.0)},
                             2: {1: (0.5, 0.5), 3: (0.6, 0.4), 8: (0.7, 0.3)}},
                    current=[3, 3, 8], weights_per_major=[10, 20, 30])
    assert suggest_mask_bits(s, 0.005) == [3, 1, 8]      # the last: none within, so the best mAP
    assert suggest_mask_bits(s, 0.25) == [1, 1, 3]


def test_format_names_the_code_step_of_the_models_size_head():
    """The output-group table states what one code step does to a box size: a fraction of the input side
    (linear head) or a factor size_min ** (-cap / 31) (log head)."""
    from gnetmdk.gti.sensitivity import OUTPUT_GROUPS, format_sensitivity
    kw = dict(base_map=0.5, layers=["1.1"], majors=[0], weights=[(0.5, 0.0)], weight_formats={0: {8: (0.5, 0.0)}},
              current=[8], weights_per_major=[10], outputs={g: (0.4, 0.1) for g in OUTPUT_GROUPS}, output_cap=1.24)
    lin = format_sensitivity(Sensitivity(**kw))
    assert "steps of 0.04; box sizes are fractions of the input side, a step of 0.04 of it" in lin
    log = format_sensitivity(Sensitivity(**kw, size_head="log", size_min=1 / 64))
    assert f"one step multiplies a box size by {64 ** 0.04:.3g}" in log and "fractions" not in log


def test_quantize_output_channels_rounds_only_the_named_channels_device_cpu():
    from gnetmdk.gti.sensitivity import output_group_channels, quantize_output_channels
    out = torch.tensor([[0.0, 0.05, 0.3, 1.0, 2.5, -0.2, 0.33, 0.5, 0.61, 0.9, 1.7, 0.02, 3.1]], dtype=torch.float64)
    groups = output_group_channels(3)
    assert sorted(sum(groups.values(), [])) == list(range(13))            # every channel in one group
    q = quantize_output_channels(out, groups["box sizes (w, h)"], 3.1)    # steps of 0.1
    assert q[0, [2, 3, 7, 8]].tolist() == pytest.approx([0.3, 1.0, 0.5, 0.6])
    assert torch.equal(q[0, [0, 1, 4, 5, 6, 9, 10, 11, 12]], out[0, [0, 1, 4, 5, 6, 9, 10, 11, 12]])
    q = quantize_output_channels(out, [5, 12, 4], 3.1)                     # clamped to [0, cap]
    assert q[0, [5, 12, 4]].tolist() == pytest.approx([0.0, 3.1, 2.5]) and q.dtype == out.dtype


def test_sensitivity_tool_tables_plot_and_suggestion_device_cpu(tmp_path_factory, capsys):
    """One step-1 epoch, a step-2 entry and calibration, then the tool: every sublayer appears in the
    weight and activation tables; the one-sublayer row equals an independent evaluation of the model
    with only that conv quantized; the JSON holds the suggested mask_bits, one allowed weight format per major."""
    torch.set_num_threads(1)
    root, path = make_cards_workdir(tmp_path_factory, "sens")
    klass = load_config_class(path)
    out = ["checkpoint_root", os.path.join(root, "ck"), "log_root", os.path.join(root, "log"), "model_root",
           os.path.join(root, "model")]
    run_stage(build_config(klass, [*out, "num_epochs", "1"], step=1))
    run_stage(build_config(klass, [*out, "num_epochs", "0"], step=2))
    run_stage(build_config(klass, out, cal=True))
    capsys.readouterr()
    plots = os.path.join(root, "plots")
    tool = _tool()
    assert tool.main(["--config", path, "--plots", plots, *out]) == 0
    text = capsys.readouterr().out
    cfg = build_config(klass, out, step=1)
    from gnetmdk.checkpoint.io import load_checkpoint
    from gnetmdk.models.rebuild import build_model_from_checkpoint
    from gnetmdk.dataset.dataset import build_dataset
    from gnetmdk.gti.transforms import fold_bn
    model = build_model_from_checkpoint(load_checkpoint(os.path.join(root, "ck", "step1", "best.pth")), cfg).eval()
    fold_bn(model)
    n = len(model.convs())
    data = json.load(open(os.path.join(plots, "sensitivity.json")))
    assert len(data["layers"]) == n and all(l["acts_map"] is not None for l in data["layers"])
    ds = build_dataset(cfg, "valid")
    ds.augment = False
    evaluate = tool.make_evaluator(ds, cfg, 16)
    base, _ = evaluate(model)
    model.convs()[1].enable_fake_quant()
    m1, _ = evaluate(model)
    assert data["base_map"] == pytest.approx(base, abs=1e-12)
    assert data["layers"][1]["weights_map"] == pytest.approx(m1, abs=1e-12)
    assert len(data["suggested"]) == len(data["current"]) and set(data["suggested"]) <= {1, 3, 8}
    assert f"suggested mask_bits: {data['suggested']}" in text
    assert "activations quantized in one layer only" in text and os.path.isfile(os.path.join(plots, "sensitivity.png"))
    # the output groups: each row is the model evaluated with only that group on the output layer's code grid
    from gnetmdk.gti.sensitivity import OUTPUT_GROUPS, output_group_channels, quantize_output_channels
    model.convs()[1].disable_fake_quant()
    cap = data["output_cap"]
    assert cap == pytest.approx(float(load_checkpoint(os.path.join(root, "ck", "step2", "cal.pth"))["caps"][-1]))
    assert list(data["outputs"]) == list(OUTPUT_GROUPS) and "output layer's 5-bit code grid" in text
    chans = output_group_channels(model.num_classes)[OUTPUT_GROUPS[1]]
    hook = model.register_forward_hook(lambda mod, inp, out: quantize_output_channels(out, chans, cap))
    m_sizes, _ = evaluate(model)
    hook.remove()
    assert data["outputs"][OUTPUT_GROUPS[1]][0] == pytest.approx(m_sizes, abs=1e-12)
    assert tool.main(["--config", path, "--weights", os.path.join(root, "ck", "step2", "best.pth"), *out]) == 2
    assert "pass the float (step-1) model" in capsys.readouterr().err
