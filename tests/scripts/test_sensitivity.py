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


def _stub_model_and_sensitivity(costs):
    """A tiny GNetDet (5801) and a Sensitivity of it whose output errors rank major 4's 1-bit format worst, then
    major 1's; ``evaluate`` reads the formats the convs quantize with: mAP 0.80 less ``costs[(major, format)]``
    (default 3-bit 2^-11, 1-bit 2^-8, 8-bit 0: sums exact in any order) per quantized major layer, outputs all
    equal to that mAP."""
    from gnetmdk.models.gnetdet import GNetDet
    model = GNetDet(3, 224, 0.0625, use_bn=False, chip="5801").eval()
    majors = [s.major for s in model.specs]
    errs = {1: 0.2, 3: 0.05, 8: 0.01}
    fmts = {m: {b: (0.8, errs[b] + (0.3 if (m, b) == (3, 1) else 0.0)) for b in (1, 3, 8)} for m in range(6)}
    sens = Sensitivity(base_map=0.80, layers=[str(i) for i in range(len(majors))], majors=majors,
                       weights=[(0.8, 0.0)] * len(majors), weight_formats=fmts, current=model.mask_bits(),
                       weights_per_major=[1] * 6)
    calls = []

    def evaluate(m):
        quantized = {(mj, c.weight_format) for mj, c in zip(majors, m.convs()) if c.fake_quant_enabled}
        calls.append(sorted(quantized))
        value = 0.80 - sum(costs.get(q, {1: 2.0 ** -8, 3: 2.0 ** -11, 8: 0.0}[q[1]]) for q in quantized)
        return value, [torch.full((2, 3), value)]
    return model, sens, evaluate, calls


def test_check_mask_bits_raises_the_worst_layer_until_the_whole_model_is_within_device_cpu():
    """The per-layer choice measured whole misses the tolerance (major 4 at 1 bit costs 3 points together);
    the layer with the largest output error alone is raised first (major 4, then major 1), each time
    evaluated again, and the first choice within the tolerance is kept; the convs' formats are restored."""
    from gnetmdk.gti.sensitivity import check_mask_bits
    model, sens, evaluate, calls = _stub_model_and_sensitivity({(3, 1): 2.0 ** -5})
    before = [(c.weight_format, c.weight_bits, c.bias_bits, c.fake_quant_enabled) for c in model.convs()]
    chk = check_mask_bits(model, evaluate, "5801", sens, [1, 3, 3, 1, 3, 8], 0.005)
    assert [t[0] for t in chk.trail] == [[1, 3, 3, 1, 3, 8], [1, 3, 3, 3, 3, 8], [3, 3, 3, 3, 3, 8]]
    first = 2.0 ** -8 + 3 * 2.0 ** -11 + 2.0 ** -5
    assert [t[1] for t in chk.trail] == pytest.approx([0.80 - first, 0.80 - 2.0 ** -8 - 4 * 2.0 ** -11,
                                                       0.80 - 5 * 2.0 ** -11], abs=1e-12)
    assert chk.trail[0][2] == pytest.approx(first / 0.80)             # relative L2 against the float outputs
    assert chk.chosen == [3, 3, 3, 3, 3, 8] and chk.within
    assert calls[0] == [] and all(len({q[0] for q in c}) == 6 for c in calls[1:])   # float, then all majors
    assert [(c.weight_format, c.weight_bits, c.bias_bits, c.fake_quant_enabled) for c in model.convs()] == before


def test_check_mask_bits_keeps_the_best_when_nothing_is_within_device_cpu():
    """Major 6 costs 1.6 points at any format and majors 3-5 cost as much at 8 bits as at 3: the five 3-bit
    layers are raised one per evaluation, the earliest first on a tie of output errors (6 evaluations), none
    within; the choice with the best mAP is kept, the fewest bits on a tie, and a mask_bits the chip has no
    format for is a ValueError."""
    from gnetmdk.gti.sensitivity import check_mask_bits
    costs = {(5, b): 2.0 ** -6 for b in (1, 3, 8)}
    costs.update({(m, 8): 2.0 ** -11 for m in (2, 3, 4)})
    model, sens, evaluate, _ = _stub_model_and_sensitivity(costs)
    chk = check_mask_bits(model, evaluate, "5801", sens, [3, 3, 3, 3, 3, 8], 0.005)
    assert [t[0] for t in chk.trail] == [[3, 3, 3, 3, 3, 8], [8, 3, 3, 3, 3, 8], [8, 8, 3, 3, 3, 8],
                                         [8, 8, 8, 3, 3, 8], [8, 8, 8, 8, 3, 8], [8] * 6]
    assert not chk.within and chk.chosen == [8, 8, 3, 3, 3, 8]       # the best mAP from there on: fewest bits
    with pytest.raises(ValueError, match="one of the chip's weight formats"):
        check_mask_bits(model, evaluate, "5801", sens, [3, 3, 2, 3, 3, 8])


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
    # the suggestion measured whole: the trail starts at the per-layer choice and its last entry (the choice,
    # or the best of a trail that never got within) is the model with every conv quantized at its major's format
    from gnetmdk.gti.sensitivity import Sensitivity as _S, suggest_mask_bits as _sug
    per_layer = _sug(_S(base_map=data["base_map"], layers=[], majors=[], weights=[],
                        weight_formats={int(m) - 1: {int(b): tuple(v) for b, v in by.items()}
                                        for m, by in data["weight_formats"].items()}), 0.005)
    assert data["together"][0]["mask_bits"] == per_layer and "quantized at once" in text
    picked = next(t for t in data["together"] if t["mask_bits"] == data["suggested"])
    assert data["within"] == (picked["map"] >= data["base_map"] - 0.005)
    specs = model.specs
    from gnetmdk.gti.spec import register_bits
    for c, sp in zip(model.convs(), specs):
        c.weight_format = data["suggested"][sp.major]
        c.weight_bits, c.bias_bits = register_bits(cfg.gnetdet.chip, c.weight_format)
        c.enable_fake_quant()
    model.set_gains()
    assert evaluate(model)[0] == pytest.approx(picked["map"], abs=1e-12)
    for c in model.convs():
        c.disable_fake_quant()
    model.set_gains()
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
