"""TrainConfig: the choices of its Literal fields and its range checks, each error naming the
field and the value."""

from __future__ import annotations

from typing import Any

import pytest

from qkv.models.config import POSITIONALS as MODEL_POSITIONALS
from qkv.train.config import POSITIONALS, SCHEDULES, TASKS, TrainConfig, lr_at


def test_literal_choices_match_what_they_name() -> None:
    assert POSITIONALS == MODEL_POSITIONALS
    assert TASKS == ("copy", "reverse", "sort", "add", "text")
    assert SCHEDULES == ("cosine", "inverse_sqrt", "constant")


@pytest.mark.parametrize(
    ("field", "value", "error", "message"),
    [
        ("task", "nope", ValueError, r"task must be one of .*'reverse'.*, got 'nope'"),
        ("positional", "rope", ValueError, r"positional must be one of .*, got 'rope'"),
        ("schedule", "linear", ValueError, r"schedule must be one of .*, got 'linear'"),
        ("steps", 0, ValueError, "steps must be a positive int, got 0"),
        ("batch_size", 2.0, TypeError, r"batch_size must be an int, got 2\.0"),
        ("num_layers", True, TypeError, "num_layers must be an int, got True"),
        ("warmup_steps", -1, ValueError, "warmup_steps must be a non-negative int, got -1"),
        ("dropout", 1.0, ValueError, r"dropout must lie in \[0, 1\), got 1\.0"),
        ("beta2", -0.1, ValueError, r"beta2 must lie in \[0, 1\), got -0\.1"),
        ("min_lr_ratio", 1.5, ValueError, r"min_lr_ratio must lie in \[0, 1\], got 1\.5"),
        ("lr", 0.0, ValueError, r"lr must be > 0, got 0\.0"),
        ("lr", "1e-3", TypeError, "lr must be a float, got '1e-3'"),
        ("grad_clip", -1.0, ValueError, "grad_clip and weight_decay must be >= 0"),
    ],
)
def test_bad_fields_are_named(field: str, value: Any, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        TrainConfig(**{field: value})


def test_edges_that_are_allowed() -> None:
    cfg = TrainConfig(min_lr_ratio=1.0, warmup_steps=0, dropout=0.0, grad_clip=0.0)
    # min_lr_ratio=1 makes the cosine schedule flat, and no warmup starts at the full lr
    assert cfg.schedule == "cosine"
    assert [lr_at(s, cfg) for s in range(cfg.steps)] == [cfg.lr] * cfg.steps
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg


def test_from_dict_names_unknown_keys() -> None:
    with pytest.raises(ValueError, match=r"unknown TrainConfig keys \['colour'\]"):
        TrainConfig.from_dict({**TrainConfig().to_dict(), "colour": "red"})
