"""``nn.MultiheadAttention``'s call conventions turned into qkv's, and qkv's results back into them.

What :class:`qkv.nn.MultiHeadAttention` takes as a drop-in: inputs ``[B, L, D]``, ``[L, B, D]``
(``batch_first=False``) or unbatched ``[L, D]``; ``key_padding_mask`` ``[B, S]`` and
``attn_mask`` ``[T, S]`` / ``[B * H, T, S]``, bool True = ignore or float added to the scores;
``need_weights`` / ``average_attn_weights``. This module checks and converts those arguments to
batch-first tensors and qkv's blocked mask and score bias, and lays the output and weights out
as PyTorch does. It holds no weights.

Shapes: B batch, T query length, S key length, D width, H heads.
"""

from __future__ import annotations

import torch
from torch import Tensor

from qkv._checks import check_bool
from qkv.masks import Dense, StructuredMask, combine
from qkv.masks.convert import reshape_mha_attn_mask

__all__ = [
    "WEIGHTLESS_BACKENDS",
    "batch_first_inputs",
    "check_flags",
    "merge_masks",
    "resolve_need_weights",
    "torch_outputs",
]

WEIGHTLESS_BACKENDS = ("fused", "blockwise", "flex")
"""Backends that compute no ``[B, H, T, S]`` weights; a module built for one defaults to
``need_weights=False``."""


def _torch_mask(name: str, m: Tensor, B: int, H: int, S: int) -> Tensor:
    """``nn.MultiheadAttention``'s mask shapes as 4-D, broadcastable to ``[B, H, T, S]``.

    ``key_padding_mask``: ``[B, S]``. ``attn_mask``: ``[T, S]``, ``[B * H, T, S]``, or (qkv's
    extension, which PyTorch refuses) any 4-D shape broadcastable to ``[B, H, T, S]``.
    """
    if not isinstance(m, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(m).__name__}")
    if m.dtype != torch.bool and not m.is_floating_point():
        raise TypeError(f"{name} must be bool (True = ignore) or additive float, got {m.dtype}")
    if name == "key_padding_mask":
        if tuple(m.shape) != (B, S):
            raise ValueError(f"key_padding_mask must be [B, S] = [{B}, {S}], got {tuple(m.shape)}")
        return m[:, None, None, :]  # [B, 1, 1, S]
    if m.dim() == 4:
        return m  # [B|1, H|1, T|1, S|1], qkv's extension
    return reshape_mha_attn_mask(m, B, H)  # [1, 1, T, S] or [B, H, T, S]


def check_flags(need_weights: object, average_attn_weights: object, is_causal: object) -> None:
    """``forward``'s flags are bools (``need_weights`` may be None: the backend's default).

    Args:
        need_weights: the caller's ``need_weights``.
        average_attn_weights: the caller's ``average_attn_weights``.
        is_causal: the caller's ``is_causal``.

    Raises:
        TypeError: a flag that is not a bool, a tensor named as such (a mask passed where a flag
            stands in the positional order).
    """
    flags = {
        "need_weights": need_weights,
        "average_attn_weights": average_attn_weights,
        "is_causal": is_causal,
    }
    for name, flag in flags.items():
        if isinstance(flag, Tensor):
            raise TypeError(
                f"{name} must be a bool, got a Tensor; the positional order is "
                f"nn.MultiheadAttention's (query, key, value, key_padding_mask, "
                f"need_weights, attn_mask, average_attn_weights, is_causal)"
            )
        if flag is not None:
            check_bool(name, flag)


def merge_masks(
    torch_masks: dict[str, Tensor | None],
    mask: Tensor | StructuredMask | None,
    attn_bias: Tensor | None,
    B: int,
    H: int,
    S: int,
) -> tuple[Tensor | StructuredMask | None, Tensor | None]:
    """PyTorch-style masks joined to qkv's: bool ones to ``mask``, float ones to ``attn_bias``.

    Args:
        torch_masks: ``key_padding_mask`` / ``attn_mask`` by name, in ``nn.MultiheadAttention``'s
            shapes and senses (see :func:`_torch_mask`), or None.
        mask: qkv's blocked mask (True = blocked) or a :mod:`qkv.masks` rule, or None.
        attn_bias: float score bias broadcastable to ``[B, H, T, S]``, or None.
        B: batch size.
        H: heads.
        S: key length.

    Returns:
        ``(blocked, attn_bias)`` for :func:`qkv.attention`; a rule keeps its structure, with the
        bool PyTorch masks as a ``Dense`` part.

    Raises:
        TypeError / ValueError: as :func:`_torch_mask`.
    """
    blocked_parts: list[Tensor] = []
    for name, m in torch_masks.items():
        if m is None:
            continue
        m4 = _torch_mask(name, m, B, H, S)  # [B|1, H|1, T|1, S]
        if m4.dtype == torch.bool:
            blocked_parts.append(m4)
        else:  # PyTorch adds a float mask to the scores: so does qkv
            attn_bias = m4 if attn_bias is None else attn_bias + m4  # [B|1, H|1, T|1, S]
    dense = combine(*blocked_parts)
    if isinstance(mask, StructuredMask):
        # keep the structure (blockwise skips its empty tiles); PyTorch-style masks join it
        # as a dense part
        return (mask if dense is None else mask | Dense(dense)), attn_bias
    return combine(mask, dense), attn_bias


def _check_input(name: str, x: object, width: int, rank: int, batch_first: bool) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.is_nested:
        raise TypeError(
            f"{name} is a nested tensor, which qkv.MultiHeadAttention does not take (build "
            f"nn.TransformerEncoder with enable_nested_tensor=False)"
        )
    if x.dim() != rank or x.shape[-1] != width:
        layout = {2: "[L, D] (unbatched)", 3: "[B, L, D]" if batch_first else "[L, B, D]"}
        raise ValueError(f"{name} must be {layout[rank]} with D={width}, got {tuple(x.shape)}")


def batch_first_inputs(
    query: Tensor,
    key: Tensor | None,
    value: Tensor | None,
    key_padding_mask: Tensor | None,
    widths: tuple[int, int, int],
    batch_first: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None, bool]:
    """Query, key, value (and the padding mask) checked and made ``[B, L, D]``.

    Args:
        query: ``[B, T, D]``, ``[T, B, D]`` (not ``batch_first``) or ``[T, D]`` (unbatched).
        key: same layout, or None for ``query``.
        value: same layout, or None for ``key``.
        key_padding_mask: ``[B, S]`` (``[S]`` unbatched) or None; checked later, by
            :func:`merge_masks`.
        widths: the last dimension each of query, key and value must have.
        batch_first: the module's layout flag.

    Returns:
        ``(query [B, T, D], key [B, S, kdim], value [B, S, vdim], key_padding_mask, unbatched)``.

    Raises:
        TypeError: a non-tensor or nested input.
        ValueError: a wrong rank or width, or inputs that disagree on B (key and value on S).
    """
    key = query if key is None else key
    value = key if value is None else value
    unbatched = isinstance(query, Tensor) and query.dim() == 2
    rank = 2 if unbatched else 3
    for name, x, width in zip(("query", "key", "value"), (query, key, value), widths, strict=True):
        _check_input(name, x, width, rank, batch_first)
    if unbatched:
        query, key, value = query[None], key[None], value[None]  # [1, L, D]
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask[None]  # [1, S]
    elif not batch_first:
        query, key, value = (x.transpose(0, 1) for x in (query, key, value))  # [B, L, D]
    B = query.shape[0]
    if key.shape[0] != B or value.shape[:2] != key.shape[:2]:
        raise ValueError(
            f"query, key and value must share B (and key/value S): got query "
            f"{tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}"
        )
    return query, key, value, key_padding_mask, unbatched


def resolve_need_weights(need_weights: bool | None, backend: str) -> bool:
    """``need_weights`` resolved: None is True unless ``backend`` returns no weights.

    Args:
        need_weights: the caller's flag, or None for the backend's default.
        backend: the module's attention backend.

    Returns:
        Whether to return weights.

    Raises:
        ValueError: True with a backend that returns no weights.
    """
    weightless = backend in WEIGHTLESS_BACKENDS
    if need_weights is None:
        return not weightless
    if need_weights and weightless:
        raise ValueError(
            f"need_weights=True, but this module was built with backend={backend!r}, "
            "which returns no weights: call it with need_weights=False (or leave it unset), "
            "or build it with backend='reference' or 'auto'"
        )
    return need_weights


def torch_outputs(
    out: Tensor,
    weights: Tensor | None,
    average_attn_weights: bool,
    unbatched: bool,
    batch_first: bool,
) -> tuple[Tensor, Tensor | None]:
    """The output in the query's layout and the weights as ``nn.MultiheadAttention`` gives them.

    Args:
        out: ``[B, T, D]``.
        weights: ``[B, H, T, S]``, or None when none are to be returned.
        average_attn_weights: average the weights over heads.
        unbatched: the query was ``[T, D]``: drop the B dimension.
        batch_first: the module's layout flag.

    Returns:
        ``(output, weights or None)``: weights ``[B, T, S]`` averaged or ``[B, H, T, S]``
        (without B when unbatched).
    """
    if unbatched:
        out = out[0]  # [T, D]
    elif not batch_first:
        out = out.transpose(0, 1)  # [T, B, D]
    if weights is None:
        return out, None
    weights = weights.mean(dim=1) if average_attn_weights else weights  # [B, (H,) T, S]
    return out, (weights[0] if unbatched else weights)
