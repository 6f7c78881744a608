"""StaticKVCache: preallocated keys and values of fixed shapes, written at tensor positions.

:class:`~qkv.nn.kv_cache.KVCache` returns the keys cached so far, so every decoding step has
another key length: under ``torch.compile`` each step is a new shape. This cache is the one
torchtune's ``kv_cache.py`` and gpt-fast's ``model.py`` use for a compiled decode step: every
layer's storage is allocated once, ``[B, Hkv, C, Dh]``; a step writes its keys/values at
``cache_position`` (a long tensor, never a Python int) and attends over all ``C`` slots, with a
mask that blocks the slots after each query (unwritten or future) and the prompt's padding. The
shapes of a step never change, so its graph compiles once.

Or over the first ``n`` slots only, those written so far: a step given a :meth:`window` of
``n`` slots reads ``n`` keys and values per layer instead of ``C``. Its length is the one shape
that changes from step to step; marked dynamic (``torch._dynamo.mark_dynamic``), it still
compiles once (:class:`~qkv.models.static_decode.StaticDecoder` does this on the CPU).

The model calls :meth:`StaticKVCache.prepare` once per step, before its layers (it returns that
mask and each token's position); each self-attention layer then calls :meth:`update`.
Cross-attention (an encoder–decoder) is not cached here.

Shapes: B batch, Hkv key/value heads, T new tokens, C capacity (slots), Dh head width.
"""

from __future__ import annotations

import torch
from torch import Tensor

from qkv._checks import check_positive_int

__all__ = ["StaticKVCache"]


class StaticKVCache:
    """Fixed-shape per-layer key/value storage for a compiled decode step.

    Args:
        num_layers: self-attention layers that call :meth:`update`.
        capacity: C, the slots of each layer (prompt + generated tokens).
        batch_size: B.
        num_kv_heads: Hkv.
        head_dim: Dh.
        dtype: storage dtype (the model's).
        device: storage device (the model's).

    Raises:
        TypeError / ValueError: sizes that are not positive ints.
    """

    def __init__(
        self,
        num_layers: int,
        capacity: int,
        *,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        self.num_layers = check_positive_int("num_layers", num_layers)
        self.capacity = check_positive_int("capacity", capacity)
        shape = (
            check_positive_int("batch_size", batch_size),
            check_positive_int("num_kv_heads", num_kv_heads),
            capacity,
            check_positive_int("head_dim", head_dim),
        )
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.padding = torch.zeros(batch_size, capacity, dtype=torch.bool, device=device)  # [B, C]
        self.pad_count = torch.zeros(batch_size, dtype=torch.long, device=device)  # [B]
        self.has_padding = False  # whether the prompt of :meth:`start` had any padding
        self._position: Tensor | None = None  # [T] slots of the current step
        self._length = capacity  # n, the slots the current step attends over

    @property
    def batch_size(self) -> int:
        """B."""
        return self.padding.shape[0]

    def start(self, is_pad: Tensor | None) -> None:
        """Begin a generation: record the (left) padding of its ``[B, T0]`` prompt.

        Slots keep their old values: :meth:`prepare`'s mask blocks every slot not written yet.

        Args:
            is_pad: bool ``[B, T0]``, True = padding (on the left of each row), or None.

        Raises:
            ValueError: another batch size, or a prompt longer than the capacity.
        """
        self.padding.zero_()
        self.pad_count.zero_()
        self.has_padding = False
        self._position, self._length = None, self.capacity
        if is_pad is None:
            return
        rows, length = is_pad.shape  # [B, T0]
        if rows != self.batch_size or length > self.capacity:
            raise ValueError(
                f"is_pad must be [B, T0] with B={self.batch_size} and T0 <= capacity="
                f"{self.capacity}, got {tuple(is_pad.shape)}"
            )
        self.padding[:, :length] = is_pad
        self.pad_count.copy_(is_pad.sum(dim=1))
        self.has_padding = bool(self.pad_count.any())

    def window(self, length: int) -> Tensor:
        """The first ``length`` slots, for :meth:`prepare`: a step given them attends over
        those slots only, not all ``C``.

        A step whose last token goes to slot ``s`` needs ``length = s + 1`` (every later slot
        is blocked for it anyway); the prompt needs its length ``T0``.

        Args:
            length: n, ``1 <= n <= C``.

        Returns:
            bool ``[B, n]``, the prompt's padding of those slots (a view of :attr:`padding`).

        Raises:
            TypeError: ``length`` not an int.
            ValueError: ``length`` outside ``[1, C]``.
        """
        if isinstance(length, bool) or not isinstance(length, int):
            raise TypeError(f"length must be an int, got {type(length).__name__}")
        if not 1 <= length <= self.capacity:
            raise ValueError(f"length must be in [1, capacity={self.capacity}], got {length}")
        return self.padding[:, :length]  # [B, n]

    def prepare(
        self, cache_position: Tensor, window: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """Set the slots this step writes; return its attention mask and its tokens' positions.

        Args:
            cache_position: long ``[T]``, the slot of each new token (``T0 + step`` when
                decoding; ``arange(T0)`` for the prompt), the same for every row.
            window: :meth:`window`, the ``n`` slots this step attends over; every slot of
                ``cache_position`` must be among them (not checked: no value is read on the
                host). None: all ``C`` slots.

        Returns:
            ``(mask, positions)``: bool ``[B, 1, T, n]`` (``n = C`` without a window), True =
            blocked (slots after the query's, and the prompt's padding); long ``[B, T]``, each
            token's position within its row's real tokens (its slot minus the row's left
            padding; 0 for a padding token, whose output nobody reads).

        Raises:
            ValueError: a ``window`` that is not bool ``[B, n]`` with ``n <= C``.
        """
        pad = self.padding if window is None else window  # [B, n]
        if pad.dtype != torch.bool or pad.dim() != 2 or pad.shape[0] != self.batch_size:
            raise ValueError(
                f"window must be bool [B={self.batch_size}, n] (StaticKVCache.window), got "
                f"{pad.dtype} {tuple(pad.shape)}"
            )
        if pad.shape[1] > self.padding.shape[1]:  # (the capacity, as a shape: it may be dynamic)
            raise ValueError(
                f"window covers {pad.shape[1]} slots, the cache has capacity={self.capacity}"
            )
        self._position, self._length = cache_position, pad.shape[1]
        slots = torch.arange(pad.shape[1], device=cache_position.device)  # [n]
        after = slots[None, :] > cache_position[:, None]  # [T, n]
        mask = after[None, None] | pad[:, None, None, :]  # [B, 1, T, n]
        positions = (cache_position[None, :] - self.pad_count[:, None]).clamp(min=0)  # [B, T]
        return mask, positions

    def update(self, layer_idx: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write one layer's new keys/values at the step's slots; return the ``n`` slots the
        step attends over (all ``C`` unless :meth:`prepare` was given a window).

        Args:
            layer_idx: which layer.
            k: ``[B, Hkv, T, Dh]``.
            v: ``[B, Hkv, T, Dh]``.

        Returns:
            ``(keys, values)``, each ``[B, Hkv, n, Dh]`` (views of the storage).

        Raises:
            RuntimeError: :meth:`prepare` was not called for this step, or a layer out of range.
        """
        if self._position is None:
            raise RuntimeError("StaticKVCache.update before prepare(cache_position)")
        if not 0 <= layer_idx < self.num_layers:
            raise RuntimeError(
                f"layer_idx={layer_idx} is out of range for a cache of {self.num_layers} layers"
            )
        self.keys[layer_idx].index_copy_(2, self._position, k)
        self.values[layer_idx].index_copy_(2, self._position, v)
        n = self._length
        return self.keys[layer_idx][:, :, :n], self.values[layer_idx][:, :, :n]  # [B, Hkv, n, Dh]

    def get_cross(self, layer_idx: int) -> tuple[Tensor, Tensor] | None:
        """Cross-attention is not cached here.

        Raises:
            RuntimeError: always (an encoder–decoder uses :class:`~qkv.nn.kv_cache.KVCache`).
        """
        raise RuntimeError("StaticKVCache holds self-attention only; use KVCache for cross")

    def set_cross(self, layer_idx: int, k: Tensor, v: Tensor) -> None:
        """See :meth:`get_cross`.

        Raises:
            RuntimeError: always.
        """
        self.get_cross(layer_idx)

    def __repr__(self) -> str:
        B, Hkv, C, Dh = self.keys[0].shape
        return (
            f"StaticKVCache(num_layers={self.num_layers}, batch_size={B}, num_kv_heads={Hkv}, "
            f"capacity={C}, head_dim={Dh}, dtype={self.keys[0].dtype})"
        )
