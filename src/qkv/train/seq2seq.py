"""The sequence-to-sequence tasks (for :class:`qkv.Transformer`): ``copy``, ``reverse``, ``sort``
over a small alphabet, and ``add`` (``"123+45=" -> "168"``), with exact-match evaluation by
greedy decoding. See :mod:`qkv.train.tasks` for the held-out rule and the batches' determinism.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from qkv._checks import check_positive_int
from qkv.distributed import ContextParallel
from qkv.models.config import TransformerConfig
from qkv.train.config import TrainConfig
from qkv.train.task import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    SPECIALS,
    DecodeOptions,
    EvalSums,
    Vocab,
    is_held_out,
    loss_sum,
    model_width,
    pad_rows,
    sequence_shard,
    shard_slice,
    step_rng,
)

__all__ = [
    "AddTask",
    "AlphabetTask",
    "CopyTask",
    "ReverseTask",
    "Seq2SeqBatch",
    "Seq2SeqTask",
    "SortTask",
]

_EVAL_CHUNK = 250  # sources decoded per generate call during evaluation


@dataclass(frozen=True)
class Seq2SeqBatch:
    """Padded ids: ``src [B, S]``; ``tgt_in = <bos> + target`` and ``tgt_out = target + <eos>``,
    both ``[B, T]``. Padding is ``PAD_ID`` everywhere. With ``context_parallel`` set, the three
    are this rank's shards of the sequences (:meth:`context_shard`)."""

    src: Tensor
    tgt_in: Tensor
    tgt_out: Tensor
    context_parallel: ContextParallel | None = None

    @property
    def targets(self) -> Tensor:
        """``tgt_out [B, T]``: the loss targets."""
        return self.tgt_out

    @property
    def num_tokens(self) -> int:
        """Non-padding source + target tokens (what tokens/s counts)."""
        return int((self.src != PAD_ID).sum() + (self.tgt_out != PAD_ID).sum())

    def logits(self, model: nn.Module) -> Tensor:
        """Teacher-forced scores ``[B, T, V]`` of an encoder-decoder ``model`` (this rank's
        shard under context parallelism)."""
        extra = {} if self.context_parallel is None else {"context_parallel": self.context_parallel}
        return model(
            self.src,
            self.tgt_in,
            src_padding_mask=self.src == PAD_ID,
            tgt_padding_mask=self.tgt_in == PAD_ID,
            **extra,
        )  # [B, T, V]

    def shard(self, rank: int, world_size: int) -> Seq2SeqBatch:
        """The contiguous slice of rows for one process."""
        sl = shard_slice(self.src.shape[0], rank, world_size)
        return Seq2SeqBatch(self.src[sl], self.tgt_in[sl], self.tgt_out[sl], self.context_parallel)

    def context_shard(self, setting: ContextParallel) -> Seq2SeqBatch:
        """This rank's shards of ``src``, ``tgt_in`` and ``tgt_out`` (see
        :func:`~qkv.train.task.sequence_shard`), run context-parallel in ``setting``."""
        return Seq2SeqBatch(
            sequence_shard(self.src, setting),  # [B, S_local]
            sequence_shard(self.tgt_in, setting),  # [B, T_local]
            sequence_shard(self.tgt_out, setting),  # [B, T_local]
            setting,
        )


class Seq2SeqTask:
    """Base of the sequence-to-sequence tasks: a vocabulary, a sampler and the correct answer.

    Subclasses define ``name``, ``vocab``, ``max_src_len``, ``max_tgt_len``,
    :meth:`sample_source`, :meth:`target` and :meth:`spec`.

    Args:
        held_out_fraction: share of the sources kept for evaluation.

    Raises:
        ValueError: ``held_out_fraction`` outside ``(0, 1)``.
    """

    name = ""
    model_type = "transformer"
    metric = "exact-match"
    vocab: Vocab
    max_src_len: int
    max_tgt_len: int

    def __init__(self, held_out_fraction: float = 0.1) -> None:
        if not 0.0 < held_out_fraction < 1.0:
            raise ValueError(f"held_out_fraction must lie in (0, 1), got {held_out_fraction}")
        self.held_out_fraction = held_out_fraction

    def sample_source(self, rng: random.Random) -> str:
        """One random source string."""
        raise NotImplementedError

    def target(self, source: str) -> str:
        """The correct output for ``source``."""
        raise NotImplementedError

    def spec(self) -> dict[str, Any]:
        """JSON-serialisable arguments that rebuild this task (see
        :func:`qkv.train.tasks.task_from_spec`)."""
        raise NotImplementedError

    def model_config(self, cfg: TrainConfig) -> dict[str, Any]:
        """A :class:`~qkv.models.config.TransformerConfig` dict sized by ``cfg``, with room for
        the longest source or target plus ``<bos>`` and ``<eos>``."""
        V = self.vocab.size
        return TransformerConfig(
            src_vocab_size=V,
            tgt_vocab_size=V,
            num_encoder_layers=cfg.num_layers,
            num_decoder_layers=cfg.num_layers,
            max_positions=max(self.max_src_len, self.max_tgt_len) + 2,
            pad_id=PAD_ID,
            bos_id=BOS_ID,
            eos_id=EOS_ID,
            **model_width(cfg),
        ).to_dict()

    def _sample(self, rng: random.Random, held_out: bool) -> str:
        while True:
            src = self.sample_source(rng)
            if is_held_out(src, self.held_out_fraction) == held_out:
                return src

    def collate(self, sources: list[str]) -> Seq2SeqBatch:
        """Encode and pad ``sources`` with their correct targets."""
        tgts = [self.vocab.encode(self.target(s)) for s in sources]
        return Seq2SeqBatch(
            src=pad_rows([self.vocab.encode(s) for s in sources]),
            tgt_in=pad_rows([[BOS_ID, *t] for t in tgts]),
            tgt_out=pad_rows([[*t, EOS_ID] for t in tgts]),
        )

    def train_batch(self, seed: int, step: int, batch_size: int) -> Seq2SeqBatch:
        """The global training batch of ``step`` (held-out sources never appear)."""
        rng = step_rng(seed, step, "train")
        return self.collate([self._sample(rng, held_out=False) for _ in range(batch_size)])

    def eval_sources(self, n: int, seed: int) -> list[str]:
        """Up to ``n`` distinct held-out sources (fewer only if the task has fewer)."""
        rng = step_rng(seed, 0, "eval")
        found: dict[str, None] = {}
        for _ in range(200 * n):
            if len(found) == n:
                break
            found.setdefault(self._sample(rng, held_out=True))
        return list(found)

    @torch.no_grad()
    def held_out_sums(
        self, model: nn.Module, n: int, seed: int, rank: int, world_size: int
    ) -> EvalSums:
        """Exact-sequence matches of greedy decoding (the output must equal the target and end
        with ``<eos>``) and the teacher-forced loss, over this process's share of the sources."""
        sources = self.eval_sources(n, seed)[rank::world_size]
        if not sources:  # a process may get none when there are fewer examples than processes
            return EvalSums(correct=0, count=0, loss=0.0, tokens=0)
        correct = 0
        for i in range(0, len(sources), _EVAL_CHUNK):
            chunk = sources[i : i + _EVAL_CHUNK]
            batch = self.collate(chunk)
            out = model.generate(  # type: ignore[operator]
                batch.src, self.max_tgt_len + 1, src_padding_mask=batch.src == PAD_ID
            )  # [B, L], starts with <bos>
            for row, src in zip(out.tolist(), chunk, strict=True):
                correct += self.vocab.decode(row[1:]) == self.target(src)
        total, tokens = loss_sum(model, self.collate(sources))
        return EvalSums(correct=correct, count=len(sources), loss=float(total), tokens=tokens)

    @torch.no_grad()
    def generate(self, model: nn.Module, ids: list[int], options: DecodeOptions) -> list[int]:
        """Greedy or beam-search decoding of the source ``ids`` (default length: the longest
        target + ``<eos>``); the sampling options do not apply."""
        n = self.max_tgt_len + 1 if options.max_new_tokens is None else options.max_new_tokens
        src = torch.tensor([ids])  # [1, S]
        out = model.generate(  # type: ignore[operator]
            src, n, src_padding_mask=src == PAD_ID, beam_size=options.beam_size
        )  # [1, L]
        new = [i for i in out[0].tolist() if i != PAD_ID]
        return new[1:] if new and new[0] == BOS_ID else new

    def teacher_forced_ids(self, text: str, generated: list[int]) -> tuple[list[int], list[int]]:
        """The source ids of ``text`` and ``<bos>`` + the output (without ``<eos>``)."""
        return self.vocab.encode(text), [BOS_ID] + [i for i in generated if i >= len(SPECIALS)]


class AlphabetTask(Seq2SeqTask):
    """Base of the tasks over strings of ``min_len`` to ``max_len`` letters of ``alphabet``.

    Raises:
        ValueError: ``min_len`` outside ``[1, max_len]``, or fewer than 2 letters.
    """

    def __init__(
        self,
        min_len: int = 1,
        max_len: int = 12,
        alphabet: str = "abcdefghij",
        held_out_fraction: float = 0.1,
    ) -> None:
        super().__init__(held_out_fraction)
        if not 1 <= min_len <= max_len:
            raise ValueError(f"need 1 <= min_len <= max_len, got min_len={min_len}, {max_len=}")
        if len(alphabet) < 2:
            raise ValueError(f"alphabet needs at least 2 symbols, got {alphabet!r}")
        self.min_len, self.max_len, self.alphabet = min_len, max_len, alphabet
        self.vocab = Vocab(tuple(alphabet))
        self.max_src_len = self.max_tgt_len = max_len

    def sample_source(self, rng: random.Random) -> str:
        n = rng.randint(self.min_len, self.max_len)
        return "".join(rng.choice(self.alphabet) for _ in range(n))

    def spec(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "min_len": self.min_len,
            "max_len": self.max_len,
            "alphabet": self.alphabet,
            "held_out_fraction": self.held_out_fraction,
        }


class CopyTask(AlphabetTask):
    """Output the input unchanged: ``"abc" -> "abc"``."""

    name = "copy"

    def target(self, source: str) -> str:
        return source


class ReverseTask(AlphabetTask):
    """Output the input reversed: ``"abc" -> "cba"`` (cross-attention: the anti-diagonal)."""

    name = "reverse"

    def target(self, source: str) -> str:
        return source[::-1]


class SortTask(AlphabetTask):
    """Output the input's characters sorted: ``"cab" -> "abc"``."""

    name = "sort"

    def target(self, source: str) -> str:
        return "".join(sorted(source))


class AddTask(Seq2SeqTask):
    """Add two non-negative integers: ``"123+45=" -> "168"``.

    Args:
        max_digits: each operand has 1 to ``max_digits`` digits.
        held_out_fraction: share of the problems kept for evaluation.
    """

    name = "add"

    def __init__(self, max_digits: int = 3, held_out_fraction: float = 0.1) -> None:
        super().__init__(held_out_fraction)
        self.max_digits = check_positive_int("max_digits", max_digits)
        self.vocab = Vocab(tuple("0123456789+="))
        self.max_src_len = 2 * max_digits + 2
        self.max_tgt_len = max_digits + 1

    def sample_source(self, rng: random.Random) -> str:
        a, b = (str(rng.randrange(10 ** rng.randint(1, self.max_digits))) for _ in range(2))
        return f"{a}+{b}="

    def target(self, source: str) -> str:
        a, sep, rest = source.partition("+")
        if not sep or not rest.endswith("=") or not (a + rest[:-1]).isdigit():
            raise ValueError(f"add task input must look like '123+45=', got {source!r}")
        return str(int(a) + int(rest[:-1]))

    def spec(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "max_digits": self.max_digits,
            "held_out_fraction": self.held_out_fraction,
        }
