"""The language-model task (for :class:`qkv.DecoderOnlyLM`): characters of any UTF-8 text,
evaluated by next-character accuracy on the file's tail."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from qkv.distributed import ContextParallel
from qkv.models.config import DecoderOnlyConfig
from qkv.train.config import TrainConfig
from qkv.train.task import (
    EOS_ID,
    PAD_ID,
    SPECIALS,
    DecodeOptions,
    EvalSums,
    Vocab,
    loss_sum,
    model_width,
    pad_rows,
    sequence_shard,
    shard_slice,
    step_rng,
)

__all__ = ["LMBatch", "TextTask"]


@dataclass(frozen=True)
class LMBatch:
    """Padded ids ``inputs [B, T]`` and next-token ``targets [B, T]`` (``PAD_ID`` = ignore).
    With ``context_parallel`` set, both are this rank's shards (:meth:`context_shard`)."""

    inputs: Tensor
    targets: Tensor
    context_parallel: ContextParallel | None = None

    @property
    def num_tokens(self) -> int:
        """Non-padding target tokens."""
        return int((self.targets != PAD_ID).sum())

    def logits(self, model: nn.Module) -> Tensor:
        """Next-token scores ``[B, T, V]`` of a decoder-only ``model`` (this rank's shard under
        context parallelism)."""
        extra = {} if self.context_parallel is None else {"context_parallel": self.context_parallel}
        return model(self.inputs, padding_mask=self.inputs == PAD_ID, **extra)  # [B, T, V]

    def shard(self, rank: int, world_size: int) -> LMBatch:
        """The contiguous slice of rows for one process."""
        sl = shard_slice(self.inputs.shape[0], rank, world_size)
        return LMBatch(self.inputs[sl], self.targets[sl], self.context_parallel)

    def context_shard(self, setting: ContextParallel) -> LMBatch:
        """This rank's shards of ``inputs`` and ``targets`` (see
        :func:`~qkv.train.task.sequence_shard`), run context-parallel in ``setting``."""
        return LMBatch(
            sequence_shard(self.inputs, setting),  # [B, T_local]
            sequence_shard(self.targets, setting),  # [B, T_local]
            setting,
        )


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
    model_type = "decoder_only"
    metric = "next-char accuracy"

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
            inputs=pad_rows([w[:-1] for w in windows]), targets=pad_rows([w[1:] for w in windows])
        )

    def train_batch(self, seed: int, step: int, batch_size: int) -> LMBatch:
        """The global training batch of ``step``."""
        rng = step_rng(seed, step, "train")
        return self._collate([self._window(rng, self.train_text) for _ in range(batch_size)])

    def eval_batch(self, n: int, seed: int) -> LMBatch:
        """``n`` windows of the held-out text."""
        rng = step_rng(seed, 0, "eval")
        return self._collate([self._window(rng, self.eval_text) for _ in range(n)])

    def model_config(self, cfg: TrainConfig) -> dict[str, Any]:
        """A :class:`~qkv.models.config.DecoderOnlyConfig` dict sized by ``cfg``, with room for a
        whole window plus the target shift."""
        return DecoderOnlyConfig(
            vocab_size=self.vocab.size,
            num_layers=cfg.num_layers,
            max_positions=self.block_size + 1,
            pad_id=PAD_ID,
            eos_id=EOS_ID,
            **model_width(cfg),
        ).to_dict()

    @torch.no_grad()
    def held_out_sums(
        self, model: nn.Module, n: int, seed: int, rank: int, world_size: int
    ) -> EvalSums:
        """Next-character accuracy and loss over this process's rows of ``n`` held-out windows."""
        full = self.eval_batch(n, seed)
        rows = list(range(rank, full.inputs.shape[0], world_size))
        part = LMBatch(full.inputs[rows], full.targets[rows])
        total, tokens = loss_sum(model, part)
        logits = part.logits(model)  # [B, T, V]
        keep = part.targets != PAD_ID  # [B, T]
        correct = int((logits.argmax(-1) == part.targets)[keep].sum())
        return EvalSums(correct=correct, count=tokens, loss=float(total), tokens=tokens)

    @torch.no_grad()
    def generate(self, model: nn.Module, ids: list[int], options: DecodeOptions) -> list[int]:
        """Continue the prompt ``ids`` greedily or by sampling; by default with what fits in the
        model's ``max_positions`` after the prompt (at most the block size, at least one token).

        Raises:
            ValueError: ``beam_size != 1`` (beam search is for sequence tasks).
        """
        if options.beam_size != 1:
            raise ValueError(
                f"beam_size={options.beam_size}: beam search is for sequence tasks; "
                "text models decode greedily or by sampling"
            )
        room = int(model.config.max_positions) - len(ids)  # type: ignore[union-attr,arg-type]
        n = options.max_new_tokens
        n = max(1, min(self.block_size, room)) if n is None else n
        prompt = torch.tensor([ids])  # [1, P]
        pad = torch.zeros_like(prompt, dtype=torch.bool)  # [1, P] every prompt token is real
        out = model.generate(  # type: ignore[operator]
            prompt, n, padding_mask=pad, **{"eos_id": EOS_ID, **options.text_kwargs()}
        )  # [1, P + n']
        return list(out[0, len(ids) :].tolist())

    def teacher_forced_ids(self, text: str, generated: list[int]) -> tuple[None, list[int]]:
        """No source; the prompt's ids followed by the continuation's (without ``<eos>``)."""
        return None, self.vocab.encode(text) + [i for i in generated if i >= len(SPECIALS)]
