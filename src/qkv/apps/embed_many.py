"""Many sentences for ``qkv embed``: read in batches, printed as embeddings or nearest neighbours.

The similarity matrix of :func:`qkv.apps.embed.format_embed` is N² numbers: 2,000 sentences
printed 32 MB and peaked at 534 MB. Here memory grows linearly in N at most: ``--embeddings``
prints each batch's rows as soon as they are encoded (memory of one batch), and ``--top-k``
keeps the ``[N, D]`` embeddings and compares them a block of rows at a time (``[block, N]``
similarities, never ``[N, N]``). Sentences come from arguments, a UTF-8 file (one per line) or
standard input (``-``), in batches; a bar on stderr shows the progress on a terminal.

Shapes: N sentences, D embedding width.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import TextIO

import torch
from torch import Tensor
from tqdm import tqdm

from qkv.apps.embed import SentenceEmbedder

__all__ = [
    "MAX_MATRIX",
    "batched",
    "check_text",
    "nearest",
    "read_lines",
    "write_embeddings",
    "write_neighbours",
]

MAX_MATRIX = 100
"""The most sentences the N x N similarity matrix is printed for."""
_BLOCK = 256  # rows of the similarity compared at once by nearest()


def check_text(text: str, what: str) -> str:
    """``text`` if it is valid Unicode text (encodable as UTF-8).

    Command-line arguments that are not valid UTF-8 reach Python as lone surrogates
    (``'\\udce9'`` for the byte 0xe9), which the tokenizer refuses with a message about its
    input types; this says which argument, and which byte.

    Raises:
        ValueError: a lone surrogate, named with ``what`` and its position.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        bad = text[err.start]
        code = ord(bad)
        byte = f"the byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"{bad!r}"
        raise ValueError(
            f"{what} is not valid UTF-8 text: {byte} at position {err.start} ({text!r})"
        ) from None
    return text


def read_lines(source: str) -> Iterator[str]:
    """The non-blank lines of a UTF-8 file, or of standard input for ``"-"``, one at a time.

    Raises:
        OSError: the file cannot be opened.
        ValueError: a line that is not UTF-8, named with the file, line number and byte.
    """
    name = "standard input" if source == "-" else source
    stream = sys.stdin.buffer if source == "-" else open(source, "rb")  # noqa: SIM115
    try:
        for number, raw in enumerate(stream, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(
                    f"{name} line {number} is not valid UTF-8: the byte "
                    f"0x{raw[err.start]:02x} at column {err.start + 1}"
                ) from None
            line = line.rstrip("\r\n")
            if line.strip():
                yield line
    finally:
        if stream is not sys.stdin.buffer:
            stream.close()


def batched(items: Iterable[str], size: int) -> Iterator[list[str]]:
    """``items`` in lists of ``size`` (the last one shorter)."""
    batch: list[str] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _bar(total: int | None) -> tqdm:
    return tqdm(
        total=total,
        unit=" sentences",
        desc="embed",
        file=sys.stderr,
        disable=not sys.stderr.isatty(),  # a redrawn bar is for a terminal, not a log
        dynamic_ncols=True,
    )


def write_embeddings(
    embedder: SentenceEmbedder, sentences: Iterable[str], out: TextIO, total: int | None = None
) -> int:
    """Print one line per sentence: its D embedding values (unit length), space-separated.

    Each batch is printed as soon as it is encoded, so memory is that of one batch.

    Returns:
        The number of sentences.
    """
    n = 0
    with _bar(total) as bar:
        for batch in batched(sentences, embedder.batch_size):
            rows = embedder.encode(batch)  # [b, D]
            out.write("".join(" ".join(f"{x:.7g}" for x in r) + "\n" for r in rows.tolist()))
            n += len(batch)
            bar.update(len(batch))
    return n


def nearest(embeddings: Tensor, k: int, block: int = _BLOCK) -> tuple[Tensor, Tensor]:
    """Each row's ``k`` most similar other rows (cosine of unit vectors), ``block`` rows at once.

    Args:
        embeddings: ``[N, D]`` unit-length rows.
        k: neighbours per row (at most ``N - 1`` are returned).
        block: rows compared at once: memory ``block x N``, never ``N x N``.

    Returns:
        ``(similarity [N, k'], index [N, k'])``, most similar first, ``k' = min(k, N - 1)``.
    """
    N = embeddings.shape[0]
    kk = min(k, N - 1)
    sims, idx = [], []
    for start in range(0, N, block):
        rows = embeddings[start : start + block]  # [b, D]
        sim = rows @ embeddings.T  # [b, N]
        own = torch.arange(rows.shape[0])
        sim[own, start + own] = float("-inf")  # not its own neighbour
        top = sim.topk(kk, dim=1)  # [b, k']
        sims.append(top.values)
        idx.append(top.indices)
    return torch.cat(sims), torch.cat(idx)  # [N, k']


def write_neighbours(
    embedder: SentenceEmbedder,
    sentences: Iterable[str],
    k: int,
    out: TextIO,
    total: int | None = None,
) -> int:
    """Print each sentence (``[i] text``) and its ``k`` nearest others with their cosine.

    Returns:
        The number of sentences.
    """
    texts: list[str] = []
    chunks: list[Tensor] = []
    with _bar(total) as bar:
        for batch in batched(sentences, embedder.batch_size):
            chunks.append(embedder.encode(batch))  # [b, D]
            texts += batch
            bar.update(len(batch))
    if not texts:
        raise ValueError("no sentences to compare (the input holds no non-blank line)")
    if len(texts) < 2:
        raise ValueError("--top-k needs at least two sentences, got one")
    sims, idx = nearest(torch.cat(chunks), k)  # [N, k']
    for i, text in enumerate(texts):
        lines = [f"[{i + 1}] {text}"]
        lines += [
            f"    {s:.4f}  [{j + 1}] {texts[j]}"
            for s, j in zip(sims[i].tolist(), idx[i].tolist(), strict=True)
        ]
        out.write("\n".join(lines) + "\n")
    return len(texts)
