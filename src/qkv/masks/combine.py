"""The base of every mask rule and how rules combine: :class:`StructuredMask` (``a | b``),
:class:`AnyOf` (blocked wherever any part blocks) and :class:`Dense` (a bool tensor seen tile by
tile, so that a tensor joins a combination with ``|``). The rules themselves are in
:mod:`qkv.masks.rules`; the convention is qkv's one (bool, True = blocked).
"""

from __future__ import annotations

from typing import TypeVar, cast

import torch
from torch import Tensor

from qkv.masks.tiles import EMPTY, FULL, Tile, TileMask
from qkv.masks.validate import validate_mask

__all__ = ["AnyOf", "Dense", "StructuredMask", "by_value", "classify", "parts_of"]

_M = TypeVar("_M")


class StructuredMask:
    """Base class: a mask in qkv's convention given by a rule, tile by tile."""

    def validate(self, B: int, H: int, T: int, S: int, device: torch.device) -> None:
        """Check the rule fits ``[B, H, T, S]`` on ``device``.

        Raises:
            ValueError: a size or device that does not match.
        """

    def mask_shape(self, B: int, H: int, T: int, S: int) -> tuple[int, int, int, int]:
        """The shape :meth:`materialize` returns: ``[1, 1, T, S]`` unless the rule needs more."""
        return 1, 1, T, S

    def tile(self, tile: Tile) -> TileMask:
        """Mask of the queries ``[tile.q0, tile.q1)`` by keys ``[tile.k0, tile.k1)``.

        Args:
            tile: the grid, the tile's bounds and the device.

        Returns:
            :data:`FULL`, :data:`EMPTY`, or a bool tensor broadcastable to
            ``[B, H, q1 - q0, k1 - k0]``, True = blocked.
        """
        raise NotImplementedError

    def materialize(
        self, B: int, H: int, T: int, S: int, device: torch.device | None = None
    ) -> Tensor:
        """The whole mask as a bool tensor, True = blocked.

        Args:
            B: batch size.
            H: query heads.
            T: query length.
            S: key length.
            device: device of the result (default CPU).

        Returns:
            Bool tensor of :meth:`mask_shape` (broadcastable to ``[B, H, T, S]``; a
            ``mask_mod`` that reads ``b`` or ``h`` widens it to those). Costs ``T * S`` memory
            at most; the reference and fused backends use it.

        Raises:
            ValueError: the rule does not fit ``[B, H, T, S]`` on ``device``.
        """
        dev = torch.device("cpu") if device is None else device
        self.validate(B, H, T, S, dev)
        shape = self.mask_shape(B, H, T, S)
        t = self.tile(Tile.whole(B, H, T, S, dev))
        if t is FULL:
            return torch.zeros(shape, dtype=torch.bool, device=dev)  # mask_shape
        if t is EMPTY:
            return torch.ones(shape, dtype=torch.bool, device=dev)  # mask_shape
        assert isinstance(t, Tensor)
        return t.expand(torch.broadcast_shapes(t.shape, shape))  # mask_shape (or wider)

    def __or__(self, other: object) -> AnyOf:
        if isinstance(other, Tensor):
            return AnyOf(self, Dense(other))
        if not isinstance(other, StructuredMask):
            return NotImplemented
        return AnyOf(self, other)

    def __ror__(self, other: object) -> AnyOf:
        if isinstance(other, Tensor):
            return AnyOf(Dense(other), self)
        return NotImplemented


def by_value() -> bool:
    """Whether a tile may be classified from the mask's values (``bool(tile.all())``).

    Not under torch.compile / export: a data-dependent branch would break the graph there.
    Such a tile is then computed with its own mask, which is exact (only slower), so compiled
    blockwise stays one graph for every rule.
    """
    return not torch.compiler.is_compiling()


def classify(blocked: Tensor) -> TileMask:
    """EMPTY if every key of the tile is blocked, FULL if none is, else the tile itself
    (always the tile itself under tracing, see :func:`by_value`)."""
    if not by_value():
        return blocked
    if bool(blocked.all()):
        return EMPTY
    if not bool(blocked.any()):
        return FULL
    return blocked


class AnyOf(StructuredMask):
    """Blocked wherever any part blocks (build it with ``a | b``).

    Args:
        *parts: the rules to combine; nested ``AnyOf`` parts are flattened.

    Raises:
        TypeError: a part that is not a :class:`StructuredMask`.
    """

    parts: tuple[StructuredMask, ...]

    def __init__(self, *parts: StructuredMask) -> None:
        flat: list[StructuredMask] = []
        for p in parts:
            if not isinstance(p, StructuredMask):
                raise TypeError(f"AnyOf parts must be StructuredMask, got {type(p).__name__}")
            flat.extend(parts_of(p))
        self.parts = tuple(flat)

    def __repr__(self) -> str:
        return " | ".join(repr(p) for p in self.parts)

    def validate(self, B: int, H: int, T: int, S: int, device: torch.device) -> None:
        for p in self.parts:
            p.validate(B, H, T, S, device)

    def mask_shape(self, B: int, H: int, T: int, S: int) -> tuple[int, int, int, int]:
        shape = torch.broadcast_shapes(*(p.mask_shape(B, H, T, S) for p in self.parts))
        return shape[0], shape[1], shape[2], shape[3]

    def tile(self, tile: Tile) -> TileMask:
        tiles = []
        for p in self.parts:
            t = p.tile(tile)
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
        if by_value() and bool(out.all()):
            return EMPTY
        return out


def parts_of(mask: _M) -> tuple[_M, ...]:
    """The parts of a combined rule (an :class:`AnyOf`'s, already flat), else ``(mask,)``:
    what a planner walks to see every rule of a mask (anything else passes as its own part)."""
    return cast("tuple[_M, ...]", mask.parts) if isinstance(mask, AnyOf) else (mask,)


class Dense(StructuredMask):
    """A bool tensor mask (qkv's convention) seen tile by tile, so it can join an :class:`AnyOf`.

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

    def validate(self, B: int, H: int, T: int, S: int, device: torch.device) -> None:
        validate_mask(self.mask, B, H, T, S, device, name=f"Dense mask {list(self.mask.shape)}")

    def mask_shape(self, B: int, H: int, T: int, S: int) -> tuple[int, int, int, int]:
        return self.mask.shape[0], self.mask.shape[1], T, S

    def tile(self, tile: Tile) -> TileMask:
        m = self.mask
        qs = slice(tile.q0, tile.q1) if m.shape[2] != 1 else slice(None)
        ks = slice(tile.k0, tile.k1) if m.shape[3] != 1 else slice(None)
        return classify(m[:, :, qs, ks])  # [B|1, H|1, bq|1, bk|1]
