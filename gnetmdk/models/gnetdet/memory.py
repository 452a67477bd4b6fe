"""The memory table of docs/chip.md ("Memory limits"): GNetDet configurations counted against the chip's
memory limits (gnetmdk.gti.memory, which counts any layer list and knows no model).

``python3 -m gnetmdk.models.gnetdet.memory [CONFIG ...]`` prints the table (markdown) for the given
configs (default: the repository's examples/*.py) and the full-width GNetDet-224 and GNetDet-448.
"""
from __future__ import annotations

import glob
import os
import sys
from typing import Dict, List, Optional, Sequence

from gnetmdk.config import load_config_class
from gnetmdk.gti.memory import fmt, memory_report
from gnetmdk.gti.spec import get_chip_spec

from .config import GNetDetConfig
from .model import gnetdet_layers, gnetdet_memory_layers, major_weight_formats


def _gnetdet_row(label: str, image_size: int, num_classes: int, width_mult: float, chip: str,
                 mask_bits: Sequence[int], head_width_mult: float = 0.0) -> Dict[str, object]:
    """One row of the table (see :func:`memory_table`) for one GNetDet configuration."""
    specs = gnetdet_layers(image_size, num_classes, width_mult, chip, mask_bits, head_width_mult)
    spec = get_chip_spec(chip)
    rep = memory_report(gnetdet_memory_layers(specs, image_size, chip, padded=False), spec)
    pad = memory_report(gnetdet_memory_layers(specs, image_size, chip, padded=True), spec)
    big = rep.layers[rep.largest_layer]
    return {"config": label, "size": image_size, "width": width_mult, "chip": chip,
            "mask_bits": major_weight_formats(specs), "default": not mask_bits, "largest_io": rep.largest_io,
            "largest_layer": big.name.split(" (")[0], "coef": rep.coefficient_total,
            "coef_padded": pad.coefficient_total, "io_limit": spec.max_layer_io, "coef_limit": spec.max_coef_memory,
            "fits": rep.fits, "padded_fits": pad.fits, "io_fits": rep.io_fits, "coef_fits": rep.coefficients_fit}


def memory_table(config_files: Sequence[str] = ()) -> List[Dict[str, object]]:
    """Rows of the docs/chip.md table: every GNetDet config among ``config_files`` (default: the
    repository's examples/*.py) with the chip's default mask_bits and with the config's own, then the
    full-width GNetDet-224 and GNetDet-448 (20 classes, chip 5801) with the default, the examples'
    mask_bits and all major layers at 3 bits.

    Returns:
        dicts with config, size, width, chip, mask_bits, default (the chip default), largest_io,
        largest_layer, coef (the output layer counted as used), coef_padded (with its zero filters),
        io_limit, coef_limit, fits (as used: what is refused), padded_fits, io_fits, coef_fits.
    """
    if not config_files:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        config_files = sorted(glob.glob(os.path.join(root, "examples", "*.py")))
    rows: List[Dict[str, object]] = []
    examples_bits: Dict[int, List[int]] = {}
    for path in config_files:
        klass = load_config_class(path)
        if getattr(klass, "model_name", "gnetdet") != "gnetdet" or klass.image_size not in (224, 448):
            continue
        cfg = klass()
        g = GNetDetConfig()          # the section's defaults, then the config's values (unvalidated)
        own = getattr(klass, "gnetdet", None)
        for k, v in (own.items() if isinstance(own, dict) else vars(own).items() if own is not None else ()):
            setattr(g, k, v)
        parent = os.path.basename(os.path.dirname(os.path.abspath(path)))
        label = f"{parent}/{os.path.basename(path)}" if parent == "examples" else os.path.basename(path)
        for bits in ([], list(g.mask_bits)) if g.mask_bits else ([],):
            rows.append(_gnetdet_row(label, cfg.image_size, cfg.num_classes, float(g.width_mult), str(g.chip), bits,
                                     float(g.head_width_mult)))
        if g.mask_bits:
            examples_bits.setdefault(cfg.image_size, list(g.mask_bits))
    for size in (224, 448):
        majors = len(major_weight_formats(gnetdet_layers(size, 20, 1.0, "5801", [])))
        for bits in [[]] + ([examples_bits[size]] if size in examples_bits else []) + [[3] * majors]:
            rows.append(_gnetdet_row(f"GNetDet-{size} full width", size, 20, 1.0, "5801", bits))
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python3 -m gnetmdk.models.gnetdet.memory [CONFIG ...]``: print the memory table (markdown) of the given
    configs (default: examples/*.py) and the full-width GNetDets."""
    args = list(sys.argv[1:] if argv is None else argv)
    rows = memory_table(args)
    print("| config | input | width_mult | mask_bits | largest layer input + output (limit 4,816,896) "
          "| coefficient memory, output layer as used / zero-padded (budget 489,216) | fits |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        bits = f"{r['mask_bits']}" + (" (chip default)" if r["default"] else "")
        if not r["fits"]:
            fits = "no (" + ", ".join(k for k, ok in (("per layer", r["io_fits"]), ("coefficients", r["coef_fits"]))
                                      if not ok) + "): refused"
        else:
            fits = "yes" if r["padded_fits"] else "unless zero filters count: noted"
        print(f"| {r['config']} | {r['size']} | {r['width']:g} | {bits} | {fmt(r['largest_io'])} ({r['largest_layer']}) "
              f"| {fmt(r['coef'])} / {fmt(r['coef_padded'])} | {fits} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
