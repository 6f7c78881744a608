"""What a training run is: :class:`TrainConfig` (everything that decides the resulting weights),
the learning-rate schedule and the optimizer. Training only: the model's config comes from the
task (:meth:`qkv.train.task.Task.model_config`) and the model from
:func:`qkv.models.registry.model_from_config`."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal, get_args

import torch
from torch import nn

from qkv._checks import check_nonnegative_int, check_positive_int, check_probability

__all__ = [
    "POSITIONALS",
    "SCHEDULES",
    "TASKS",
    "Positional",
    "Schedule",
    "TaskName",
    "TrainConfig",
    "build_optimizer",
    "lr_at",
]

TaskName = Literal["copy", "reverse", "sort", "add", "text"]
Schedule = Literal["cosine", "inverse_sqrt", "constant"]
# The model's positional encodings (qkv.models.config.POSITIONALS; a test keeps the two equal).
Positional = Literal["sinusoidal", "learned", "rotary", "alibi", "relative", "none"]
TASKS: tuple[str, ...] = get_args(TaskName)
SCHEDULES: tuple[str, ...] = get_args(Schedule)
POSITIONALS: tuple[str, ...] = get_args(Positional)

_POSITIVE = (
    "d_model",
    "num_heads",
    "num_layers",
    "dim_feedforward",
    "steps",
    "batch_size",
    "eval_every",
    "eval_size",
)
_FRACTIONS = ("dropout", "label_smoothing", "beta1", "beta2")  # in [0, 1)
_CHOICES = (("task", TASKS), ("schedule", SCHEDULES), ("positional", POSITIONALS))


@dataclass(frozen=True)
class TrainConfig:
    """Everything that decides the weights a run ends with (stored in checkpoints; ``--resume``
    refuses a config that differs). Defaults: the ``reverse`` task's tuned settings.

    Attributes:
        task: ``copy``, ``reverse``, ``sort``, ``add`` or ``text``.
        text_path: the UTF-8 file of the ``text`` task.
        min_len: shortest sequence (copy/reverse/sort).
        max_len: longest sequence (copy/reverse/sort).
        max_digits: operand digits (add).
        block_size: longest window (text).
        d_model: model width D.
        num_heads: attention heads H.
        num_layers: encoder and decoder layers each (or the decoder-only model's layers).
        dim_feedforward: inner width of the feed-forward blocks.
        dropout: dropout everywhere in the model.
        positional: the model's positional encoding.
        steps: optimizer steps of the whole run (the schedule spans them).
        batch_size: global batch (split across processes).
        lr: peak learning rate.
        warmup_steps: linear warmup from ``lr / warmup_steps`` to ``lr``.
        schedule: ``cosine`` (to ``min_lr_ratio * lr``), ``inverse_sqrt`` or ``constant``.
        min_lr_ratio: the cosine schedule's floor, relative to ``lr``.
        weight_decay: AdamW's decoupled decay (matrices only, not biases or norms).
        beta1: AdamW's first-moment decay.
        beta2: AdamW's second-moment decay.
        grad_clip: clip the global gradient norm to this (0 disables).
        label_smoothing: cross-entropy label smoothing.
        eval_every: evaluate on the held-out split every this many steps (and at the end).
        eval_size: held-out examples (windows for ``text``).
        seed: seeds the weights, the data and dropout.

    Raises:
        ValueError: a field out of range or not one of its choices, naming it and the value.
        TypeError: a count that is not an int (or a rate that is not a number), named.
    """

    task: TaskName = "reverse"
    text_path: str | None = None
    min_len: int = 1
    max_len: int = 12
    max_digits: int = 3
    block_size: int = 64
    d_model: int = 64
    num_heads: int = 4
    num_layers: int = 2
    dim_feedforward: int = 256
    dropout: float = 0.0
    positional: Positional = "sinusoidal"
    steps: int = 1500
    batch_size: int = 64
    lr: float = 2e-3
    warmup_steps: int = 100
    schedule: Schedule = "cosine"
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.98
    grad_clip: float = 1.0
    label_smoothing: float = 0.0
    eval_every: int = 250
    eval_size: int = 500
    seed: int = 0

    def __post_init__(self) -> None:
        for name, choices in _CHOICES:
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {choices}, got {getattr(self, name)!r}")
        for name in _POSITIVE:
            check_positive_int(name, getattr(self, name))
        check_nonnegative_int("warmup_steps", self.warmup_steps)
        for name in _FRACTIONS:
            check_probability(name, getattr(self, name), inclusive_one=False)
        check_probability("min_lr_ratio", self.min_lr_ratio)
        for name in ("lr", "grad_clip", "weight_decay"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise TypeError(f"{name} must be a float, got {value!r} ({type(value).__name__})")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.grad_clip < 0 or self.weight_decay < 0:
            raise ValueError(
                f"grad_clip and weight_decay must be >= 0, got {self.grad_clip}, "
                f"{self.weight_decay}"
            )

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable fields."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        """Inverse of :meth:`to_dict`.

        Raises:
            ValueError: an unknown key, named.
        """
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown TrainConfig keys {unknown}")
        return cls(**d)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of the update at 0-based ``step``: linear warmup, then the schedule."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    if cfg.schedule == "inverse_sqrt":
        return cfg.lr * math.sqrt(max(1, cfg.warmup_steps) / (step + 1))
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine)


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices (``dim >= 2``) only; the lr is set per step."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=lr_at(0, cfg),
        betas=(cfg.beta1, cfg.beta2),
    )
