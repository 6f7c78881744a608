"""Built-in tasks, generated on the fly from a seed (no download).

Sequence-to-sequence tasks (for :class:`qkv.Transformer`): ``copy``, ``reverse``, ``sort`` over a
small alphabet, and ``add`` ("123+45=" -> "168"). One language-model task (for
:class:`qkv.DecoderOnlyLM`): ``text``, characters of any UTF-8 file.

Every task has a :class:`Vocab` whose ids 0, 1, 2 are ``<pad>``, ``<bos>``, ``<eos>``, and
produces sequences of varying length, so padding masks are exercised for real.

Held-out split: a source string belongs to the held-out split when the SHA-256 of its text falls
in the lowest ``held_out_fraction`` of the hash range. The rule depends on the string alone (not
on a seed or on sampling order), so training batches, which reject held-out sources, can never
contain an evaluation example. The text task holds out the last part of the file instead.

Batches are a pure function of ``(seed, step)``: resuming at step k, or every rank of a
multi-process run, regenerates exactly the same global batch without saving any data state.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "PAD_ID",
    "SPECIALS",
    "TASKS",
    "AddTask",
    "CopyTask",
    "LMBatch",
    "ReverseTask",
    "Seq2SeqBatch",
    "Seq2SeqTask",
    "SortTask",
    "TextTask",
    "Vocab",
    "is_held_out",
    "make_task",
    "task_from_spec",
]

SPECIALS = ("<pad>", "<bos>", "<eos>")
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
TASKS = ("copy", "reverse", "sort", "add", "text")


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


def is_held_out(source: str, fraction: float) -> bool:
    """Whether ``source`` belongs to the held-out split (a pure function of the string)."""
    h = int.from_bytes(hashlib.sha256(source.encode("utf-8")).digest()[:8], "big")
    return h < fraction * 2**64


def _pad(rows: list[list[int]]) -> Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [PAD_ID] * (width - len(r)) for r in rows], dtype=torch.long)


@dataclass(frozen=True)
class Seq2SeqBatch:
    """Padded ids: ``src [B, S]``; ``tgt_in = <bos> + target`` and ``tgt_out = target + <eos>``,
    both ``[B, T]``. Padding is ``PAD_ID`` everywhere."""

    src: Tensor
    tgt_in: Tensor
    tgt_out: Tensor

    @property
    def num_tokens(self) -> int:
        """Non-padding source + target tokens (what tokens/s counts)."""
        return int((self.src != PAD_ID).sum() + (self.tgt_out != PAD_ID).sum())

    def shard(self, rank: int, world_size: int) -> Seq2SeqBatch:
        """The contiguous slice of rows for one process."""
        sl = _shard_slice(self.src.shape[0], rank, world_size)
        return Seq2SeqBatch(self.src[sl], self.tgt_in[sl], self.tgt_out[sl])


@dataclass(frozen=True)
class LMBatch:
    """Padded ids ``inputs [B, T]`` and next-token ``targets [B, T]`` (``PAD_ID`` = ignore)."""

    inputs: Tensor
    targets: Tensor

    @property
    def num_tokens(self) -> int:
        """Non-padding target tokens."""
        return int((self.targets != PAD_ID).sum())

    def shard(self, rank: int, world_size: int) -> LMBatch:
        """The contiguous slice of rows for one process."""
        sl = _shard_slice(self.inputs.shape[0], rank, world_size)
        return LMBatch(self.inputs[sl], self.targets[sl])


def _shard_slice(B: int, rank: int, world_size: int) -> slice:
    if B % world_size != 0:
        raise ValueError(f"global batch size {B} is not divisible by world_size={world_size}")
    per = B // world_size
    return slice(rank * per, (rank + 1) * per)


def _step_rng(seed: int, step: int, what: str) -> random.Random:
    return random.Random(f"qkv:{what}:{seed}:{step}")  # str seeds hash with SHA-512: stable


class Seq2SeqTask:
    """Base of the sequence-to-sequence tasks: a vocabulary, a sampler and the correct answer.

    Subclasses define ``name``, ``vocab``, :meth:`sample_source` and :meth:`target`.
    """

    name = ""
    kind = "seq2seq"
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
        """JSON-serialisable arguments that rebuild this task (see :func:`task_from_spec`)."""
        raise NotImplementedError

    def _sample(self, rng: random.Random, held_out: bool) -> str:
        while True:
            src = self.sample_source(rng)
            if is_held_out(src, self.held_out_fraction) == held_out:
                return src

    def collate(self, sources: list[str]) -> Seq2SeqBatch:
        """Encode and pad ``sources`` with their correct targets."""
        tgts = [self.vocab.encode(self.target(s)) for s in sources]
        return Seq2SeqBatch(
            src=_pad([self.vocab.encode(s) for s in sources]),
            tgt_in=_pad([[BOS_ID, *t] for t in tgts]),
            tgt_out=_pad([[*t, EOS_ID] for t in tgts]),
        )

    def train_batch(self, seed: int, step: int, batch_size: int) -> Seq2SeqBatch:
        """The global training batch of ``step`` (held-out sources never appear)."""
        rng = _step_rng(seed, step, "train")
        return self.collate([self._sample(rng, held_out=False) for _ in range(batch_size)])

    def eval_sources(self, n: int, seed: int) -> list[str]:
        """Up to ``n`` distinct held-out sources (fewer only if the task has fewer)."""
        rng = _step_rng(seed, 0, "eval")
        found: dict[str, None] = {}
        for _ in range(200 * n):
            if len(found) == n:
                break
            found.setdefault(self._sample(rng, held_out=True))
        return list(found)


class _AlphabetTask(Seq2SeqTask):
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


class CopyTask(_AlphabetTask):
    """Output the input unchanged: ``"abc" -> "abc"``."""

    name = "copy"

    def target(self, source: str) -> str:
        return source


class ReverseTask(_AlphabetTask):
    """Output the input reversed: ``"abc" -> "cba"`` (cross-attention: the anti-diagonal)."""

    name = "reverse"

    def target(self, source: str) -> str:
        return source[::-1]


class SortTask(_AlphabetTask):
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
        if max_digits < 1:
            raise ValueError(f"max_digits must be >= 1, got {max_digits}")
        self.max_digits = max_digits
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


class TextTask:
    """Character-level language modelling on a UTF-8 text.

    Windows of ``block_size // 2`` to ``block_size`` characters (varying, so padding is used)
    are cut from the first ``1 - held_out_fraction`` of the text for training and from the rest
    for evaluation.

    Args:
        text: the corpus; None builds a task that can only encode and decode (a checkpoint's).
        block_size: longest window.
        held_out_fraction: tail share of the text kept for evaluation.
        symbols: the vocabulary (default: the sorted characters of ``text``); given when
            rebuilding the task of a checkpoint.

    Raises:
        ValueError: a text too short for two windows in each split.
    """

    name = "text"
    kind = "lm"

    def __init__(
        self,
        text: str | None,
        block_size: int = 64,
        held_out_fraction: float = 0.1,
        symbols: str | None = None,
    ) -> None:
        if block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {block_size}")
        self.block_size = block_size
        self.held_out_fraction = held_out_fraction
        if text is None:
            if symbols is None:
                raise ValueError("TextTask needs a text or its symbols")
            self.vocab = Vocab(tuple(symbols))
            self.train_text = self.eval_text = ""
            return
        self.vocab = Vocab(tuple(sorted(set(text))) if symbols is None else tuple(symbols))
        split = int(len(text) * (1.0 - held_out_fraction))
        self.train_text, self.eval_text = text[:split], text[split:]
        for name, part in (("training", self.train_text), ("held-out", self.eval_text)):
            if len(part) < block_size + 2:
                raise ValueError(
                    f"the text's {name} part has {len(part)} characters; block_size={block_size}"
                    f" needs at least {block_size + 2} (use a longer file or a smaller block)"
                )

    def spec(self) -> dict[str, Any]:
        """What a checkpoint stores to encode prompts later (the vocabulary, not the text)."""
        return {
            "name": self.name,
            "block_size": self.block_size,
            "symbols": "".join(self.vocab.symbols),
        }

    def _window(self, rng: random.Random, text: str) -> list[int]:
        n = rng.randint(max(2, self.block_size // 2), self.block_size) + 1
        start = rng.randrange(len(text) - n + 1)
        return self.vocab.encode(text[start : start + n])

    def _collate(self, windows: list[list[int]]) -> LMBatch:
        return LMBatch(
            inputs=_pad([w[:-1] for w in windows]), targets=_pad([w[1:] for w in windows])
        )

    def train_batch(self, seed: int, step: int, batch_size: int) -> LMBatch:
        """The global training batch of ``step``."""
        rng = _step_rng(seed, step, "train")
        return self._collate([self._window(rng, self.train_text) for _ in range(batch_size)])

    def eval_batch(self, n: int, seed: int) -> LMBatch:
        """``n`` windows of the held-out text."""
        rng = _step_rng(seed, 0, "eval")
        return self._collate([self._window(rng, self.eval_text) for _ in range(n)])


def make_task(
    name: str,
    *,
    text_path: str | Path | None = None,
    min_len: int = 1,
    max_len: int = 12,
    max_digits: int = 3,
    block_size: int = 64,
) -> Seq2SeqTask | TextTask:
    """Build a built-in task by name.

    Args:
        name: one of ``copy``, ``reverse``, ``sort``, ``add``, ``text``.
        text_path: the UTF-8 file of the ``text`` task.
        min_len: shortest sequence (copy/reverse/sort).
        max_len: longest sequence (copy/reverse/sort).
        max_digits: operand digits (add).
        block_size: longest window (text).

    Raises:
        ValueError: unknown name, or ``text`` without a file.
    """
    if name in ("copy", "reverse", "sort"):
        cls = {"copy": CopyTask, "reverse": ReverseTask, "sort": SortTask}[name]
        return cls(min_len=min_len, max_len=max_len)
    if name == "add":
        return AddTask(max_digits=max_digits)
    if name == "text":
        if text_path is None:
            raise ValueError("task 'text' needs a file: --text FILE")
        return TextTask(Path(text_path).read_text(encoding="utf-8"), block_size=block_size)
    raise ValueError(f"unknown task {name!r}; expected one of {', '.join(TASKS)}")


def task_from_spec(spec: dict[str, Any]) -> Seq2SeqTask | TextTask:
    """Rebuild the task a checkpoint was trained on from its :meth:`spec`.

    The text task comes back with its vocabulary and a placeholder corpus: enough to encode
    prompts and decode outputs, not to train.

    Raises:
        ValueError: an unknown task name or argument.
    """
    args = dict(spec)
    name = args.pop("name", None)
    if name in ("copy", "reverse", "sort"):
        return {"copy": CopyTask, "reverse": ReverseTask, "sort": SortTask}[name](**args)
    if name == "add":
        return AddTask(**args)
    if name == "text":
        return TextTask(None, block_size=int(args["block_size"]), symbols=str(args["symbols"]))
    raise ValueError(f"unknown task spec {spec!r}; expected name in {', '.join(TASKS)}")
