"""Shared test settings: deterministic seeds and CPU threads sized for a 2-core machine."""

import pytest
import torch

torch.set_num_threads(2)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
