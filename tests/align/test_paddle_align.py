"""The pieces of the alignment check against PaddleDetection that run without paddle (device cpu):
plain momentum SGD (nesterov false), BatchNorm's biased running variance (bn_running_var biased),
and the reference script's batches (tools/paddle_reference.py). The check itself needs a paddle
environment: docs/alignment.md, "Against PaddleDetection"."""
import importlib.util
import os
import sys

import numpy as np
import pytest
import torch

from gnetmdk.config import BaseConfig, build_config
from gnetmdk.config.base import ConfigError
from gnetmdk.dist.syncbn import DistBatchNorm2d
from gnetmdk.engine.schedule import build_optimizer
from gnetmdk.layers.inplace_abn import BatchNormAct2d
from repo_paths import REPO

ROOT = REPO
CARDS = os.path.join(os.path.dirname(ROOT), "shared", "data", "cards")


class _Cfg(BaseConfig):
    device = "cpu"


def _cfg(*over):
    return build_config(_Cfg, list(over), step=1)


def test_sgd_nesterov_switch_device_cpu():
    """nesterov false is the plain momentum of PaddleDetection's Momentum: v = mu v + g, p -= lr v;
    the default (Nesterov) steps by lr (g + mu v), 1 + mu times the first plain step."""
    torch.manual_seed(0)
    for nesterov in (False, True):
        model = torch.nn.Linear(3, 2, bias=False)
        p0 = model.weight.detach().clone()
        opt = build_optimizer(model, _cfg("optimizer", "sgd", "learning_rate", "0.1", "momentum", "0.9",
                                          "weight_decay", "0", "nesterov", str(nesterov).lower()))
        assert opt.param_groups[0]["nesterov"] is nesterov
        g1, g2 = torch.randn(2, 3, dtype=torch.float64), torch.randn(2, 3, dtype=torch.float64)
        for g in (g1, g2):
            model.weight.grad = g.float()
            opt.step()
        v1 = g1
        v2 = 0.9 * v1 + g2
        if nesterov:
            expected = p0.double() - 0.1 * (g1 + 0.9 * v1) - 0.1 * (g2 + 0.9 * v2)
        else:
            expected = p0.double() - 0.1 * v1 - 0.1 * v2
        assert torch.allclose(model.weight.double(), expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("layer", ["dist", "abn"])
def test_biased_running_variance_device_cpu(layer):
    """bn_running_var biased: running_var = (1 - m) running_var + m var_biased (PaddlePaddle's moving
    variance); the default keeps torch's unbiased var n / (n - 1). The normalised output is the same."""
    torch.manual_seed(1)
    x = torch.randn(2, 3, 4, 5, dtype=torch.float64) * 3 + 1
    n = 2 * 4 * 5
    var_b = x.transpose(0, 1).reshape(3, -1).var(dim=1, unbiased=False)
    outs = {}
    for unbiased in (True, False):
        bn = (DistBatchNorm2d(3) if layer == "dist" else BatchNormAct2d(3, activation="identity")).double()
        bn.unbiased_running_var = unbiased
        outs[unbiased] = bn(x)
        want = 0.9 * 1.0 + 0.1 * (var_b * n / (n - 1) if unbiased else var_b)
        assert torch.allclose(bn.running_var, want, rtol=1e-12, atol=0)
        assert torch.allclose(bn.running_mean, 0.1 * x.mean(dim=(0, 2, 3)), rtol=1e-12, atol=1e-15)
    assert torch.equal(outs[True], outs[False])


def test_bn_running_var_config_device_cpu():
    from gnetmdk.layers.prepare import prepare_model
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU())
    notes = prepare_model(model, _cfg("bn_running_var", "biased"), torch.device("cpu"))
    assert isinstance(model[1], DistBatchNorm2d) and model[1].unbiased_running_var is False
    assert any("biased batch variance" in n for n in notes)
    plain = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU())
    prepare_model(plain, _cfg(), torch.device("cpu"))
    assert plain[1].unbiased_running_var is True
    with pytest.raises(ConfigError, match="bn_running_var"):
        _cfg("bn_running_var", "paddle")
    with pytest.raises(ConfigError, match="sync_bn true"):
        _cfg("bn_running_var", "biased", "sync_bn", "false")


def _reference_module():
    spec = importlib.util.spec_from_file_location("paddle_reference", os.path.join(ROOT, "tools", "paddle_reference.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)          # imports neither paddle nor torch at load time
    return mod


@pytest.mark.skipif(not os.path.isdir(CARDS), reason="cards dataset not present")
def test_reference_batches_are_the_voc_boxes_device_cpu():
    """The reference script's batches: uint8 RGB at the asked size, targets [class, x1, y1, x2, y2
    relative, score 1] equal to the XML boxes over the original image size, padding rows class -1."""
    from gnetmdk.dataset.voc import parse_voc_xml
    ref = _reference_module()
    images, targets = ref.read_voc_batches(CARDS, ref.CARDS, 96, 3, 50)
    assert images.shape == (3, 3, 96, 96) and images.dtype == np.uint8 and images.std() > 10
    assert targets.shape == (3, 50, 6) and targets.dtype == np.float32
    with open(os.path.join(CARDS, "ImageSets", "Main", "train.txt")) as fh:
        names = [line.split()[0] for line in fh if line.strip()][:3]
    for i, name in enumerate(names):
        ann = parse_voc_xml(os.path.join(CARDS, "Annotations", name + ".xml"), ref.CARDS)
        w, h = ann["width"], ann["height"]
        valid = targets[i][targets[i][:, 0] >= 0]
        assert len(valid) == len(ann["labels"]) > 0 and (targets[i][len(valid):, 0] == -1).all()
        assert valid[:, 0].tolist() == [float(c) for c in ann["labels"]]
        boxes = np.asarray(ann["boxes"], np.float64) / np.array([w, h, w, h])
        assert np.allclose(valid[:, 1:5], np.clip(boxes, 0, 1), atol=2 / min(w, h)) and (valid[:, 5] == 1).all()


def test_reference_script_without_paddle_device_cpu(tmp_path, capsys):
    try:
        import paddle  # noqa: F401
        pytest.skip("paddle is installed here: the refusal is for environments without it")
    except ImportError:
        pass
    ref = _reference_module()
    assert ref.main(["--out", str(tmp_path / "ref"), "--dataset", CARDS]) == 2
    assert "paddle cannot be imported" in capsys.readouterr().err
    assert ref.main(["--out", str(tmp_path / "ref"), "--dataset", str(tmp_path)]) == 2
    assert "is not a VOC folder" in capsys.readouterr().err


def test_align_paddle_script_refusals_device_cpu(tmp_path):
    """tools/align_paddle.sh: usage without arguments, and a paddle python that cannot run the
    reference ends in one error line with exit 2, before anything of gnetmdk runs."""
    import subprocess
    script = os.path.join(ROOT, "tools", "align_paddle.sh")
    r = subprocess.run(["bash", script], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "usage: bash tools/align_paddle.sh" in r.stderr
    r = subprocess.run(["bash", script, str(tmp_path / "no-python"), str(tmp_path / "out")], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "cannot import paddle and ppdet" in r.stderr and "no-python" in r.stderr
    assert r.stderr.count("\n") == 1 and not (tmp_path / "out").exists()
    # the gnetmdk steps' interpreter (GNETMDK_PYTHON) is checked first, and named
    env = dict(os.environ, GNETMDK_PYTHON=str(tmp_path / "no-gnetmdk"))
    r = subprocess.run(["bash", script, sys.executable, str(tmp_path / "out")], capture_output=True, text=True,
                       timeout=60, env=env)
    assert r.returncode == 2 and "cannot import torch and gnetmdk: set GNETMDK_PYTHON" in r.stderr
    assert not (tmp_path / "out").exists()
