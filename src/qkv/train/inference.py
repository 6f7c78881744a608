"""Decode with a trained checkpoint: what ``qkv generate`` runs."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from qkv.train.checkpoint import Checkpoint, CheckpointError, build_model, load_checkpoint
from qkv.train.task import DecodeOptions, Task
from qkv.train.tasks import task_from_spec

__all__ = ["Generation", "generate_text", "load_trained"]


def load_trained(path: str | Path) -> tuple[nn.Module, Task, Checkpoint]:
    """The model (in eval mode) and task of a checkpoint directory, weights verified.

    Raises:
        CheckpointError: see :func:`qkv.train.checkpoint.load_checkpoint`, and a config/weights
            mismatch naming the key and both shapes.
    """
    ckpt = load_checkpoint(path)
    try:
        task = task_from_spec(ckpt.task)
    except (ValueError, TypeError, KeyError) as err:
        raise CheckpointError(f"{ckpt.path}: the task in config.json is invalid: {err}") from None
    return build_model(ckpt).eval(), task, ckpt


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
    task: Task,
    text: str,
    *,
    beam_size: int = 1,
    max_new_tokens: int | None = None,
    temperature: float = 1.0,
    top_k: int | None = None,
    greedy: bool = True,
    seed: int = 0,
) -> Generation:
    """Decode ``text`` with the model's KV-cached ``generate``, as the task decodes
    (:meth:`qkv.train.task.Task.generate`), and time it.

    Args:
        model: the task's model: a ``Transformer`` (sequence tasks) or ``DecoderOnlyLM`` (text).
        task: the checkpoint's task (its vocabulary encodes ``text``).
        text: the input (sequence tasks) or the prompt (text).
        beam_size: beam search width for sequence tasks (1: greedy).
        max_new_tokens: default: the task's longest target + 1, or for text what fits in the
            model's ``max_positions`` after the prompt (at most the block size).
        temperature: sampling temperature (text, when not ``greedy``).
        top_k: sample among the k likeliest (text, when not ``greedy``).
        greedy: text models: argmax decoding instead of sampling.
        seed: the sampling generator's seed.

    Returns:
        The decoded :class:`Generation`.

    Raises:
        ValueError: an empty input, a character outside the vocabulary, ``beam_size < 1``, or
            beam search asked of a text model.
        TypeError: a ``beam_size`` that is not an int.
    """
    options = DecodeOptions(beam_size, max_new_tokens, temperature, top_k, greedy, seed)
    ids = task.vocab.encode(text)
    if not ids:
        raise ValueError("the input text is empty")
    t0 = time.perf_counter()
    with torch.no_grad():
        new = task.generate(model, ids, options)
    seconds = time.perf_counter() - t0
    return Generation(
        text=task.vocab.decode(new),
        ids=new,
        seconds=seconds,
        tokens_per_s=len(new) / seconds if seconds > 0 else 0.0,
    )
