"""The batches an examination runs: the caller's texts padded left, right, alone, and altered.

Every batch follows the Hugging Face convention: ``mask`` ``[B, W]`` with 1 = token, 0 = padding.
A sample's *live* outputs are those at its tokens (for an encoder–decoder model, every decoder
position); the properties compare live outputs only, the j-th live output of sample i being "text
i, token j".

Shapes: B samples, W padded width, L_i live tokens of sample i, K decoder tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

import torch
from torch import Tensor

__all__ = ["Batch", "Samples", "Side", "other_tokens"]

Side = Literal["left", "right"]


@dataclass(frozen=True)
class Batch:
    """Token ids and their padding, as a model is called with them.

    Attributes:
        ids: ``[B, W]`` token ids.
        mask: ``[B, W]`` long, 1 = token, 0 = padding.
        decoder_ids: ``[B, K]`` decoder input ids of an encoder–decoder model (no padding), else
            None.
        name: what the batch is, for the reader ("left-padded batch").
    """

    ids: Tensor
    mask: Tensor
    decoder_ids: Tensor | None = None
    name: str = ""

    @property
    def positions(self) -> Tensor:
        """``[B, W]`` the position ids ``transformers``' ``generate`` computes: each token's index
        among its sample's tokens (padding gets 1, as there)."""
        pos = self.mask.long().cumsum(-1) - 1  # [B, W]
        return pos.masked_fill(self.mask == 0, 1)  # [B, W]

    def row(self, i: int) -> Batch:
        """Sample ``i`` alone, with the padding it has here: ``[1, W]``."""
        dec = None if self.decoder_ids is None else self.decoder_ids[i : i + 1]
        return Batch(self.ids[i : i + 1], self.mask[i : i + 1], dec, f"{self.name}, row {i} alone")

    def live(self, i: int) -> Tensor:
        """bool ``[W]``: the token positions of sample ``i``."""
        return self.mask[i].bool()


@dataclass(frozen=True)
class Samples:
    """The caller's samples as live token sequences, and how much padding each gets.

    Attributes:
        seqs: each sample's tokens ``[L_i]``, in order.
        pads: padding tokens sample i gets in the padded batches (width ``max(L_i + pads_i)``).
        pad_id: the id written at padded positions.
        decoder_ids: ``[B, K]`` decoder inputs (encoder–decoder models), else None.
    """

    seqs: tuple[Tensor, ...]
    pads: tuple[int, ...]
    pad_id: int
    decoder_ids: Tensor | None = None

    @classmethod
    def from_batch(
        cls, input_ids: Tensor, attention_mask: Tensor, pad_id: int | None
    ) -> tuple[Samples, list[str]]:
        """Read the samples of a checked ``[B, T]`` batch; make sure padding gets exercised.

        When no sample is padded (all of one length), sample i gets i padding tokens (a single
        sample gets one, and a second sample, its own tokens reversed, is added so that the
        batch has two rows); the notes say so.

        Args:
            input_ids: ``[B, T]`` token ids.
            attention_mask: ``[B, T]`` 1 = token, 0 = padding; each row's tokens contiguous.
            pad_id: the id for padded positions when the batch has none (default 0).

        Returns:
            ``(samples, notes)``.
        """
        mask = attention_mask.bool()  # [B, T]
        seqs = [input_ids[i][mask[i]] for i in range(input_ids.shape[0])]
        notes: list[str] = []
        if (~mask).any():
            pad_id = int(input_ids[~mask][0])
        elif pad_id is None:
            pad_id = 0
        if len(seqs) == 1:
            seqs.append(seqs[0].flip(0)[: max(1, len(seqs[0]) // 2)])
            notes.append("one text: a second sample (its first half, reversed) was added")
        lengths = [len(s) for s in seqs]
        width = max(lengths)
        pads = [width - n for n in lengths]
        if not any(pads):
            pads = list(range(len(seqs)))
            notes.append(f"no padding in the input: sample i was given i padding tokens ({pad_id})")
        return cls(tuple(seqs), tuple(pads), pad_id), notes

    @property
    def size(self) -> int:
        """B, the number of samples."""
        return len(self.seqs)

    def with_decoder(self, decoder_ids: Tensor) -> Samples:
        """The same samples with decoder inputs ``[B, K]``."""
        return replace(self, decoder_ids=decoder_ids)

    def padded(self, side: Side) -> Batch:
        """All samples, padded on ``side`` to the common width."""
        width = max(len(s) + p for s, p in zip(self.seqs, self.pads, strict=True))
        ids = self.seqs[0].new_full((self.size, width), self.pad_id)  # [B, W]
        mask = torch.zeros_like(ids)  # [B, W]
        for i, s in enumerate(self.seqs):
            start = width - len(s) if side == "left" else 0
            ids[i, start : start + len(s)] = s
            mask[i, start : start + len(s)] = 1
        return Batch(ids, mask, self.decoder_ids, f"{side}-padded batch")

    def same_length(self, i: int) -> tuple[int, ...]:
        """The texts as long as text ``i`` (itself included), in order."""
        return tuple(j for j, s in enumerate(self.seqs) if len(s) == len(self.seqs[i]))

    def unpadded(self, i: int) -> tuple[Batch, int]:
        """The texts as long as text ``i``, without padding (``[n, L_i]``; text i alone when no
        other text has its length), and the row of text ``i`` in it."""
        rows = list(self.same_length(i))
        ids = torch.stack([self.seqs[j] for j in rows])  # [n, L_i]
        dec = None if self.decoder_ids is None else self.decoder_ids[rows]
        L = len(self.seqs[i])
        name = f"text {i} alone" if len(rows) == 1 else f"the {len(rows)} texts of {L} tokens"
        return Batch(ids, torch.ones_like(ids), dec, name + ", unpadded"), rows.index(i)


def other_tokens(
    ids: Tensor, vocab_size: int | None, pool: Sequence[int], generator: torch.Generator
) -> Tensor:
    """For each id, a random id that differs from it: from ``[0, vocab_size)`` when the vocabulary
    is known, else from ``pool`` (the ids the caller's batch holds).

    Args:
        ids: any shape of token ids.
        vocab_size: the model's vocabulary, or None.
        pool: ids known to be valid, used when ``vocab_size`` is None.
        generator: the random generator (examinations are reproducible).

    Returns:
        ids of the same shape, each different from the one it replaces where at least two ids
        are available.
    """
    if vocab_size is not None and vocab_size > 1:
        shift = torch.randint(1, vocab_size, ids.shape, generator=generator)
        return (ids + shift.to(ids.device)) % vocab_size
    values = sorted(set(pool))
    if len(values) < 2:
        return ids.clone()
    table = torch.tensor(values, device=ids.device)  # [n]
    index = torch.searchsorted(table, ids.clamp(min=values[0]))
    index = index.clamp(max=len(values) - 1)
    shift = torch.randint(1, len(values), ids.shape, generator=generator).to(ids.device)
    return table[(index + shift) % len(values)]
