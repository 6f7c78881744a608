"""Decode with a trained checkpoint or a Hugging Face decoder: what ``qkv generate`` runs."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal, Unpack

import torch
from tokenizers import Tokenizer
from torch import Tensor, nn

from qkv.convert.hf_load import load_hf
from qkv.models.decoder_only import DecoderOnlyLM
from qkv.train.checkpoint import (
    FORMAT,
    MANIFEST,
    Checkpoint,
    CheckpointError,
    build_model,
    load_checkpoint,
)
from qkv.train.task import DecodeKwargs, DecodeOptions, SamplingKwargs, Task
from qkv.train.tasks import task_from_spec

__all__ = [
    "HF_DEFAULT_NEW_TOKENS",
    "TOKENIZER_FILE",
    "Generation",
    "checkpoint_kind",
    "generate_hf",
    "generate_text",
    "load_hf_decoder",
    "load_trained",
]

TOKENIZER_FILE = "tokenizer.json"
HF_DEFAULT_NEW_TOKENS = 32
"""Tokens a Hugging Face decoder generates when ``max_new_tokens`` is not given (at most what
fits in its ``max_position_embeddings``)."""


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

    @classmethod
    def timed(cls, text: str, ids: list[int], seconds: float) -> Generation:
        """The output of a decode that took ``seconds``, its speed computed."""
        return cls(text, ids, seconds, len(ids) / seconds if seconds > 0 else 0.0)


def generate_text(
    model: nn.Module,
    task: Task,
    text: str,
    **options: Unpack[DecodeKwargs],
) -> Generation:
    """Decode ``text`` with the model's KV-cached ``generate``, as the task decodes
    (:meth:`qkv.train.task.Task.generate`), and time it.

    Args:
        model: the task's model: a ``Transformer`` (sequence tasks) or ``DecoderOnlyLM`` (text).
        task: the checkpoint's task (its vocabulary encodes ``text``).
        text: the input (sequence tasks) or the prompt (text).
        **options: the fields of :class:`~qkv.train.task.DecodeOptions` (``beam_size``,
            ``max_new_tokens``, ``temperature``, ``top_k``, ``greedy``, ``seed``), with its
            defaults. ``max_new_tokens`` default: the task's longest target + 1, or for text
            what fits in the model's ``max_positions`` after the prompt (at most the block size).

    Returns:
        The decoded :class:`Generation`.

    Raises:
        ValueError: an empty input, a character outside the vocabulary, ``beam_size < 1``, or
            beam search asked of a text model.
        TypeError: a ``beam_size`` that is not an int, an unknown option.
    """
    decode = DecodeOptions(**options)
    ids = task.vocab.encode(text)
    if not ids:
        raise ValueError("the input text is empty")
    t0 = time.perf_counter()
    with torch.no_grad():
        new = task.generate(model, ids, decode)
    return Generation.timed(task.vocab.decode(new), new, time.perf_counter() - t0)


def checkpoint_kind(path: str | Path) -> Literal["qkv", "hf"]:
    """Whether ``path`` is a qkv checkpoint (``config.json`` with qkv's manifest ``format``) or a
    Hugging Face ``save_pretrained`` directory (``config.json`` with a ``model_type``).

    Paths this cannot decide (no directory, a ``config.json`` that does not parse, pickle files)
    count as qkv's, so that :func:`load_trained` says precisely what is wrong with them.

    Raises:
        ValueError: a directory that is clearly neither (no ``config.json``, or one with neither
            key).
    """
    root = Path(path)
    if not root.is_dir():
        return "qkv"
    try:
        data = json.loads((root / MANIFEST).read_text(encoding="utf-8"))
    except FileNotFoundError:
        data = None
    except (json.JSONDecodeError, UnicodeDecodeError, OSError):
        return "qkv"
    if isinstance(data, dict) and data.get("format") == FORMAT:
        return "qkv"
    if isinstance(data, dict) and "model_type" in data:
        return "hf"
    if any(root.glob("*.bin")) or any(root.glob("*.pt")):
        return "qkv"  # load_checkpoint explains why pickles are refused
    why = (
        f"it has no {MANIFEST}"
        if data is None
        else f"its {MANIFEST} has neither 'format': {FORMAT!r} nor a 'model_type'"
    )
    raise ValueError(
        f"{str(root)!r} is neither a qkv checkpoint nor a Hugging Face save_pretrained "
        f"directory: {why}"
    )


def load_hf_decoder(path: str | Path) -> tuple[DecoderOnlyLM, Tokenizer | None]:
    """A Hugging Face decoder directory as a qkv :class:`DecoderOnlyLM` (eval mode, float32) and
    its ``tokenizer.json`` when there is one.

    Raises:
        FileNotFoundError / ValueError: see :func:`qkv.convert.load_hf`; a model that does not
            generate (``bert``); a ``tokenizer.json`` that ``tokenizers`` cannot read.
    """
    root = Path(path)
    model = load_hf(root)
    if not isinstance(model, DecoderOnlyLM):
        raise ValueError(
            f"{str(root)!r} holds a {type(model).__name__}, an encoder, which does not generate "
            "(qkv embed uses it); qkv generate needs a llama, qwen2, mistral or gpt2 directory"
        )
    file = root / TOKENIZER_FILE
    if not file.is_file():
        return model, None
    try:
        return model, Tokenizer.from_file(str(file))
    except Exception as err:  # tokenizers raises plain Exceptions for malformed files
        raise ValueError(f"{file} is not a tokenizer file tokenizers can read: {err}") from None


def _prompt_ids(prompt: str, tokenizer: Tokenizer | None, vocab_size: int) -> list[int]:
    if tokenizer is not None:
        ids = list(tokenizer.encode(prompt).ids)
        if not ids:
            raise ValueError(f"the prompt {prompt!r} encodes to no tokens")
        return ids
    words = prompt.split()
    bad = [w for w in words if not w.isdigit() or int(w) >= vocab_size]
    if not words or bad:
        raise ValueError(
            f"without a {TOKENIZER_FILE} the prompt must be space-separated token ids in "
            f"[0, {vocab_size}), got {prompt!r}" + (f" (bad: {' '.join(bad[:5])})" if bad else "")
        )
    return [int(w) for w in words]


def generate_hf(
    model: DecoderOnlyLM,
    tokenizer: Tokenizer | None,
    prompt: str,
    *,
    on_text: Callable[[str], object] | None = None,
    beam_size: int = 1,
    compile: bool = False,
    **options: Unpack[SamplingKwargs],
) -> Generation:
    """Continue ``prompt`` with a model from :func:`load_hf_decoder`, KV-cached, and time it.

    Args:
        model: the decoder.
        tokenizer: encodes the prompt and decodes the output; None: the prompt is space-separated
            token ids and the output is printed as ids.
        prompt: text, or ids (see ``tokenizer``).
        on_text: called with each new piece of the output text as soon as its tokens are
            generated (streaming); the pieces join to :attr:`Generation.text`. Beam search
            knows its text only at the end: one call with all of it.
        beam_size: K > 1: beam search (greedy options only: ``max_new_tokens`` and
            ``eos_ids``; see :meth:`DecoderOnlyLM.generate`).
        compile: decode on a static KV cache with the step compiled (``torch.compile``; the
            first call with a new batch size or cache capacity pays the compilation).
        **options: the fields of :class:`~qkv.train.task.DecodeOptions` but ``beam_size``.
            ``max_new_tokens`` default: :data:`HF_DEFAULT_NEW_TOKENS`, at most what fits in the
            model's ``max_positions``; generation stops after the config's ``eos_token_id``
            unless ``eos_ids`` are given.

    Returns:
        The :class:`Generation` (``text``: the continuation only).

    Raises:
        ValueError: an empty prompt, ids outside the vocabulary (no tokenizer), a prompt that
            leaves no room in ``max_positions``, beam search with a sampling option or with
            ``compile``; see :meth:`DecoderOnlyLM.generate`.
    """
    c = model.config
    decode = DecodeOptions(beam_size=beam_size, **options)
    kwargs = _hf_generate_kwargs(decode, compile)
    ids = _prompt_ids(prompt, tokenizer, c.vocab_size)
    n = decode.max_new_tokens
    if n is None:
        n = min(HF_DEFAULT_NEW_TOKENS, c.max_positions - len(ids))
        if n < 1:
            raise ValueError(
                f"the prompt has {len(ids)} tokens: no room left in max_positions={c.max_positions}"
            )
    pieces = _TextPieces(tokenizer, on_text)
    prompt_ids = torch.tensor([ids])  # [1, P]
    t0 = time.perf_counter()
    stream = on_text is not None and beam_size == 1
    with torch.no_grad():
        out = model.generate(
            prompt_ids,
            n,
            padding_mask=torch.zeros_like(prompt_ids, dtype=torch.bool),  # no padding
            streamer=pieces.add if stream else None,
            **kwargs,
        )  # [1, P + n']
    seconds = time.perf_counter() - t0
    new = [int(i) for i in out[0, len(ids) :].tolist()]
    if on_text is not None and not stream:  # beam search: the best hypothesis, at the end
        pieces.ids.extend(new)
    pieces.flush()
    return Generation.timed(_decode(tokenizer, new), new, seconds)


def _hf_generate_kwargs(decode: DecodeOptions, compile: bool) -> dict[str, Any]:
    """:meth:`DecoderOnlyLM.generate`'s keywords for ``decode`` (sampling or greedy options;
    beam search: the stop ids only, the other options refused by name)."""
    if decode.beam_size == 1:
        return {**decode.text_kwargs(), "compile": compile}
    default = DecodeOptions(beam_size=decode.beam_size, max_new_tokens=decode.max_new_tokens)
    given = [
        f"{f.name}={getattr(decode, f.name)!r}"
        for f in fields(DecodeOptions)
        if f.name not in ("seed", "eos_ids") and getattr(decode, f.name) != getattr(default, f.name)
    ]
    given += ["compile=True"] if compile else []
    if given:
        raise ValueError(
            f"beam_size={decode.beam_size} decodes greedily and takes max_new_tokens and eos_ids "
            f"only; got {', '.join(given)}"
        )
    stops = {} if decode.eos_ids is None else {"eos_id": list(decode.eos_ids)}
    return {"beam_size": decode.beam_size, **stops}


def _decode(tokenizer: Tokenizer | None, ids: list[int]) -> str:
    return tokenizer.decode(ids) if tokenizer is not None else " ".join(map(str, ids))


class _TextPieces:
    """Turns a one-row stream of tokens into new pieces of text.

    The whole output is decoded again after each token and only what was not yet handed out is
    passed on; text that may still change (an incomplete UTF-8 character, decoded as U+FFFD) is
    held back until the next token or :meth:`flush`.
    """

    def __init__(self, tokenizer: Tokenizer | None, on_text: Callable[[str], object] | None):
        self.tokenizer = tokenizer
        self.on_text = on_text
        self.ids: list[int] = []
        self.sent = ""

    def add(self, step: Tensor) -> None:
        """Take one step's token (``[1]``) and pass on the text it completes."""
        self.ids.append(int(step[0]))
        self._send(final=False)

    def flush(self) -> None:
        """Pass on whatever is still held back."""
        self._send(final=True)

    def _send(self, *, final: bool) -> None:
        if self.on_text is None:
            return
        text = _decode(self.tokenizer, self.ids)
        if not text.startswith(self.sent) or (text.endswith("\ufffd") and not final):
            return
        piece, self.sent = text[len(self.sent) :], text
        if piece:
            self.on_text(piece)
