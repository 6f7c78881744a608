"""Stacks of N layers with an optional final norm, and the bare encoder–decoder body.

The layers are injected (built by the model or by a converter), so a stack only loops:
layer ``i`` gets ``layer_idx=i`` for its slot in a :class:`~qkv.nn.kv_cache.KVCache`.
:class:`EncoderDecoder` is ``nn.Transformer`` without embeddings or head, the same call
(batch first, True = padding masks), so that :mod:`qkv.convert.torch_transformer` maps one onto
the other weight for weight.

Shapes: B batch, S source length, T target length, D model width, H heads.
Masks are in qkv's convention (bool, True = blocked, broadcastable to ``[B, H, T, S]``).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn

from qkv.masks import padding_mask
from qkv.nn.kv_cache import KVCache
from qkv.nn.layers import DecoderLayer, EncoderLayer

__all__ = ["Decoder", "Encoder", "EncoderDecoder"]


class Encoder(nn.Module):
    """``norm(layer_N(... layer_1(x)))``.

    Args:
        layers: the encoder layers (also causal decoder-only blocks, with ``is_causal=True``).
        norm: final norm (pre-norm stacks need one), or None.
    """

    def __init__(self, layers: Sequence[EncoderLayer], norm: nn.Module | None = None) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.norm = norm

    def forward(
        self,
        x: Tensor,
        mask: Tensor | None = None,
        *,
        is_causal: bool = False,
        attn_bias: Tensor | None = None,
        rope: tuple[Tensor, Tensor] | None = None,
        kv_cache: KVCache | None = None,
    ) -> Tensor:
        """Args: as :meth:`EncoderLayer.forward`; x ``[B, T, D]``. Returns ``[B, T, D]``."""
        for i, layer in enumerate(self.layers):
            x = layer(
                x,
                mask,
                is_causal=is_causal,
                attn_bias=attn_bias,
                rope=rope,
                kv_cache=kv_cache,
                layer_idx=i,
            )  # [B, T, D]
        return x if self.norm is None else self.norm(x)


class Decoder(nn.Module):
    """Decoder layers over the encoder output, then an optional final norm.

    Args:
        layers: the decoder layers.
        norm: final norm, or None.
    """

    def __init__(self, layers: Sequence[DecoderLayer], norm: nn.Module | None = None) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.norm = norm

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
    ) -> Tensor:
        """Args: as :meth:`DecoderLayer.forward`; x ``[B, T, D]``. Returns ``[B, T, D]``."""
        for i, layer in enumerate(self.layers):
            x = layer(
                x,
                memory,
                self_mask,
                memory_mask,
                is_causal=is_causal,
                self_attn_bias=self_attn_bias,
                rope=rope,
                kv_cache=kv_cache,
                layer_idx=i,
            )  # [B, T, D]
        return x if self.norm is None else self.norm(x)


class EncoderDecoder(nn.Module):
    """The body of ``nn.Transformer``: encoder stack, decoder stack, no embeddings or head.

    Args:
        encoder: an :class:`Encoder`.
        decoder: a :class:`Decoder`.
    """

    def __init__(self, encoder: Encoder, decoder: Decoder) -> None:
        super().__init__()
        self.encoder = encoder
        self.decoder = decoder

    def forward(
        self,
        src: Tensor,
        tgt: Tensor,
        src_key_padding_mask: Tensor | None = None,
        tgt_key_padding_mask: Tensor | None = None,
        memory_key_padding_mask: Tensor | None = None,
        *,
        tgt_is_causal: bool = True,
    ) -> Tensor:
        """``nn.Transformer(batch_first=True)``'s forward with key-padding masks only.

        Args:
            src: ``[B, S, D]``.
            tgt: ``[B, T, D]``.
            src_key_padding_mask: bool ``[B, S]``, True = padding.
            tgt_key_padding_mask: bool ``[B, T]``, True = padding.
            memory_key_padding_mask: bool ``[B, S]``, True = padding.
            tgt_is_causal: causal target self-attention.

        Returns:
            ``[B, T, D]``.
        """

        def pad(m: Tensor | None) -> Tensor | None:
            return None if m is None else padding_mask(m)  # [B, 1, 1, L]

        memory = self.encoder(src, pad(src_key_padding_mask))  # [B, S, D]
        return self.decoder(
            tgt,
            memory,
            pad(tgt_key_padding_mask),
            pad(memory_key_padding_mask),
            is_causal=tgt_is_causal,
        )  # [B, T, D]
