"""``qkv.doctor.examine``: prove a model's attention invariances by metamorphic probes.

Some attention bugs show in no single call, only in how the model behaves across calls: a causal
mask off by one, positions not shifted for left padding, a mask dropped or broadcast across the
batch, a KV cache whose steps drift from the full forward, a custom kernel that disagrees with
eager. :func:`examine` runs the model on the caller's texts rearranged in ways that must not
change the live outputs (alone, padded left and right, other pad ids, other future tokens,
cached steps, other attention implementations) and reports each property of
:data:`~qkv.doctor.examination.PROPERTIES` with its worst error and the bound measured on the model
itself (see :mod:`qkv.doctor.session`).

Shapes: B batch, T tokens.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from qkv.doctor.batches import Samples
from qkv.doctor.examination import Examination, Property
from qkv.doctor.probes import Kind, adapter_for
from qkv.doctor.properties import PROBES
from qkv.doctor.restore import evaluating
from qkv.doctor.session import Session

__all__ = ["DECODER_TOKENS", "examine", "examine_texts"]

DECODER_TOKENS = 8
"""Decoder input length of an encoder–decoder examination (the start token, then random ids)."""


def _check_inputs(input_ids: object, attention_mask: object) -> tuple[Tensor, Tensor]:
    if not isinstance(input_ids, Tensor) or input_ids.dtype not in (torch.int32, torch.int64):
        got = input_ids.dtype if isinstance(input_ids, Tensor) else type(input_ids).__name__
        raise TypeError(f"input_ids must be an int32/int64 tensor of token ids, got {got}")
    if input_ids.dim() != 2 or input_ids.numel() == 0:
        raise ValueError(f"input_ids must be [B, T] with B, T >= 1, got {list(input_ids.shape)}")
    if attention_mask is None:
        return input_ids, torch.ones_like(input_ids)
    if not isinstance(attention_mask, Tensor):
        raise TypeError(f"attention_mask must be a tensor or None, got {type(attention_mask)}")
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask must have the shape of input_ids {list(input_ids.shape)}, got "
            f"{list(attention_mask.shape)}"
        )
    mask = attention_mask.long()
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("attention_mask must hold 1 (token) and 0 (padding) only")
    if not bool(mask.any(dim=1).all()):
        empty = int((~mask.bool().any(dim=1)).nonzero()[0, 0])
        raise ValueError(f"attention_mask row {empty} has no token: every sample needs one")
    before = torch.cat([torch.zeros_like(mask[:, :1]), mask[:, :-1]], dim=1)  # [B, T]
    runs = ((mask == 1) & (before == 0)).sum(dim=1)  # [B] runs of tokens per row
    if bool((runs > 1).any()):
        row = int((runs > 1).nonzero()[0, 0])
        raise ValueError(
            f"attention_mask row {row} is not padding: its tokens must be one contiguous run, "
            f"padded on the left or the right, got {mask[row].tolist()}"
        )
    return input_ids, mask


def examine(
    model: Any,
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    *,
    kind: Kind | None = None,
) -> Examination:
    """Check a model's attention invariances on a batch of texts.

    The model runs in eval mode; its training flags, dtype, ``requires_grad`` flags and
    ``transformers`` attention implementation are restored afterwards. A probe that raises or
    returns NaN fails its property with the error in ``detail``; the examination itself raises
    only for bad arguments.

    Args:
        model: a ``transformers`` model (causal LM, encoder, encoder–decoder), a qkv model
            (``DecoderOnlyLM``, ``Transformer``, ``BertEncoder``), or any callable
            ``model(input_ids, attention_mask=...)`` returning ``[B, T, ...]`` or a ModelOutput.
        input_ids: ``[B, T]`` token ids; for an encoder–decoder model, the encoder input (the
            decoder gets its start token and random ids).
        attention_mask: ``[B, T]`` 1 = token, 0 = padding (left or right), or None (no padding;
            the examination then pads the samples itself).
        kind: ``"causal-lm"``, ``"encoder"`` or ``"seq2seq"``; inferred for ``transformers``
            and qkv models, required for other callables.

    Returns:
        The :class:`~qkv.doctor.examination.Examination`: one
        :class:`~qkv.doctor.examination.Property` per property.

    Raises:
        TypeError: ids that are not an integer tensor, a mask that is not a tensor, a model that
            is not callable.
        ValueError: ids not ``[B, T]``, a mask of another shape or with values other than 0 / 1,
            a sample without tokens or with holes, an unknown kind or one that cannot be inferred.
    """
    input_ids, mask = _check_inputs(input_ids, attention_mask)
    adapter = adapter_for(model, kind)
    samples, notes = Samples.from_batch(input_ids, mask, adapter.pad_id)
    if adapter.kind == "seq2seq":
        g = torch.Generator().manual_seed(1)
        vocab = adapter.decoder_vocab_size or int(input_ids.max()) + 1
        dec = torch.randint(0, vocab, (samples.size, DECODER_TOKENS), generator=g)
        dec[:, 0] = adapter.decoder_start
        samples = samples.with_decoder(dec.to(input_ids.device))
        notes.append(f"decoder input: the start token {adapter.decoder_start}, then random ids")
    session = Session(adapter, samples)
    properties: dict[str, Property] = {}
    start = time.perf_counter()
    seconds: dict[str, float] = {}
    with evaluating(adapter.modules()), torch.no_grad():
        session.measure()
        seconds["reference"] = time.perf_counter() - start
        for name, probe in PROBES.items():
            start = time.perf_counter()
            try:
                properties[name] = probe(session)
            except Exception as e:
                bound = None if session.bound.source == "not measured" else session.bound
                properties[name] = Property(False, None, bound, f"{type(e).__name__}: {e}")
            seconds[name] = time.perf_counter() - start
    notes += session.notes
    return Examination(properties, adapter.description, tuple(notes), seconds)


def examine_texts(
    model: Any, tokenizer: Any, texts: Sequence[str], *, kind: Kind | None = None
) -> Examination:
    """Tokenize ``texts`` and :func:`examine` the model on them.

    Each text is tokenized alone, then padded on the tokenizer's ``padding_side`` with its pad
    token (else its end-of-sequence token, else 0), so tokenizers without a pad token (GPT-2)
    work too.

    Args:
        model: as :func:`examine`.
        tokenizer: a ``transformers`` tokenizer (called as ``tokenizer(text)["input_ids"]``).
        texts: one or more texts.
        kind: as :func:`examine`.

    Returns:
        The :class:`~qkv.doctor.examination.Examination`.

    Raises:
        TypeError: ``texts`` is a single string or holds something other than strings.
        ValueError: no texts, or a text that gives no token.
    """
    if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
        raise TypeError(f"texts must be a sequence of strings, got {texts!r:.80}")
    if len(texts) == 0:
        raise ValueError("texts must hold at least one text, got none")
    encoded = [list(tokenizer(t)["input_ids"]) for t in texts]
    for t, ids in zip(texts, encoded, strict=True):
        if not ids:
            raise ValueError(f"the text {t!r:.60} gives no token")
    pad = next((p for p in (tokenizer.pad_token_id, tokenizer.eos_token_id) if p is not None), 0)
    left = getattr(tokenizer, "padding_side", "right") == "left"
    width = max(len(ids) for ids in encoded)
    rows, masks = [], []
    for ids in encoded:
        fill = [pad] * (width - len(ids))
        ones, zeros = [1] * len(ids), [0] * len(fill)
        rows.append(fill + ids if left else ids + fill)
        masks.append(zeros + ones if left else ones + zeros)
    device = next((p.device for p in getattr(model, "parameters", list)()), torch.device("cpu"))
    input_ids = torch.tensor(rows, device=device)  # [B, T]
    attention_mask = torch.tensor(masks, device=device)  # [B, T]
    return examine(model, input_ids, attention_mask, kind=kind)
