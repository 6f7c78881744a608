"""Attention masks: builders and converters between conventions.

**The one internal convention.** Inside qkv a mask is a ``torch.bool`` tensor broadcastable to
``[B, H, T, S]`` in which ``True`` means *this key may NOT be attended* ("blocked"). Every other
convention (PyTorch SDPA's, ``nn.MultiheadAttention``'s, Hugging Face's, additive float masks) is
converted at the edge by the named converters of :mod:`qkv.masks.convert`.

Every builder here returns a 4-D tensor (``[B, 1, 1, S]`` for padding, ``[1, 1, T, S]`` for
causal and sliding-window masks), so that no mask built by qkv relies on right-aligned
broadcasting, which is where a ``[B, S]`` padding mask silently turns into a ``[T, S]`` one.

Each builder is a thin call of a rule of :mod:`qkv.masks.rules` (``padding_mask`` is
``Padding(...).materialize``, ``causal_mask`` ``Causal(...)``, ``sliding_window_mask``
``SlidingWindow(...)``), so a mask has one meaning whichever spelling builds it.

Causal alignment for ``T != S``, the same for every function and rule: **bottom-right by
default** (query ``i`` sees keys ``0..i + S - T``, so the last query sees every key: what a KV
cache needs and what ``qkv.attention(is_causal=True)`` does); ``align="top_left"`` lets query
``i`` see keys ``0..i`` (PyTorch SDPA's ``is_causal=True``); ``offset=n`` puts query 0 at
position ``n``. ``offset`` with an explicit ``align`` is a ValueError. The two alignments agree
when ``T == S`` (``nn.Transformer.generate_square_subsequent_mask``). See
:mod:`qkv.masks.tiles`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from qkv._checks import check_positive_int
from qkv.masks.rules import Causal, Padding, SlidingWindow
from qkv.masks.tiles import Align

__all__ = ["causal_mask", "combine", "padding_mask", "sliding_window_mask"]


def _check_tensor(name: str, x: object) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def _check_bool(name: str, mask: object) -> Tensor:
    mask = _check_tensor(name, mask)
    if mask.dtype != torch.bool:
        raise TypeError(
            f"{name} must be a bool tensor (True = blocked, qkv's convention), got {mask.dtype}; "
            "use qkv.masks.from_hf / from_additive / from_sdpa_bool to convert"
        )
    return mask


def padding_mask(
    lengths_or_is_pad: Tensor, S: int | None = None, *, device: torch.device | None = None
) -> Tensor:
    """Build a key-padding mask in qkv's convention: ``Padding(lengths_or_is_pad)`` materialized.

    Args:
        lengths_or_is_pad: either an integer tensor ``[B]`` of valid lengths (keys ``>= length``
            are padding), or a bool tensor ``[B, S]`` with True at padding positions (the
            ``key_padding_mask`` sense of ``nn.MultiheadAttention``).
        S: key length; required with lengths, checked against the bool form.
        device: device of the result (defaults to the input's).

    Returns:
        Bool tensor ``[B, 1, 1, S]``, True = padding (blocked).

    Raises:
        TypeError: input is not a tensor, or an integer tensor that is not 1-D (a Hugging Face
            ``attention_mask`` goes through :func:`from_hf`).
        ValueError: wrong rank, S missing or smaller than a length, negative lengths.
    """
    rule = Padding(lengths_or_is_pad)
    x = rule.is_pad if rule.is_pad is not None else rule.lengths
    assert x is not None
    if rule.is_pad is not None:
        if S is not None and rule.is_pad.shape[1] != S:
            raise ValueError(f"padding mask has S={rule.is_pad.shape[1]} but S={S} was given")
        S = rule.is_pad.shape[1]
    elif S is None:
        raise ValueError("padding_mask(lengths) needs S, the key length")
    if device is not None and x.device != device:
        rule = Padding(x.to(device))
    return rule.materialize(x.shape[0], 1, 1, S, x.device if device is None else device)


def _check_lengths(T: int, S: int | None) -> tuple[int, int]:
    T = check_positive_int("T", T)
    return T, check_positive_int("S", T if S is None else S)


def causal_mask(
    T: int,
    S: int | None = None,
    *,
    offset: int | None = None,
    align: Align | None = None,
    device: torch.device | None = None,
) -> Tensor:
    """Causal mask: query ``i`` (at absolute position ``p_i``) may not see keys ``j > p_i``.

    ``Causal(align=align, offset=offset).materialize(1, 1, T, S)``.

    Args:
        T: query length.
        S: key length (defaults to T).
        offset: absolute position of query 0 (KV-cache decoding: the number of cached keys
            before this chunk), instead of ``align``.
        align: ``"bottom_right"`` (the default: ``p_i = i + S - T``, the last query sees every
            key) or ``"top_left"`` (``p_i = i``, PyTorch SDPA's ``is_causal``).
        device: device of the result (default CPU).

    Returns:
        Bool tensor ``[1, 1, T, S]``, True = blocked.

    Raises:
        TypeError: lengths or ``offset`` that are not ints.
        ValueError: non-positive lengths, unknown ``align``, or ``offset`` with ``align``.
    """
    T, S = _check_lengths(T, S)
    return Causal(align=align, offset=offset).materialize(1, 1, T, S, device)  # [1, 1, T, S]


def sliding_window_mask(
    T: int,
    S: int | None = None,
    *,
    window: int,
    offset: int | None = None,
    align: Align | None = None,
    device: torch.device | None = None,
) -> Tensor:
    """Causal sliding-window mask: query at position ``p`` sees keys ``p - window + 1 .. p``.

    ``SlidingWindow(window, align=align, offset=offset).materialize(1, 1, T, S)``.

    Args:
        T: query length.
        S: key length (defaults to T).
        window: number of keys each query may see, itself included (``>= 1``).
        offset: absolute position of query 0, as in :func:`causal_mask`.
        align: as in :func:`causal_mask` (bottom-right by default).
        device: device of the result (default CPU).

    Returns:
        Bool tensor ``[1, 1, T, S]``, True = blocked.

    Raises:
        ValueError: ``window < 1`` or the errors of :func:`causal_mask`.
        TypeError: a ``window`` that is not an int, or the errors of :func:`causal_mask`.
    """
    T, S = _check_lengths(T, S)
    rule = SlidingWindow(check_positive_int("window", window), align=align, offset=offset)
    return rule.materialize(1, 1, T, S, device)  # [1, 1, T, S]


def combine(*masks: Tensor | None) -> Tensor | None:
    """OR the blocked sets of several masks (a key is blocked if any mask blocks it).

    Args:
        *masks: bool masks in qkv's convention, or None (ignored).

    Returns:
        The broadcast OR, or None if every mask is None.

    Raises:
        TypeError: a mask is not a bool tensor.
        ValueError: the masks do not broadcast together (their shapes are listed), or lie on
            different devices.
    """
    present = [_check_bool(f"masks[{i}]", m) for i, m in enumerate(masks) if m is not None]
    if not present:
        return None
    devices = {m.device for m in present}
    if len(devices) > 1:
        raise ValueError(f"masks are on different devices: {[str(m.device) for m in present]}")
    try:
        torch.broadcast_shapes(*(m.shape for m in present))
    except RuntimeError as err:
        shapes = [tuple(m.shape) for m in present]
        raise ValueError(f"masks do not broadcast together: shapes {shapes}") from err
    out = present[0]
    for m in present[1:]:
        out = out | m
    return out
