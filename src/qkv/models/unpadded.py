"""Encoder layers run on the real tokens only: the unpadded path of :class:`BertEncoder`.

A padded batch of sentences of mixed lengths spends much of every linear layer, norm and
feed-forward block on padding. :func:`encode_unpadded` runs a stack of
:class:`~qkv.nn.layers.EncoderLayer` s on the packed rows of the real tokens instead (see
:mod:`qkv.models.packing`): each layer's own submodules (``q_proj``, ``k_proj``, ``v_proj``,
``out_proj``, ``ffn``, the norms and dropouts) work on ``[N, D]`` rows, and only attention, the one
step that mixes rows, runs on the compact ``[B', T']`` grid, through :func:`qkv.attention` with the
layer's backend, scale and dropout. Nothing is cached: the weights are read from the layers at each
call, so in-place updates and ``load_state_dict`` are seen.

The result is :meth:`EncoderLayer.forward`'s on the real tokens (to float roundoff; the tests hold
it to float64 precision); padding positions come back as zeros. :func:`runs_unpadded` says which
layers this reproduces: no recorded weights and no hooks on the layer or its attention (those
would miss calls), self-attention with equal key and query widths.

Shapes: B batch, T padded length, N real tokens, B' samples with a token, T' longest length,
D model width, H heads, Hkv key/value heads, Dh head width.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from qkv.functional import attention
from qkv.models.packing import Packing, plan_packing
from qkv.nn.layers import EncoderLayer
from qkv.nn.multihead import MultiHeadAttention

__all__ = ["encode_unpadded", "layer_on_rows", "runs_unpadded"]

BIAS_BACKENDS = ("auto", "fused")
"""Backends that get the grid's padding keys as a float bias: one batched SDPA call, which they do
not cut into per-length calls as they would a bool mask (the calls cost more than the padding
they skip)."""


def runs_unpadded(layer: EncoderLayer) -> bool:
    """Whether :func:`encode_unpadded` reproduces ``layer``'s forward.

    Args:
        layer: an encoder layer.

    Returns:
        False when something observes the layer's calls (forward hooks on the layer or its
        attention, recorded attention weights) or the attention is not plain self-attention over
        the model width (other key or value widths).
    """
    attn = layer.self_attn
    if attn.record_weights or attn.kdim != attn.embed_dim or attn.vdim != attn.embed_dim:
        return False
    return not any(m._forward_hooks or m._forward_pre_hooks for m in (layer, attn))


def encode_unpadded(layers: Sequence[EncoderLayer], x: Tensor, is_pad: Tensor) -> Tensor:
    """The layers on the real tokens of ``x`` only.

    Plans the packing on the host (one sync); for eager use, not tracing or compiling.

    Args:
        layers: encoder layers for which :func:`runs_unpadded` holds.
        x: ``[B, T, D]`` inputs, batch first.
        is_pad: bool ``[B, T]``, True = padding.

    Returns:
        ``[B, T, D]``: the layers' outputs at the real tokens, zeros at padding.
    """
    plan = plan_packing(is_pad)
    if plan.rows == 0:
        return x.new_zeros(x.shape)  # [B, T, D]: no token at all
    blocked = plan.grid_padding  # [B', 1, 1, T'] or None; no row fully blocked
    bias = None if blocked is None else x.new_zeros(blocked.shape).masked_fill(blocked, -torch.inf)
    rows = plan.pack(x)  # [N, D]
    for layer in layers:
        attend = _GridAttention(layer.self_attn, plan, blocked, bias)
        rows = layer_on_rows(layer, rows, attend)  # [N, D]
    return plan.unpack(rows)  # [B, T, D], zeros at padding


class _GridAttention:
    """One layer's attention core on packed rows: ``q, k, v`` rows ``[N, *]`` -> ``[N, D]``.

    The rows go to the grid, attend there with the padding as a bool mask or (SDPA backends) a
    float bias, and come back as rows; the output projection is the caller's.
    """

    def __init__(
        self, attn: MultiHeadAttention, plan: Packing, blocked: Tensor | None, bias: Tensor | None
    ) -> None:
        self.attn, self.plan = attn, plan
        as_bias = attn.backend in BIAS_BACKENDS
        self.mask: Tensor | None = None if as_bias else blocked  # [B', 1, 1, T']
        self.bias: Tensor | None = bias if as_bias else None  # [B', 1, 1, T']

    def _heads(self, rows: Tensor, heads: int) -> Tensor:
        grid = self.plan.to_grid(rows)  # [B', T', heads * Dh]
        B, T, _ = grid.shape
        return grid.view(B, T, heads, self.attn.head_dim).transpose(1, 2)  # [B', heads, T', Dh]

    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        attn = self.attn
        out, _ = attention(
            self._heads(q, attn.num_heads),
            self._heads(k, attn.num_kv_heads),
            self._heads(v, attn.num_kv_heads),
            mask=self.mask,
            attn_bias=self.bias,
            scale=attn.scale,
            dropout_p=attn.dropout,
            training=attn.training,
            backend=attn.backend,
        )  # [B', H, T', Dh]
        B, _, T, _ = out.shape
        grid = out.transpose(1, 2).reshape(B, T, attn.embed_dim)  # [B', T', D]
        return self.plan.from_grid(grid)  # [N, D]


def layer_on_rows(
    layer: EncoderLayer, x: Tensor, attend: Callable[[Tensor, Tensor, Tensor], Tensor]
) -> Tensor:
    """:meth:`EncoderLayer.forward` on ``[N, D]`` rows, attention through ``attend``.

    Args:
        layer: an encoder layer for which :func:`runs_unpadded` holds.
        x: ``[N, D]`` rows.
        attend: the attention core: projected ``q, k, v`` rows ``[N, *]`` -> ``[N, D]``, before
            the output projection (the rows' own sentences are its business).

    Returns:
        ``[N, D]``.
    """
    attn = layer.self_attn

    def self_block(h: Tensor) -> Tensor:
        out = attend(attn.q_proj(h), attn.k_proj(h), attn.v_proj(h))  # [N, D]
        return layer.dropout1(attn.out_proj(out))  # [N, D]

    if layer.norm_first:
        x = x + self_block(layer.norm1(x))  # [N, D]
        return x + layer.dropout2(layer.ffn(layer.norm2(x)))  # [N, D]
    x = layer.norm1(x + self_block(x))  # [N, D]
    return layer.norm2(x + layer.dropout2(layer.ffn(x)))  # [N, D]
