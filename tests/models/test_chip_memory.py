"""The chip's memory limits (gnetmdk.gti.memory, docs/chip.md "Memory limits"): the per-layer input + output
limit and the coefficient budget of the 5801, at config time and in the converter.

# device cpu
"""
from __future__ import annotations

import glob
import os

import pytest

from gnetmdk.config import BaseConfig, load_config_class
from gnetmdk.config.overrides import build_config
from gnetmdk.gti.memory import (MemoryLayer, check_chip_memory, chip_layers_memory, memory_report,
                                suggest_mask_bits)
from gnetmdk.models.gnetdet.memory import memory_table
from gnetmdk.gti.spec import CHIPS, ChipSpecError, get_chip_spec
from gnetmdk.models.gnetdet.model import gnetdet_layers, gnetdet_memory_layers
from repo_paths import REPO

SPEC = get_chip_spec("5801")

#: a full-width GNetDet-448 over the budget by any count: its last two major layers at 8 bits
OVER_BITS = [3, 3, 3, 3, 3, 8, 8]
#: the line it is refused with (after its prefix)
OVER = ("coefficient memory 530,016 with mask_bits [3, 3, 3, 3, 3, 8, 8] is not below chip 5801's budget of "
        "489,216 (sum of in x out channels / 4 for 1-bit, / 2 for 3-bit, / 1 for 8-bit kernels; the running sum "
        "reaches it at conv 15 (major layer 7, sublayer 2)): use mask_bits [3, 3, 3, 3, 3, 3, 8] (fewer 8-bit "
        "major layers) or width_mult 0.5")


def vgg16(mask_bits, size=224):
    """VGG16's 13 convs in 5 major layers, each ending in a 2x2 pool, 3 input channels."""
    chans = [[64, 64], [128, 128], [256, 256, 256], [512, 512, 512], [512, 512, 512]]
    layers, cin, n = [], 3, 0
    for m, (cs, bits) in enumerate(zip(chans, mask_bits)):
        for j, c in enumerate(cs):
            n += 1
            out = size // 2 if j == len(cs) - 1 else size
            layers.append(MemoryLayer(cin, c, size, size, out, out, bits, f"conv {n}", m))
            cin, size = c, out
    return layers


def test_limits_per_chip_device_cpu():
    assert SPEC.max_layer_io == 4_816_896 and SPEC.max_coef_memory == 489_216
    for chip in ("2801", "2803"):     # GTI's material states no memory limits for these
        assert CHIPS[chip].max_layer_io is None and CHIPS[chip].max_coef_memory is None


def test_vgg16_example_fits_device_cpu():
    """GTI's worked example: VGG16 with mask bits [3, 3, 3, 1, 1] needs 456,800 units and fits."""
    rep = check_chip_memory(vgg16([3, 3, 3, 1, 1]), SPEC)
    assert rep.coefficient_total == 456_800 and rep.fits
    # per major layer: (3*64 + 64*64)/2, (64*128 + 128*128)/2, (128*256 + 2*256*256)/2, (256*512 + 2*512*512)/4, 3*512*512/4
    assert [sum(l.coefficients for l in rep.layers if l.major == m) for m in range(5)] == [
        2144, 12288, 81920, 163840, 196608]
    # the largest layer: conv 2 reads 64x224x224 and writes its pooled 64x112x112
    assert rep.largest_io == 64 * 224 * 224 + 64 * 112 * 112 == 4_014_080 and rep.largest_layer == 1
    # all at 8 bits it is over the budget; the advice lowers the widest kernels first and arrives at GTI's choice
    with pytest.raises(ChipSpecError, match=r"coefficient memory 1,634,496 .* not below chip 5801's budget"):
        check_chip_memory(vgg16([8] * 5), SPEC)
    assert suggest_mask_bits(vgg16([8] * 5), SPEC) == [3, 3, 3, 1, 1]


def test_full_width_gnetdet_counts_device_cpu():
    """GNetDet-448 at full width, 3-bit with the last major layer at 8 bits: 292,960 + 196,608 (the last
    conv padded to 256 channels, as the converter writes it) = 489,568, over 489,216 by 352; with the last
    conv's 30 used outputs (20 classes) 431,712, which fits: the band that is noted, not refused."""
    for size in (224, 448):
        layers = gnetdet_memory_layers(gnetdet_layers(size, 20), size, "5801")
        rep = memory_report(layers, SPEC)
        assert rep.coefficient_total == 489_568 and not rep.coefficients_fit and rep.io_fits
        assert layers[-1].out_channels == 256 and layers[0].in_channels == 3
        assert rep.largest_io == 4_014_080      # 448: conv 2 (64x224x224 in, 64x112x112 out); 224: conv 2 likewise
        used = gnetdet_memory_layers(gnetdet_layers(size, 20), size, "5801", padded=False)
        assert used[-1].out_channels == 30 and memory_report(used, SPEC).coefficient_total == 431_712
        assert memory_report(used, SPEC).fits
    # an all-3-bit GNetDet-448 fits
    assert memory_report(gnetdet_memory_layers(gnetdet_layers(448, 20, mask_bits=[3] * 7), 448), SPEC).fits


def test_config_time_refusal_coefficients_device_cpu():
    """A full-width GNetDet-448 with its last two major layers at 8 bits is refused when the config is
    built: one line naming the layer, the amount against the budget and the fix. The bare defaults (the
    last major layer at 8 bits, as GTI's own 5801 GNetDet-448) pass with the note the trainer logs."""
    from gnetmdk.models import get_family
    from gnetmdk.models.gnetdet.config import gnetdet_memory_note
    with pytest.raises(ChipSpecError) as info:
        build_config(BaseConfig, ["image_size", "448", "mask_bits", str(OVER_BITS).replace(" ", "")])
    msg = str(info.value)
    # BaseConfig's 3 classes: 13 used outputs of the last (8-bit, 256-input) conv instead of 30: 17 x 256 fewer
    assert "\n" not in msg and msg == "config section 'gnetdet' (GNetDet-448, width_mult 1, chip 5801): " + OVER.replace(
        "530,016", f"{530_016 - 17 * 256:,}"), msg
    cfg = build_config(BaseConfig, ["image_size", "448"])
    notes = get_family("gnetdet").configure(None, cfg)
    assert notes == [gnetdet_memory_note(448, cfg.num_classes, 1.0, "5801", [])]
    assert notes[0].startswith("chip 5801 memory: coefficient memory ") and "489,568 if the output layer's zero " \
        "filters count" in notes[0] and "\n" not in notes[0]
    assert get_family("gnetdet").configure(None, build_config(BaseConfig, ["image_size", "448", "mask_bits",
                                                                             "[3,3,3,3,3,3,3]"])) == []
    # the suggested fixes pass
    build_config(BaseConfig, ["image_size", "448", "mask_bits", "[3,3,3,3,3,3,8]"])
    build_config(BaseConfig, ["image_size", "448", "width_mult", "0.5"])
    # chips without stated limits are not checked
    build_config(BaseConfig, ["image_size", "224", "chip", "2801"])


def test_config_time_refusal_per_layer_device_cpu():
    """GNetDet-448 at width 2: conv 2 reads 128x224x224 and writes 128x112x112, over 4,816,896."""
    with pytest.raises(ChipSpecError) as info:
        build_config(BaseConfig, ["image_size", "448", "width_mult", "2", "mask_bits", "[1,1,1,1,1,1,1]"])
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.endswith("conv 2 (major layer 2, sublayer 1): input 128x224x224 + output 128x112x112 = 8,028,160 "
                        "feature-map values, over chip 5801's per-layer limit of 4,816,896: use width_mult 1 or a "
                        "smaller image_size"), msg


def test_per_layer_limit_constructed_device_cpu():
    """A layer that keeps 64 channels at 448 px without a pool: 2 x 64 x 448 x 448 = 25,690,112 values."""
    layers = [MemoryLayer(3, 64, 448, 448, 448, 448, 3, "conv 1"),
              MemoryLayer(64, 64, 448, 448, 448, 448, 3, "conv 2"),
              MemoryLayer(64, 64, 448, 448, 224, 224, 3, "conv 3")]
    with pytest.raises(ChipSpecError) as info:
        check_chip_memory(layers, SPEC, "my net")
    assert str(info.value) == ("my net: conv 2: input 64x448x448 + output 64x448x448 = 25,690,112 feature-map values, "
                               "over chip 5801's per-layer limit of 4,816,896: use a narrower width_mult or a "
                               "smaller image_size")
    # exactly at the limit passes; one value more does not
    at = MemoryLayer(1, 1, 1, 4_816_895, 1, 1, 8)
    assert check_chip_memory([at], SPEC).largest_io == 4_816_896
    with pytest.raises(ChipSpecError, match="4,816,897 feature-map values"):
        check_chip_memory([MemoryLayer(1, 1, 1, 4_816_896, 1, 1, 8)], SPEC)
    # the same list on a chip without stated limits
    assert check_chip_memory(layers, get_chip_spec("2801")).largest_io == 25_690_112


def test_converter_refuses_before_writing_device_cpu():
    """The converter's first check (check_checkpoint_for_chip) and its check on the integerised layers."""
    import torch
    from gnetmdk.engine.stages import STAGES, apply_stage
    from gnetmdk.chip import ConversionError, check_checkpoint_for_chip, chip_model_from_gnetdet
    from gnetmdk.gti.transforms import fold_requant_multipliers
    from gnetmdk.models.gnetdet.model import GNetDet
    meta = {"name": "gnetdet", "use_bn": False, "chip": "5801", "image_size": 448, "num_classes": 20,
            "width_mult": 1.0, "mask_bits": OVER_BITS}
    with pytest.raises(ConversionError) as info:
        check_checkpoint_for_chip({"stage": "step4", "model_meta": meta}, "big.pth")
    msg = str(info.value)
    assert msg == f"checkpoint 'big.pth' cannot run on chip 5801: {OVER} (and retrain)"
    check_checkpoint_for_chip({"stage": "step4", "model_meta": dict(meta, mask_bits=[3] * 7)}, "ok.pth")
    check_checkpoint_for_chip({"stage": "step4", "model_meta": dict(meta, mask_bits=[])}, "noted.pth")

    # a gain-edited full-width GNetDet-448 (random weights, caps set by hand): refused on the integerised
    # layers, before a chip model exists
    from gnetmdk.gti.memory import memory_note

    def edited(bits):
        torch.manual_seed(0)
        model = GNetDet(num_classes=20, image_size=448, width_mult=1.0, use_bn=False, chip="5801", mask_bits=bits)
        with torch.no_grad():
            for r in model.relus():
                r.cap.fill_(4.0)
            fold_requant_multipliers(model)
        apply_stage(model, STAGES["step4"])
        return model.eval()

    with pytest.raises(ConversionError) as info:
        chip_model_from_gnetdet(edited(OVER_BITS), [f"c{i}" for i in range(20)])
    assert str(info.value) == ("the model cannot run on chip 5801: " + OVER.replace(
        "or width_mult 0.5", "or a narrower width_mult (and retrain)"))
    # the chip default: converted, and the converter's note names the two counts
    cm = chip_model_from_gnetdet(edited([]), [f"c{i}" for i in range(20)])
    note = memory_note(cm)
    assert note.startswith("chip 5801 memory: coefficient memory 431,712 is below the budget of 489,216, but "
                           "489,568 if the output layer's zero filters count"), note


def test_converted_layers_count_as_configured_device_cpu():
    """The config-time count (layer list + padding rule) equals the count of the layers the converter writes."""
    import torch
    from gnetmdk.engine.stages import STAGES, apply_stage
    from gnetmdk.chip import chip_model_from_gnetdet
    from gnetmdk.gti.transforms import fold_requant_multipliers
    from gnetmdk.models.gnetdet.model import GNetDet
    for size, width, classes, bits in ((224, 0.0625, 3, [8, 3, 3, 3, 3, 8]), (448, 0.125, 6, [])):
        torch.manual_seed(0)
        model = GNetDet(num_classes=classes, image_size=size, width_mult=width, use_bn=False, chip="5801",
                        mask_bits=bits)
        with torch.no_grad():
            for r in model.relus():
                r.cap.fill_(4.0)
            fold_requant_multipliers(model)
        apply_stage(model, STAGES["step4"])
        model.eval()
        cm = chip_model_from_gnetdet(model, [f"c{i}" for i in range(classes)])
        written = chip_layers_memory(cm.layers, cm.input_size)
        configured = gnetdet_memory_layers(model.specs, size, "5801")
        assert written == configured
        assert chip_layers_memory(cm.layers, cm.input_size, used_out=cm.used_channels) == gnetdet_memory_layers(
            model.specs, size, "5801", padded=False)
        assert cm.output_channels == configured[-1].out_channels > 10 + classes


def _example_configs():
    files = sorted(glob.glob(os.path.join(REPO, "examples", "*.py"))) + [os.path.join(REPO, "configs.py")]
    return [f for f in files if getattr(load_config_class(f), "model_name", "gnetdet") == "gnetdet"]


@pytest.mark.parametrize("path", _example_configs(), ids=os.path.basename)
def test_example_configs_fit_device_cpu(path):
    """Every GNetDet example (the README's demo examples/shapes.py among them) passes the config check,
    with its own mask_bits and with the chip default."""
    cfg = build_config(load_config_class(path))
    build_config(load_config_class(path), ["mask_bits", "[]"])
    assert cfg.gnetdet.chip == "5801"


def test_memory_table_matches_checks_device_cpu():
    """The docs/chip.md table: the examples fit by both counts; the full-width models with an 8-bit last
    major layer fit with the output layer as used, not as padded (noted); all 3-bit fits by both."""
    rows = memory_table()
    examples = [r for r in rows if r["config"].startswith("examples/")]
    assert {r["config"] for r in examples} >= {"examples/shapes.py", "examples/cards.py"}
    assert all(r["fits"] and r["padded_fits"] for r in examples)
    full = [r for r in rows if "full width" in r["config"]]
    assert [(r["size"], r["mask_bits"], int(r["coef"]), int(r["coef_padded"]), r["fits"], r["padded_fits"])
            for r in full] == [
        (224, [3, 3, 3, 3, 3, 8], 431_712, 489_568, True, False), (224, [8, 3, 3, 3, 3, 8], 433_856, 491_712, True, False),
        (224, [3, 3, 3, 3, 3, 3], 362_336, 391_264, True, True),
        (448, [3, 3, 3, 3, 3, 3, 8], 431_712, 489_568, True, False),
        (448, [8, 3, 3, 3, 3, 3, 8], 431_808, 489_664, True, False),
        (448, [3, 3, 3, 3, 3, 3, 3], 362_336, 391_264, True, True)]
    assert all(r["largest_io"] == 4_014_080 for r in full)


def test_docs_table_is_what_the_code_computes_device_cpu(capsys):
    """docs/chip.md's memory table is the output of ``python3 -m gnetmdk.models.gnetdet.memory``, line for line."""
    from gnetmdk.models.gnetdet.memory import main
    assert main([]) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    with open(os.path.join(REPO, "docs", "chip.md"), encoding="utf-8") as fh:
        doc = fh.read().splitlines()
    start = doc.index(printed[0])
    assert doc[start:start + len(printed)] == printed
