"""Helpers for the chip tests: meta files of the real datasets, a config file, and step-4 checkpoints
made without training (a tiny BN-free GNetDet, He-initialised, calibrated on real images, gain-edited).

Real datasets are read in place from ../shared/data (beside the repository); everything written goes under a tmp folder.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(os.path.dirname(REPO), "shared", "data")
DATASETS: Dict[str, List[str]] = {"raccoon": ["raccoon"], "cards": ["nine", "ten", "jack", "queen", "king", "ace"]}


def have(name: str) -> bool:
    """The shared dataset ``name`` is present."""
    return os.path.isdir(os.path.join(DATA, name))


def make_meta(name: str, meta_dir: str) -> Dict[str, str]:
    """Meta files <meta_dir>/<name>_train.txt and _valid.txt of a shared dataset (gnetmdk's converter)."""
    from gnetmdk.dataset.voc import convert_voc_to_meta
    train = os.path.join(meta_dir, f"{name}_train.txt")
    valid = os.path.join(meta_dir, f"{name}_valid.txt")
    if not (os.path.isfile(train) and os.path.isfile(valid)):
        convert_voc_to_meta(os.path.join(DATA, name), DATASETS[name], train, valid)
    return {"train": train, "valid": valid}


def write_config(folder: str, name: str, width_mult: float = 0.0625, max_val_images: int = 0, **extra) -> str:
    """A configs.py for dataset ``name`` whose outputs (meta, checkpoints, model) live in ``folder``."""
    make_meta(name, os.path.join(folder, "meta"))
    body = {
        "DS_NAME": name, "VOC_CLASSES": DATASETS[name], "dataset_path": os.path.join(DATA, name),
        "meta_root": os.path.join(folder, "meta"), "image_size": 224, "width_mult": width_mult, "use_bn": False,
        "chip": "5801", "batch_size": 8, "num_workers": 0, "threads": 1, "cache_images": False,
        "max_val_images": max_val_images, "checkpoint_root": os.path.join(folder, "checkpoint"),
        "model_root": os.path.join(folder, "model"), "channels_last": False, "progress": False,
        "device": "cpu",
        "weight_scale": "gti",   # the rule of build_step4_model's GNetDet (the model class's default)
    }
    body.update(extra)
    lines = ["from gnetmdk.config import BaseConfig", "", "", "class Config(BaseConfig):"]
    lines += [f"    {k} = {v!r}" for k, v in body.items()]
    path = os.path.join(folder, f"config_{name}.py")
    with open(path, "w") as fh:
        fh.write("\n".join(lines) + "\n")
    return path


def load_images(dataset, n: Optional[int] = None) -> np.ndarray:
    """(N, 224, 224, 3) uint8 network-size images of a GNetDetDataset (evaluation preprocessing)."""
    idx = range(len(dataset) if n is None else min(n, len(dataset)))
    return np.stack([dataset.prepare(i)[0] for i in idx])


def _init(model, seed: int) -> None:
    """He-normal weights, small biases; the output layer predicts boxes near the cell centre with
    input-dependent confidence and class scores, so decoding yields ranked detections."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        convs = model.convs()
        for conv in convs:
            fan_in = conv.in_channels * 9
            conv.weight.copy_(torch.randn(conv.weight.shape, generator=g) * math.sqrt(2.0 / fan_in))
            conv.bias.copy_(torch.randn(conv.bias.shape, generator=g) * 0.2 + 0.1)
        convs[0].weight.mul_(1 / 16.0)            # the input holds codes 0..31
        last = convs[-1]
        last.weight.mul_(0.15)
        base = [0.5, 0.5, 0.45, 0.45, 0.5, 0.5, 0.5, 0.7, 0.7, 0.5] + [0.8] * (last.out_channels - 10)
        last.bias.copy_(torch.tensor(base))


def build_step4_model(num_classes: int, calib_images: np.ndarray, seed: int = 0, width_mult: float = 0.0625,
                      chip: str = "5801", mask_bits: Sequence[int] = (), **model_kw):
    """A step-4 GNetDet-224 without training: init, calibrate caps on ``calib_images`` (uint8 NHWC),
    gain-edit, step-4 switches, eval mode; ``model_kw`` go to GNetDet (e.g. score_head). Returns
    (model, pre-edit caps)."""
    from gnetmdk.engine.calibration import calibrate_caps
    from gnetmdk.engine.stages import STAGES, apply_stage
    from gnetmdk.gti.quantize import image_to_codes
    from gnetmdk.gti.transforms import fold_requant_multipliers
    from gnetmdk.models.gnetdet.model import GNetDet
    torch.manual_seed(seed)
    model = GNetDet(num_classes=num_classes, image_size=224, width_mult=width_mult, use_bn=False, chip=chip,
                    mask_bits=list(mask_bits), **model_kw)
    _init(model, seed)
    x = image_to_codes(torch.from_numpy(calib_images)).permute(0, 3, 1, 2).float()
    calibrate_caps(model, lambda: [x])                    # the cal stage on one batch (percentile 99)
    caps = fold_requant_multipliers(model)
    apply_stage(model, STAGES["step4"])
    model.eval()
    return model, caps


def save_step4_checkpoint(path: str, model, config_file: str, stage: str = "step4") -> str:
    """Save ``model`` as a checkpoint in the format of Trainer.state (caps as the trainer writes them)."""
    from gnetmdk.checkpoint.io import save_checkpoint
    from gnetmdk.config import load_config
    cfg = load_config(config_file)
    st = {"stage": stage, "step": 4 if stage == "step4" else 3, "model_meta": model.meta(),
          "model": {k: v.detach().cpu() for k, v in model.state_dict().items()},
          "caps": [float(r.cap) for r in model.relus()], "config": cfg.to_dict(), "epoch": 0, "iteration": 0,
          "best_map": -1.0, "map": None, "entry_map": None, "world_size": 1}
    save_checkpoint(path, st)
    return path


def run_tool(script: str, *args, timeout: int = 120) -> subprocess.CompletedProcess:
    """Run tools/<script> with the test's python, single-threaded, from the repository root."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return subprocess.run([sys.executable, os.path.join(REPO, "tools", script), *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout, env=env)
