"""Encoder and decoder layers: attention and feed-forward blocks, each wrapped in a residual
connection with normalization before (``norm_first=True``, pre-norm) or after (post-norm, the
original Transformer and ``nn.Transformer``'s default) the sublayer.

Both layers share one constructor (:class:`_Layer`): a decoder layer is an encoder layer plus a
cross-attention block with its own norm and dropout. The attribute names are the state-dict keys
(``self_attn``, ``cross_attn``, ``ffn``, ``norm1..3``), fixed for checkpoints and converters.

Shapes: B batch, T target length, S source length, D model width, H heads.
Masks are in qkv's convention (bool, True = blocked, broadcastable to ``[B, H, T, S]``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor, nn

from qkv.nn.feed_forward import Activation, FeedForward
from qkv.nn.multihead import MultiHeadAttention
from qkv.nn.norms import NormKind, make_norm

if TYPE_CHECKING:
    from qkv.nn.kv_cache import KVCache

__all__ = ["DecoderLayer", "EncoderLayer", "NormKind", "make_norm"]


class _Layer(nn.Module):
    """The parts every layer has: self-attention, feed-forward, one norm and one dropout per
    sublayer; :attr:`_cross` adds the cross-attention block (decoder layers).

    Args:
        d_model: D.
        num_heads: H.
        dim_feedforward: inner width of the feed-forward block.
        dropout: dropout on attention weights, the FFN activation and each residual branch.
        activation: ``"relu"``, ``"gelu"`` or ``"swiglu"``.
        norm_first: pre-norm (True) or post-norm (False).
        layer_norm_eps: eps of the norms.
        norm: ``"layer"`` (LayerNorm) or ``"rms"`` (RMSNorm).
        num_kv_heads: key/value heads for grouped-query attention (default H).
        bias: biases in the linear layers.
        qkv_bias: biases on the attention's query/key/value projections (default ``bias``).
        out_bias: a bias on the attention's output projection (default ``bias``).
        ffn_bias: biases in the feed-forward block (default ``bias``).
        device: parameter device.
        dtype: parameter dtype.
    """

    _cross: ClassVar[bool] = False
    norm1: nn.Module
    norm2: nn.Module
    dropout1: nn.Dropout
    dropout2: nn.Dropout

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        dim_feedforward: int = 2048,
        dropout: float = 0.1,
        activation: Activation = "relu",
        *,
        norm_first: bool = False,
        layer_norm_eps: float = 1e-5,
        norm: NormKind = "layer",
        num_kv_heads: int | None = None,
        bias: bool = True,
        qkv_bias: bool | None = None,
        out_bias: bool | None = None,
        ffn_bias: bool | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        self.norm_first = norm_first
        attn_kw: dict[str, Any] = {
            "num_kv_heads": num_kv_heads,
            "bias": bias,
            "qkv_bias": qkv_bias,
            "out_bias": out_bias,
            "dropout": dropout,
            **factory,
        }
        self.self_attn = MultiHeadAttention(d_model, num_heads, **attn_kw)
        if self._cross:
            self.cross_attn = MultiHeadAttention(d_model, num_heads, **attn_kw)
        ffn_b = bias if ffn_bias is None else ffn_bias
        self.ffn = FeedForward(d_model, dim_feedforward, activation, dropout, bias=ffn_b, **factory)
        sublayers = 3 if self._cross else 2
        for i in range(1, sublayers + 1):
            setattr(self, f"norm{i}", make_norm(norm, d_model, layer_norm_eps, **factory))
        for i in range(1, sublayers + 1):
            setattr(self, f"dropout{i}", nn.Dropout(dropout))

    def _self_block(
        self, x: Tensor, mask: Tensor | None, is_causal: bool, extra: dict[str, Any]
    ) -> Tensor:
        out, _ = self.self_attn(x, need_weights=False, mask=mask, is_causal=is_causal, **extra)
        return self.dropout1(out)  # [B, T, D]


class EncoderLayer(_Layer):
    """Bidirectional self-attention then feed-forward, each with residual + norm.

    Post-norm: ``x = norm1(x + drop(attn(x))); x = norm2(x + drop(ffn(x)))``.
    Pre-norm: ``x = x + drop(attn(norm1(x))); x = x + drop(ffn(norm2(x)))``.

    Args: as :class:`_Layer`.
    """

    def forward(
        self,
        x: Tensor,
        mask: Tensor | None = None,
        *,
        is_causal: bool = False,
        attn_bias: Tensor | None = None,
        rope: tuple[Tensor, Tensor] | None = None,
        kv_cache: KVCache | None = None,
        layer_idx: int = 0,
    ) -> Tensor:
        """Args:
            x: ``[B, T, D]``.
            mask: bool, True = blocked, broadcastable to ``[B, H, T, S]`` (e.g. key padding);
                ``S = T`` without a cache, cached + new tokens with one.
            is_causal: also block future positions (bottom-right aligned, right with a cache).
            attn_bias: float score bias ``[*, H, T, S]`` (ALiBi).
            rope: ``(cos, sin)`` ``[T, Dh]`` rotary tables for these positions.
            kv_cache: decode incrementally: keys/values of earlier tokens come from the cache.
            layer_idx: this layer's slot in the cache.

        Returns:
            ``[B, T, D]``.
        """
        extra: dict[str, Any] = {
            "attn_bias": attn_bias,
            "rope": rope,
            "kv_cache": kv_cache,
            "layer_idx": layer_idx,
        }
        if self.norm_first:
            x = x + self._self_block(self.norm1(x), mask, is_causal, extra)  # [B, T, D]
            x = x + self.dropout2(self.ffn(self.norm2(x)))  # [B, T, D]
        else:
            x = self.norm1(x + self._self_block(x, mask, is_causal, extra))  # [B, T, D]
            x = self.norm2(x + self.dropout2(self.ffn(x)))  # [B, T, D]
        return x


class DecoderLayer(_Layer):
    """Causal self-attention, cross-attention to the encoder output, feed-forward.

    Args: as :class:`_Layer`.
    """

    _cross = True
    cross_attn: MultiHeadAttention
    norm3: nn.Module
    dropout3: nn.Dropout

    def _cross_block(
        self, x: Tensor, memory: Tensor, mask: Tensor | None, extra: dict[str, Any]
    ) -> Tensor:
        out, _ = self.cross_attn(x, memory, memory, need_weights=False, mask=mask, **extra)
        return self.dropout2(out)  # [B, T, D]

    def forward(
        self,
        x: Tensor,
        memory: Tensor,
        self_mask: Tensor | None = None,
        memory_mask: Tensor | None = None,
        *,
        is_causal: bool = True,
        self_attn_bias: Tensor | None = None,
        rope: tuple[Tensor, Tensor] | None = None,
        kv_cache: KVCache | None = None,
        layer_idx: int = 0,
    ) -> Tensor:
        """Args:
            x: target ``[B, T, D]``.
            memory: encoder output ``[B, S, D]``.
            self_mask: bool, True = blocked, broadcastable to ``[B, H, T, T]`` (target padding;
                with a cache the last dim counts cached + new tokens).
            memory_mask: bool, True = blocked, broadcastable to ``[B, H, T, S]`` (source padding).
            is_causal: block future target positions (default True; bottom-right aligned).
            self_attn_bias: float score bias for the self-attention (ALiBi).
            rope: ``(cos, sin)`` ``[T, Dh]`` rotary tables for the target positions (self-attention
                only).
            kv_cache: decode incrementally: self-attention keys/values are appended, the
                cross-attention ones computed once.
            layer_idx: this layer's slot in the cache.

        Returns:
            ``[B, T, D]``.
        """
        sa: dict[str, Any] = {
            "attn_bias": self_attn_bias,
            "rope": rope,
            "kv_cache": kv_cache,
            "layer_idx": layer_idx,
        }
        ca: dict[str, Any] = {"kv_cache": kv_cache, "layer_idx": layer_idx, "cross": True}
        if self.norm_first:
            x = x + self._self_block(self.norm1(x), self_mask, is_causal, sa)  # [B, T, D]
            x = x + self._cross_block(self.norm2(x), memory, memory_mask, ca)  # [B, T, D]
            x = x + self.dropout3(self.ffn(self.norm3(x)))  # [B, T, D]
        else:
            x = self.norm1(x + self._self_block(x, self_mask, is_causal, sa))  # [B, T, D]
            x = self.norm2(x + self._cross_block(x, memory, memory_mask, ca))  # [B, T, D]
            x = self.norm3(x + self.dropout3(self.ffn(x)))  # [B, T, D]
        return x
