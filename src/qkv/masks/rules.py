"""Structured masks: masks described by a rule instead of a ``[T, S]`` tensor.

Every object here means the same thing as a bool tensor in qkv's one convention (True = this key
may NOT be attended; see :mod:`qkv.masks`), and :meth:`StructuredMask.materialize` builds that
tensor. The point of the rule is that the blockwise backend never has to build it: for a tile of
queries ``[q0, q1)`` by keys ``[k0, k1)`` :meth:`StructuredMask.tile` says "nothing blocked"
(:data:`FULL`), "everything blocked" (:data:`EMPTY`, the tile is skipped), or gives the tile's
own ``[*, *, q1 - q0, k1 - k0]`` mask, from index arithmetic (causal, sliding window), lengths
(padding), per-tile min/max (document ids), or by evaluating a predicate on the tile's index grid
only (``mask_mod``, as in PyTorch's FlexAttention).

Combine rules with ``|`` (a key is blocked if any rule blocks it), e.g.
``Causal() | Padding(lengths)``.

Positions: query ``i`` sits at absolute position ``i + offset``. ``Causal`` and ``SlidingWindow``
take ``align="bottom_right"`` (default, ``offset = S - T``: the last query sees the last key,
what a KV cache needs and what ``qkv.attention(is_causal=True)`` does), ``align="top_left"``
(``offset = 0``, PyTorch SDPA's ``is_causal``), or an explicit ``offset``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor

Align = Literal["top_left", "bottom_right"]


class _Sentinel:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


FULL = _Sentinel("FULL")
"""Tile result: no key in the tile is blocked (compute it without a mask)."""
EMPTY = _Sentinel("EMPTY")
"""Tile result: every key in the tile is blocked for every batch and head (skip it)."""

TileMask = Tensor | _Sentinel
"""What :meth:`StructuredMask.tile` returns: FULL, EMPTY, or a bool tile mask."""

__all__ = [
    "EMPTY",
    "FULL",
    "Causal",
    "Dense",
    "Documents",
    "MaskMod",
    "Padding",
    "SlidingWindow",
    "StructuredMask",
    "TileMask",
    "Union",
]


class StructuredMask:
    """Base class: a mask in qkv's convention given by a rule, tile by tile."""

    def validate(self, B: int, H: int, T: int, S: int, device: torch.device) -> None:
        """Check the rule fits ``[B, H, T, S]`` on ``device``.

        Raises:
            ValueError: a size or device that does not match.
        """

    def tile(
        self,
        B: int,
        H: int,
        T: int,
        S: int,
        q0: int,
        q1: int,
        k0: int,
        k1: int,
        device: torch.device,
    ) -> TileMask:
        """Mask of queries ``[q0, q1)`` by keys ``[k0, k1)``.

        Returns:
            :data:`FULL`, :data:`EMPTY`, or a bool tensor broadcastable to
            ``[B, H, q1 - q0, k1 - k0]``, True = blocked.
        """
        raise NotImplementedError

    def materialize(
        self, B: int, H: int, T: int, S: int, device: torch.device | None = None
    ) -> Tensor:
        """The whole mask as a bool tensor broadcastable to ``[B, H, T, S]``, True = blocked.

        This costs ``T * S`` memory; the reference and fused backends use it.
        """
        dev = torch.device("cpu") if device is None else device
        self.validate(B, H, T, S, dev)
        t = self.tile(B, H, T, S, 0, T, 0, S, dev)
        if t is FULL:
            return torch.zeros(1, 1, T, S, dtype=torch.bool, device=dev)  # [1, 1, T, S]
        if t is EMPTY:
            return torch.ones(1, 1, T, S, dtype=torch.bool, device=dev)  # [1, 1, T, S]
        assert isinstance(t, Tensor)
        return t.expand(t.shape[0], t.shape[1], T, S)  # [B|1, H|1, T, S]

    def __or__(self, other: StructuredMask) -> Union:
        if not isinstance(other, StructuredMask):
            return NotImplemented
        return Union(self, other)


def _grid(q0: int, q1: int, k0: int, k1: int, device: torch.device) -> tuple[Tensor, Tensor]:
    q_idx = torch.arange(q0, q1, device=device)[:, None]  # [bq, 1]
    kv_idx = torch.arange(k0, k1, device=device)[None, :]  # [1, bk]
    return q_idx, kv_idx


def _offset(T: int, S: int, align: Align, offset: int | None) -> int:
    if offset is not None:
        return offset
    return 0 if align == "top_left" else S - T


def _check_align(align: object, offset: object) -> None:
    if align not in ("top_left", "bottom_right"):
        raise ValueError(f"align must be 'top_left' or 'bottom_right', got {align!r}")
    if offset is not None and (not isinstance(offset, int) or isinstance(offset, bool)):
        raise TypeError(f"offset must be an int or None, got {offset!r}")


class SlidingWindow(StructuredMask):
    """Query at position ``p`` sees keys ``p - window + 1 .. p`` (``window=None``: all ``<= p``).

    Args:
        window: keys each query may see, itself included (``>= 1``), or None for plain causal.
        align: ``"bottom_right"`` (default) or ``"top_left"``; see the module docstring.
        offset: absolute position of query 0; overrides ``align``.

    Raises:
        ValueError: ``window < 1`` or an unknown ``align``.
        TypeError: a non-int ``offset``.
    """

    def __init__(
        self, window: int | None, *, align: Align = "bottom_right", offset: int | None = None
    ) -> None:
        if window is not None and (not isinstance(window, int) or window < 1):
            raise ValueError(f"window must be an int >= 1 or None, got {window!r}")
        _check_align(align, offset)
        self.window = window
        self.align: Align = align
        self.offset = offset

    def __repr__(self) -> str:
        where = f"offset={self.offset}" if self.offset is not None else f"align={self.align!r}"
        return f"{type(self).__name__}(window={self.window}, {where})"

    def tile(
        self,
        B: int,
        H: int,
        T: int,
        S: int,
        q0: int,
        q1: int,
        k0: int,
        k1: int,
        device: torch.device,
    ) -> TileMask:
        off = _offset(T, S, self.align, self.offset)
        # delta = query position - key position; allowed iff 0 <= delta < window.
        lo = q0 + off - (k1 - 1)  # smallest delta in the tile
        hi = q1 - 1 + off - k0  # largest delta in the tile
        w = self.window
        if hi < 0 or (w is not None and lo >= w):
            return EMPTY
        if lo >= 0 and (w is None or hi < w):
            return FULL
        q_idx, kv_idx = _grid(q0, q1, k0, k1, device)
        delta = q_idx + off - kv_idx  # [bq, bk]
        blocked = delta < 0
        if w is not None:
            blocked = blocked | (delta >= w)  # [bq, bk]
        return blocked[None, None]  # [1, 1, bq, bk]


class Causal(SlidingWindow):
    """Causal mask: query at position ``p`` may not see keys after ``p``.

    Args:
        align: ``"bottom_right"`` (default, as ``qkv.attention(is_causal=True)``) or
            ``"top_left"`` (as PyTorch SDPA's ``is_causal``).
        offset: absolute position of query 0 (number of cached keys); overrides ``align``.
    """

    def __init__(self, *, align: Align = "bottom_right", offset: int | None = None) -> None:
        super().__init__(None, align=align, offset=offset)

    def __repr__(self) -> str:
        where = f"offset={self.offset}" if self.offset is not None else f"align={self.align!r}"
        return f"Causal({where})"


def _check_int_tensor(name: str, x: object, dims: int) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {x.dtype}")
    if x.dim() != dims:
        raise ValueError(f"{name} must be {dims}-D, got shape {tuple(x.shape)}")
    return x


class Padding(StructuredMask):
    """Key padding by lengths: in sample ``b`` keys ``>= lengths[b]`` are blocked.

    Args:
        lengths: integer tensor ``[B]`` of valid key lengths, each in ``[0, S]``.

    Raises:
        TypeError: ``lengths`` is not a 1-D integer tensor.
    """

    def __init__(self, lengths: Tensor) -> None:
        self.lengths = _check_int_tensor("lengths", lengths, 1)
        self._min = int(lengths.min()) if lengths.numel() else 0
        self._max = int(lengths.max()) if lengths.numel() else 0

    def __repr__(self) -> str:
        return f"Padding(lengths={self.lengths.tolist()})"

    def validate(self, B: int, H: int, T: int, S: int, device: torch.device) -> None:
        if self.lengths.shape[0] != B:
            raise ValueError(f"Padding lengths has B={self.lengths.shape[0]}, expected B={B}")
        if self._min < 0 or self._max > S:
            raise ValueError(f"Padding lengths must lie in [0, S={S}], got {self.lengths.tolist()}")
        if self.lengths.device != device:
            raise ValueError(f"Padding lengths is on {self.lengths.device}, query on {device}")

    def tile(
        self,
        B: int,
        H: int,
        T: int,
        S: int,
        q0: int,
        q1: int,
        k0: int,
        k1: int,
        device: torch.device,
    ) -> TileMask:
        if k0 >= self._max:
            return EMPTY
        if k1 <= self._min:
            return FULL
        kv_idx = torch.arange(k0, k1, device=device)  # [bk]
        blocked = kv_idx[None, :] >= self.lengths[:, None]  # [B, bk]
        return blocked[:, None, None, :]  # [B, 1, 1, bk]


class Documents(StructuredMask):
    """Packed sequences: a query may only see keys of its own document.

    Args:
        q_ids: integer tensor ``[B, T]``, the document id of each query.
        kv_ids: integer tensor ``[B, S]``; default ``q_ids`` (self-attention). Ids must be
            non-decreasing along the sequence for tiles to be skipped by min/max; any ids are
            correct, unsorted ones just skip fewer tiles.

    Raises:
        TypeError: ids that are not 2-D integer tensors.
    """

    def __init__(self, q_ids: Tensor, kv_ids: Tensor | None = None) -> None:
        self.q_ids = _check_int_tensor("q_ids", q_ids, 2)
        self.kv_ids = self.q_ids if kv_ids is None else _check_int_tensor("kv_ids", kv_ids, 2)

    def __repr__(self) -> str:
        return f"Documents(q_ids {list(self.q_ids.shape)}, kv_ids {list(self.kv_ids.shape)})"

    def validate(self, B: int, H: int, T: int, S: int, device: torch.device) -> None:
        for name, ids, L in (("q_ids", self.q_ids, T), ("kv_ids", self.kv_ids, S)):
            if tuple(ids.shape) != (B, L):
                raise ValueError(
                    f"Documents {name} must be [B, L] = {[B, L]}, got {list(ids.shape)}"
                )
            if ids.device != device:
                raise ValueError(f"Documents {name} is on {ids.device}, query on {device}")

    def tile(
        self,
        B: int,
        H: int,
        T: int,
        S: int,
        q0: int,
        q1: int,
        k0: int,
        k1: int,
        device: torch.device,
    ) -> TileMask:
        qd = self.q_ids[:, q0:q1]  # [B, bq]
        kd = self.kv_ids[:, k0:k1]  # [B, bk]
        q_lo, q_hi = qd.amin(dim=1), qd.amax(dim=1)  # [B]
        k_lo, k_hi = kd.amin(dim=1), kd.amax(dim=1)  # [B]
        if bool(((q_hi < k_lo) | (k_hi < q_lo)).all()):
            return EMPTY
        if bool(((q_lo == q_hi) & (k_lo == k_hi) & (q_lo == k_lo)).all()):
            return FULL
        blocked = qd[:, :, None] != kd[:, None, :]  # [B, bq, bk]
        return blocked[:, None]  # [B, 1, bq, bk]


ModFn = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


class MaskMod(StructuredMask):
    """An arbitrary predicate ``mask_mod(b, h, q_idx, kv_idx)``, as in PyTorch FlexAttention.

    **Sense**: like FlexAttention, ``mask_mod`` returns True where the query MAY attend the key;
    this class converts it to qkv's convention (True = blocked) at this edge.

    The predicate gets broadcastable integer tensors ``b [B, 1, 1, 1]``, ``h [1, H, 1, 1]``,
    ``q_idx [1, 1, bq, 1]``, ``kv_idx [1, 1, 1, bk]`` and must return a bool tensor that
    broadcasts to ``[B, H, bq, bk]`` (write it with tensor ops, e.g. ``q_idx >= kv_idx``). It is
    only ever evaluated on one tile's index grid, so the blockwise backend costs O(block²)
    memory for it.

    Args:
        mask_mod: the predicate, True = may attend.
        name: shown in explanations; default the function's ``__name__``.

    Raises:
        TypeError: ``mask_mod`` is not callable.
    """

    def __init__(self, mask_mod: ModFn, *, name: str | None = None) -> None:
        if not callable(mask_mod):
            raise TypeError(f"mask_mod must be callable, got {type(mask_mod).__name__}")
        self.mask_mod = mask_mod
        self.name = name or getattr(mask_mod, "__name__", "mask_mod")

    def __repr__(self) -> str:
        return f"MaskMod({self.name})"

    def tile(
        self,
        B: int,
        H: int,
        T: int,
        S: int,
        q0: int,
        q1: int,
        k0: int,
        k1: int,
        device: torch.device,
    ) -> TileMask:
        b = torch.arange(B, device=device)[:, None, None, None]  # [B, 1, 1, 1]
        h = torch.arange(H, device=device)[None, :, None, None]  # [1, H, 1, 1]
        q_idx = torch.arange(q0, q1, device=device)[None, None, :, None]  # [1, 1, bq, 1]
        kv_idx = torch.arange(k0, k1, device=device)[None, None, None, :]  # [1, 1, 1, bk]
        keep = self.mask_mod(b, h, q_idx, kv_idx)
        if not isinstance(keep, Tensor) or keep.dtype != torch.bool:
            got = keep.dtype if isinstance(keep, Tensor) else type(keep).__name__
            raise TypeError(f"mask_mod {self.name} must return a bool tensor, got {got}")
        blocked = ~keep  # [B|1, H|1, bq|1, bk|1]
        if blocked.dim() != 4:
            blocked = blocked.reshape((1,) * (4 - blocked.dim()) + tuple(blocked.shape))
        if bool(blocked.all()):
            return EMPTY
        if not bool(blocked.any()):
            return FULL
        return blocked.expand(blocked.shape[0], blocked.shape[1], q1 - q0, k1 - k0)


class Union(StructuredMask):
    """Blocked wherever any part blocks (build it with ``a | b``)."""

    parts: tuple[StructuredMask, ...]

    def __init__(self, *parts: StructuredMask) -> None:
        flat: list[StructuredMask] = []
        for p in parts:
            if not isinstance(p, StructuredMask):
                raise TypeError(f"Union parts must be StructuredMask, got {type(p).__name__}")
            flat.extend(p.parts if isinstance(p, Union) else [p])
        self.parts = tuple(flat)

    def __repr__(self) -> str:
        return " | ".join(repr(p) for p in self.parts)

    def validate(self, B: int, H: int, T: int, S: int, device: torch.device) -> None:
        for p in self.parts:
            p.validate(B, H, T, S, device)

    def tile(
        self,
        B: int,
        H: int,
        T: int,
        S: int,
        q0: int,
        q1: int,
        k0: int,
        k1: int,
        device: torch.device,
    ) -> TileMask:
        tiles = []
        for p in self.parts:
            t = p.tile(B, H, T, S, q0, q1, k0, k1, device)
            if t is EMPTY:
                return EMPTY
            if t is not FULL:
                tiles.append(t)
        if not tiles:
            return FULL
        out = tiles[0]
        assert isinstance(out, Tensor)
        for t in tiles[1:]:
            assert isinstance(t, Tensor)
            out = out | t  # [B|1, H|1, bq, bk]
        if bool(out.all()):
            return EMPTY
        return out


class Dense(StructuredMask):
    """A bool tensor mask (qkv's convention) seen tile by tile, so it can join a :class:`Union`.

    The tensor already exists, so nothing is saved in memory; tiles that are all True are still
    skipped by the blockwise backend.

    Args:
        mask: bool tensor broadcastable to ``[B, H, T, S]``, True = blocked, 4-D.

    Raises:
        TypeError: not a bool tensor.
        ValueError: not 4-D.
    """

    def __init__(self, mask: Tensor) -> None:
        if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
            raise TypeError("Dense needs a bool tensor mask (True = blocked)")
        if mask.dim() != 4:
            raise ValueError(f"Dense needs a 4-D mask [B|1, H|1, T|1, S], got {list(mask.shape)}")
        self.mask = mask

    def __repr__(self) -> str:
        return f"Dense({list(self.mask.shape)})"

    def tile(
        self,
        B: int,
        H: int,
        T: int,
        S: int,
        q0: int,
        q1: int,
        k0: int,
        k1: int,
        device: torch.device,
    ) -> TileMask:
        m = self.mask
        qs = slice(q0, q1) if m.shape[2] != 1 else slice(None)
        ks = slice(k0, k1) if m.shape[3] != 1 else slice(None)
        t = m[:, :, qs, ks]  # [B|1, H|1, bq|1, bk|1]
        if bool(t.all()):
            return EMPTY
        if not bool(t.any()):
            return FULL
        return t
