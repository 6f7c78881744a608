"""KVCache: the keys and values of every layer for incremental decoding.

It lives outside the attention modules (one cache per model and per generation), so a module
stays a pure function of its inputs and weights. Each self-attention layer calls
:meth:`KVCache.update` with the keys/values of its *new* tokens and attends over everything
returned; storage is preallocated to ``capacity`` tokens on first use, so appending costs the
size of the new tokens only and the per-token cost of decoding stays flat.

Cross-attention keys/values (from the encoder output, fixed during decoding) are computed once
and kept with :meth:`set_cross` / :meth:`get_cross`.

Shapes: B batch, Hkv key/value heads, T new tokens, S cached + new tokens, Dh head width.
"""

from __future__ import annotations

import torch
from torch import Tensor

from qkv._checks import check_positive_int
from qkv._deprecation import RenamedAttribute, renamed_keyword

__all__ = ["KVCache"]


class KVCache:
    """Per-layer key/value storage with one shared length.

    Args:
        num_layers: number of attention layers that will call :meth:`update`.
        capacity: the most tokens (cached + new) each layer holds.
        max_len: deprecated spelling of ``capacity`` (one release).

    Raises:
        TypeError: sizes that are not ints.
        ValueError: non-positive sizes.
        TypeError: both ``capacity`` and ``max_len``.
    """

    def __init__(
        self, num_layers: int, capacity: int | None = None, *, max_len: int | None = None
    ) -> None:
        capacity = renamed_keyword("max_len", max_len, "capacity", capacity, owner="KVCache")
        if capacity is None:
            raise TypeError("KVCache needs a capacity")
        self.num_layers = check_positive_int("num_layers", num_layers)
        self.capacity = check_positive_int("capacity", capacity)
        self._k: list[Tensor | None] = [None] * num_layers
        self._v: list[Tensor | None] = [None] * num_layers
        self._lengths = [0] * num_layers
        self._cross: dict[int, tuple[Tensor, Tensor]] = {}
        self._padding: Tensor | None = None  # [B, S] True = padding key, or None
        self._padding_len = 0

    max_len = RenamedAttribute[int]("capacity")

    @property
    def length(self) -> int:
        """Tokens cached in every layer (the position offset of the next token)."""
        return min(self._lengths)

    def __len__(self) -> int:
        return self.length

    def _check_layer(self, layer_idx: int) -> None:
        if not 0 <= layer_idx < self.num_layers:
            raise RuntimeError(
                f"layer_idx={layer_idx} is out of range for a cache of {self.num_layers} layers"
            )

    def update(self, layer_idx: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append the new keys/values of one layer; return all of that layer's keys/values.

        Args:
            layer_idx: which layer, ``0 <= layer_idx < num_layers``.
            k: ``[B, Hkv, T, Dh]``.
            v: ``[B, Hkv, T, Dv]``.

        Returns:
            ``(k_all [B, Hkv, S, Dh], v_all [B, Hkv, S, Dv])``: views of the storage.

        Raises:
            RuntimeError: layer out of range, the capacity exceeded, a layer updated twice for one
                step, or shapes/dtypes that differ from the earlier updates.
        """
        self._check_layer(layer_idx)
        if k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3]:
            raise RuntimeError(
                f"k and v must be [B, Hkv, T, *] with equal B, Hkv, T; got {tuple(k.shape)} and "
                f"{tuple(v.shape)}"
            )
        start = self._lengths[layer_idx]
        if start > self.length:
            raise RuntimeError(
                f"layer {layer_idx} was updated twice for one step (it holds {start} tokens, "
                f"other layers {self.length}); call each layer's update once per step"
            )
        T = k.shape[2]
        if start + T > self.capacity:
            raise RuntimeError(
                f"KV cache overflow: {start} cached + {T} new tokens > capacity={self.capacity}"
            )
        ck, cv = self._k[layer_idx], self._v[layer_idx]
        if ck is None or cv is None:
            B, Hkv, _, Dh = k.shape
            ck = k.new_empty(B, Hkv, self.capacity, Dh)  # [B, Hkv, capacity, Dh]
            cv = v.new_empty(B, Hkv, self.capacity, v.shape[3])  # [B, Hkv, capacity, Dv]
            self._k[layer_idx], self._v[layer_idx] = ck, cv
        elif (
            ck.shape[:2] != k.shape[:2]
            or ck.shape[3] != k.shape[3]
            or cv.shape[3] != v.shape[3]
            or ck.dtype != k.dtype
        ):
            raise RuntimeError(
                f"layer {layer_idx}: new keys {tuple(k.shape)} {k.dtype} do not match the cached "
                f"{tuple(ck.shape)} {ck.dtype} (same B, Hkv, Dh and dtype expected)"
            )
        ck[:, :, start : start + T] = k
        cv[:, :, start : start + T] = v
        self._lengths[layer_idx] = start + T
        return ck[:, :, : start + T], cv[:, :, : start + T]  # [B, Hkv, S, Dh], [B, Hkv, S, Dv]

    def append_padding(self, is_pad: Tensor | None, T: int) -> Tensor | None:
        """Record which of the ``T`` new tokens are padding; return the mask of all keys.

        Call once per step, before the layers. Returns None while no padding was ever recorded.

        Args:
            is_pad: bool ``[B, T]`` (True = padding) or None (no padding among the new tokens).
            T: number of new tokens.

        Returns:
            bool ``[B, S]`` over every cached + new key, or None.

        Raises:
            RuntimeError: called twice for one step or with a batch size that changed.
        """
        if self._padding_len != self.length:
            raise RuntimeError(
                f"append_padding called twice for one step (padding covers {self._padding_len} "
                f"tokens, the cache {self.length})"
            )
        self._padding_len += T
        if is_pad is None and self._padding is None:
            return None
        if is_pad is None:
            assert self._padding is not None
            is_pad = self._padding.new_zeros(self._padding.shape[0], T)  # [B, T]
        if self._padding is None:
            old = is_pad.new_zeros(is_pad.shape[0], self._padding_len - T)  # [B, S - T]
        else:
            old = self._padding
            if old.shape[0] != is_pad.shape[0]:
                raise RuntimeError(f"batch size changed from {old.shape[0]} to {is_pad.shape[0]}")
        self._padding = torch.cat([old, is_pad], dim=1)  # [B, S]
        return self._padding

    def set_cross(self, layer_idx: int, k: Tensor, v: Tensor) -> None:
        """Keep a layer's cross-attention keys/values ``[B, Hkv, S_src, Dh]`` for later steps.

        Raises:
            RuntimeError: layer out of range.
        """
        self._check_layer(layer_idx)
        self._cross[layer_idx] = (k, v)

    def get_cross(self, layer_idx: int) -> tuple[Tensor, Tensor] | None:
        """The cross-attention keys/values stored by :meth:`set_cross`, or None."""
        self._check_layer(layer_idx)
        return self._cross.get(layer_idx)

    def reorder(self, index: Tensor) -> None:
        """Select batch rows (beam search): row ``i`` becomes old row ``index[i]``.

        Args:
            index: long ``[B_new]``.
        """
        for i in range(self.num_layers):
            ck, cv = self._k[i], self._v[i]
            if ck is not None and cv is not None:
                self._k[i] = ck.index_select(0, index)
                self._v[i] = cv.index_select(0, index)
        self._cross = {
            i: (k.index_select(0, index), v.index_select(0, index))
            for i, (k, v) in self._cross.items()
        }
        if self._padding is not None:
            self._padding = self._padding.index_select(0, index)

    def reset(self) -> None:
        """Forget everything (the storage is freed and reallocated on the next update)."""
        self._k = [None] * self.num_layers
        self._v = [None] * self.num_layers
        self._lengths = [0] * self.num_layers
        self._cross = {}
        self._padding = None
        self._padding_len = 0

    def __repr__(self) -> str:
        return (
            f"KVCache(num_layers={self.num_layers}, capacity={self.capacity}, length={self.length})"
        )
