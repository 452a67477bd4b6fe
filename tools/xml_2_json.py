#!/usr/bin/env python3
"""Convert a PASCAL VOC dataset into COCO-json files <out-dir>/<DS_NAME>_train.json and _valid.json.

The same checks, split and report as tools/xml_2_txt.py (every annotation and image checked, both
files written as one set, bad files refused with the file named or, with --skip-bad, listed); point
the config's ``train_json`` / ``val_json`` at the two files to train from them (PaddleDetection's
``voc2012_train.json`` / ``voc2012_val.json`` are read the same way).

    python3 tools/xml_2_json.py --config examples/ppyolo_cards.py
    python3 tools/xml_2_json.py --name cards --dataset-dir ../shared/data/cards \\
        --classes nine,ten,jack,queen,king,ace --out-dir data/meta

Exit status: 0 on success, 2 on a dataset/annotation/config error (one message on stderr).
"""
from __future__ import annotations

import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import xml_2_txt  # noqa: E402


def main(argv=None) -> int:
    """Run the tool (xml_2_txt.main writing COCO json); returns the exit status."""
    return xml_2_txt.main(argv, coco=True)


if __name__ == "__main__":
    sys.exit(main())
