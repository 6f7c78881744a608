"""Attention masks: builders and converters between conventions.

**The one internal convention.** Inside qkv a mask is a ``torch.bool`` tensor broadcastable to
``[B, H, T, S]`` in which ``True`` means *this key may NOT be attended* ("blocked"). Everything
else is converted at the edge with the named converters below:

================================  ==================  ==========================================
convention                        meaning of a value  converter into / out of qkv
================================  ==================  ==========================================
PyTorch SDPA bool ``attn_mask``   True = may attend   :func:`from_sdpa_bool` / :func:`to_sdpa_bool`
``nn.MultiheadAttention`` bool    True = ignore       :func:`from_mha_bool` / :func:`to_mha_bool`
Hugging Face ``attention_mask``   1 = keep, 0 = pad   :func:`from_hf` / :func:`to_hf`
additive float mask               0 keep, -inf block  :func:`from_additive` / :func:`to_additive`
================================  ==================  ==========================================

Every builder here returns a 4-D tensor (``[B, 1, 1, S]`` for padding, ``[1, 1, T, S]`` for
causal and sliding-window masks), so that no mask built by qkv relies on right-aligned
broadcasting, which is where a ``[B, S]`` padding mask silently turns into a ``[T, S]`` one.

Causal alignment for ``T != S``: ``align="top_left"`` lets query ``i`` see keys ``0..i`` (this is
what ``torch.nn.functional.scaled_dot_product_attention(is_causal=True)`` does);
``align="bottom_right"`` lets query ``i`` see keys ``0..i + S - T`` so the last query sees every
key (this is what a KV cache needs, and what ``torch.nn.attention.bias.causal_lower_right``
does). ``nn.Transformer.generate_square_subsequent_mask`` only builds the square ``T == S`` case,
where both alignments agree.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

Align = Literal["top_left", "bottom_right"]

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
    """Build a key-padding mask in qkv's convention.

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
    x = _check_tensor("lengths_or_is_pad", lengths_or_is_pad)
    if x.dtype == torch.bool:
        if x.dim() != 2:
            raise ValueError(
                f"a bool padding mask must be [B, S] (True = padding), got shape {tuple(x.shape)}"
            )
        if S is not None and x.shape[1] != S:
            raise ValueError(f"padding mask has S={x.shape[1]} but S={S} was given")
        out = x[:, None, None, :]  # [B, 1, 1, S]
        return out.to(device) if device is not None else out
    if x.is_floating_point() or x.is_complex():
        raise TypeError(
            f"lengths must be an integer tensor [B], got {x.dtype}; for an additive float mask "
            "use qkv.masks.from_additive"
        )
    if x.dim() != 1:
        raise TypeError(
            f"integer input to padding_mask must be lengths [B], got shape {tuple(x.shape)}; "
            "a Hugging Face attention_mask [B, S] (1 = keep) goes through qkv.masks.from_hf"
        )
    if S is None:
        raise ValueError("padding_mask(lengths) needs S, the key length")
    if x.numel() and (int(x.min()) < 0 or int(x.max()) > S):
        raise ValueError(f"lengths must lie in [0, S={S}], got {x.tolist()}")
    dev = device if device is not None else x.device
    positions = torch.arange(S, device=dev)  # [S]
    blocked = positions[None, :] >= x.to(dev)[:, None]  # [B, S]
    return blocked[:, None, None, :]  # [B, 1, 1, S]


def _query_positions(
    T: int, S: int, offset: int | None, align: Align, device: torch.device | None
) -> Tensor:
    if align not in ("top_left", "bottom_right"):
        raise ValueError(f"align must be 'top_left' or 'bottom_right', got {align!r}")
    if offset is None:
        offset = 0 if align == "top_left" else S - T
    elif align != "top_left":
        raise ValueError("give either offset or align='bottom_right', not both")
    return torch.arange(T, device=device) + offset  # [T]


def _check_lengths(T: int, S: int | None) -> int:
    if not isinstance(T, int) or T < 1:
        raise ValueError(f"T must be a positive int, got {T!r}")
    S = T if S is None else S
    if not isinstance(S, int) or S < 1:
        raise ValueError(f"S must be a positive int, got {S!r}")
    return S


def causal_mask(
    T: int,
    S: int | None = None,
    *,
    offset: int | None = None,
    align: Align = "top_left",
    device: torch.device | None = None,
) -> Tensor:
    """Causal mask: query ``i`` (at absolute position ``p_i``) may not see keys ``j > p_i``.

    Args:
        T: query length.
        S: key length (defaults to T).
        offset: absolute position of query 0 (KV-cache decoding: the number of cached keys
            before this chunk). Overrides ``align``.
        align: ``"top_left"`` (``p_i = i``, PyTorch SDPA's ``is_causal``) or
            ``"bottom_right"`` (``p_i = i + S - T``, the last query sees every key).
        device: device of the result.

    Returns:
        Bool tensor ``[1, 1, T, S]``, True = blocked.

    Raises:
        ValueError: non-positive lengths, unknown ``align``, or ``offset`` with bottom-right.
    """
    S = _check_lengths(T, S)
    q_pos = _query_positions(T, S, offset, align, device)  # [T]
    k_pos = torch.arange(S, device=device)  # [S]
    blocked = k_pos[None, :] > q_pos[:, None]  # [T, S]
    return blocked[None, None]  # [1, 1, T, S]


def sliding_window_mask(
    T: int,
    S: int | None = None,
    *,
    window: int,
    offset: int | None = None,
    align: Align = "top_left",
    device: torch.device | None = None,
) -> Tensor:
    """Causal sliding-window mask: query at position ``p`` sees keys ``p - window + 1 .. p``.

    Args:
        T: query length.
        S: key length (defaults to T).
        window: number of keys each query may see, itself included (``>= 1``).
        offset: absolute position of query 0, as in :func:`causal_mask`.
        align: as in :func:`causal_mask`.
        device: device of the result.

    Returns:
        Bool tensor ``[1, 1, T, S]``, True = blocked.

    Raises:
        ValueError: ``window < 1`` or the errors of :func:`causal_mask`.
    """
    S = _check_lengths(T, S)
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be an int >= 1, got {window!r}")
    q_pos = _query_positions(T, S, offset, align, device)  # [T]
    k_pos = torch.arange(S, device=device)  # [S]
    delta = q_pos[:, None] - k_pos[None, :]  # [T, S]
    blocked = (delta < 0) | (delta >= window)  # [T, S]
    return blocked[None, None]  # [1, 1, T, S]


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
