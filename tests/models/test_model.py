"""GNetDet structure, chip-limit refusals, registry, decoding round trip."""
import pytest
import torch

from gnetmdk.config import ConfigError
from gnetmdk.dataset.dataset import encode_targets
from gnetmdk.models import create_model
from gnetmdk.models.gnetdet import ChipLimitError, GNetDet, gnetdet_layers
from gnetmdk.models.gnetdet.decode import decode_gnetdet


def test_layer_lists_follow_gti_structure():
    l448 = gnetdet_layers(448, 20)
    assert [l.out_channels for l in l448] == [64, 64, 128, 128, 256, 256, 256, 256, 256, 256, 256, 256, 256, 256, 256, 30]
    assert sum(l.pool_after for l in l448) == 5 and len({l.major for l in l448}) == 7
    l224 = gnetdet_layers(224, 20)
    assert sum(l.pool_after for l in l224) == 4 and len({l.major for l in l224}) == 6
    # default 5801 weight formats: 3-bit, last major layer 8-bit
    assert [l.weight_format for l in l448][-3:] == [8, 8, 8] and l448[0].weight_format == 3
    # width multiplier rounds to powers of 2, at least the chip minimum
    assert [l.out_channels for l in gnetdet_layers(224, 6, 0.25)][:5] == [16, 16, 32, 32, 64]


def test_output_shape_and_grid():
    m = GNetDet(num_classes=3, image_size=224, width_mult=0.0625)
    y = m(torch.zeros(2, 3, 224, 224))
    assert y.shape == (2, 14, 14, 13) and y.dtype == torch.float32


@pytest.mark.parametrize("kwargs,needle", [
    (dict(num_classes=3, image_size=448, chip="2801"), "7 major layers, chip 2801 allows at most 6"),
    (dict(num_classes=250, image_size=224), "260 output channels"),
    (dict(num_classes=3, image_size=320), "224 or 448"),
    (dict(num_classes=3, image_size=224, mask_bits=[3, 3]), "one weight format per major layer"),
    (dict(num_classes=3, image_size=224, chip="2803", mask_bits=[3] * 6), "weight format 3 not on chip 2803"),
])
def test_chip_limits_refused_with_layer_and_limit(kwargs, needle):
    with pytest.raises(ChipLimitError) as e:
        GNetDet(**kwargs)
    assert needle in str(e.value)


def test_hidden_channels_must_be_power_of_two_in_chip_range():
    from gnetmdk.gti.spec import get_chip_spec
    from gnetmdk.models.gnetdet.model import check_chip_limits
    layers = gnetdet_layers(224, 3, 1.0, "2801")
    layers[2].out_channels = 96
    with pytest.raises(ChipLimitError) as e:
        check_chip_limits(layers, get_chip_spec("2801"), 224)
    assert "conv 3 (major layer 2, sublayer 1): 96 output channels" in str(e.value)
    layers[2].out_channels = 8
    with pytest.raises(ChipLimitError, match="power of 2 in 16..1024"):
        check_chip_limits(layers, get_chip_spec("2801"), 224)


def test_width_below_chip_minimum_is_clamped_on_5801_not_2801():
    # 5801 accepts 4 channels: width_mult 1/16 gives 4..16 channels
    m = GNetDet(num_classes=2, image_size=224, width_mult=0.0625, chip="5801")
    assert m.layers[0].conv.out_channels == 4


def test_registry_refuses_unknown_model_with_suggestion():
    with pytest.raises(ConfigError) as e:
        create_model("gnetdte", num_classes=2)
    assert "gnetdet" in str(e.value)


def test_decode_of_encoded_targets_recovers_boxes():
    boxes = torch.tensor([[0.1, 0.2, 0.5, 0.6], [0.55, 0.05, 0.95, 0.45]]).numpy()
    labels = torch.tensor([2, 0]).numpy()
    t = torch.from_numpy(encode_targets(boxes, labels, 14, 3))
    out = decode_gnetdet(t[None], 3, conf_thresh=0.5, nms_thresh=0.5)[0]
    order = out["labels"].argsort(descending=True)
    assert out["labels"][order].tolist() == [2, 0]
    assert torch.allclose(out["boxes"][order], torch.tensor(boxes), atol=1e-6)
    assert torch.allclose(out["scores"], torch.ones(2))


def test_weight_scale_config_decides_for_step1_checkpoint_kept_for_quantized(capsys):
    """device cpu"""
    from gnetmdk.models.rebuild import build_model_from_checkpoint
    from gnetmdk.config import BaseConfig, build_config
    m = GNetDet(num_classes=3, image_size=224, width_mult=0.0625)
    ckpt = {"model_meta": m.meta(), "model": m.state_dict(), "stage": "step1"}
    assert ckpt["model_meta"]["weight_scale"] == "gti"
    cfg = build_config(BaseConfig, ["weight_scale", "mse", "image_size", "224"])
    rebuilt = build_model_from_checkpoint(ckpt, cfg)
    assert {c.method for c in rebuilt.convs()} == {"mse"}
    assert {c.method for c in build_model_from_checkpoint(ckpt).convs()} == {"gti"}
    assert capsys.readouterr().err == ""
    # a step-3 checkpoint trained under the MSE rule keeps it whatever the config says, with a note
    q = GNetDet(num_classes=3, image_size=224, width_mult=0.0625, weight_scale="mse")
    qckpt = {"model_meta": q.meta(), "model": q.state_dict(), "stage": "step3"}
    gti_cfg = build_config(BaseConfig, ["image_size", "224", "weight_scale", "gti"])
    assert {c.method for c in build_model_from_checkpoint(qckpt, gti_cfg, path="s3.pth").convs()} == {"mse"}
    err = capsys.readouterr().err
    assert "s3.pth" in err and "weight_scale 'mse'" in err


@pytest.mark.parametrize("kwargs,needle", [
    (dict(score_head="softmax"), "score_head must be 'linear' or 'logit'"),
    (dict(score_head="logit", score_scale=0.0), "score_scale must be a positive number"),
    (dict(score_head="logit", score_scale=float("nan")), "score_scale must be a positive number"),
])
def test_score_head_settings_refused(kwargs, needle):
    from gnetmdk.config.base import ConfigError
    with pytest.raises(ConfigError, match=needle):
        GNetDet(num_classes=2, image_size=224, width_mult=0.0625, **kwargs)


def test_logit_head_meta_roundtrip():
    m = GNetDet(num_classes=2, image_size=224, width_mult=0.0625, score_head="logit", score_offset=0.5,
                score_scale=10.0)
    meta = m.meta()
    assert (meta["score_head"], meta["score_offset"], meta["score_scale"]) == ("logit", 0.5, 10.0)
    back = GNetDet(**{k: v for k, v in meta.items() if k != "name"})
    assert back.loss_weights["score_scale"] == 10.0


def test_box_slots_reaches_the_loss_from_config_and_checkpoint():
    # box_slots is a training setting: the config decides it for a new model and for a loaded
    # checkpoint alike, and it leaves the model's structure and meta (what a checkpoint stores) alone
    from gnetmdk.models.rebuild import build_model_from_checkpoint
    from gnetmdk.config import BaseConfig, build_config
    from gnetmdk.models import model_from_config
    cfg = build_config(BaseConfig, ["image_size", "224", "width_mult", "0.0625", "box_slots", "1"])
    m = model_from_config(cfg)
    assert m.loss_weights["box_slots"] == 1
    assert "box_slots" not in m.meta()
    ckpt = {"model_meta": m.meta(), "model": m.state_dict(), "stage": "step1"}
    assert build_model_from_checkpoint(ckpt, cfg).loss_weights["box_slots"] == 1
    two = build_config(BaseConfig, ["image_size", "224", "width_mult", "0.0625"])
    assert build_model_from_checkpoint(ckpt, two).loss_weights["box_slots"] == 2
    with pytest.raises(ConfigError, match="box_slots"):
        GNetDet(num_classes=2, image_size=224, width_mult=0.0625, box_slots=0)


def _step(model, x, batched):
    model.batch_weight_quant = batched
    model.zero_grad(set_to_none=True)
    for r in model.relus():         # the caps are buffers: zero_grad does not reach them
        r.cap.grad = None
    y = model(x)
    (y * torch.linspace(-1, 1, y.numel(), device=y.device).reshape(y.shape)).sum().backward()
    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    caps = [None if r.cap.grad is None else r.cap.grad.clone() for r in model.relus()]
    return y.detach(), grads, caps


@pytest.mark.parametrize("device_path", [False, True])
@pytest.mark.parametrize("stage,learn_caps", [("step2", False), ("step3", False), ("step3", True), ("step4", False)])
@pytest.mark.parametrize("weight_scale", ["gti", "mse"])
def test_weights_quantized_in_one_pass_equal_each_conv_alone(weight_scale, stage, learn_caps, device_path):
    """GNetDet quantizes all its convs' weights in one pass per forward (batch_weight_quant); outputs,
    weight and bias gradients and the learned caps' gradients equal those of each conv quantizing its
    own, bit for bit: step 2, gain-aware step 3 with fixed and with learned caps, step 4, on the host
    and on the device path (device cpu)."""
    from gnetmdk.engine.stages import STAGES, apply_stage
    from gnetmdk.gti import quantize as Q
    torch.manual_seed(0)
    m = GNetDet(3, 224, 0.25, use_bn=False, chip="5801", mask_bits=[8, 3, 3, 3, 1, 8], weight_scale=weight_scale,
                gain_aware=True)
    with torch.no_grad():
        for k, r in enumerate(m.relus()):
            r.cap.fill_(2.0 + 0.37 * k)
        if stage == "step4":
            from gnetmdk.gti.transforms import fold_requant_multipliers
            fold_requant_multipliers(m)
    for r in m.relus():
        r.cap.requires_grad_(learn_caps)
    apply_stage(m, STAGES[stage])
    m.train()
    x = torch.randint(0, 32, (2, 3, 224, 224)).float()
    with (Q.force_device_path() if device_path else torch.enable_grad()):
        y0, g0, c0 = _step(m, x, False)
        y1, g1, c1 = _step(m, x, True)
    assert m.set_gains() == (stage == "step3")
    assert torch.equal(y0, y1)
    for a, b in zip(g0 + c0, g1 + c1):
        assert (a is None and b is None) or torch.equal(a, b)
    assert all(g is not None for g in g1) and (not learn_caps or all(c is not None for c in c1))
    assert all(c.batched_params is None for c in m.convs())      # nothing kept after the forward


def test_weights_quantized_per_conv_on_a_cpu_by_default(monkeypatch):
    """``batch_weight_quant None`` (the default) quantizes per conv on a CPU, in one pass elsewhere
    (device cpu)."""
    import gnetmdk.models.gnetdet.model as gm
    from gnetmdk.engine.stages import STAGES, apply_stage
    calls = []
    monkeypatch.setattr(gm, "quantize_convs", lambda convs: calls.append(len(convs)) or
                        [c.quantized_params() for c in convs])
    m = GNetDet(3, 224, 0.0625, use_bn=False)
    apply_stage(m, STAGES["step2"])
    assert m.batch_weight_quant is None
    m(torch.zeros(1, 3, 224, 224))
    assert calls == []
    m.batch_weight_quant = True
    m(torch.zeros(1, 3, 224, 224))
    assert calls == [len(m.convs())]


def test_a_stage_is_set_by_the_models_family_device_cpu(monkeypatch):
    """apply_stage hands the model to its family's prepare_stage (named by the model's meta), which sets
    the chip's switches for GNetDet; PP-YOLO's float model and a family without quantizers keep their
    mode and nothing else."""
    from gnetmdk.config.registry import get_family
    from gnetmdk.engine.stages import STAGES, apply_stage
    from gnetmdk.models.base import DetectorFamily
    from gnetmdk.models.gnetdet.model import GNetDet
    from gnetmdk.models.ppyolo.model import ppyolo_r18vd
    m = GNetDet(image_size=224, num_classes=2, width_mult=0.25)
    seen = []
    fam = type(get_family("gnetdet"))
    real = fam.prepare_stage
    monkeypatch.setattr(fam, "prepare_stage", lambda self, model, stage, calibrating=False:
                        (seen.append((model, stage.name, calibrating)), real(self, model, stage, calibrating)))
    apply_stage(m, STAGES["cal"], calibrating=True)
    assert seen == [(m, "cal", True)]
    assert all(c.fake_quant_enabled for c in m.convs()) and all(r.observer_enabled and not r.fake_quant_enabled for r in m.relus())
    m.eval()
    apply_stage(m, STAGES["step4"])
    assert not m.training and m.exact_eval and all(r.integer and r.fake_quant_enabled and not r.observer_enabled for r in m.relus())
    p = ppyolo_r18vd(num_classes=2)
    p.eval()
    apply_stage(p, STAGES["step3"])                    # the float model: no quantizers yet
    assert p.qgraph is None and not p.training
    plain = torch.nn.Linear(2, 2).train()
    DetectorFamily.prepare_stage(None, plain, STAGES["step3"])
    assert plain.training


def test_head_width_mult_widens_only_the_last_major_layers_hidden_convs_device_cpu():
    """head_width_mult sets the channels of the last major layer's hidden sublayers (6.1, 6.2 of
    GNetDet-224); every other layer keeps width_mult's, the output layer its 10 + C; 0 is width_mult."""
    base = gnetdet_layers(224, 3, 0.25, "5801")
    wide = gnetdet_layers(224, 3, 0.25, "5801", (), head_width_mult=1.0)
    assert [l.out_channels for l in base] == [16, 16, 32, 32, 64, 64, 64, 64, 64, 64, 64, 64, 64, 64, 64, 13]
    assert [l.out_channels for l in wide] == [16, 16, 32, 32, 64, 64, 64, 64, 64, 64, 64, 64, 64, 256, 256, 13]
    assert [l.in_channels for l in wide][-3:] == [64, 256, 256]
    assert [(l.major, l.weight_format, l.pool_after) for l in wide] == \
        [(l.major, l.weight_format, l.pool_after) for l in base]
    assert [l.out_channels for l in gnetdet_layers(224, 3, 0.25, "5801", (), head_width_mult=0.0)] == \
        [l.out_channels for l in base]
    # at 448 the head is major layer 7; the chip's maximum still bounds it
    l448 = gnetdet_layers(448, 20, 0.25, "5801", (), head_width_mult=8.0)
    assert [l.out_channels for l in l448][-3:] == [1024, 1024, 30] and l448[-4].out_channels == 64


def test_head_width_mult_round_trips_through_a_checkpoint_and_must_match_the_config_device_cpu():
    from gnetmdk.checkpoint.io import CheckpointError
    from gnetmdk.config import BaseConfig, build_config
    from gnetmdk.models import model_from_config
    from gnetmdk.models.rebuild import build_model_from_checkpoint, check_compatible
    cfg = build_config(BaseConfig, ["image_size", "224", "width_mult", "0.0625", "head_width_mult", "0.25"])
    m = model_from_config(cfg)
    assert [c.out_channels for c in m.convs()][-3:] == [64, 64, 10 + cfg.num_classes] and m.meta()["head_width_mult"] == 0.25
    ckpt = {"model_meta": m.meta(), "model": m.state_dict(), "stage": "step1"}
    back = build_model_from_checkpoint(ckpt, cfg)
    assert [c.weight.shape for c in back.convs()] == [c.weight.shape for c in m.convs()]
    narrow = build_config(BaseConfig, ["image_size", "224", "width_mult", "0.0625"])
    with pytest.raises(CheckpointError, match="head_width_mult: checkpoint 0.25 vs config 0.0"):
        check_compatible(ckpt, narrow, "x.pth")
    # a checkpoint written before the field (no head_width_mult in its meta) is a head at width_mult
    old_narrow = {k: v for k, v in model_from_config(narrow).meta().items() if k != "head_width_mult"}
    check_compatible({"model_meta": old_narrow}, narrow, "o.pth")
    with pytest.raises(CheckpointError, match="head_width_mult: checkpoint 0.0 vs config 0.25"):
        check_compatible({"model_meta": old_narrow}, cfg, "o.pth")


@pytest.mark.parametrize("value", ["-1", "nan", "inf"])
def test_head_width_mult_out_of_range_is_refused_naming_the_field(value):
    from gnetmdk.config import BaseConfig, build_config
    # -1 is a number the section refuses; nan and inf the command line already refuses as numbers
    with pytest.raises(ConfigError, match=r"head_width_mult' = .*must be a finite number"):
        build_config(BaseConfig, ["image_size", "224", "width_mult", "0.0625", "head_width_mult", value])
