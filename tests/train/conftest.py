"""Tiny settings shared by the training tests (seconds, not minutes, on 2 cores)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from qkv.train.config import TrainConfig

TINY: dict[str, Any] = {
    "task": "reverse",
    "max_len": 5,
    "d_model": 16,
    "num_heads": 2,
    "num_layers": 1,
    "dim_feedforward": 32,
    "steps": 30,
    "batch_size": 16,
    "lr": 3e-3,
    "warmup_steps": 5,
    "eval_every": 30,
    "eval_size": 20,
}


def make_tiny(**overrides: Any) -> TrainConfig:
    """A model and run small enough for a unit test."""
    return TrainConfig(**{**TINY, **overrides})


@pytest.fixture
def tiny() -> Callable[..., TrainConfig]:
    """The :func:`make_tiny` factory."""
    return make_tiny
