#!/usr/bin/env python3
"""Convert a PASCAL VOC dataset into GNetDet meta files <out-dir>/<DS_NAME>_train.txt and _valid.txt.

Examples:
    python3 tools/xml_2_txt.py                       # everything from configs.py
    python3 tools/xml_2_txt.py --name cards --dataset-dir /path/cards \\
        --classes nine,ten,jack,queen,king,ace --out-dir data/meta   # no config needed
    python3 tools/xml_2_txt.py --config examples/shapes.py data_root runs/d meta_root runs/d/meta

Config overrides (``KEY VALUE`` or ``KEY=VALUE``, as train.py reads them) come after the options.

The work is done by gnetmdk.dataset.voc.convert_voc_to_meta; see its docstring for the format.
Exit status: 0 on success, 2 on a dataset/annotation/config error (one message on stderr).
"""

from __future__ import annotations

import argparse
import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from gnetmdk.config.cli import Parser  # noqa: E402
from gnetmdk.dataset.voc import VOCFormatError, convert_voc_to_coco, convert_voc_to_meta, parse_fold  # noqa: E402
from gnetmdk.engine.cli import tool_main  # noqa: E402

DEFAULT_CONFIG = os.path.join(REPO_ROOT, "configs.py")


class CLIError(Exception):
    """A user error reported as one line on stderr with exit status 2."""


CONFIG_NOTE = ("Without --config, values not given on the command line come from configs.py at "
               "the repository root. With --name, --dataset-dir, --classes and --out-dir all "
               "given, no config is loaded.")


def parse_args(argv=None, doc=None):
    """The command line of this tool and of tools/xml_2_json.py: options first, then config overrides
    (``KEY VALUE`` / ``KEY=VALUE``), returned as ``args.overrides``. ``doc``: the calling script's
    docstring, the --help text of tools/xml_2_json.py (default: this tool's meta-file text)."""
    if doc is None:
        p = Parser(description="Convert VOC XML annotations into the project's meta files "
                               "(<DS_NAME>_train.txt / _valid.txt).", epilog=CONFIG_NOTE)
    else:
        import textwrap
        p = Parser(description=doc.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                   epilog=doc.split("\n", 1)[1].strip() + "\n\n" + textwrap.fill(CONFIG_NOTE, 100))
    p.add_argument("--config", default=None, metavar="FILE",
                   help=f"config file (default: {DEFAULT_CONFIG})")
    p.add_argument("--name", default=None, metavar="NAME",
                   help="dataset name DS_NAME used in the output file names (default: config DS_NAME)")
    p.add_argument("--dataset-dir", default=None, metavar="DIR",
                   help="VOC dataset root with JPEGImages/ and Annotations/ (default: config dataset_dir)")
    p.add_argument("--classes", default=None, metavar="a,b,c",
                   help="comma-separated class list, index = label (default: config VOC_CLASSES)")
    p.add_argument("--out-dir", default=None, metavar="DIR",
                   help="output folder (default: config meta_dir)")
    p.add_argument("--keep-difficult", action="store_true",
                   help="keep objects marked difficult (dropped by default)")
    p.add_argument("--keep-empty", action="store_true",
                   help="also write the images without objects, as background images: training learns 'no "
                        "object' from them and evaluation counts detections on them as false positives "
                        "(left out by default)")
    p.add_argument("--skip-bad", action="store_true",
                   help="skip bad annotations/images and list them, instead of stopping at the first")
    p.add_argument("--val-fraction", type=float, default=None,
                   help="valid share for the random split used when ImageSets/Main/{train,val}.txt "
                        "are absent (default 0.2)")
    p.add_argument("--fold", default=None, metavar="I/K",
                   help="valid = the I-th (0 to K-1) of K disjoint folds of that random split instead of its "
                        "first --val-fraction, for K-fold cross-validation: the K runs of one --seed each "
                        "score different images and together score every image once; 0/5 is the default "
                        "split (docs/pipeline.md, 'Cross-validation folds')")
    p.add_argument("--seed", type=int, default=None,
                   help="seed of that random split (default: config seed, or 0 without a config)")
    args, args.overrides = p.parse_with_overrides(sys.argv[1:] if argv is None else argv)
    return args


def _load_config(path: str | None, overrides=()):
    path = path or DEFAULT_CONFIG
    if not os.path.isfile(path):
        raise CLIError(f"config file {path} not found; pass --config FILE, or give --name, "
                       f"--dataset-dir, --classes and --out-dir")
    try:
        from gnetmdk.config import load_config
    except ImportError as exc:
        raise CLIError(f"cannot load the config system ({exc}); give --name, --dataset-dir, "
                       f"--classes and --out-dir instead") from None
    try:
        return load_config(path, list(overrides))
    except Exception as exc:  # any config problem becomes one line, not a traceback
        raise CLIError(f"cannot load config {path}: {exc}") from None


def resolve_settings(args) -> dict:
    """Command-line values, completed from the config only when something is missing."""
    overrides = getattr(args, "overrides", [])
    need_config = args.config is not None or bool(overrides) or None in (
        args.name, args.dataset_dir, args.classes, args.out_dir)
    cfg = _load_config(args.config, overrides) if need_config else None

    def pick(value, attr):
        if value is not None:
            return value
        if not hasattr(cfg, attr):
            raise CLIError(f"config has no {attr}; pass it on the command line")
        return getattr(cfg, attr)

    classes = args.classes
    if classes is not None:
        classes = [c.strip() for c in classes.split(",") if c.strip()]
    else:
        classes = list(pick(None, "VOC_CLASSES"))
    if not classes:
        raise CLIError("the class list is empty")
    seed = args.seed if args.seed is not None else (getattr(cfg, "seed", 0) if cfg is not None else 0)
    image_size, cell, fixed = _grid(cfg)
    return {
        "image_size": image_size,
        "cell": cell,
        "fixed_cell": fixed,
        "size_head": _size_head(cfg),
        "output_codes": _output_codes(cfg),
        "ten_bit": _ten_bit_setting(cfg),
        "grid": cfg.grid_size if cfg is not None and getattr(cfg, "model_name", "gnetdet") == "gnetdet" else None,
        "slots": int(cfg.gnetdet.box_slots) if cfg is not None and getattr(cfg, "model_name", "gnetdet") == "gnetdet"
        else None,
        "name": str(pick(args.name, "DS_NAME")),
        "dataset_dir": str(pick(args.dataset_dir, "dataset_dir")),
        "classes": classes,
        "out_dir": str(pick(args.out_dir, "meta_dir")),
        "seed": int(seed),
    }


def _grid(cfg):
    """(image_size, the finest grid cell in input pixels, whether the cell keeps its pixel size when
    image_size changes) of the config's model, or (None, None, None) without a config: GNetDet's
    output grid (14 x 14 at 224 and 448, so its cell grows with the input; 32 px otherwise), PP-YOLO's
    finest level (its stride)."""
    if cfg is None or not hasattr(cfg, "image_size"):
        return None, None, None
    size = int(cfg.image_size)
    if getattr(cfg, "model_name", "gnetdet") == "ppyolo":
        return size, 4 * 2 ** min(cfg.ppyolo.return_idx), True
    return size, size / cfg.grid_size, cfg.grid_size != 14


def _size_head(cfg):
    """The config's GNetDet size head ("linear" or "log"), or None (no config, or another model)."""
    if cfg is None or getattr(cfg, "model_name", "gnetdet") != "gnetdet" or not hasattr(cfg, "gnetdet"):
        return None
    return str(cfg.gnetdet.size_head)


def _output_codes(cfg) -> int:
    """The largest code of the config's GNetDet output layer: 1023 with ``gnetdet.output_bits 10`` (the
    chip's 10-bit output), else 31."""
    if cfg is None or getattr(cfg, "model_name", "gnetdet") != "gnetdet" or not hasattr(cfg, "gnetdet"):
        return 31
    return 1023 if int(getattr(cfg.gnetdet, "output_bits", 5)) == 10 else 31


def _ten_bit_setting(cfg):
    """The overrides that put the config's GNetDet output layer in the chip's 10-bit mode
    (``gnetdet.output_bits 10``, with ``mask_bits`` given its 7th entry), or None where the config has
    it already, is not a GNetDet config, or the chip has no room for the extra major layer (only
    GNetDet-224 on the 5801 has: docs/quantization.md, "The 10-bit output mode")."""
    if cfg is None or getattr(cfg, "model_name", "gnetdet") != "gnetdet" or not hasattr(cfg, "gnetdet"):
        return None
    g = cfg.gnetdet
    if int(getattr(g, "output_bits", 5)) == 10:
        return None
    import copy
    from gnetmdk.config.base import ConfigError
    from gnetmdk.models.gnetdet.config import check_gnetdet_config
    masks = [int(b) for b in g.mask_bits] + ([int(g.mask_bits[-1])] if g.mask_bits else [])
    ten = copy.deepcopy(cfg)
    ten.gnetdet.output_bits, ten.gnetdet.mask_bits = 10, masks
    try:
        check_gnetdet_config(ten)                     # the config's own check: chip limits and memory at 10 bits
    except ConfigError:
        return None
    return "gnetdet.output_bits 10" + (f" gnetdet.mask_bits {','.join(map(str, masks))}" if masks else "")


#: warn when more than this share of the train boxes is smaller than one grid cell
SMALL_SHARE = 0.2

#: GNetDet's linear size head: warn when more than SMALL_SHARE of the boxes span fewer than this many
#: steps of the output layer's 5-bit codes (a step is cap / 31 of the side, about 1/31 for a cap near 1:
#: docs/quantization.md, "Activations"). Rounding a box of k steps moves each side by up to half a step, 1 / (2 k) of the box:
#: at 4 steps an IoU of 0.8 at worst, at 1-2 steps below 0.5 (docs/results/accuracy-matrix.md, the dense set).
SIZE_STEPS = 4


def size_head_warning(sizes, size_head, codes: int = 31, ten_bit=None):
    """The warning for boxes too small for the linear size head's output codes, or None.

    Args:
        sizes: [(w, h)] relative to the image (convert_voc_to_meta's ``box_sizes``).
        size_head: the config's ``gnetdet.size_head``; only "linear" can warn.
        codes: the output layer's largest code, 31 or 1023 (``gnetdet.output_bits 10``: steps of 1/1023).
        ten_bit: the overrides for the chip's 10-bit output where the config's chip has room for it
            (:func:`_ten_bit_setting`), named as the second remedy; None leaves it out.
    Returns:
        a message naming the share of boxes below SIZE_STEPS / 31 of the side and the remedies
        (``gnetdet.size_head log``; the 10-bit output), or None.
    """
    import numpy as np
    if size_head != "linear" or not sizes:
        return None
    rel = np.sqrt(np.prod(np.asarray(sizes, dtype=np.float64), axis=1))
    small = float(np.mean(rel < SIZE_STEPS / float(codes)))
    if small <= SMALL_SHARE:
        return None
    return (f"{100 * small:.0f}% of the train boxes are smaller than {SIZE_STEPS} steps of the chip's "
            f"{5 if codes == 31 else 10}-bit output codes ({100 * SIZE_STEPS / codes:.0f}% of the image side with an "
            f"output cap near 1): with the linear size "
            "head (size_head linear, GTI) the chip model rounds their width and height to those steps. Set "
            "gnetdet.size_head log in the config (sizes in log space, the same relative step at every size) "
            "before step 1" + _ten_bit_remedy(ten_bit))


#: a class is looked at on its own from this many train boxes
CLASS_MIN_BOXES = 10


def _ten_bit_remedy(ten_bit) -> str:
    """The size warnings' second remedy, the chip's 10-bit output (``ten_bit``: its overrides), or ""."""
    if not ten_bit:
        return ""
    return (f"; or keep the linear head and give the output layer the chip's 10-bit codes ({ten_bit}: steps 33 "
            "times finer; it can be set from step 2's checkpoint on; on the dense set's tiles, seed 0, step 4 ended "
            "0.3 points under step 1 where 5 bits lost 15.6: docs/results/accuracy-matrix.md, 'The chip's 10-bit "
            "output')")


def class_size_lines(sizes, labels, classes, image_size=None, cell=None, size_head=None, codes: int = 31,
                     ten_bit=None):
    """Per class: boxes, median size and the shares below a grid cell and (linear size head) below
    :data:`SIZE_STEPS` output code steps; and the warning for a class whose boxes are small even when
    the whole set's are not (a minority class of small objects, which the set's shares hide).

    Args:
        sizes: [(w, h)] relative to the image; labels: the class index of each; classes: the names.
        image_size, cell: as :func:`box_size_lines`; size_head: the config's ``gnetdet.size_head``;
        codes: the output layer's largest code (31, or 1023 with ``gnetdet.output_bits 10``);
        ten_bit: as :func:`size_head_warning`.
    Returns:
        (lines to print, a warning or None).
    """
    import numpy as np
    if not sizes:
        return [], None
    rel = np.sqrt(np.prod(np.asarray(sizes, dtype=np.float64), axis=1))
    labels = np.asarray(labels, dtype=np.int64)
    lines, small_classes = ["  per class: boxes, median size, below a grid cell, below "
                            f"{SIZE_STEPS} output code steps"], []
    for c, name in enumerate(classes):
        r = rel[labels == c]
        if not len(r):
            continue
        med = f"{np.median(r) * image_size:.1f} px" if image_size else f"{np.median(r):.3f} of the side"
        below_cell = f"{100 * np.mean(r * image_size < cell):.0f}%" if image_size and cell else "-"
        steps = float(np.mean(r < SIZE_STEPS / float(codes)))
        lines.append(f"    {name:<16} {len(r):6d}  {med:>14}  {below_cell:>5}  {100 * steps:.0f}%")
        if size_head == "linear" and len(r) >= CLASS_MIN_BOXES and steps > SMALL_SHARE:
            small_classes.append(f"{name} ({100 * steps:.0f}% of its {len(r)} boxes)")
    warn = None
    if small_classes:
        warn = (f"class(es) {', '.join(small_classes)} span fewer than {SIZE_STEPS} steps of the chip's "
                f"{5 if codes == 31 else 10}-bit output "
                "codes: with the linear size head the chip model rounds their width and height to those steps, "
                "however few of the set's boxes they are. Set gnetdet.size_head log before step 1 (on the dense set "
                "of 4-16 px shapes it took step 4 from 14-16 points below step 1 to within half a point: "
                "docs/results/accuracy-matrix.md, 'The size head')" + _ten_bit_remedy(ten_bit))
    return lines, warn


def _cell_counts(centres, grid: int):
    """{(column, row, image index): boxes whose centre lies in that grid cell of that image}."""
    from collections import Counter
    return Counter((int(min(cx * grid, grid - 1)), int(min(cy * grid, grid - 1)), img) for cx, cy, img in centres)


def shared_cell_line(centres, grid: int, slots: int):
    """The share of train boxes whose grid cell (the one holding their centre) holds more boxes than the
    model has box slots per cell: what a cell can predict at most (GNetDet's ``box_slots``), so the rest
    of those boxes cannot be found at that input. None without a grid."""
    if not centres or not grid:
        return None
    cells = _cell_counts(centres, grid)
    crowded = sum(n for n in cells.values() if n > slots)
    over = sum(n - slots for n in cells.values() if n > slots)
    return (f"  boxes in a grid cell with more than {slots} box(es) (the model's box slots per cell): "
            f"{100 * crowded / len(centres):.1f}%; at most {100 * (len(centres) - over) / len(centres):.1f}% of the boxes "
            f"can be predicted at this grid ({grid} x {grid})")


#: warn when more than this share of the train boxes cannot be predicted: their grid cell holds more
#: boxes than the model has box slots, so only ``slots`` of them can be found at that grid
CROWDED_SHARE = 0.05


def crowded_cell_warning(centres, grid: int, slots: int, size_head=None):
    """The warning for boxes lost to crowded grid cells, or None.

    A GNetDet cell predicts at most ``box_slots`` boxes; every further box whose centre falls in the
    same cell cannot be found at that grid (mAP's recall stops there). Warns when more than
    :data:`CROWDED_SHARE` of the train boxes are lost that way.

    Args:
        centres: [(cx, cy, image index)], box centres relative to the image (convert_voc_to_meta's
            ``box_centres``).
        grid: cells per side of the output grid; slots: the config's ``gnetdet.box_slots``.
        size_head: the config's ``gnetdet.size_head``, which decides what is advised about slots.
    Returns:
        a message naming the lost share and the settings to try, each with the measurement behind
        it in docs/results/accuracy-matrix.md, or None.
    """
    if not centres or not grid:
        return None
    cells = _cell_counts(centres, grid)
    lost = sum(n - slots for n in cells.values() if n > slots) / len(centres)
    if lost <= CROWDED_SHARE:
        return None
    msg = (f"{100 * lost:.0f}% of the train boxes share a grid cell ({grid} x {grid}) with more boxes than the "
           f"model's {slots} box slot(s) per cell and cannot be found at this grid. ")
    if slots == 1 and size_head != "log":
        msg += ("gnetdet.box_slots 2 lets a cell hold two (YOLOv1's two slots; with the log size head two slots "
                "failed to train on the shapes demo, docs/results/accuracy-matrix.md, 'The size head'); ")
    msg += ("cutting the images into tiles spreads the objects over more cells: tools/tile_voc.py SRC DST --tiles 2 "
            "--overlap PX, scored whole with tools/eval_voc.py --stitch (on the dense set of 30-80 shapes per image, "
            "2 x 2 tiles took step 4 to within 1 point of step 1: docs/results/accuracy-matrix.md, 'The dense set "
            "through 2 x 2 tiles')")
    return msg


def box_size_lines(sizes, image_size=None, cell=None, fixed_cell=True):
    """Box-size statistics of one split and the small-box warning.

    Args:
        sizes: [(w, h)] relative to the image (convert_voc_to_meta's ``box_sizes``).
        image_size: the config's input side in pixels (None: sizes stay relative).
        cell: the model's finest grid cell in input pixels at ``image_size``.
        fixed_cell: the cell keeps its pixel size at other input sizes (a stride); False when the
            grid has a fixed number of cells (GNetDet's 14 x 14).

    Returns:
        (lines to print, a warning or None). The size of a box is ``sqrt(w h)``; a box is "smaller
        than a cell" when that is below ``cell``. With a fixed cell the warning names the input size
        (a multiple of 32) at which at most :data:`SMALL_SHARE` of the boxes would be; with a fixed
        number of cells it names the tiles (n x n per image, each resized to ``image_size``) that would.
    """
    import numpy as np
    if not sizes:
        return [], None
    rel = np.sqrt(np.prod(np.asarray(sizes, dtype=np.float64), axis=1))
    q = np.percentile(rel, [0, 10, 50, 90, 100])
    if image_size is None:
        return ["  box size sqrt(w h), fraction of the image: min {:.3f}  p10 {:.3f}  median {:.3f}  p90 {:.3f}  "
                "max {:.3f}".format(*q)], None
    px = q * image_size
    lines = [f"  box size sqrt(w h) at image_size {image_size}: min {px[0]:.1f}  p10 {px[1]:.1f}  median "
             f"{px[2]:.1f}  p90 {px[3]:.1f}  max {px[4]:.1f} px"]
    if not cell:
        return lines, None
    small = float(np.mean(rel * image_size < cell))
    lines.append(f"  smaller than a grid cell ({cell:g} px): {100 * small:.1f}% of the boxes")
    if small <= SMALL_SHARE:
        return lines, None
    msg = (f"{100 * small:.0f}% of the train boxes are smaller than one grid cell ({cell:g} px at image_size "
           f"{image_size}): a cell predicts a few boxes, so small touching objects are lost. ")
    if fixed_cell:
        need = cell / max(float(np.quantile(rel, SMALL_SHARE)), 1e-9)
        msg += f"Use image_size {int(np.ceil(need / 32.0) * 32)} (at most {100 * SMALL_SHARE:.0f}% below a cell), "
        msg += "or crop the images into tiles"
    else:
        # a tile of fraction f of the image side, resized to image_size, enlarges a box of relative size r
        # to r / f of the input: at most SMALL_SHARE of the boxes stay below a cell when f <= q / (cell / size)
        frac = float(np.quantile(rel, SMALL_SHARE)) * image_size / cell
        n = int(np.ceil(1.0 / max(frac, 1e-9)))
        msg += ("The 14 x 14 grid grows with the input, so a larger image_size does not help: crop the images "
                f"into tiles, each with larger objects relative to the grid: {n} x {n} tiles per image (each at "
                f"most {100 * frac:.0f}% of the image side), each resized to image_size, leave at most "
                f"{100 * SMALL_SHARE:.0f}% of the boxes below a cell: tools/tile_voc.py SRC DST --tiles {n} "
                "--overlap PX (PX at least the largest box side) writes them, and tools/eval_voc.py --stitch "
                "scores the whole images")
    return lines, msg


def print_summary(report: dict, out=sys.stdout) -> None:
    splits = report["splits"]
    names = list(splits)
    kept_empty = any(splits[s].get("empty_written") for s in names)
    width = max([len("images (no objects)")] + [len("  written (--keep-empty)")] * kept_empty
                + [len(c) for c in report["classes"]])
    line = lambda label, vals: print(  # noqa: E731
        f"  {label:<{width}} " + " ".join(f"{v:>8}" for v in vals), file=out)
    print(f"dataset {report['dataset_dir']} ({report['split_source']})", file=out)
    line("", names)
    line("images", [splits[s]["images"] for s in names])
    line("boxes", [splits[s]["boxes"] for s in names])
    for c in report["classes"]:
        line(c, [splits[s]["per_class"][c] for s in names])
    line("images (no objects)", [len(splits[s]["no_objects"]) for s in names])
    if kept_empty:
        line("  written (--keep-empty)", [splits[s].get("empty_written", 0) for s in names])
    line("difficult dropped", [splits[s]["dropped_difficult"] for s in names])
    for s in names:
        print(f"wrote {splits[s]['file']}", file=out)


@tool_main
def main(argv, coco: bool = False, doc=None) -> int:
    """Run the tool; ``coco`` writes COCO-json files (tools/xml_2_json.py, whose docstring ``doc`` is
    its --help text) instead of meta files. Returns the exit status (0 ok, 2 a dataset/annotation/config
    error)."""
    args = parse_args(argv, doc)
    tool = "xml_2_json" if coco else "xml_2_txt"
    try:
        st = st_cfg = resolve_settings(args)
        ext = "json" if coco else "txt"
        out_train = os.path.join(st["out_dir"], f"{st['name']}_train.{ext}")
        out_valid = os.path.join(st["out_dir"], f"{st['name']}_valid.{ext}")
        convert = convert_voc_to_coco if coco else convert_voc_to_meta
        fold = None
        if args.fold is not None:
            if args.val_fraction is not None:
                raise CLIError("--fold and --val-fraction both choose the val share: give one "
                               "(a fold I/K holds 1/K of the images)")
            fold = parse_fold(args.fold)
        report = convert(
            st["dataset_dir"], st["classes"], out_train, out_valid,
            keep_difficult=args.keep_difficult, skip_bad=args.skip_bad,
            val_fraction=0.2 if args.val_fraction is None else args.val_fraction, seed=st["seed"],
            keep_empty=args.keep_empty, fold=fold,
        )
    except (CLIError, VOCFormatError, OSError, ValueError) as exc:
        print(f"error: {exc} ({tool})", file=sys.stderr)
        return 2

    for _path, reason in report["skipped"]:
        print(f"skipped: {reason}", file=sys.stderr)
    for warning in report.get("warnings", []):
        print(f"warning: {warning}", file=sys.stderr)
    if report["skipped"]:
        print(f"{len(report['skipped'])} file(s) skipped", file=sys.stderr)
    print_summary(report)
    warn = size_warn = class_warn = crowd_warn = None
    for split, st in report["splits"].items():
        lines, w = box_size_lines(st.get("box_sizes", []), st_cfg["image_size"], st_cfg["cell"], st_cfg["fixed_cell"])
        if split == "train":
            more, class_warn = class_size_lines(st.get("box_sizes", []), st.get("box_labels", []), report["classes"],
                                                st_cfg["image_size"], st_cfg["cell"], st_cfg.get("size_head"),
                                                st_cfg.get("output_codes", 31), st_cfg.get("ten_bit"))
            lines += more
            if st_cfg.get("grid"):
                shared = shared_cell_line(st.get("box_centres", []), st_cfg["grid"], st_cfg["slots"])
                lines += [shared] if shared else []
                crowd_warn = crowded_cell_warning(st.get("box_centres", []), st_cfg["grid"], st_cfg["slots"],
                                                  st_cfg.get("size_head"))
        if lines:
            print(f"{split}:")
            for line in lines:
                print(line)
        if split == "train":
            warn = w
            size_warn = size_head_warning(st.get("box_sizes", []), st_cfg.get("size_head"),
                                          st_cfg.get("output_codes", 31), st_cfg.get("ten_bit"))
    for w in (warn, size_warn or class_warn, crowd_warn):
        if w:
            print(f"warning: {w}", file=sys.stderr)
    empty = sum(len(st["no_objects"]) for st in report["splits"].values())
    if empty and not args.keep_empty:
        print(f"note: {empty} image(s) without objects were left out; --keep-empty writes them as background "
              "images (trained on as 'no object'; their detections count as false positives)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
