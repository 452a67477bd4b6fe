"""GTI's converter inputs, written in the open from a chip model (docs/chip.md, "GTI's text and JSON files").

* ``filter.txt`` / ``bias.txt``: every quantized weight / bias w_q = W_int / 2^s, b_q = b_int / 2^s,
  layer by layer, OIHW order, one number per line, ``%.16e`` as GTI's converter wrote them (exact:
  each value is a dyadic rational with at most 20 significant bits). The padded channels of the last
  conv are included (zeros), as GTI's converter padded GNetDet's last layer.
* ``relu_cap.txt``: one cap per conv (the calibrated caps when known, see :func:`write_gti_files`).
* the "dat" JSON ``<chip>_gnetdet_dat_<size>.json``: per major layer ``coef_bits``, ``image_size``,
  ``input_channels``, ``output_channels``, ``pooling``, ``sublayer_number``, ``scaling`` (its
  shifts), ``major_layer`` (1-based), ``learning`` / ``last_layer_out`` (false), ``ten_bits_enable``
  (true on a 10-bit output layer's major layer only), and ``model: [{"ChipType", "MajorLayerNumber"}]``
  (with ``"ActivationBitMode": 1`` for a 10-bit output, the chip's 10-bit output mode as GTI's kits
  name it).
* the "model" JSON ``<chip>_gnetdet_model_<size>.json``: image reader (CS_BGR24_PLANAR, size) ->
  GTICNN (chip, output H x W x C).
"""
from __future__ import annotations

import json
import os
from typing import Dict, List, Optional

import numpy as np

from gnetmdk.chip.model_file import ChipModel


def quantized_values(chip_model: ChipModel):
    """(weights, biases): float64 arrays of every w_q = W_int / 2^s and b_q = b_int / 2^s, concatenated
    layer by layer in OIHW order (the content of filter.txt and bias.txt)."""
    ws, bs = [], []
    for l in chip_model.layers:
        scale = float(2 ** l.shift)
        ws.append(l.weight.astype(np.float64).ravel() / scale)
        bs.append(l.bias.astype(np.float64).ravel() / scale)
    return np.concatenate(ws), np.concatenate(bs)


def dat_json(chip_model: ChipModel) -> Dict[str, object]:
    """GTI's "dat" JSON content (the per-major-layer description the chip's configuration is built from)."""
    layers = []
    for m in chip_model.header()["major_layers"]:
        layers.append({"coef_bits": m["coef_bits"], "image_size": m["image_size"],
                       "input_channels": m["input_channels"], "output_channels": m["output_channels"],
                       "pooling": m["pooling"], "sublayer_number": m["sublayer_number"], "scaling": m["scaling"],
                       "major_layer": m["major_layer"], "learning": False, "last_layer_out": False})
        if m.get("ten_bits_enable"):
            layers[-1]["ten_bits_enable"] = True
    model = {"ChipType": int(chip_model.chip), "MajorLayerNumber": len(layers)}
    if chip_model.output_bits == 10:
        model["ActivationBitMode"] = 1
    return {"layer": layers, "model": [model]}


def model_json(chip_model: ChipModel, data_file: str = "") -> Dict[str, object]:
    """GTI's "model" JSON content: image reader -> CNN on the chip."""
    size, g = chip_model.input_size, chip_model.grid
    return {
        "name": f"gti_{chip_model.chip}_{chip_model.model_name}",
        "version": 100,
        "layer": [
            {"name": "image reader", "operation": "IMAGEREADER", "data file": None, "data offset": None,
             "input format": "CS_BGR24_PLANAR", "output format": "CS_BGR24_PLANAR", "output channels": 3,
             "output height": size, "output width": size},
            {"name": "cnn", "operation": "GTICNN", "data file": data_file, "data offset": 0, "mode": 0,
             "device": {"chip": chip_model.chip, "name": None, "type": 0},
             "output channels": chip_model.output_channels, "output height": g, "output width": g},
        ],
    }


def gti_file_names(chip_model: ChipModel) -> Dict[str, str]:
    """File names written by :func:`write_gti_files` (keys: filter, bias, relu_cap, dat, model)."""
    tag = f"{chip_model.chip}_{chip_model.model_name}"
    return {"filter": "filter.txt", "bias": "bias.txt", "relu_cap": "relu_cap.txt",
            "dat": f"{tag}_dat_{chip_model.input_size}.json", "model": f"{tag}_model_{chip_model.input_size}.json"}


def gti_file_texts(chip_model: ChipModel, out_dir: str, data_file: str = "") -> Dict[str, str]:
    """The contents of filter.txt, bias.txt, relu_cap.txt and the dat / model JSON files, by path in
    ``out_dir`` (nothing is written; :func:`write_gti_files` writes them as one set).

    relu_cap.txt holds the calibrated (pre-gain-edit) caps when the chip model knows them; otherwise
    an existing relu_cap.txt in ``out_dir`` with one cap per conv whose last equals cap_last is kept
    (left out of the result: calibration wrote it), and only otherwise the chip's effective caps
    (31 for every conv, 1023 for a 10-bit output layer: after gain editing the codes are the activations).
    """
    names = gti_file_names(chip_model)
    paths = {k: os.path.join(out_dir, v) for k, v in names.items()}
    w, b = quantized_values(chip_model)
    texts = {paths["filter"]: "".join(f"{v:.16e}\n" for v in w.tolist()),
             paths["bias"]: "".join(f"{v:.16e}\n" for v in b.tolist())}
    caps: Optional[List[float]] = chip_model.calibrated_caps()
    if caps is not None:
        texts[paths["relu_cap"]] = "".join(f"{c:.8g}\n" for c in caps)
    elif not _cap_file_matches(paths["relu_cap"], len(chip_model.layers), chip_model.cap_last):
        texts[paths["relu_cap"]] = "".join(f"{float(l.max_code):.8g}\n" for l in chip_model.layers)
    texts[paths["dat"]] = json.dumps(dat_json(chip_model), indent=4, sort_keys=True) + "\n"
    texts[paths["model"]] = json.dumps(model_json(chip_model, data_file), indent=4, sort_keys=True) + "\n"
    return texts


def write_gti_files(chip_model: ChipModel, out_dir: str, data_file: str = "") -> Dict[str, str]:
    """Write filter.txt, bias.txt, relu_cap.txt and the dat / model JSON files into ``out_dir`` as one set
    (gnetmdk.checkpoint.io.atomic_write_set; relu_cap.txt as :func:`gti_file_texts` says).

    Args:
        chip_model: the converted model.
        out_dir: output folder (created).
        data_file: value of the model JSON's "data file" (GTI put its chip.dat path there).
    Returns:
        name -> path of every file (relu_cap included even when kept).
    """
    from gnetmdk.utils.atomic import atomic_write_set, text_writer
    os.makedirs(out_dir, exist_ok=True)
    atomic_write_set({p: text_writer(t) for p, t in gti_file_texts(chip_model, out_dir, data_file).items()})
    return {k: os.path.join(out_dir, v) for k, v in gti_file_names(chip_model).items()}


def _cap_file_matches(path: str, n: int, cap_last: float) -> bool:
    """A relu_cap.txt with ``n`` positive caps whose last equals ``cap_last`` (to 1e-5 relative)."""
    try:
        with open(path) as fh:
            vals = [float(t) for t in fh.read().split()]
    except (OSError, ValueError):
        return False
    return len(vals) == n and all(v > 0 for v in vals) and abs(vals[-1] - cap_last) <= 1e-5 * cap_last
