"""Shared test settings: deterministic seeds, CPU threads sized for a 2-core machine, the
hypothesis profiles, and tests/ on ``sys.path`` for the shared helper modules
(``reference_f64``)."""

import sys
from pathlib import Path

import pytest
import torch
from hypothesis import settings

torch.set_num_threads(2)
sys.path.insert(0, str(Path(__file__).parent))

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
