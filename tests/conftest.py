"""Test lanes: CPU tests pin ``device cpu`` in their configs; tests marked ``cuda`` run on a GPU and
are skipped where torch sees none (python3 -m pytest -m cuda runs that lane alone).

A config left at ``device auto`` is an error in the tests and in every process they start
(GNETMDK_AUTO_DEVICE=refuse, gnetmdk.config.base.cuda_wanted): on a GPU machine "auto" would move a
CPU test onto the GPU, so every test says which device it tests, on every machine."""
import os
import sys

import pytest
import torch

os.environ["GNETMDK_AUTO_DEVICE"] = "refuse"

# tests/<package>/ mirrors gnetmdk/<package>/; test modules import the helpers of tests/ (repo_paths,
# chip_helpers, dist_helpers) and a few of each other's (test_pipeline's workdir, test_stem's reference),
# so tests/ and every folder under it are on sys.path, whichever file pytest collects first
_TESTS = os.path.dirname(os.path.abspath(__file__))
for _dir in sorted(d for d, _sub, files in os.walk(_TESTS) if any(f.startswith("test_") for f in files)) + [_TESTS]:
    if _dir not in sys.path:
        sys.path.insert(0, _dir)


def pytest_collection_modifyitems(config, items):
    # GNETMDK_CUDA_LANE_DEVICE=cpu: run the lane's logic on the CPU (a check of the tests themselves)
    if torch.cuda.is_available() or os.environ.get("GNETMDK_CUDA_LANE_DEVICE") == "cpu":
        return
    skip = pytest.mark.skip(reason="cuda lane: torch sees no GPU here")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def _single_threaded():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture
def one_thread():
    """Single-threaded torch for one test, restored afterwards: small models only wait on a second
    intra-op thread on a busy machine (elementwise ops measured 400x slower with 2 threads under load),
    and a fixed thread count fixes the order of float sums that exact comparisons rely on."""
    yield from _single_threaded()


@pytest.fixture(scope="module")
def one_thread_module():
    """:func:`one_thread` for a whole module (``pytestmark = pytest.mark.usefixtures("one_thread_module")``)."""
    yield from _single_threaded()
