"""Attention for one query row per head, written as reductions that inductor fuses.

A cached decoding step attends from one new token (``T == 1``) to every cached key. Through
SDPA that step costs more than its arithmetic: on the CPU, compiled, GPT-2 small at 128 cache
slots, each layer spent 121 us writing zeroed copies of the whole key and value cache
(:func:`~qkv.backends.reference.drop_blocked_keys`) and 74 us in SDPA's flash kernel for a
12 x 128 score matrix; together 6.5 % of a decoding step that reads 498 MB of weights.

Here the scores are a sum over ``Dh`` of ``q * k`` and the output a sum over ``S`` of
``weights * v``, with the blocked keys and values replaced by 0 inside those sums
(``torch.where``, which inductor inlines into the reductions: nothing of the cache's size is
written). Under ``torch.compile`` the whole attention becomes a few fused loops; eagerly the
broadcast products would be materialized, so :func:`one_query_applies` admits compiled CPU
calls only.

qkv's semantics are kept: a blocked key or value never reaches the output (a NaN or inf there
is replaced, not multiplied by a zero weight), and a query with every key blocked gives 0.

Shapes: B batch, H query heads, Hkv key/value heads (``H = Hkv * G``), S keys, Dh/Dv widths.
"""

from __future__ import annotations

import torch
from torch import Tensor

from qkv.backends.call import needs_grad
from qkv.masks.validate import as_4d

__all__ = ["one_query_applies", "one_query_attention"]


def one_query_applies(
    query: Tensor, key: Tensor, value: Tensor, attn_bias: Tensor | None, dropout_p: float,
    training: bool,
) -> bool:  # fmt: skip
    """Whether :func:`one_query_attention` runs this call: one query row, compiling for the CPU,
    no active dropout, no gradient (a decoding step).

    Cheap Python checks first; the shape check last, as a Python bool of a static size.
    """
    return (
        torch.compiler.is_compiling()
        and query.device.type == "cpu"
        and not (training and dropout_p > 0.0)
        and not needs_grad(query, key, value, attn_bias)
        and query.shape[2] == 1
    )


def _grouped(x: Tensor, Hkv: int, G: int) -> Tensor:
    """A ``[B|1, H|1, 1, S]`` mask or bias as ``[B|1, Hkv|1, G|1, S]`` (head ``h`` is group
    member ``h % G`` of key/value head ``h // G``, as SDPA's ``enable_gqa`` pairs them)."""
    b, h, _, s = x.shape
    if h == 1:
        return x  # [B|1, 1, 1, S]: broadcasts over Hkv and G
    return x.reshape(b, Hkv, G, s)  # [B|1, Hkv, G, S]


def one_query_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: Tensor | None,
    attn_bias: Tensor | None,
    scale: float,
    work: torch.dtype,
) -> Tensor:
    """Attention of one query row per head; see :func:`qkv.attention` for the contract.

    Args:
        query: ``[B, H, 1, Dh]``.
        key: ``[B, Hkv, S, Dh]`` with ``H % Hkv == 0``.
        value: ``[B, Hkv, S, Dv]``.
        mask: bool broadcastable to ``[B, H, 1, S]``, True = blocked (any causal part already
            joined), or None.
        attn_bias: float broadcastable to ``[B, H, 1, S]``, added to the scores, or None.
        scale: multiplies the scores.
        work: the dtype computed in (float32 or float64).

    Returns:
        ``[B, H, 1, Dv]`` in ``work``; a query whose every key is blocked gives 0.
    """
    B, H, _, Dh = query.shape
    Hkv, Dv = key.shape[1], value.shape[3]
    G = H // Hkv
    q = query.to(work).reshape(B, Hkv, G, 1, Dh)  # [B, Hkv, G, 1, Dh]
    k = key.to(work)[:, :, None]  # [B, Hkv, 1, S, Dh]
    v = value.to(work)[:, :, None]  # [B, Hkv, 1, S, Dv]
    blocked = None if mask is None else _grouped(as_4d(mask), Hkv, G)  # [B|1, Hkv|1, G|1, S]
    if blocked is not None:
        k = torch.where(blocked[..., None], 0.0, k)  # [B, Hkv, G, S, Dh]
        v = torch.where(blocked[..., None], 0.0, v)  # [B, Hkv, G, S, Dv]
    scores = (q * k).sum(dim=-1) * scale  # [B, Hkv, G, S]
    if attn_bias is not None:
        scores = scores + _grouped(as_4d(attn_bias).to(work), Hkv, G)  # [B, Hkv, G, S]
    dead: Tensor | None = None
    if blocked is not None:
        scores = torch.where(blocked, float("-inf"), scores)  # [B, Hkv, G, S]
        dead = blocked.all(dim=-1, keepdim=True)  # [B|1, Hkv|1, G|1, 1]
        scores = torch.where(dead, 0.0, scores)  # [B, Hkv, G, S]: no all -inf row
    weights = torch.softmax(scores, dim=-1)  # [B, Hkv, G, S]
    out = (weights[..., None] * v).sum(dim=-2)  # [B, Hkv, G, Dv]
    if dead is not None:
        out = torch.where(dead, 0.0, out)  # [B, Hkv, G, Dv]
    return out.reshape(B, H, 1, Dv)  # [B, H, 1, Dv]
