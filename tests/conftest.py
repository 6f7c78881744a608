"""Shared test settings: deterministic seeds, CPU threads sized to the machine's cores, the
hypothesis profiles, and tests/ on ``sys.path`` for the shared helper modules
(``reference_f64``)."""

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import settings

sys.path.insert(0, str(Path(__file__).parent))


def _threads() -> int:
    """Torch threads for this test process: the cores shared out among pytest-xdist's workers
    (``make test`` runs ``-n auto``, one worker a core: 1 thread each), at most 2 (what a serial
    run has always used; more only adds OpenMP spinning on a busy machine)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if hasattr(os, "sched_getaffinity"):  # the cores this process may use, as -n auto counts
        cores = len(os.sched_getaffinity(0))
    else:
        cores = os.cpu_count() or 1
    return max(1, min(2, cores // workers))


THREADS = _threads()
torch.set_num_threads(THREADS)

# Hypothesis profiles. Property tests take their example count from the profile, not from
# their own @settings, so one switch sizes them all:
# - "ci" (the default): 40 examples a test, what every property test ran before the profiles
#   (two ran 25); the seven take 1.3 s together on 2 cores. No deadline: the first example
#   of a test pays for torch's warm-up, and a shared CI machine's timing is noise.
# - "long": 2000 examples a test, for a search by hand or from a script, e.g.
#   `pytest tests --hypothesis-profile long` (the seven property tests: 144 s on 2 cores).
settings.register_profile("ci", max_examples=40, deadline=None, print_blob=True)
settings.register_profile("long", max_examples=2000, deadline=None, print_blob=True)
settings.load_profile("ci")  # pytest's --hypothesis-profile NAME loads NAME after this


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _threads_restored() -> Iterator[None]:
    """A test that calls ``qkv train`` / ``generate`` in process (``--threads``) cannot leave
    its thread count to the tests that follow it in the same worker."""
    yield
    torch.set_num_threads(THREADS)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """README blocks first: each starts interpreters and takes seconds (one takes ~30 s), so run
    early they overlap the many short tests on the other pytest-xdist workers instead of leaving
    one worker busy alone at the end. The order is otherwise kept."""
    items.sort(key=lambda item: not item.nodeid.startswith("tests/test_readme.py::test_readme_"))
