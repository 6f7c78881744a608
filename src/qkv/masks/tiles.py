"""What a rule is asked about: one tile of the attention grid, and where its queries sit.

A :class:`Tile` names the grid (``B, H, T, S``), the tile's bounds (queries ``[q0, q1)`` by keys
``[k0, k1)``) and the device; :meth:`qkv.masks.StructuredMask.tile` answers :data:`FULL`,
:data:`EMPTY` or the tile's own bool mask.

**Alignment, one rule for every causal and sliding-window mask** (functions and rules alike):
query ``i`` of ``T`` sits at absolute position ``i + offset`` among ``S`` keys, where

- ``align="bottom_right"`` (**the default**): ``offset = S - T``, so the last query sees the last
  key. This is what a KV cache needs, what ``qkv.attention(is_causal=True)`` does, and what
  ``torch.nn.attention.bias.causal_lower_right`` and FlashAttention (>= 2.1) do;
- ``align="top_left"``: ``offset = 0``, what ``F.scaled_dot_product_attention(is_causal=True)``
  does;
- ``offset=n``: query 0 sits at position ``n`` (e.g. the number of keys cached before a chunk).

Both alignments agree when ``T == S``. ``offset`` together with an explicit ``align`` is a
``ValueError``: either says where the queries sit, and two answers cannot both hold.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

Align = Literal["top_left", "bottom_right"]
"""Where the ``T`` queries sit among the ``S`` keys; see the module docstring."""
ALIGNS: tuple[Align, ...] = ("top_left", "bottom_right")

__all__ = [
    "ALIGNS",
    "EMPTY",
    "FULL",
    "Align",
    "Tile",
    "TileMask",
    "query_offset",
    "resolve_alignment",
]


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


@dataclass(frozen=True)
class Tile:
    """Queries ``[q0, q1)`` by keys ``[k0, k1)`` of a ``[B, H, T, S]`` attention grid.

    Attributes:
        B: batch size of the grid.
        H: query heads of the grid.
        T: query length of the grid.
        S: key length of the grid.
        q0: first query row of the tile.
        q1: one past its last query row.
        k0: first key of the tile.
        k1: one past its last key.
        device: where the tile's mask is built.
    """

    B: int
    H: int
    T: int
    S: int
    q0: int
    q1: int
    k0: int
    k1: int
    device: torch.device

    @classmethod
    def whole(cls, B: int, H: int, T: int, S: int, device: torch.device) -> Tile:
        """The tile that covers the whole ``T x S`` grid."""
        return cls(B, H, T, S, 0, T, 0, S, device)

    @property
    def bounds(self) -> tuple[int, int, int, int]:
        """``(q0, q1, k0, k1)``."""
        return self.q0, self.q1, self.k0, self.k1

    def q_index(self) -> Tensor:
        """Query rows of the tile, ``[bq]`` with ``bq = q1 - q0``."""
        return torch.arange(self.q0, self.q1, device=self.device)  # [bq]

    def k_index(self) -> Tensor:
        """Keys of the tile, ``[bk]`` with ``bk = k1 - k0``."""
        return torch.arange(self.k0, self.k1, device=self.device)  # [bk]


def resolve_alignment(align: object, offset: object) -> tuple[Align | None, int | None]:
    """Check ``align`` / ``offset`` and apply the one default.

    Args:
        align: ``"bottom_right"``, ``"top_left"`` or None (bottom-right unless ``offset`` is
            given).
        offset: absolute position of query 0, or None.

    Returns:
        ``(align, None)`` or ``(None, offset)``: exactly one of them says where queries sit.

    Raises:
        ValueError: an unknown ``align``, or ``offset`` together with an explicit ``align``.
        TypeError: an ``offset`` that is not an int (or is a bool).
    """
    checked: Align | None
    if align == "top_left" or align == "bottom_right":
        checked = align
    elif align is None:
        checked = None
    else:
        raise ValueError(f"align must be 'top_left' or 'bottom_right', got {align!r}")
    if offset is None:
        return ("bottom_right" if checked is None else checked), None
    if isinstance(offset, bool) or not isinstance(offset, int):
        raise TypeError(f"offset must be an int or None, got {offset!r}")
    if align is not None:
        raise ValueError(
            f"give either offset or align, not both (got offset={offset}, align={align!r}): "
            "each says where the queries sit"
        )
    return None, offset


def query_offset(T: int, S: int, align: Align | None, offset: int | None) -> int:
    """Absolute position of query 0 for ``T`` queries over ``S`` keys (see the module docstring).

    Args:
        T: query length.
        S: key length.
        align: as returned by :func:`resolve_alignment`.
        offset: as returned by :func:`resolve_alignment`; wins when not None.

    Returns:
        ``offset``, or ``0`` for top-left, or ``S - T`` for bottom-right.
    """
    if offset is not None:
        return offset
    return 0 if align == "top_left" else S - T
