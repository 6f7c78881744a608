"""Stacks of N layers with an optional final norm, and the bare encoder–decoder body.

The layers are injected (built by the model or by a converter), so a stack only loops:
layer ``i`` gets ``layer_idx=i`` for its slot in a :class:`~qkv.nn.kv_cache.KVCache`. The loop
runs inside :func:`~qkv.backends.shared.share_plans`: the layers attend with the same mask over
inputs of the same shapes, so the first layer's attention plan serves them all (one plan, and
at most one host sync for a padding mask, per forward instead of one per layer).
:class:`Encoder`, :class:`Decoder` and :class:`EncoderDecoder` take ``nn.TransformerEncoder``,
``nn.TransformerDecoder`` and ``nn.Transformer``'s calls (positional order, mask senses, no
implicit causal mask, the layers' ``batch_first``), so that :mod:`qkv.convert.torch_transformer`
maps one onto the other weight for weight and call for call; qkv's extras are keyword-only.

Shapes: B batch, S source length, T target length, D model width, H heads.
Masks: as :mod:`qkv.nn.layers` (PyTorch's senses; 4-D broadcastable to ``[B, H, T, S]`` too).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Unpack

import torch
from torch import Tensor, nn

from qkv.backends.shared import share_plans
from qkv.nn.extras import DecoderExtras, EncoderExtras
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
        src: Tensor,
        mask: Tensor | None = None,
        src_key_padding_mask: Tensor | None = None,
        is_causal: bool | None = None,
        **extras: Unpack[EncoderExtras],
    ) -> Tensor:
        """``nn.TransformerEncoder.forward``; args as :meth:`EncoderLayer.forward`, extras as
        :class:`~qkv.nn.extras.EncoderExtras` (layer ``i`` gets ``layer_idx=i``).

        ``is_causal=None`` (PyTorch's default, which then inspects ``mask``) means False here:
        a causal ``mask`` blocks the same keys either way. Returns the input's shape.
        """
        x = src
        with share_plans():
            for i, layer in enumerate(self.layers):
                x = layer(
                    x, mask, src_key_padding_mask, bool(is_causal), **extras, layer_idx=i
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
        tgt: Tensor,
        memory: Tensor,
        tgt_mask: Tensor | None = None,
        memory_mask: Tensor | None = None,
        tgt_key_padding_mask: Tensor | None = None,
        memory_key_padding_mask: Tensor | None = None,
        tgt_is_causal: bool | None = None,
        memory_is_causal: bool = False,
        **extras: Unpack[DecoderExtras],
    ) -> Tensor:
        """``nn.TransformerDecoder.forward``; args as :meth:`DecoderLayer.forward`, extras as
        :class:`~qkv.nn.extras.DecoderExtras` (layer ``i`` gets ``layer_idx=i``).

        ``tgt_is_causal=None`` means False (no implicit causal mask, as in PyTorch).
        Returns the target's shape.
        """
        x = tgt
        with share_plans():
            for i, layer in enumerate(self.layers):
                x = layer(
                    x,
                    memory,
                    tgt_mask,
                    memory_mask,
                    tgt_key_padding_mask,
                    memory_key_padding_mask,
                    bool(tgt_is_causal),
                    memory_is_causal,
                    **extras,
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

    @property
    def batch_first(self) -> bool:
        """The layers' layout (read from the first encoder layer, as PyTorch does)."""
        for layer in self.encoder.layers:
            assert isinstance(layer, EncoderLayer)
            return layer.self_attn.batch_first
        return True

    def _check_pair(self, src: object, tgt: object) -> None:
        """``src`` and ``tgt`` are tensors of one rank, batch size and width (see
        :meth:`forward`'s Raises)."""
        if not isinstance(src, Tensor) or not isinstance(tgt, Tensor):
            raise TypeError(
                f"src and tgt must be tensors, got {type(src).__name__} and {type(tgt).__name__}"
            )
        batch_dim = 0 if self.batch_first else 1
        if src.dim() != tgt.dim() or (
            src.dim() == 3 and src.shape[batch_dim] != tgt.shape[batch_dim]
        ):
            layout = "[B, L, D]" if self.batch_first else "[L, B, D]"
            raise ValueError(
                f"src and tgt must share the batch size in the layout {layout} "
                f"(batch_first={self.batch_first}), got {tuple(src.shape)} and {tuple(tgt.shape)}"
            )
        if src.shape[-1] != tgt.shape[-1]:
            raise ValueError(
                f"src and tgt must share the width D, got {tuple(src.shape)} and {tuple(tgt.shape)}"
            )

    @staticmethod
    def generate_square_subsequent_mask(
        sz: int, device: torch.device | None = None, dtype: torch.dtype | None = None
    ) -> Tensor:
        """``nn.Transformer.generate_square_subsequent_mask``: float ``[sz, sz]``, ``-inf``
        above the diagonal, 0 elsewhere."""
        return nn.Transformer.generate_square_subsequent_mask(sz, device, dtype)

    def forward(
        self,
        src: Tensor,
        tgt: Tensor,
        src_mask: Tensor | None = None,
        tgt_mask: Tensor | None = None,
        memory_mask: Tensor | None = None,
        src_key_padding_mask: Tensor | None = None,
        tgt_key_padding_mask: Tensor | None = None,
        memory_key_padding_mask: Tensor | None = None,
        src_is_causal: bool | None = None,
        tgt_is_causal: bool | None = None,
        memory_is_causal: bool = False,
    ) -> Tensor:
        """``nn.Transformer.forward``: the same signature and semantics.

        No causal mask unless asked for (``tgt_mask`` or ``tgt_is_causal=True``); the layout is
        the layers' ``batch_first`` (the source module's, for a converted one).

        Args:
            src: ``[B, S, D]`` (``[S, B, D]`` if not ``batch_first``; ``[S, D]`` unbatched).
            tgt: ``[B, T, D]``, same layout.
            src_mask: encoder self-attention mask ``[S, S]`` or ``[B * H, S, S]``, bool
                True = blocked, or float added to the scores.
            tgt_mask: decoder self-attention mask ``[T, T]`` or ``[B * H, T, T]``, same senses.
            memory_mask: cross-attention mask ``[T, S]`` or ``[B * H, T, S]``, same senses.
            src_key_padding_mask: ``[B, S]``, bool True = padding, or float.
            tgt_key_padding_mask: ``[B, T]``, bool True = padding, or float.
            memory_key_padding_mask: ``[B, S]``, bool True = padding, or float.
            src_is_causal: causal encoder self-attention (None: False).
            tgt_is_causal: causal decoder self-attention (None: False).
            memory_is_causal: causal cross-attention.

        Returns:
            ``[B, T, D]`` in ``tgt``'s layout.

        Raises:
            TypeError: ``src`` or ``tgt`` is not a tensor.
            ValueError: ``src`` and ``tgt`` of different batch sizes or widths, or of different
                ranks.
        """
        self._check_pair(src, tgt)
        memory = self.encoder(src, src_mask, src_key_padding_mask, src_is_causal)  # [B, S, D]
        return self.decoder(
            tgt,
            memory,
            tgt_mask,
            memory_mask,
            tgt_key_padding_mask,
            memory_key_padding_mask,
            tgt_is_causal,
            memory_is_causal,
        )  # [B, T, D]
