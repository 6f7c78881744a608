"""What a task is, for the loop, the decoder and the plots: the :class:`Task` and :class:`Batch`
protocols, and what every task shares (the :class:`Vocab` with its three special ids, the
held-out rule, padding, sharding, per-step generators and the summed loss).

The loop, :func:`qkv.train.inference.generate_text` and the plots only call these protocols;
they never ask which task they hold, so a new task is one class (see ``tests/train``).
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Any, Protocol, TypedDict

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv._checks import check_positive_int
from qkv.distributed import ContextParallel, shard
from qkv.train.config import TrainConfig

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "PAD_ID",
    "SPECIALS",
    "Batch",
    "DecodeKwargs",
    "DecodeOptions",
    "EvalSums",
    "SamplingKwargs",
    "Task",
    "Vocab",
    "is_held_out",
    "loss_sum",
    "model_width",
    "pad_rows",
    "sequence_shard",
    "shard_slice",
    "step_rng",
]

SPECIALS = ("<pad>", "<bos>", "<eos>")
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2


@dataclass(frozen=True)
class Vocab:
    """Characters as tokens, after the three specials ``<pad>`` (0), ``<bos>`` (1), ``<eos>`` (2).

    Args:
        symbols: the characters, in id order starting at id 3.

    Raises:
        ValueError: an entry that is not one character, or a repeated one.
    """

    symbols: tuple[str, ...]

    def __post_init__(self) -> None:
        for s in self.symbols:
            if not isinstance(s, str) or len(s) != 1:
                raise ValueError(f"vocab symbols must be single characters, got {s!r}")
        if len(set(self.symbols)) != len(self.symbols):
            raise ValueError(f"vocab symbols must be unique, got {''.join(self.symbols)!r}")

    @property
    def size(self) -> int:
        """Number of ids, specials included."""
        return len(SPECIALS) + len(self.symbols)

    def token(self, i: int) -> str:
        """The text of id ``i`` (a special's name for 0-2)."""
        return SPECIALS[i] if i < len(SPECIALS) else self.symbols[i - len(SPECIALS)]

    def encode(self, text: str) -> list[int]:
        """Ids of the characters of ``text`` (no specials added).

        Raises:
            ValueError: a character outside the vocabulary (named, with the vocabulary).
        """
        index = {s: i + len(SPECIALS) for i, s in enumerate(self.symbols)}
        ids = []
        for pos, ch in enumerate(text):
            if ch not in index:
                raise ValueError(
                    f"input character {ch!r} at position {pos} is not in the vocabulary "
                    f"{''.join(self.symbols)!r}"
                )
            ids.append(index[ch])
        return ids

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``: skips ``<pad>``/``<bos>``, stops at the first ``<eos>``."""
        out = []
        for i in ids:
            if i == EOS_ID:
                break
            if i >= len(SPECIALS):
                out.append(self.symbols[i - len(SPECIALS)])
        return "".join(out)


class Batch(Protocol):
    """A padded batch of one task: it runs the model on itself and names its loss targets."""

    @property
    def targets(self) -> Tensor:
        """The ids the model must predict, ``[B, T]`` (``PAD_ID``: no loss)."""
        ...

    @property
    def num_tokens(self) -> int:
        """Tokens this batch trains on, for tokens/s (what counts is the task's choice)."""
        ...

    def logits(self, model: nn.Module) -> Tensor:
        """The model's scores for :attr:`targets`, ``[B, T, V]``."""
        ...

    def shard(self, rank: int, world_size: int) -> Batch:
        """The contiguous slice of rows for one process."""
        ...

    def context_shard(self, setting: ContextParallel) -> Batch:
        """This process's shard of every sequence (:func:`sequence_shard`), as a batch whose
        :meth:`logits` run the model context-parallel in ``setting`` (every rank of its group
        calls them together) and whose :attr:`targets` are the shard's."""
        ...


@dataclass(frozen=True)
class EvalSums:
    """One process's share of a held-out evaluation, summed (so processes add them up).

    Attributes:
        correct: examples (or tokens) judged correct by the task's metric.
        count: examples (or tokens) judged.
        loss: summed cross-entropy over ``tokens``.
        tokens: target tokens the loss covers.
    """

    correct: int
    count: int
    loss: float
    tokens: int


@dataclass(frozen=True)
class DecodeOptions:
    """How :meth:`Task.generate` decodes (each task uses the options that apply to it).

    Attributes:
        beam_size: beam search width for sequence tasks (1: greedy).
        max_new_tokens: tokens to generate at most (None: the task's default length).
        temperature: sampling temperature (text, when not ``greedy``).
        top_k: sample among the k likeliest (text, when not ``greedy``).
        greedy: text models: argmax decoding instead of sampling.
        seed: the sampling generator's seed.
        top_p: sample among the likeliest tokens whose probabilities sum to ``top_p`` (text).
        min_p: sample among tokens at least ``min_p`` times as likely as the likeliest (text).
        repetition_penalty: penalise tokens already in the row (text; 1 = none).
        eos_ids: stop ids (text; None: the model's own).
        min_new_tokens: the stop ids are banned until this many tokens are generated (text).

    The text options are checked by the model's ``generate`` (see
    :class:`qkv.models.decoding.DecodingOptions`).

    Raises:
        ValueError / TypeError: ``beam_size`` not a positive int.
    """

    beam_size: int = 1
    max_new_tokens: int | None = None
    temperature: float = 1.0
    top_k: int | None = None
    greedy: bool = True
    seed: int = 0
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float = 1.0
    eos_ids: tuple[int, ...] | None = None
    min_new_tokens: int = 0

    def __post_init__(self) -> None:
        check_positive_int("beam_size", self.beam_size)

    def text_kwargs(self) -> dict[str, Any]:
        """The keywords of :meth:`qkv.DecoderOnlyLM.generate` these options give (``eos_id``
        only when :attr:`eos_ids` is set; the seed as a ``generator``)."""
        kw: dict[str, Any] = {
            "greedy": self.greedy,
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "min_new_tokens": self.min_new_tokens,
            "generator": torch.Generator().manual_seed(self.seed),
        }
        if self.eos_ids is not None:
            kw["eos_id"] = list(self.eos_ids)
        return kw


class SamplingKwargs(TypedDict, total=False):
    """:class:`DecodeOptions` as keywords, for a decoder that samples or decodes greedily (no
    beams). The meanings and defaults are :class:`DecodeOptions`'s."""

    max_new_tokens: int | None
    temperature: float
    top_k: int | None
    greedy: bool
    seed: int
    top_p: float | None
    min_p: float | None
    repetition_penalty: float
    eos_ids: tuple[int, ...] | None
    min_new_tokens: int


class DecodeKwargs(SamplingKwargs, total=False):
    """Every :class:`DecodeOptions` field as a keyword: :class:`SamplingKwargs` and
    ``beam_size``."""

    beam_size: int


class Task(Protocol):
    """What the training loop, :func:`~qkv.train.inference.generate_text` and the plots need.

    Attributes:
        name: the task's name (the progress bar shows it).
        vocab: its tokens.
        model_type: the :data:`qkv.models.registry.MODEL_TYPES` key of the model it trains.
        metric: what the held-out accuracy counts, for the log (e.g. ``"exact-match"``).
    """

    name: str
    vocab: Vocab
    model_type: str
    metric: str

    def spec(self) -> dict[str, Any]:
        """JSON-serialisable arguments stored in checkpoints to rebuild the task."""
        ...

    def model_config(self, cfg: TrainConfig) -> dict[str, Any]:
        """The ``to_dict()`` of the config of a model of :attr:`model_type` sized by ``cfg``."""
        ...

    def train_batch(self, seed: int, step: int, batch_size: int) -> Batch:
        """The global training batch of ``step``: a pure function of its arguments."""
        ...

    def held_out_sums(
        self, model: nn.Module, n: int, seed: int, rank: int, world_size: int
    ) -> EvalSums:
        """Evaluate process ``rank``'s share of ``n`` held-out examples (model in eval mode)."""
        ...

    def generate(self, model: nn.Module, ids: list[int], options: DecodeOptions) -> list[int]:
        """Decode the input ``ids``; the new ids only (no ``<bos>``, no prompt, no padding)."""
        ...

    def teacher_forced_ids(
        self, text: str, generated: list[int]
    ) -> tuple[list[int] | None, list[int]]:
        """``(source ids or None, decoder ids)`` of the forward pass that reproduces the output
        ``generated`` for the input ``text`` (what the attention plots run)."""
        ...


def loss_sum(model: nn.Module, batch: Batch, label_smoothing: float = 0.0) -> tuple[Tensor, int]:
    """Summed cross-entropy over the non-padding targets of ``batch`` and their count."""
    logits = batch.logits(model)  # [B, T, V]
    targets = batch.targets  # [B, T]
    V = logits.shape[-1]
    total = F.cross_entropy(
        logits.reshape(-1, V),  # [B * T, V]
        targets.reshape(-1),  # [B * T]
        ignore_index=PAD_ID,
        reduction="sum",
        label_smoothing=label_smoothing,
    )
    return total, int((targets != PAD_ID).sum())


def model_width(cfg: TrainConfig) -> dict[str, Any]:
    """The model-config fields every task takes from ``cfg`` as they are (width, heads, ...)."""
    return {
        "d_model": cfg.d_model,
        "num_heads": cfg.num_heads,
        "dim_feedforward": cfg.dim_feedforward,
        "dropout": cfg.dropout,
        "norm_first": True,  # pre-norm: stable for small models without a careful warmup
        "positional": cfg.positional,
    }


def is_held_out(source: str, fraction: float) -> bool:
    """Whether ``source`` belongs to the held-out split (a pure function of the string)."""
    h = int.from_bytes(hashlib.sha256(source.encode("utf-8")).digest()[:8], "big")
    return h < fraction * 2**64


def pad_rows(rows: list[list[int]]) -> Tensor:
    """``rows`` right-padded with ``PAD_ID`` into one ``[len(rows), longest]`` long tensor."""
    width = max(len(r) for r in rows)
    return torch.tensor([r + [PAD_ID] * (width - len(r)) for r in rows], dtype=torch.long)


def sequence_shard(x: Tensor, setting: ContextParallel) -> Tensor:
    """This rank's shard of the padded ids ``x [B, T]`` along ``T``, for context parallelism.

    A batch narrower than the group (``T`` below its ranks) is first right-padded with
    ``PAD_ID`` to one column per rank, so that no rank holds an empty shard (the models need
    at least one position); padding is masked out of attention and carries no loss, so the
    result is the same as without it.

    Args:
        x: long ``[B, T]``, the same on every rank of the group.
        setting: the group and layout.

    Returns:
        Long ``[B, T_local]``, ``T_local >= 1``.
    """
    width = max(x.shape[1], setting.world)
    if width > x.shape[1]:
        x = F.pad(x, (0, width - x.shape[1]), value=PAD_ID)  # [B, width]
    return shard(x, 1, setting.group, setting.layout)  # [B, T_local]


def shard_slice(B: int, rank: int, world_size: int) -> slice:
    """Rows of process ``rank`` in a global batch of ``B`` rows.

    Raises:
        ValueError: ``B`` not divisible by ``world_size``.
    """
    if B % world_size != 0:
        raise ValueError(f"global batch size {B} is not divisible by world_size={world_size}")
    per = B // world_size
    return slice(rank * per, (rank + 1) * per)


def step_rng(seed: int, step: int, what: str) -> random.Random:
    """The generator of ``what`` (``"train"``, ``"eval"``) at ``step``: a pure function of the
    three, so resuming or another rank regenerates the same data."""
    return random.Random(f"qkv:{what}:{seed}:{step}")  # str seeds hash with SHA-512: stable
