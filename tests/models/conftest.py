"""Model tests compare outputs only: run them without building autograd graphs."""

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _no_grad() -> Iterator[None]:
    with torch.no_grad():
        yield
