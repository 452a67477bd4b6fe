"""Tests for gnetmdk.config: precedence, override parsing, type conversion, validation, paths."""

import os
import textwrap
from typing import List

import pytest

from gnetmdk.config import (BaseConfig, ConfigError, build_config, config_from_dict, convert_value,
                            load_config, load_config_class, parse_overrides)
from repo_paths import REPO


class Config(BaseConfig):
    """A user config as a configs.py would hold it."""

    DEFAULT_STEP = 1
    DS_NAME = "toy"
    VOC_CLASSES = ["a", "b"]
    batch_size = 8                       # Config > BaseConfig (16)
    learning_rate = 1e-3
    num_epochs = 7
    image_size = 224
    per_step = {
        1: dict(learning_rate=2e-3, num_epochs=3),
        2: dict(learning_rate=2e-4),
        "cal": dict(batch_size=4),
        3: dict(batch_size=2, augment="False"),     # a string bool must be converted, not bool("False")
    }


class Step3Config(Config):
    DEFAULT_STEP = 3


FIELDS = BaseConfig.field_types()


# ------------------------------------------------------------------ precedence
def test_base_defaults_when_nothing_set():
    cfg = build_config(BaseConfig)
    assert cfg.batch_size == 16
    assert cfg.learning_rate == 1e-4
    assert cfg.step == 1
    assert cfg.DS_NAME == "shapes"


def test_class_attrs_override_base():
    cfg = build_config(Config, step=2)
    assert cfg.batch_size == 8                 # Config
    assert cfg.num_epochs == 7                 # Config (per_step[2] does not set it)
    assert cfg.weight_decay == BaseConfig.weight_decay   # BaseConfig
    assert cfg.DS_NAME == "toy"


def test_per_step_overrides_class_attrs():
    cfg = build_config(Config, step=1)
    assert cfg.learning_rate == 2e-3 and cfg.num_epochs == 3 and cfg.batch_size == 8
    cfg = build_config(Config, step=2)
    assert cfg.learning_rate == 2e-4 and cfg.num_epochs == 7
    cfg = build_config(Config, step=4)         # no per_step entry: class values
    assert cfg.learning_rate == 1e-3 and cfg.batch_size == 8


def test_cli_overrides_per_step():
    cfg = build_config(Config, ["learning_rate", "5e-5", "num_epochs=11"], step=1)
    assert cfg.learning_rate == 5e-5
    assert cfg.num_epochs == 11
    cfg = build_config(Config, ["batch-size", "32"], step=3)
    assert cfg.batch_size == 32                # CLI beats per_step[3] (2)


def test_per_step_string_bool_converted():
    cfg = build_config(Config, step=3)
    assert cfg.augment is False
    assert cfg.batch_size == 2


def test_instances_do_not_share_mutable_defaults():
    a = build_config(Config)
    b = build_config(Config)
    a.VOC_CLASSES.append("c")
    assert b.VOC_CLASSES == ["a", "b"]
    assert Config.VOC_CLASSES == ["a", "b"]


# ------------------------------------------------------------------ step / cal
def test_default_step_and_step_argument():
    assert build_config(Config).step == 1
    assert build_config(Step3Config).step == 3
    assert build_config(Step3Config).batch_size == 2          # per_step[3] follows DEFAULT_STEP
    assert build_config(Step3Config, step=2).step == 2        # --step beats DEFAULT_STEP
    assert build_config(Config, ["step", "4"]).step == 4      # step as an override
    assert build_config(Config, ["step", "4"], step=2).step == 2   # --step beats "step 4"


def test_cal_sets_step_2_and_stage_name():
    cfg = build_config(Config, step=4, cal=True)
    assert cfg.cal is True
    assert cfg.step == 2
    assert cfg.stage_name == "cal"
    assert cfg.batch_size == 4                 # per_step["cal"]
    assert cfg.checkpoint_dir() == os.path.join("checkpoint", "step2")
    assert cfg.log_dir == os.path.join("log", "cal")
    cfg = build_config(Config, ["cal", "true"], step=3)
    assert cfg.cal and cfg.step == 2 and cfg.stage_name == "cal"
    assert build_config(Config, step=3).stage_name == "step3"


def test_bad_step_refused():
    with pytest.raises(ConfigError, match="step"):
        build_config(Config, step=5)


# ------------------------------------------------------------------ override syntax
def test_key_value_forms_and_dashes():
    a = parse_overrides(["batch-size", "4", "learning_rate=0.5", "--num-epochs", "3"], FIELDS)
    assert a == {"batch_size": 4, "learning_rate": 0.5, "num_epochs": 3}
    assert isinstance(a["batch_size"], int) and isinstance(a["learning_rate"], float)
    # "=" inside the value stays in the value
    assert parse_overrides(["load=a=b.pth"], FIELDS) == {"load": "a=b.pth"}


def test_unknown_key_names_closest_field():
    with pytest.raises(ConfigError) as e:
        parse_overrides(["batch-szie", "4"], FIELDS)
    assert "batch_size" in str(e.value)
    assert "batch_szie" in str(e.value)
    with pytest.raises(ConfigError) as e:
        build_config(Config, ["lerning_rate=1e-3"])
    assert "learning_rate" in str(e.value)


def test_key_without_value_refused():
    with pytest.raises(ConfigError, match="no value"):
        parse_overrides(["batch_size"], FIELDS)
    with pytest.raises(ConfigError, match="no value"):
        parse_overrides(["num_epochs", "3", "batch_size"], FIELDS)


# ------------------------------------------------------------------ conversion by type
@pytest.mark.parametrize("raw,expected", [
    ("true", True), ("True", True), ("1", True), ("yes", True), ("YES", True), ("on", True),
    ("false", False), ("False", False), ("0", False), ("no", False), ("off", False),
])
def test_bool_conversion(raw, expected):
    assert convert_value("augment", raw, bool) is expected
    assert parse_overrides(["augment", raw], FIELDS)["augment"] is expected


def test_bool_false_string_trap():
    # bool("False") is True in Python; the config must give False
    assert build_config(Config, ["augment", "False"]).augment is False
    assert build_config(Config, ["cache_images=0"]).cache_images is False


@pytest.mark.parametrize("raw", ["maybe", "2", "", "tru"])
def test_bool_refuses_garbage(raw):
    with pytest.raises(ConfigError, match="augment"):
        convert_value("augment", raw, bool)


def test_int_conversion():
    assert convert_value("batch_size", "12", int) == 12
    assert convert_value("batch_size", "12.0", int) == 12
    assert type(convert_value("batch_size", "12", int)) is int
    for raw in ("1.5", "abc", ""):
        with pytest.raises(ConfigError, match="batch_size"):
            convert_value("batch_size", raw, int)


def test_float_conversion():
    assert convert_value("learning_rate", "1e-3", float) == pytest.approx(1e-3)
    assert convert_value("learning_rate", "2", float) == 2.0
    assert type(convert_value("learning_rate", "2", float)) is float
    with pytest.raises(ConfigError, match="learning_rate"):
        convert_value("learning_rate", "fast", float)


def test_list_conversion():
    assert convert_value("mask_bits", "1,2,3", List[int]) == [1, 2, 3]
    assert convert_value("mask_bits", "[1, 2]", List[int]) == [1, 2]
    assert convert_value("mask_bits", "3", List[int]) == [3]
    assert convert_value("mask_bits", "[]", List[int]) == []
    assert convert_value("hsv_gain", "0.1,0.2,0.3", List[float]) == [0.1, 0.2, 0.3]
    assert convert_value("VOC_CLASSES", "cat,dog", List[str]) == ["cat", "dog"]
    assert convert_value("VOC_CLASSES", "['cat', 'dog']", List[str]) == ["cat", "dog"]
    with pytest.raises(ConfigError, match="mask_bits"):
        convert_value("mask_bits", "1,2.5", List[int])
    with pytest.raises(ConfigError, match="mask_bits"):
        convert_value("mask_bits", "[1, 2", List[int])
    cfg = build_config(Config, ["VOC_CLASSES", "x,y,z", "lr_milestones=[3, 5]"])
    assert cfg.VOC_CLASSES == ["x", "y", "z"] and cfg.num_classes == 3
    assert cfg.lr_milestones == [3, 5]


def test_non_string_passes_through():
    assert convert_value("batch_size", 5, int) == 5


# ------------------------------------------------------------------ validation
@pytest.mark.parametrize("override,field", [
    (["batch_size", "0"], "batch_size"),
    (["learning_rate", "-1e-3"], "learning_rate"),
    (["learning_rate", "0"], "learning_rate"),
    (["chip", "9999"], "9999"),
    (["mask_bits", "3,3,5,3,3,8"], "mask_bits"),        # 5801 has no 5-bit weight format
    (["chip", "2801", "image_size", "300"], "image_size"),
    (["cap_percentile", "0"], "cap_percentile"),
    (["cap_percentile", "100.5"], "cap_percentile"),
    (["weight_scale", "l1"], "weight_scale"),
    (["cap_method", "kl"], "cap_method"),
    (["optimizer", "lion"], "optimizer"),
    (["VOC_CLASSES", "a,a"], "VOC_CLASSES"),
    (["num_epochs", "-1"], "num_epochs"),
    (["score_scale", "0"], "score_scale"),
    (["score_scale", "nan"], "score_scale"),
    (["l_range", "-1"], "l_range"),
    (["l_noobj", "inf"], "l_noobj"),
    (["mosaic_prob", "1.5"], "mosaic_prob"),
    (["flip_prob", "-0.1"], "flip_prob"),
    (["rotate_prob", "1.01"], "rotate_prob"),
    (["conf_thresh", "1.5"], "conf_thresh"),
    (["conf_thresh", "-0.01"], "conf_thresh"),
    (["nms_thresh", "0"], "nms_thresh"),
    (["max_detections", "0"], "max_detections"),
    (["box_slots", "3"], "box_slots"),
    (["box_slots", "0"], "box_slots"),
    (["equalize", "1.5"], "gnetdet.equalize"),
    (["equalize", "-0.1"], "gnetdet.equalize"),
    (["equalize_max_scale", "0.5"], "equalize_max_scale"),
    (["bias_correct", "maybe"], "bias_correct"),
    (["shapes_images", "240"], "shapes_images"),
    (["shapes_images", "240,0"], "shapes_images"),
    (["shapes_objects", "3,1"], "shapes_objects"),
])
def test_out_of_range_refused(override, field):
    with pytest.raises(ConfigError) as e:
        build_config(Config, override)
    assert field in str(e.value)


def test_in_range_values_accepted():
    cfg = build_config(Config, ["chip", "2803", "mask_bits", "5,5,5,5,5,12", "cap_percentile", "100"])
    assert cfg.gnetdet.chip == "2803" and cfg.gnetdet.mask_bits == [5, 5, 5, 5, 5, 12]
    assert build_config(Config, ["image_size", "320"]).image_size == 320     # 5801 takes 320


def test_misspelt_class_attribute_refused():
    class Bad(BaseConfig):
        batch_sise = 4

    with pytest.raises(ConfigError) as e:
        build_config(Bad)
    assert "batch_sise" in str(e.value) and "batch_size" in str(e.value)


def test_extra_helpers_in_config_allowed():
    class Fine(BaseConfig):
        DEFAULT_STEP = 2
        _private = 3

        def helper(self):
            return 1

    assert build_config(Fine).step == 2


def test_per_step_unknown_field_refused():
    class BadStep(BaseConfig):
        per_step = {1: {"batch_sise": 4}}

    with pytest.raises(ConfigError, match="batch_sise"):
        build_config(BadStep)


# ------------------------------------------------------------------ config files
def test_load_config_class_missing_file(tmp_path):
    path = str(tmp_path / "nope.py")
    with pytest.raises(ConfigError) as e:
        load_config_class(path)
    assert path in str(e.value)


def test_load_config_class_without_config(tmp_path):
    path = tmp_path / "configs_noclass.py"
    path.write_text("X = 1\n")
    with pytest.raises(ConfigError) as e:
        load_config_class(str(path))
    assert str(path) in str(e.value)
    path2 = tmp_path / "configs_wrongbase.py"
    path2.write_text("class Config:\n    batch_size = 3\n")
    with pytest.raises(ConfigError) as e:
        load_config_class(str(path2))
    assert str(path2) in str(e.value)


def test_load_config_from_file(tmp_path):
    path = tmp_path / "configs_ok.py"
    path.write_text(textwrap.dedent("""
        from gnetmdk.config import BaseConfig
        DEFAULT_STEP = 2

        class Config(BaseConfig):
            DEFAULT_STEP = DEFAULT_STEP
            DS_NAME = "filecfg"
            batch_size = 6
            per_step = {2: dict(batch_size=3)}
    """))
    klass = load_config_class(str(path))
    assert issubclass(klass, BaseConfig) and klass.DS_NAME == "filecfg"
    cfg = load_config(str(path), ["num_epochs", "2"])
    assert cfg.step == 2 and cfg.batch_size == 3 and cfg.num_epochs == 2
    assert cfg.train_meta == os.path.join("data/meta", "filecfg_train.txt")


# ------------------------------------------------------------------ derived values
def test_derived_paths():
    cfg = build_config(Config, ["data_root", "/d", "meta_root", "/m", "checkpoint_root", "ck"], step=3)
    assert cfg.dataset_dir == os.path.join("/d", "toy")
    assert cfg.train_meta == os.path.join("/m", "toy_train.txt")
    assert cfg.valid_meta == os.path.join("/m", "toy_valid.txt")
    assert cfg.checkpoint_dir() == os.path.join("ck", "step3")
    assert cfg.checkpoint_dir(2) == os.path.join("ck", "step2")
    assert cfg.num_classes == 2
    cfg = build_config(Config, ["dataset_path", "/voc/here"])
    assert cfg.dataset_dir == "/voc/here"


@pytest.mark.parametrize("size,grid", [(224, 14), (448, 14), (320, 10), (640, 20)])
def test_grid_size(size, grid):
    assert build_config(Config, ["image_size", str(size)]).grid_size == grid


# ------------------------------------------------------------------ round trip
def test_to_dict_round_trip():
    cfg = build_config(Config, ["batch_size", "5", "mask_bits", "3,3,3,3,3,8", "augment", "no"], step=2)
    d = cfg.to_dict()
    assert set(d) == set(FIELDS) | set(BaseConfig.section_types())       # the families' sections nested
    assert d["batch_size"] == 5 and d["gnetdet"]["mask_bits"] == [3, 3, 3, 3, 3, 8] and d["augment"] is False
    assert set(d["gnetdet"]) == set(BaseConfig.section_types()["gnetdet"])
    back = config_from_dict(d, Config)
    assert isinstance(back, Config)
    assert back.to_dict() == d
    assert back.step == 2 and back.learning_rate == 2e-4
    # unknown keys ignored, missing keys take the class value
    partial = config_from_dict({"batch_size": 9, "gone_field": 1}, Config)
    assert partial.batch_size == 9 and partial.DS_NAME == "toy"
    assert not hasattr(partial, "gone_field")


# ------------------------------------------------------------------ family sections
def test_sections_short_and_dotted_names_and_configs_dict():
    """A family's fields live in its section (cfg.gnetdet); configs.py sets them with a dict or by their
    own names, the command line as gnetdet.field or field; the later source wins as for top-level fields."""
    class WithSection(BaseConfig):
        gnetdet = dict(l_coord=3.0, box_slots=1)
        score_head = "logit"                         # an older configs.py: a section field by its own name
        per_step = {3: {"gnetdet.cap_lr": 1e-3}, 2: {"l_noobj": 0.5}}
    cfg = build_config(WithSection, ["gnetdet.l_coord", "4", "score-offset", "0.5"], step=3)
    g = cfg.gnetdet
    assert (g.l_coord, g.box_slots, g.score_head, g.score_offset, g.cap_lr) == (4.0, 1, "logit", 0.5, 1e-3)
    assert build_config(WithSection, step=2).gnetdet.l_noobj == 0.5
    assert not hasattr(cfg, "l_coord")                # not everyone's field any more
    with pytest.raises(ConfigError, match="gnetdet.l_cord.*did you mean gnetdet.l_coord"):
        build_config(BaseConfig, ["gnetdet.l_cord", "1"])

    class BadSection(BaseConfig):
        gnetdet = dict(l_cord=1.0)
    with pytest.raises(ConfigError, match="l_cord"):
        build_config(BadSection)

    class NotADict(BaseConfig):
        gnetdet = 3
    with pytest.raises(ConfigError, match="must be a dict of gnetdet fields"):
        build_config(NotADict)


def test_config_saved_before_sections_reads_into_them():
    """A checkpoint's config written when every field was top-level: the section fields are found."""
    flat = {"batch_size": 4, "l_coord": 2.5, "mask_bits": [8, 3, 3, 3, 3, 8], "model_name": "gnetdet"}
    cfg = config_from_dict(flat)
    assert cfg.batch_size == 4 and cfg.gnetdet.l_coord == 2.5 and cfg.gnetdet.mask_bits == [8, 3, 3, 3, 3, 8]
    from gnetmdk.config import config_value
    assert config_value(cfg, "l_coord") == 2.5 and config_value(cfg, "gnetdet.l_coord") == 2.5
    assert config_value(cfg, "batch_size") == 4 and config_value(cfg, "no_such") is None


# ------------------------------------------------------------------ shipped configs
SHIPPED = ["configs.py"] + sorted("examples/" + f for f in os.listdir(os.path.join(REPO, "examples"))
                                  if f.endswith(".py"))


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_configs_resolve_at_every_stage_their_family_runs(name):
    """Every config the repository ships passes the start-up checks at each stage of its family (and the
    calibration pass where the family has one), so a documented command does not stop on its config."""
    from gnetmdk.models import get_family
    klass = load_config_class(os.path.join(REPO, name))
    family = get_family(build_config(klass, []).model_name)
    steps = [int(s[4:]) for s in family.stages if s.startswith("step")]
    assert steps and steps[0] == 1
    cfg1 = build_config(klass, [], step=1)
    float_only = cfg1.model_name == "ppyolo" and (cfg1.ppyolo.dcn_v2_stages or cfg1.ppyolo.coord_conv)
    for step in steps:
        if float_only and step > 1:
            # PP-YOLO r50vd with DCN / CoordConv: the quantized stages are refused, naming the fields
            with pytest.raises(ConfigError, match="dcn_v2_stages|coord_conv"):
                build_config(klass, [], step=step)
            continue
        cfg = build_config(klass, [], step=step)
        assert cfg.step == step and cfg.num_classes == len(cfg.VOC_CLASSES)
    if "cal" in family.stages and not float_only:
        assert build_config(klass, [], cal=True).cal


#: shipped configs whose quantized stages keep the recipe's optimizer steps on epochs of another length
#: (quantized_stages(epoch_factor)): examples/facemask_tiles.py trains 115 steps an epoch where the photos
#: it derives from give 42
#: configs that evaluate the shared schedule less often (the demo's 960 val images take 3.5 times as long)
EVAL_INTERVAL = {"examples/shapes.py": {2: 5, 3: 5, 4: 3}}
EPOCH_FACTOR = {"examples/facemask_tiles.py": 42 / 115}

GNETDET_SHIPPED = [n for n in SHIPPED if build_config(load_config_class(os.path.join(REPO, n)), []).model_name
                   == "gnetdet"]


@pytest.mark.parametrize("name", GNETDET_SHIPPED)
def test_gnetdet_configs_share_one_quantization_recipe_device_cpu(name):
    """The GNetDet configs the repository ships differ only in dataset, model size and float training: at
    steps 2, cal, 3 and 4 they resolve to the shared schedule (gnetmdk.config.recipe; the demo evaluates it
    less often, EVAL_INTERVAL), and their
    quantization fields are the section's defaults with the first and the last major layer at 8 bits
    (the accuracy matrix, docs/results.md, measures this one recipe on every dataset)."""
    from gnetmdk.config import quantized_stages
    from gnetmdk.models.gnetdet.config import GNetDetConfig
    klass = load_config_class(os.path.join(REPO, name))
    recipe = quantized_stages(EPOCH_FACTOR.get(name, 1.0))
    for key in (2, "cal", 3, 4):
        step, cal = (2, True) if key == "cal" else (key, False)
        cfg = build_config(klass, [], step=step, cal=cal)
        base = build_config(BaseConfig, [], step=step, cal=cal)
        for field in ("learning_rate", "num_epochs", "warmup_epochs", "eval_interval", "ema", "ema_decay",
                      "ema_ramp", "optimizer", "weight_decay", "lr_scheduler", "distill"):
            want = recipe[key].get(field, getattr(base, field)) if key != "cal" else getattr(cfg, field)
            if field == "eval_interval" and key in EVAL_INTERVAL.get(name, {}):
                want = EVAL_INTERVAL[name][key]
            assert getattr(cfg, field) == want, (name, key, field)
        g = cfg.gnetdet
        for field in ("weight_scale", "cap_method", "output_cap_max", "gain_aware", "cap_lr"):
            assert getattr(g, field) == getattr(GNetDetConfig, field), (name, field)
        assert g.mask_bits[0] == 8 and g.mask_bits[-1] == 8 and set(g.mask_bits[1:-1]) == {3}


def test_quantized_stages_are_fresh_dicts_device_cpu():
    """Editing one config's copy of the schedule leaves the next config's untouched."""
    from gnetmdk.config import quantized_stages
    a = quantized_stages()
    a[3]["num_epochs"] = 99
    b = quantized_stages()
    assert b[3]["num_epochs"] == 10 and b[2]["ema"] is True and b[4]["learning_rate"] == 2e-5
    assert set(b) == {2, "cal", 3, 4} and b["cal"] == {}


def test_command_line_reading_shared_by_the_tools(capsys):
    """gnetmdk.config.cli: options first, then KEY VALUE overrides (an option's value is never taken for
    an override, a path after an override key is its value); an option after the overrides, a bad
    number or a stray --option is one error line and exit status 2; fail() prints and returns its code."""
    import argparse
    from gnetmdk.config.cli import Parser, at_least, fail, fraction, parse_with_overrides
    p = Parser(prog="tool")
    p.add_argument("--config")
    p.add_argument("--iters", type=at_least(1), default=1)
    p.add_argument("--iou", type=fraction(low_open=True), default=0.5)
    args, over = p.parse_with_overrides(["--config", "threads", "--iters", "3", "threads", "2", "model_root=m/x"])
    assert args.config == "threads" and args.iters == 3 and over == ["threads", "2", "model_root=m/x"]
    args, over = p.parse_with_overrides(["checkpoint_root", "runs/ck", "log_root", "runs/log"])
    assert over == ["checkpoint_root", "runs/ck", "log_root", "runs/log"]
    for argv, msg in ((["threads", "2", "--iters", "3"], "option --iters comes after the config overrides"),
                      (["--iters", "0"], "must be at least 1, got 0"), (["--iou", "0"], "must be in (0, 1], got 0")):
        with pytest.raises(SystemExit) as exc:
            p.parse_with_overrides(argv)
        assert exc.value.code == 2 and msg in capsys.readouterr().err
    plain = argparse.ArgumentParser(prog="t")
    assert parse_with_overrides(plain, ["threads", "2"])[1] == ["threads", "2"]
    with pytest.raises(SystemExit):
        parse_with_overrides(plain, ["--nope"])
    assert "unrecognised option --nope" in capsys.readouterr().err
    assert fail("bad thing", 3) == 3 and capsys.readouterr().err == "error: bad thing\n"
