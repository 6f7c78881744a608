"""Checks of what a model is called with: token ids, padding masks, the KV-cache keyword.

Every model (and :mod:`qkv.models.generate`) imports these from here, below the model modules,
so that no model module imports another.

Shapes: B batch, L sequence length.
"""

from __future__ import annotations

import torch
from torch import Tensor

import qkv.masks as masks
from qkv._checks import checks_values
from qkv._deprecation import renamed_keyword
from qkv.nn.kv_cache import KVCache

__all__ = [
    "check_ids",
    "key_padding",
    "padding_from_ids",
    "resolve_kv_cache",
    "self_attention_padding",
]


def check_ids(
    name: str,
    ids: object,
    vocab: int,
    *,
    field: str = "vocab",
    shape: tuple[int, ...] | None = None,
    validate: bool = True,
) -> Tensor:
    """Check a ``[B, L]`` integer token tensor.

    Args:
        name: the argument's name, for the message.
        ids: the tensor.
        vocab: ids must lie in ``[0, vocab)``.
        field: what ``vocab`` is called (a config field such as ``"type_vocab_size"``).
        shape: the exact shape wanted (default: any non-empty ``[B, L]``).
        validate: check the id values too (a host sync); skipped anyway while tracing or
            compiling (see :func:`qkv._checks.checks_values`). Dtype and shape are always checked.

    Returns:
        ``ids``.

    Raises:
        TypeError: not an int32/int64 tensor (what ``nn.Embedding`` takes).
        ValueError: not 2-D, empty, not ``shape``, or (when values are checked) ids outside
            ``[0, vocab)``.
    """
    if not isinstance(ids, Tensor) or ids.dtype not in (torch.int32, torch.int64):
        got = ids.dtype if isinstance(ids, Tensor) else type(ids).__name__
        raise TypeError(f"{name} must be an integer (int32/int64) tensor of token ids, got {got}")
    if ids.dim() != 2 or ids.numel() == 0:
        raise ValueError(f"{name} must be [B, L] with B, L >= 1, got {tuple(ids.shape)}")
    if shape is not None and tuple(ids.shape) != shape:
        raise ValueError(f"{name} must be [B, L] = {list(shape)}, got {list(ids.shape)}")
    if not checks_values(validate):
        return ids
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab:
        raise ValueError(
            f"{name} holds ids in [{lo}, {hi}], outside the vocabulary [0, {field}={vocab})"
        )
    return ids


def key_padding(
    is_pad: Tensor | None, ids: Tensor, name: str, validate: bool = True
) -> Tensor | None:
    """A ``[B, L]`` True = padding mask, checked against ``ids``; None when nothing is padding.

    Returning None when no position is padding keeps the mask out of the attention entirely.
    Telling that reads the mask on the host, so it is done only where values are checked
    (eagerly, ``validate=True``); otherwise the mask is returned as it is (same results).

    Args:
        is_pad: bool ``[B, L]``, True = padding, or None.
        ids: the ``[B, L]`` tokens it describes.
        name: the argument's name, for the message.
        validate: see :func:`qkv._checks.checks_values`.

    Returns:
        ``is_pad``, or None.

    Raises:
        TypeError: not bool.
        ValueError: not the shape of ``ids``.
    """
    if is_pad is None:
        return None
    if not isinstance(is_pad, Tensor) or is_pad.dtype != torch.bool:
        got = is_pad.dtype if isinstance(is_pad, Tensor) else type(is_pad).__name__
        raise TypeError(f"{name} must be a bool tensor (True = padding), got {got}")
    if is_pad.shape != ids.shape:
        raise ValueError(
            f"{name} must have the token shape {tuple(ids.shape)}, got {tuple(is_pad.shape)}"
        )
    if not checks_values(validate):
        return is_pad
    return is_pad if bool(is_pad.any()) else None


def padding_from_ids(
    ids: Tensor,
    padding_mask: Tensor | None,
    pad_id: int | None,
    name: str,
    validate: bool = True,
) -> Tensor | None:
    """The padding of ``ids``: the caller's mask (checked), else ``ids == pad_id``.

    Args:
        ids: ``[B, L]`` token ids (already checked).
        padding_mask: bool ``[B, L]``, True = padding, or None.
        pad_id: the padding token, or None (then no padding unless a mask is given).
        name: the mask argument's name, for the message.
        validate: see :func:`qkv._checks.checks_values`.

    Returns:
        bool ``[B, L]``, or None when nothing is padding.

    Raises:
        TypeError / ValueError: as :func:`key_padding`.
    """
    if padding_mask is None and pad_id is not None:
        padding_mask = ids == pad_id  # [B, L]
    return key_padding(padding_mask, ids, name, validate)


def self_attention_padding(
    ids: Tensor,
    padding_mask: Tensor | None,
    pad_id: int | None,
    name: str,
    kv_cache: KVCache | None,
    validate: bool = True,
) -> tuple[Tensor | None, int, Tensor | None]:
    """The causal self-attention's padding mask over cached + new keys, and the new tokens'
    positions; what every decoder computes before its embeddings.

    A token's position is the number of real (non-padding) tokens before it in its row, so a
    left-padded row is encoded exactly as the same row without its padding (what
    ``transformers``' ``generate`` does with ``position_ids`` from the attention mask); without
    padding that is ``offset + column``, and no per-row positions are built.

    Args:
        ids: ``[B, T]`` new token ids (already checked).
        padding_mask: bool ``[B, T]``, True = padding, or None (then ``ids == pad_id``).
        pad_id: the padding token, or None.
        name: the mask argument's name, for the message.
        kv_cache: the decoding cache: its padding is extended by this call's, and the positions
            continue from its ``length``; None: positions start at 0.
        validate: see :func:`qkv._checks.checks_values`.

    Returns:
        ``(mask, offset, positions)``: bool ``[B, 1, 1, S]`` (True = blocked, ``S`` = cached +
        new) or None when nothing is padding; the column of ``ids[:, 0]`` among the keys; long
        ``[B, T]`` positions when some key is padding, else None (positions are then
        ``offset + column``). A padding token keeps ``offset + column`` (its output is never
        attended to), so right padding changes no position at all.

    Raises:
        TypeError / ValueError: as :func:`key_padding`.
    """
    is_pad = padding_from_ids(ids, padding_mask, pad_id, name, validate)  # [B, T] or None
    offset = 0
    if kv_cache is not None:
        offset = kv_cache.length
        is_pad = kv_cache.append_padding(is_pad, ids.shape[1])  # [B, S] or None
    if is_pad is None:
        return None, offset, None
    T = ids.shape[1]
    real = (~is_pad).long().cumsum(dim=1)[:, -T:]  # [B, T] real tokens up to each one
    column = torch.arange(offset, offset + T, device=ids.device)  # [T]
    positions = torch.where(is_pad[:, -T:], column, real - 1)  # [B, T]
    return masks.padding_mask(is_pad), offset, positions  # [B, 1, 1, S], int, [B, T]


def resolve_kv_cache(kv_cache: KVCache | None, cache: KVCache | None) -> KVCache | None:
    """``kv_cache``, or the deprecated ``cache=`` keyword (one release) with a warning.

    Raises:
        TypeError: both given.
    """
    return renamed_keyword("cache", cache, "kv_cache", kv_cache, stacklevel=3)
