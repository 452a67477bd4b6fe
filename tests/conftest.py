"""Test lanes: CPU tests pin ``device cpu`` in their configs; tests marked ``cuda`` run on a GPU and
are skipped where torch sees none (python3 -m pytest -m cuda runs that lane alone)."""
import os

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    # GNETMDK_CUDA_LANE_DEVICE=cpu: run the lane's logic on the CPU (a check of the tests themselves)
    if torch.cuda.is_available() or os.environ.get("GNETMDK_CUDA_LANE_DEVICE") == "cpu":
        return
    skip = pytest.mark.skip(reason="cuda lane: torch sees no GPU here")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
