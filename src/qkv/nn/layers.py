"""Encoder and decoder layers: attention and feed-forward blocks, each wrapped in a residual
connection with normalization before (``norm_first=True``, pre-norm) or after (post-norm, the
original Transformer and ``nn.Transformer``'s default) the sublayer.

Both layers share one constructor (:class:`_Layer`): a decoder layer is an encoder layer plus a
cross-attention block with its own norm and dropout. The attribute names are the state-dict keys
(``self_attn``, ``cross_attn``, ``ffn``, ``norm1..3``), fixed for checkpoints and converters.

The calls are ``nn.TransformerEncoderLayer`` / ``nn.TransformerDecoderLayer``'s, positional
order and mask senses included, so a converted layer is a drop-in for PyTorch's: attention masks
bool True = blocked or float added to the scores, ``[T, S]`` or ``[B * H, T, S]`` (and, qkv's
extension, 4-D broadcastable to ``[B, H, T, S]``); key-padding masks ``[B, S]``, True = padding;
no causal mask unless asked for. qkv's extras (ALiBi bias, rotary tables, a KV cache) are
keyword-only.

Shapes: B batch, T target length, S source length, D model width, H heads; inputs ``[B, L, D]``
(``[L, B, D]`` with ``batch_first=False``, ``[L, D]`` unbatched).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Unpack

import torch
from torch import Tensor, nn

from qkv.dropout import Dropout
from qkv.nn.extras import DecoderLayerExtras, EncoderLayerExtras
from qkv.nn.feed_forward import Activation, FeedForward
from qkv.nn.multihead import MultiHeadAttention
from qkv.nn.norms import NormKind, make_norm

__all__ = ["DecoderLayer", "EncoderLayer", "NormKind", "make_norm"]

# (attention mask, key-padding mask) of one attention block, in PyTorch's senses
_Masks = tuple[Tensor | None, Tensor | None]
# keyword arguments of one MultiHeadAttention call (qkv's extras: bias, rotary tables, cache)
_Extras = Mapping[str, object]


class _Layer(nn.Module):
    """The parts every layer has: self-attention, feed-forward, one norm and one dropout per
    sublayer; :attr:`_cross` adds the cross-attention block (decoder layers).

    Args:
        d_model: D.
        num_heads: H.
        dim_feedforward: inner width of the feed-forward block.
        dropout: dropout on attention weights, the FFN activation and each residual branch.
        activation: one of :data:`~qkv.nn.feed_forward.ACTIVATIONS`.
        norm_first: pre-norm (True) or post-norm (False).
        layer_norm_eps: eps of the norms.
        norm: ``"layer"`` (LayerNorm) or ``"rms"`` (RMSNorm).
        num_kv_heads: key/value heads for grouped-query attention (default H).
        bias: biases in the linear layers.
        batch_first: inputs are ``[B, L, D]`` (True) or ``[L, B, D]`` (False, PyTorch's
            default; qkv's is True).
        qkv_bias: biases on the attention's query/key/value projections (default ``bias``).
        out_bias: a bias on the attention's output projection (default ``bias``).
        attn_scale: the attention's score multiplier (default ``1 / sqrt(Dh)``).
        ffn_bias: biases in the feed-forward block (default ``bias``).
        device: parameter device.
        dtype: parameter dtype.
    """

    _cross: ClassVar[bool] = False
    norm1: nn.Module
    norm2: nn.Module
    dropout1: Dropout
    dropout2: Dropout

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
        batch_first: bool = True,
        qkv_bias: bool | None = None,
        out_bias: bool | None = None,
        ffn_bias: bool | None = None,
        attn_scale: float | None = None,
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
            "batch_first": batch_first,
            "scale": attn_scale,
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
            setattr(self, f"dropout{i}", Dropout(dropout))

    @staticmethod
    def _attend(
        attn: MultiHeadAttention,
        x: Tensor,
        kv: Tensor,
        masks: _Masks,
        is_causal: bool,
        extra: _Extras,
    ) -> Tensor:
        attn_mask, key_padding_mask = masks
        out, _ = attn(
            x,
            kv,
            kv,
            key_padding_mask=key_padding_mask,
            need_weights=False,
            attn_mask=attn_mask,
            is_causal=is_causal,
            **extra,
        )
        return out  # [B, T, D]

    def _self_block(self, x: Tensor, masks: _Masks, is_causal: bool, extra: _Extras) -> Tensor:
        return self.dropout1(self._attend(self.self_attn, x, x, masks, is_causal, extra))


class EncoderLayer(_Layer):
    """Bidirectional self-attention then feed-forward, each with residual + norm.

    Post-norm: ``x = norm1(x + drop(attn(x))); x = norm2(x + drop(ffn(x)))``.
    Pre-norm: ``x = x + drop(attn(norm1(x))); x = x + drop(ffn(norm2(x)))``.

    Args: as :class:`_Layer`.
    """

    def forward(
        self,
        src: Tensor,
        src_mask: Tensor | None = None,
        src_key_padding_mask: Tensor | None = None,
        is_causal: bool = False,
        **extras: Unpack[EncoderLayerExtras],
    ) -> Tensor:
        """``nn.TransformerEncoderLayer.forward``, plus qkv's keyword-only extras.

        Args:
            src: ``[B, T, D]`` (``[T, B, D]`` if not ``batch_first``, ``[T, D]`` unbatched).
            src_mask: ``[T, S]``, ``[B * H, T, S]`` or 4-D broadcastable to ``[B, H, T, S]``;
                bool True = blocked, or float added to the scores. ``S = T`` without a cache,
                cached + new tokens with one.
            src_key_padding_mask: ``[B, S]``, bool True = padding, or float added to the scores.
            is_causal: also block future positions (bottom-right aligned, right with a cache);
                PyTorch reads it as a hint that ``src_mask`` is causal: the same result then.
            **extras: ``attn_bias``, ``rope``, ``kv_cache``, ``layer_idx``, passed to the
                self-attention (see :class:`~qkv.nn.extras.EncoderLayerExtras`).

        Returns:
            The input's shape and layout.
        """
        x = src
        masks = (src_mask, src_key_padding_mask)
        if self.norm_first:
            x = x + self._self_block(self.norm1(x), masks, is_causal, extras)  # [B, T, D]
            x = x + self.dropout2(self.ffn(self.norm2(x)))  # [B, T, D]
        else:
            x = self.norm1(x + self._self_block(x, masks, is_causal, extras))  # [B, T, D]
            x = self.norm2(x + self.dropout2(self.ffn(x)))  # [B, T, D]
        return x


class DecoderLayer(_Layer):
    """Causal self-attention, cross-attention to the encoder output, feed-forward.

    Args: as :class:`_Layer`.
    """

    _cross = True
    cross_attn: MultiHeadAttention
    norm3: nn.Module
    dropout3: Dropout

    def _cross_block(
        self, x: Tensor, memory: Tensor, masks: _Masks, is_causal: bool, extra: _Extras
    ) -> Tensor:
        return self.dropout2(self._attend(self.cross_attn, x, memory, masks, is_causal, extra))

    def forward(
        self,
        tgt: Tensor,
        memory: Tensor,
        tgt_mask: Tensor | None = None,
        memory_mask: Tensor | None = None,
        tgt_key_padding_mask: Tensor | None = None,
        memory_key_padding_mask: Tensor | None = None,
        tgt_is_causal: bool = False,
        memory_is_causal: bool = False,
        **extras: Unpack[DecoderLayerExtras],
    ) -> Tensor:
        """``nn.TransformerDecoderLayer.forward``, plus qkv's keyword-only extras.

        Args:
            tgt: target ``[B, T, D]`` (``[T, B, D]`` if not ``batch_first``, ``[T, D]``
                unbatched).
            memory: encoder output ``[B, S, D]``, same layout.
            tgt_mask: self-attention mask ``[T, T]``, ``[B * H, T, T]`` or 4-D broadcastable
                to ``[B, H, T, T]`` (with a cache the last dim counts cached + new tokens);
                bool True = blocked, or float added to the scores.
            memory_mask: cross-attention mask, the same forms over ``[T, S]``.
            tgt_key_padding_mask: ``[B, T]`` (cached + new), bool True = padding, or float.
            memory_key_padding_mask: ``[B, S]``, bool True = padding, or float.
            tgt_is_causal: block future target positions (bottom-right aligned). Default
                False, as in PyTorch: pass it (or a causal ``tgt_mask``) for a decoder.
            memory_is_causal: the same for the cross-attention.
            **extras: ``self_attn_bias``, ``rope``, ``kv_cache``, ``layer_idx`` (see
                :class:`~qkv.nn.extras.DecoderLayerExtras`); the cross-attention takes only
                the cache and its slot.

        Returns:
            The target's shape and layout.
        """
        x = tgt
        self_masks = (tgt_mask, tgt_key_padding_mask)
        cross_masks = (memory_mask, memory_key_padding_mask)
        cache = {"kv_cache": extras.get("kv_cache"), "layer_idx": extras.get("layer_idx", 0)}
        sa = {**cache, "rope": extras.get("rope"), "attn_bias": extras.get("self_attn_bias")}
        ca = {**cache, "cross": True}
        if self.norm_first:
            x = x + self._self_block(self.norm1(x), self_masks, tgt_is_causal, sa)  # [B, T, D]
            x = x + self._cross_block(
                self.norm2(x), memory, cross_masks, memory_is_causal, ca
            )  # [B, T, D]
            x = x + self.dropout3(self.ffn(self.norm3(x)))  # [B, T, D]
        else:
            x = self.norm1(x + self._self_block(x, self_masks, tgt_is_causal, sa))  # [B, T, D]
            x = self.norm2(
                x + self._cross_block(x, memory, cross_masks, memory_is_causal, ca)
            )  # [B, T, D]
            x = self.norm3(x + self.dropout3(self.ffn(x)))  # [B, T, D]
        return x
