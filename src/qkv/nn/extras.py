"""qkv's keyword-only extras of a layer or stack call, declared once.

A model hands its self-attention inputs (an ALiBi bias, rotary tables, a KV cache) down a stack
to every layer and from the layer to :class:`~qkv.nn.multihead.MultiHeadAttention`. The layers
and stacks only pass them on, so their signatures take them as ``**extras`` typed with these
dicts (``typing.Unpack``, as Hugging Face types its attention kwargs): the call syntax stays
``layer(x, attn_bias=..., kv_cache=...)`` and mypy checks every keyword.

Shapes: B batch, H heads, T new tokens, S keys (cached + new), Dh head width.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypedDict

from torch import Tensor

if TYPE_CHECKING:
    from qkv.nn.kv_cache import KVCache
    from qkv.nn.static_kv_cache import StaticKVCache

__all__ = ["DecoderExtras", "DecoderLayerExtras", "EncoderExtras", "EncoderLayerExtras"]


class _SelfAttentionInputs(TypedDict, total=False):
    """What every self-attention block of a stack shares (all optional).

    Keys:
        rope: ``(cos, sin)``, each ``[T, Dh]`` (or ``[B, 1, T, Dh]``, one row of positions per
            batch row), rotary tables for the query positions.
        kv_cache: decode incrementally: keys/values of earlier tokens come from the cache
            (cross-attention ones are computed once); masks then cover ``S`` = cached + new keys
            (a :class:`~qkv.nn.static_kv_cache.StaticKVCache`: all ``C`` slots).
    """

    rope: tuple[Tensor, Tensor] | None
    kv_cache: KVCache | StaticKVCache | None


class EncoderExtras(_SelfAttentionInputs, total=False):
    """The extras of :meth:`~qkv.nn.stacks.Encoder.forward`.

    Keys:
        attn_bias: float score bias broadcastable to ``[B, H, T, S]`` (ALiBi).
        rope, kv_cache: as :class:`_SelfAttentionInputs`.
    """

    attn_bias: Tensor | None


class DecoderExtras(_SelfAttentionInputs, total=False):
    """The extras of :meth:`~qkv.nn.stacks.Decoder.forward`.

    Keys:
        self_attn_bias: float score bias of the self-attention (ALiBi); the cross-attention
            has none.
        rope, kv_cache: as :class:`_SelfAttentionInputs` (rotary: self-attention only).
    """

    self_attn_bias: Tensor | None


class EncoderLayerExtras(EncoderExtras, total=False):
    """The extras of :meth:`~qkv.nn.layers.EncoderLayer.forward`.

    Keys:
        layer_idx: this layer's slot in ``kv_cache`` (a stack passes ``i`` to layer ``i``).
        attn_bias, rope, kv_cache: as :class:`EncoderExtras`.
    """

    layer_idx: int


class DecoderLayerExtras(DecoderExtras, total=False):
    """The extras of :meth:`~qkv.nn.layers.DecoderLayer.forward`.

    Keys:
        layer_idx: this layer's slot in ``kv_cache`` (a stack passes ``i`` to layer ``i``).
        self_attn_bias, rope, kv_cache: as :class:`DecoderExtras`.
    """

    layer_idx: int
