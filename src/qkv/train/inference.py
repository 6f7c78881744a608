"""Decode with a trained checkpoint: what ``qkv generate`` runs."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from qkv.models.registry import load_weights, model_from_config
from qkv.train.checkpoint import Checkpoint, CheckpointError, load_checkpoint
from qkv.train.tasks import BOS_ID, EOS_ID, PAD_ID, Seq2SeqTask, TextTask, task_from_spec

__all__ = ["Generation", "generate_text", "load_trained"]


def load_trained(path: str | Path) -> tuple[nn.Module, Seq2SeqTask | TextTask, Checkpoint]:
    """The model (in eval mode) and task of a checkpoint directory, weights verified.

    Raises:
        CheckpointError: see :func:`qkv.train.checkpoint.load_checkpoint`, and a config/weights
            mismatch naming the key and both shapes.
    """
    ckpt = load_checkpoint(path)
    model = model_from_config(ckpt.model_type, ckpt.model_config)
    try:
        load_weights(model, ckpt.weights, str(ckpt.path))  # maps qkv 0.1 keys, then strict
    except ValueError as err:
        raise CheckpointError(str(err)) from None
    return model.eval(), task_from_spec(ckpt.task), ckpt


@dataclass(frozen=True)
class Generation:
    """One decoded output.

    Attributes:
        text: the output (for text models, the prompt's continuation only).
        ids: the generated ids (without ``<bos>``/the prompt).
        seconds: decoding wall time.
        tokens_per_s: generated tokens per second.
    """

    text: str
    ids: list[int]
    seconds: float
    tokens_per_s: float


def generate_text(
    model: nn.Module,
    task: Seq2SeqTask | TextTask,
    text: str,
    *,
    beam_size: int = 1,
    max_new_tokens: int | None = None,
    temperature: float = 1.0,
    top_k: int | None = None,
    greedy: bool = True,
    seed: int = 0,
) -> Generation:
    """Decode ``text`` with the model's KV-cached ``generate``.

    Args:
        model: a ``Transformer`` (sequence tasks) or ``DecoderOnlyLM`` (text).
        task: the checkpoint's task (its vocabulary encodes ``text``).
        text: the input (sequence tasks) or the prompt (text).
        beam_size: beam search width for sequence tasks (1: greedy).
        max_new_tokens: default: the task's longest target + 1, or for text what fits in the
            model's ``max_len`` after the prompt (at most the block size).
        temperature: sampling temperature (text, when not ``greedy``).
        top_k: sample among the k likeliest (text, when not ``greedy``).
        greedy: text models: argmax decoding instead of sampling.
        seed: the sampling generator's seed.

    Raises:
        ValueError: an empty input, a character outside the vocabulary, ``beam_size < 1``, or
            beam search asked of a text model.
    """
    if beam_size < 1:
        raise ValueError(f"beam_size must be >= 1, got {beam_size}")
    ids = task.vocab.encode(text)
    if not ids:
        raise ValueError("the input text is empty")
    t0 = time.perf_counter()
    with torch.no_grad():
        if isinstance(task, TextTask):
            if beam_size != 1:
                raise ValueError(
                    f"beam_size={beam_size}: beam search is for sequence tasks; "
                    "text models decode greedily or by sampling"
                )
            room = int(model.config.max_len) - len(ids)  # type: ignore[union-attr,arg-type]
            n = max(1, min(task.block_size, room)) if max_new_tokens is None else max_new_tokens
            gen = torch.Generator().manual_seed(seed)
            out = model.generate(  # type: ignore[operator]
                torch.tensor([ids]),
                n,
                temperature=temperature,
                top_k=top_k,
                greedy=greedy,
                eos_id=EOS_ID,
                generator=gen,
            )
            new = out[0, len(ids) :].tolist()  # [n]
        else:
            n = task.max_tgt_len + 1 if max_new_tokens is None else max_new_tokens
            src = torch.tensor([ids])  # [1, S]
            out = model.generate(  # type: ignore[operator]
                src, n, src_padding_mask=src == PAD_ID, beam_size=beam_size
            )  # [1, L]
            new = [i for i in out[0].tolist() if i != PAD_ID]
            new = new[1:] if new and new[0] == BOS_ID else new
    seconds = time.perf_counter() - t0
    return Generation(
        text=task.vocab.decode(new),
        ids=new,
        seconds=seconds,
        tokens_per_s=len(new) / seconds if seconds > 0 else 0.0,
    )
