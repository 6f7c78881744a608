"""A :class:`~qkv.nn.multihead.MultiHeadAttention` call under context parallelism.

Inside a model's forward with ``context_parallel=``, the layer's queries, keys and values are
this rank's shards; the call goes to the scope of :mod:`qkv.distributed.context`, which holds
the global masks and the plans. What context-parallel attention does not compute is refused
with the reason, never dropped.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor, nn

from qkv.distributed.context import Scope, active_scope
from qkv.masks import StructuredMask


class MultiHeadAttention(Protocol):
    """What the sharded call reads of :class:`qkv.nn.multihead.MultiHeadAttention` (which
    imports this module)."""

    scale: float | None
    embed_dim: int
    out_proj: nn.Linear
    record_weights: bool
    training: bool
    dropout: float


__all__ = ["attend_sharded", "check_shardable", "sharded_scope"]


def sharded_scope() -> Scope | None:
    """The active context-parallel scope; None outside one, and while compiling or exporting
    (a traced graph runs on one process: the scope is not part of it)."""
    if torch.compiler.is_compiling():
        return None
    return active_scope()


def attend_sharded(
    mha: MultiHeadAttention,
    scope: Scope,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    is_causal: bool,
    cross: bool,
) -> Tensor:
    """Context-parallel attention on this rank's shards, then ``mha``'s output projection; the
    mask (global) comes from ``scope`` (see :mod:`qkv.distributed.context`).

    Args:
        mha: the layer (its scale, width and output projection).
        scope: the active scope.
        q: queries ``[B, H, T_local, Dh]``.
        k: keys ``[B, Hkv, S_local, Dh]``.
        v: values ``[B, Hkv, S_local, Dv]``.
        is_causal: add a global causal rule.
        cross: a cross-attention call (the scope's cross mask).

    Returns:
        ``[B, T_local, D]``.
    """
    B, _, T, _ = q.shape
    out = scope.attention(q, k, v, cross=cross, is_causal=is_causal, scale=mha.scale)
    out = out.transpose(1, 2).reshape(B, T, mha.embed_dim)  # [B, T, D]
    return mha.out_proj(out)  # [B, T, D]


def check_shardable(
    mha: MultiHeadAttention,
    attn_bias: Tensor | None,
    blocked: Tensor | StructuredMask | None,
    need_weights: bool | None,
) -> None:
    """Refuse what context-parallel attention does not compute, naming it.

    Raises:
        ValueError: an ``attn_bias``, weights, attention dropout in training, or a mask passed
            to the layer (local coordinates) under context parallelism.
    """
    refused = [
        name
        for name, present in (
            ("attn_bias (ALiBi or relative positions)", attn_bias is not None),
            ("attention weights (need_weights / record_weights)",
             need_weights is True or mha.record_weights),
            ("a mask passed to the layer (the model's forward gives global ones)",
             blocked is not None),
            ("attention dropout (in training)", mha.training and mha.dropout > 0),
        )
        if present
    ]  # fmt: skip
    if refused:
        raise ValueError(
            "context parallelism computes attention without "
            + ", ".join(refused)
            + "; turn it off for a sharded forward (attention dropout: a config with "
            "dropout=0, or model.eval())"
        )
