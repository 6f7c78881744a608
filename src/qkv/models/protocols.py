"""What decoding needs from a model, as Protocols: the models import the decoding loops, and the
loops name no model class, not even for typing (no import cycle, see ``tests/test_imports.py``).

:class:`~qkv.models.decoder_only.DecoderOnlyLM` is a :class:`DecoderOnlyModel` and
:class:`~qkv.models.transformer.Transformer` an :class:`EncoderDecoderModel`; mypy checks both
where the models hand themselves to :mod:`qkv.models.generate` and
:mod:`qkv.models.static_decode`.

Shapes: B batch, T new tokens, S source length, C cache slots, D model width, V vocabulary.
"""

from __future__ import annotations

from typing import Protocol

from torch import Tensor

from qkv.models.config import DecoderOnlyConfig, TransformerConfig
from qkv.nn.kv_cache import KVCache
from qkv.nn.static_kv_cache import StaticKVCache

__all__ = ["DecoderOnlyModel", "EncoderDecoderModel"]


class DecoderOnlyModel(Protocol):
    """A language model decoded token by token (see :class:`~qkv.models.DecoderOnlyLM`)."""

    @property
    def config(self) -> DecoderOnlyConfig:
        """The sizes and special ids."""
        ...

    def __call__(
        self,
        ids: Tensor,
        padding_mask: Tensor | None = ...,
        *,
        kv_cache: KVCache | None = ...,
        logits_to_keep: int = ...,
    ) -> Tensor:
        """``[B, T]`` ids -> logits ``[B, T, V]``, the cache extended by ``T``."""
        ...

    def new_cache(self, capacity: int | None = None) -> KVCache:
        """An empty cache of ``capacity`` tokens."""
        ...

    def new_static_cache(self, batch_size: int, capacity: int) -> StaticKVCache:
        """An empty fixed-shape cache of ``capacity`` slots."""
        ...

    def forward_static(
        self,
        ids: Tensor,
        kv_cache: StaticKVCache,
        cache_position: Tensor,
        *,
        logits_to_keep: int = 0,
        window: Tensor | None = None,
    ) -> Tensor:
        """``[B, T]`` ids at slots ``cache_position`` ``[T]`` -> logits ``[B, T, V]``, attending
        over the slots of ``window`` (``kv_cache.window(n)``) or all of them (None)."""
        ...


class EncoderDecoderModel(Protocol):
    """An encoder–decoder decoded token by token (see :class:`~qkv.models.Transformer`)."""

    @property
    def config(self) -> TransformerConfig:
        """The sizes and special ids."""
        ...

    def source_padding(
        self, src: Tensor, src_padding_mask: Tensor | None = None, *, validate: bool = True
    ) -> Tensor | None:
        """The checked source's padding, bool ``[B, S]``, or None."""
        ...

    def encode_padded(self, src: Tensor, is_pad: Tensor | None) -> Tensor:
        """Checked source ids ``[B, S]`` -> memory ``[B, S, D]``."""
        ...

    def decode(
        self,
        tgt: Tensor,
        memory: Tensor,
        src_padding_mask: Tensor | None = None,
        tgt_padding_mask: Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> Tensor:
        """Target ids ``[B, T]`` over ``memory`` -> logits ``[B, T, V]``."""
        ...

    def new_cache(self, capacity: int | None = None) -> KVCache:
        """An empty decoder cache of ``capacity`` target tokens."""
        ...
