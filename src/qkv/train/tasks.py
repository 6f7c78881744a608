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

from pathlib import Path
from typing import Any

from qkv.train.config import TASKS, TrainConfig
from qkv.train.seq2seq import (
    AddTask,
    AlphabetTask,
    CopyTask,
    ReverseTask,
    Seq2SeqBatch,
    Seq2SeqTask,
    SortTask,
)
from qkv.train.task import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    SPECIALS,
    Batch,
    Task,
    Vocab,
    is_held_out,
)
from qkv.train.text import LMBatch, TextTask

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "PAD_ID",
    "SPECIALS",
    "TASKS",
    "AddTask",
    "AlphabetTask",
    "Batch",
    "CopyTask",
    "LMBatch",
    "ReverseTask",
    "Seq2SeqBatch",
    "Seq2SeqTask",
    "SortTask",
    "Task",
    "TextTask",
    "Vocab",
    "build_task",
    "is_held_out",
    "make_task",
    "task_from_spec",
]

_ALPHABET_TASKS: dict[str, type[AlphabetTask]] = {
    "copy": CopyTask,
    "reverse": ReverseTask,
    "sort": SortTask,
}


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
    if name in _ALPHABET_TASKS:
        return _ALPHABET_TASKS[name](min_len=min_len, max_len=max_len)
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
    if name in _ALPHABET_TASKS:
        return _ALPHABET_TASKS[name](**args)
    if name == "add":
        return AddTask(**args)
    if name == "text":
        return TextTask(None, block_size=int(args["block_size"]), symbols=str(args["symbols"]))
    raise ValueError(f"unknown task spec {spec!r}; expected name in {', '.join(TASKS)}")


def build_task(cfg: TrainConfig) -> Seq2SeqTask | TextTask:
    """The built-in task ``cfg.task``, sized by ``cfg``.

    Raises:
        ValueError: as :func:`make_task`.
    """
    return make_task(
        cfg.task,
        text_path=cfg.text_path,
        min_len=cfg.min_len,
        max_len=cfg.max_len,
        max_digits=cfg.max_digits,
        block_size=cfg.block_size,
    )
