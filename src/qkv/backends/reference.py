"""The reference backend: the attention formula written out, returning the weights.

softmax(Q Kᵀ · scale + attn_bias + M) V, with M = -inf on blocked keys. Inputs are validated
by :mod:`qkv.functional`. This is the backend every other one is tested against.
"""

from __future__ import annotations

import torch
from torch import Tensor

from qkv.dropout import dropout
from qkv.masks.validate import as_4d


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; everything else is computed in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def expand_kv_heads(x: Tensor, num_heads: int) -> Tensor:
    """Repeat each of the ``Hkv`` key/value heads ``H // Hkv`` times (grouped-query attention).

    Args:
        x: ``[B, Hkv, S, D]``.
        num_heads: H, a multiple of Hkv.

    Returns:
        ``[B, H, S, D]`` (the input itself when ``Hkv == H``).
    """
    groups = num_heads // x.shape[1]
    if groups == 1:
        return x
    return x.repeat_interleave(groups, dim=1)  # [B, H, S, D]


def drop_blocked_keys(key: Tensor, value: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor]:
    """Zero the keys and values that ``mask`` blocks for every query of their sample and head.

    A blocked key gets weight 0, but ``0 * NaN`` and ``0 * inf`` are NaN: without this a NaN or
    inf at a padded position would reach every output row through ``weights @ V`` (and through
    SDPA's scores). With it, such keys never influence any output or gradient, whatever their
    value. Tensor ops only (no data-dependent branch), so it traces and compiles.

    Args:
        key: ``[B, Hkv, S, Dh]``.
        value: ``[B, Hkv, S, Dv]``.
        mask: bool broadcastable to ``[B, H, T, S]`` (H a multiple of Hkv), True = blocked, or
            None.

    Returns:
        ``(key, value)``, the blocked positions set to 0 (the inputs themselves when no mask).
    """
    if mask is None:
        return key, value
    m = as_4d(mask)  # [B|1, H|1, T|1, S]
    dead = m.all(dim=2)  # [B|1, H|1, S]: blocked for every query
    Hm, Hkv = dead.shape[1], key.shape[1]
    if Hm != 1 and Hm != Hkv:
        dead = dead.unflatten(1, (Hkv, Hm // Hkv)).all(dim=2)  # [B|1, Hkv, S]
    dead = dead[..., None]  # [B|1, Hkv|1, S, 1]
    # torch.where, not masked_fill: the same values and gradients, 1.5x faster on CPU when
    # the mask broadcasts
    return torch.where(dead, 0.0, key), torch.where(dead, 0.0, value)


def reference_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: Tensor | None,
    attn_bias: Tensor | None,
    scale: float,
    dropout_p: float,
    training: bool,
) -> tuple[Tensor, Tensor]:
    """Explicit attention; see :func:`qkv.attention` for the contract.

    Args:
        query: ``[B, H, T, Dh]``.
        key: ``[B, Hkv, S, Dh]`` with ``H % Hkv == 0``.
        value: ``[B, Hkv, S, Dv]``.
        mask: bool, broadcastable to ``[B, H, T, S]``, True = blocked, or None.
        attn_bias: float, broadcastable to ``[B, H, T, S]``, added to the scores, or None.
        scale: multiplies the scores.
        dropout_p: dropout probability on the weights (used only when ``training``).
        training: apply dropout.

    Returns:
        ``(output [B, H, T, Dv], weights [B, H, T, S])`` in the input dtype; the weights are the
        ones multiplied with V (after dropout). Rows with every key blocked are 0, and keys
        blocked for every query never influence anything (:func:`drop_blocked_keys`).
    """
    out_dtype = query.dtype
    work = compute_dtype(out_dtype)
    with torch.autocast(device_type=query.device.type, enabled=False):
        q = query.to(work)  # [B, H, T, Dh]
        k, v = drop_blocked_keys(key.to(work), value.to(work), mask)  # [B, Hkv, S, Dh|Dv]
        k = expand_kv_heads(k, q.shape[1])  # [B, H, S, Dh]
        v = expand_kv_heads(v, q.shape[1])  # [B, H, S, Dv]
        scores = torch.matmul(q * scale, k.transpose(-2, -1))  # [B, H, T, S]
        if attn_bias is not None:
            scores = scores + attn_bias.to(work)  # [B, H, T, S]
        if mask is not None:
            scores = scores.masked_fill(mask, float("-inf"))  # [B, H, T, S]
        # A row whose every key is blocked: softmax of all -inf is NaN, and so is its gradient.
        # Give such rows finite scores before the softmax and zero their weights after it.
        dead = torch.isneginf(scores).all(dim=-1, keepdim=True)  # [B, H, T, 1]
        scores = scores.masked_fill(dead, 0.0)  # [B, H, T, S]
        weights = torch.softmax(scores, dim=-1).masked_fill(dead, 0.0)  # [B, H, T, S]
        if training and dropout_p > 0.0:
            weights = dropout(weights, dropout_p)  # [B, H, T, S]
        # masked_fill, not a multiply: a NaN value a dead row's zero weights meet stays out
        out = torch.matmul(weights, v).masked_fill(dead, 0.0)  # [B, H, T, Dv]
    return out.to(out_dtype), weights.to(out_dtype)
