"""How the blockwise backend cuts a call into tiles: their size, and which ones it computes.

Queries are cut into blocks of ``block_q`` rows and keys into blocks of ``block_k``; each
(query block, key block) tile asks the mask (a :class:`qkv.masks.StructuredMask`) whether it is
fully blocked (skipped), fully open (computed with no mask) or partial (its own small mask).
:func:`plan_tiles` makes that :class:`TilePlan` once per call (the planner makes it while
choosing the backend, where it can); :mod:`qkv.backends.blockwise` only runs it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from qkv._checks import check_positive_int
from qkv.backends.policy import current_policy
from qkv.masks import EMPTY, FULL, SlidingWindow, StructuredMask, Tile, TileMask

__all__ = [
    "Bounds",
    "TilePlan",
    "bias_tile",
    "check_tiles",
    "default_blocks",
    "dense_tile_skip",
    "plan_tiles",
    "resolve_blocks",
]

Bounds = tuple[int, int, int, int]
"""A tile's ``(q0, q1, k0, k1)``."""


def default_blocks(mask: StructuredMask | None) -> tuple[int, int]:
    """``(block_q, block_k)`` for a mask: ``Policy.block_q x Policy.block_k`` (256 x 512),
    narrowed to a sliding window's width.

    A tile much wider than the window computes mostly masked pairs; a window-wide tile keeps
    the computed band within about twice the window.
    """
    windows = [
        p.window
        for p in getattr(mask, "parts", (mask,))
        if isinstance(p, SlidingWindow) and p.window is not None
    ]
    policy = current_policy()
    if not windows:
        return policy.block_q, policy.block_k
    w = min(windows)
    return min(max(w, 64), policy.block_q), min(max(w, 64), policy.block_k)


def resolve_blocks(
    mask: StructuredMask | None, block_q: int | None, block_k: int | None
) -> tuple[int, int]:
    """The tile size of one call: the caller's, else :func:`default_blocks`.

    Raises:
        TypeError: a block size that is not an int.
        ValueError: a block size below 1.
    """
    auto_q, auto_k = default_blocks(mask)
    return (
        auto_q if block_q is None else check_positive_int("block_q", block_q),
        auto_k if block_k is None else check_positive_int("block_k", block_k),
    )


@dataclass(frozen=True)
class TilePlan:
    """Which tiles the blockwise backend computes, for one mask on one grid.

    Attributes:
        tiles: per query block, the ``(q0, q1, k0, k1)`` of every tile not fully masked.
        total: number of tiles in the grid, skipped ones included.
        computed_pairs: query-key pairs in the computed tiles (for FLOP counts).
        grid: the ``(B, H, T, S)`` it was planned for.
        blocks: its ``(block_q, block_k)``.
        mask: the mask it was planned for (the blockwise backend refuses a plan made for another).
        masks: each computed tile's mask (FULL or a partial tile tensor) kept from planning, so
            forward and backward need not evaluate the rule again; at most
            ``Policy.mask_cache_bytes`` of partial tiles, so a dense ``mask_mod`` can never make
            it O(T · S).
    """

    tiles: tuple[tuple[Bounds, ...], ...]
    total: int
    computed_pairs: int
    grid: tuple[int, int, int, int]
    blocks: tuple[int, int]
    mask: StructuredMask | None = field(default=None, compare=False)
    masks: dict[Bounds, TileMask] = field(default_factory=dict, compare=False, repr=False)

    @property
    def computed(self) -> int:
        """Number of tiles computed."""
        return sum(len(row) for row in self.tiles)


def plan_tiles(
    mask: StructuredMask | None,
    B: int,
    H: int,
    T: int,
    S: int,
    block_q: int,
    block_k: int,
    device: torch.device,
    keep_masks: bool = False,
) -> TilePlan:
    """Classify every tile of the ``T x S`` grid; keep those that are not fully masked.

    Args:
        mask: the structured mask, or None (every tile computed, no mask).
        B: batch size.
        H: query heads.
        T: query length.
        S: key length.
        block_q: query rows per tile.
        block_k: keys per tile.
        device: where tile masks are built.
        keep_masks: keep the computed tiles' masks in :attr:`TilePlan.masks` (bounded).

    Returns:
        The plan.
    """
    rows = []
    pairs = 0
    stored = 0
    cache_bytes = current_policy().mask_cache_bytes
    kept: dict[Bounds, TileMask] = {}
    for q0 in range(0, T, block_q):
        q1 = min(q0 + block_q, T)
        row = []
        for k0 in range(0, S, block_k):
            k1 = min(k0 + block_k, S)
            t = (q0, q1, k0, k1)
            tm: TileMask = FULL if mask is None else mask.tile(Tile(B, H, T, S, *t, device))
            if tm is EMPTY:
                continue
            if keep_masks:
                size = tm.numel() if isinstance(tm, Tensor) else 0
                if stored + size <= cache_bytes:
                    kept[t] = tm
                    stored += size
            row.append(t)
            pairs += (q1 - q0) * (k1 - k0)
        rows.append(tuple(row))
    total = math.ceil(T / block_q) * math.ceil(S / block_k)
    return TilePlan(tuple(rows), total, pairs, (B, H, T, S), (block_q, block_k), mask, kept)


def bias_tile(attn_bias: Tensor | None, q0: int, q1: int, k0: int, k1: int) -> Tensor | None:
    """``attn_bias [B|1, H|1, T|1, S|1]`` restricted to queries ``[q0, q1)`` by keys
    ``[k0, k1)``, broadcast dims kept (None stays None)."""
    if attn_bias is None:
        return None
    qs = slice(q0, q1) if attn_bias.shape[2] != 1 else slice(None)
    ks = slice(k0, k1) if attn_bias.shape[3] != 1 else slice(None)
    return attn_bias[:, :, qs, ks]  # [B|1, H|1, bq|1, bk|1]


def dense_tile_skip(mask: Tensor, block_q: int, block_k: int) -> float | None:
    """The fraction of ``block_q x block_k`` tiles a bool mask tensor blocks entirely (for every
    sample and head): one vectorized pass over the mask, cheap next to the attention it saves.

    Args:
        mask: a validated 4-D bool mask, broadcastable to ``[B, H, T, S]``.
        block_q: query rows per tile.
        block_k: keys per tile.

    Returns:
        The fraction in ``[0, 1]``, or None while tracing or compiling (it reads the mask).
    """
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return None
    blocked = mask.all(dim=1).all(dim=0)  # [T|1, S]: blocked for every sample and head
    T, S = blocked.shape
    nq, nk = -(-T // block_q), -(-S // block_k)
    # Pad with True so a partial edge tile is judged on its real pairs only.
    grid = torch.nn.functional.pad(blocked, (0, nk * block_k - S, 0, nq * block_q - T), value=True)
    tiles = grid.reshape(nq, block_q, nk, block_k).all(dim=3).all(dim=1)  # [nq, nk]
    return float(tiles.float().mean())


def check_tiles(
    plan: TilePlan,
    mask: StructuredMask | None,
    grid: tuple[int, int, int, int],
    block_q: int | None,
    block_k: int | None,
) -> None:
    """Refuse a tile plan made for another mask, grid or tile size than the call's.

    Raises:
        ValueError: naming what differs.
    """
    if plan.mask is not mask:
        raise ValueError(f"the tile plan was made for {plan.mask!r}, not for {mask!r}")
    if plan.grid != grid:
        raise ValueError(f"the tile plan was made for grid {plan.grid}, not {grid}")
    for name, given, planned in zip(
        ("block_q", "block_k"), (block_q, block_k), plan.blocks, strict=True
    ):
        if given is not None and given != planned:
            raise ValueError(f"{name}={given} but the tile plan was made with {name}={planned}")
