#!/usr/bin/env python3
"""Convert a PASCAL VOC dataset into GNetDet meta files <out-dir>/<DS_NAME>_train.txt and _valid.txt.

Examples:
    python3 tools/xml_2_txt.py                       # everything from configs.py
    python3 tools/xml_2_txt.py --name cards --dataset-dir /path/cards \\
        --classes nine,ten,jack,queen,king,ace --out-dir data/meta   # no config needed

The work is done by gnetmdk.dataset.voc.convert_voc_to_meta; see its docstring for the format.
Exit status: 0 on success, 2 on a dataset/annotation/config error (one message on stderr).
"""

from __future__ import annotations

import argparse
import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from gnetmdk.dataset.voc import VOCFormatError, convert_voc_to_coco, convert_voc_to_meta  # noqa: E402

DEFAULT_CONFIG = os.path.join(REPO_ROOT, "configs.py")


class CLIError(Exception):
    """A user error reported as one line on stderr with exit status 2."""


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Convert VOC XML annotations into GNetDet meta files.",
        epilog="Without --config, values not given on the command line come from configs.py at "
               "the repository root. With --name, --dataset-dir, --classes and --out-dir all "
               "given, no config is loaded.",
    )
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
    p.add_argument("--skip-bad", action="store_true",
                   help="skip bad annotations/images and list them, instead of stopping at the first")
    p.add_argument("--val-fraction", type=float, default=0.2,
                   help="valid share for the random split used when ImageSets/Main/{train,val}.txt "
                        "are absent (default 0.2)")
    p.add_argument("--seed", type=int, default=None,
                   help="seed of that random split (default: config seed, or 0 without a config)")
    return p.parse_args(argv)


def _load_config(path: str | None):
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
        return load_config(path, [])
    except Exception as exc:  # any config problem becomes one line, not a traceback
        raise CLIError(f"cannot load config {path}: {exc}") from None


def resolve_settings(args) -> dict:
    """Command-line values, completed from the config only when something is missing."""
    need_config = args.config is not None or None in (
        args.name, args.dataset_dir, args.classes, args.out_dir)
    cfg = _load_config(args.config) if need_config else None

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
    return {
        "name": str(pick(args.name, "DS_NAME")),
        "dataset_dir": str(pick(args.dataset_dir, "dataset_dir")),
        "classes": classes,
        "out_dir": str(pick(args.out_dir, "meta_dir")),
        "seed": int(seed),
    }


def print_summary(report: dict, out=sys.stdout) -> None:
    splits = report["splits"]
    names = list(splits)
    width = max([len("images (no objects)")] + [len(c) for c in report["classes"]])
    line = lambda label, vals: print(  # noqa: E731
        f"  {label:<{width}} " + " ".join(f"{v:>8}" for v in vals), file=out)
    print(f"dataset {report['dataset_dir']} ({report['split_source']})", file=out)
    line("", names)
    line("images", [splits[s]["images"] for s in names])
    line("boxes", [splits[s]["boxes"] for s in names])
    for c in report["classes"]:
        line(c, [splits[s]["per_class"][c] for s in names])
    line("images (no objects)", [len(splits[s]["no_objects"]) for s in names])
    line("difficult dropped", [splits[s]["dropped_difficult"] for s in names])
    for s in names:
        print(f"wrote {splits[s]['file']}", file=out)


def main(argv=None, coco: bool = False) -> int:
    """Run the tool; ``coco`` writes COCO-json files (tools/xml_2_json.py) instead of meta files.
    Returns the exit status (0 ok, 2 a dataset/annotation/config error)."""
    args = parse_args(argv)
    tool = "xml_2_json" if coco else "xml_2_txt"
    try:
        st = resolve_settings(args)
        ext = "json" if coco else "txt"
        out_train = os.path.join(st["out_dir"], f"{st['name']}_train.{ext}")
        out_valid = os.path.join(st["out_dir"], f"{st['name']}_valid.{ext}")
        convert = convert_voc_to_coco if coco else convert_voc_to_meta
        report = convert(
            st["dataset_dir"], st["classes"], out_train, out_valid,
            keep_difficult=args.keep_difficult, skip_bad=args.skip_bad,
            val_fraction=args.val_fraction, seed=st["seed"],
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
