"""What a training run is: :class:`TrainConfig` (everything that decides the resulting weights),
the learning-rate schedule, and how the task's model and optimizer are built from it."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
from torch import nn

from qkv.train.tasks import BOS_ID, EOS_ID, PAD_ID, Seq2SeqTask, TextTask, make_task

__all__ = [
    "SCHEDULES",
    "TrainConfig",
    "build_model",
    "build_optimizer",
    "build_task",
    "lr_at",
    "model_from_config",
    "model_type_of",
]

SCHEDULES = ("cosine", "inverse_sqrt", "constant")


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
        num_heads: H.
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
        ValueError: a field out of range, naming it and the value.
    """

    task: str = "reverse"
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
    positional: str = "sinusoidal"
    steps: int = 1500
    batch_size: int = 64
    lr: float = 2e-3
    warmup_steps: int = 100
    schedule: str = "cosine"
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
        positive = (
            "d_model",
            "num_heads",
            "num_layers",
            "dim_feedforward",
            "steps",
            "batch_size",
            "eval_every",
            "eval_size",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.lr <= 0 or self.warmup_steps < 0:
            raise ValueError(
                f"need lr > 0 and warmup_steps >= 0, got {self.lr}, {self.warmup_steps}"
            )
        for name in ("dropout", "label_smoothing", "min_lr_ratio", "beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0 + (name == "min_lr_ratio"):
                raise ValueError(f"{name} must lie in [0, 1), got {getattr(self, name)}")
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


def build_task(cfg: TrainConfig) -> Seq2SeqTask | TextTask:
    """The task of ``cfg``."""
    return make_task(
        cfg.task,
        text_path=cfg.text_path,
        min_len=cfg.min_len,
        max_len=cfg.max_len,
        max_digits=cfg.max_digits,
        block_size=cfg.block_size,
    )


def model_type_of(task: Seq2SeqTask | TextTask) -> str:
    """``"transformer"`` for sequence-to-sequence tasks, ``"decoder_only"`` for text."""
    return "decoder_only" if isinstance(task, TextTask) else "transformer"


def build_model(cfg: TrainConfig, task: Seq2SeqTask | TextTask) -> tuple[nn.Module, dict[str, Any]]:
    """A freshly initialised model for ``task`` (seed the RNG first) and its config dict."""
    from qkv.models.config import DecoderOnlyConfig, TransformerConfig
    from qkv.models.decoder_only import DecoderOnlyLM
    from qkv.models.transformer import Transformer

    V = task.vocab.size
    common: dict[str, Any] = {
        "d_model": cfg.d_model,
        "num_heads": cfg.num_heads,
        "dim_feedforward": cfg.dim_feedforward,
        "dropout": cfg.dropout,
        "norm_first": True,  # pre-norm: stable for small models without a careful warmup
        "positional": cfg.positional,
    }
    model: nn.Module
    if isinstance(task, TextTask):
        dcfg = DecoderOnlyConfig(
            vocab_size=V,
            num_layers=cfg.num_layers,
            max_positions=cfg.block_size + 1,
            pad_id=PAD_ID,
            eos_id=EOS_ID,
            **common,
        )
        model = DecoderOnlyLM(dcfg)
        return model, dcfg.to_dict()
    tcfg = TransformerConfig(
        src_vocab_size=V,
        tgt_vocab_size=V,
        num_encoder_layers=cfg.num_layers,
        num_decoder_layers=cfg.num_layers,
        max_positions=max(task.max_src_len, task.max_tgt_len) + 2,
        pad_id=PAD_ID,
        bos_id=BOS_ID,
        eos_id=EOS_ID,
        **common,
    )
    model = Transformer(tcfg)
    return model, tcfg.to_dict()


def model_from_config(model_type: str, config: dict[str, Any]) -> nn.Module:
    """Rebuild an (untrained) model from a checkpoint's type and config dict.

    Raises:
        ValueError: an unknown model type or config key.
    """
    from qkv.models.config import DecoderOnlyConfig, TransformerConfig
    from qkv.models.decoder_only import DecoderOnlyLM
    from qkv.models.transformer import Transformer

    if model_type == "transformer":
        return Transformer(TransformerConfig.from_dict(config))
    if model_type == "decoder_only":
        return DecoderOnlyLM(DecoderOnlyConfig.from_dict(config))
    raise ValueError(f"unknown model_type {model_type!r}; expected 'transformer' or 'decoder_only'")


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
