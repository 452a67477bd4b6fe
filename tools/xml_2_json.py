#!/usr/bin/env python3
"""Convert a PASCAL VOC dataset into COCO-json files <out-dir>/<DS_NAME>_train.json and _valid.json.

The same checks, split and report as tools/xml_2_txt.py (every annotation and image checked, both
files written as one set, bad files refused with the file named or, with --skip-bad, listed); point
the config's ``train_json`` / ``val_json`` at the two files to train from them (PaddleDetection's
``voc2012_train.json`` / ``voc2012_val.json`` are read the same way).

    python3 tools/xml_2_json.py --config examples/ppyolo_cards.py
    python3 tools/xml_2_json.py --name cards --dataset-dir ../shared/data/cards \\
        --classes nine,ten,jack,queen,king,ace --out-dir data/meta

Config overrides (``KEY VALUE`` or ``KEY=VALUE``, as train.py reads them) come after the options.
Exit status: 0 on success, 2 on a dataset/annotation/config error (one message on stderr).
"""
from __future__ import annotations

import sys

import xml_2_txt  # beside this file: a script's own folder is first on sys.path


def main(argv=None) -> int:
    """Run the tool (xml_2_txt.main writing COCO json, with this docstring as its --help); returns the
    exit status."""
    return xml_2_txt.main(argv, coco=True, doc=__doc__)


if __name__ == "__main__":
    sys.exit(main())
