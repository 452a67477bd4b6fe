#!/usr/bin/env python3
"""Train one stage of the gnetmdk pipeline in one process (CPU or one GPU).

    python3 train.py --step 1
    python3 train.py --cal
    python3 train.py --step 3 batch-size 32 learning-rate=3e-6

See docs/ and `python3 train.py --help`.
"""
import sys

from gnetmdk.engine.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], distributed=False))
