#!/usr/bin/env python3
"""Train one stage with several processes / machines (torch.distributed; NCCL on GPUs, gloo on CPU).

    python3 train-dist.py --gpus 2 --step 3 batch-size 32
    python3 train-dist.py --cal
    python3 train-dist.py --world-size 2 --rank 1 --dist-url 192.168.3.100:8888

The global batch_size is split over world_size x gpus processes. See docs/distributed.md.
"""
import sys

from gnetmdk.engine.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], distributed=True))
