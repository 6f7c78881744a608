"""The context-parallel plan: for every pair of ranks, which keys one needs from the other.

Every rank holds the queries, keys and values of its own positions (see
:mod:`qkv.distributed.layout`). The mask rule is in global coordinates, so for any rectangle of
queries by keys it answers EMPTY, FULL or partial (:meth:`qkv.masks.StructuredMask.tile`). The
plan asks it, key tile by key tile, which of rank ``j``'s keys any query of rank ``i`` may see,
and keeps for each pair the smallest ``(start, stop)`` range per segment of ``j`` that covers
them: a pair the rule leaves empty sends nothing, a sliding window sends only its halo, packed
documents only to ranks that share a document. Then, for this rank, one blockwise tile plan
(:func:`qkv.backends.tiles.plan_tiles`) per pair of a query segment and a received key range,
made once and reused by forward and backward and by every layer with the same mask.

Every rank computes the same plan from the same rule, so sends and receives match without a
message to agree on them. Rules that read tensors (padding, documents) are read on the host
once, when the plan is made.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from qkv._checks import check_positive_int
from qkv.backends.tiles import TilePlan, plan_tiles, resolve_blocks
from qkv.distributed.layout import Layout, Segment, check_layout, segments
from qkv.masks import EMPTY, FULL, SlidingWindow, StructuredMask, Tile, TileMask
from qkv.masks.rules import parts_of
from qkv.masks.tiles import query_offset

__all__ = [
    "ContextPlan",
    "PairPlan",
    "Shifted",
    "local_ranges",
    "needed_ranges",
    "plan_context",
]

_KEY_TILE = 256  # keys per probe when the plan looks for the keys a pair needs
_QUERY_TILE = 1024  # query rows per probe


class Shifted(StructuredMask):
    """A global rule seen from one rectangle: local tile ``(q0, q1, k0, k1)`` is global
    ``(q_start + q0, q_start + q1, k_start + k0, k_start + k1)`` of a ``T x S`` grid.

    Args:
        rule: the rule in global coordinates.
        T: the global query length.
        S: the global key length.
        q_start: global position of local query 0.
        k_start: global position of local key 0.
    """

    def __init__(self, rule: StructuredMask, T: int, S: int, q_start: int, k_start: int) -> None:
        self.rule, self.T, self.S, self.q_start, self.k_start = rule, T, S, q_start, k_start
        self.parts = getattr(rule, "parts", (rule,))  # tile sizes follow a window part

    def __repr__(self) -> str:
        return (
            f"Shifted({self.rule!r}, T={self.T}, S={self.S}, q_start={self.q_start}, "
            f"k_start={self.k_start})"
        )

    def tile(self, tile: Tile) -> TileMask:
        return self.rule.tile(
            Tile(
                tile.B,
                tile.H,
                self.T,
                self.S,
                self.q_start + tile.q0,
                self.q_start + tile.q1,
                self.k_start + tile.k0,
                self.k_start + tile.k1,
                tile.device,
            )
        )


def _keys_seen(tm: TileMask, width: int) -> Tensor | None:
    """Which of a tile's ``width`` keys some query sees: None for all, ``[width]`` bool else."""
    if tm is FULL:
        return None
    if tm is EMPTY:
        return torch.zeros(width, dtype=torch.bool)
    assert isinstance(tm, Tensor)
    open_ = ~tm.expand(*tm.shape[:-1], width)  # [.., bk]
    return open_.reshape(-1, width).any(dim=0).cpu()  # [bk]


def _column_seen(
    rule: StructuredMask,
    B: int,
    H: int,
    grid: tuple[int, int],
    q_segments: list[Segment],
    k0: int,
    k1: int,
    device: torch.device,
) -> Tensor | None:
    """Which keys of ``[k0, k1)`` some query of ``q_segments`` sees: None for all of them,
    else a ``[k1 - k0]`` bool vector. Queries are asked ``_QUERY_TILE`` rows at a time, so a
    partial answer never costs more than ``_QUERY_TILE x _KEY_TILE`` elements."""
    seen = torch.zeros(k1 - k0, dtype=torch.bool)
    for a, b in q_segments:
        for q0 in range(a, b, _QUERY_TILE):
            tm = rule.tile(Tile(B, H, *grid, q0, min(q0 + _QUERY_TILE, b), k0, k1, device))
            s = _keys_seen(tm, k1 - k0)
            if s is None:
                return None
            seen |= s
    return seen


def needed_ranges(
    rule: StructuredMask | None,
    B: int,
    H: int,
    grid: tuple[int, int],
    q_segments: list[Segment],
    k_segment: Segment,
    device: torch.device,
) -> Segment | None:
    """The smallest range of ``k_segment`` holding every key some query of ``q_segments`` sees.

    Key columns of ``_KEY_TILE`` are asked from the left until one holds a seen key, then from
    the right: a rule that skips whole tiles (causal, windows, sorted documents, padding) is
    answered mostly without building a mask.

    Args:
        rule: the global rule (None: every key is seen).
        B: batch size.
        H: query heads.
        grid: the global ``(T, S)``.
        q_segments: the querying rank's segments.
        k_segment: one segment of the keys' rank.
        device: where the rule's tensors live.

    Returns:
        ``(start, stop)`` inside ``k_segment``, or None when no query sees any of its keys.
    """
    a, b = k_segment
    if not q_segments or b <= a:
        return None
    if rule is None:
        return a, b
    columns = [(k0, min(k0 + _KEY_TILE, b)) for k0 in range(a, b, _KEY_TILE)]

    def edge(order: list[tuple[int, int]], last: bool) -> int | None:
        for k0, k1 in order:
            seen = _column_seen(rule, B, H, grid, q_segments, k0, k1, device)
            if seen is None:
                return k1 - 1 if last else k0
            idx = seen.nonzero()
            if idx.numel():
                return k0 + int(idx[-1 if last else 0])
        return None

    first = edge(columns, last=False)
    if first is None:
        return None
    last = edge(columns[::-1], last=True)
    assert last is not None
    return first, last + 1


@dataclass(frozen=True)
class PairPlan:
    """One block this rank computes: a query segment against a range of received keys.

    Attributes:
        rows: local query rows ``(start, stop)`` of the segment.
        cols: columns ``(start, stop)`` of the key range in the keys it runs against (the
            local keys for the rank's own pair, the received buffer otherwise).
        tiles: the blockwise tile plan of the rectangle (skipped tiles left out).
        kind: ``"full"`` (no key of the rectangle blocked), ``"causal"`` (a square on the
            diagonal of a causal rule) or ``"tiles"`` (anything else: the tile loop runs it).
            A CPU forward and backward run the first two as one fused kernel call.
    """

    rows: Segment
    cols: Segment
    tiles: TilePlan
    kind: Literal["full", "causal", "tiles"] = "tiles"


def _kind(
    rule: StructuredMask | None, tp: TilePlan, square: bool, T: int, S: int
) -> Literal["full", "causal", "tiles"]:
    """What a rectangle's tile plan reduces to (see :class:`PairPlan`)."""
    every_tile = tp.computed == tp.total
    if rule is None or (every_tile and all(tp.masks.get(t) is FULL for r in tp.tiles for t in r)):
        return "full"
    causal = [p for p in parts_of(rule) if isinstance(p, SlidingWindow) and p.window is None]
    if (
        square
        and len(causal) == len(parts_of(rule))
        and all(query_offset(T, S, p.align, p.offset) == 0 for p in causal)
    ):
        return "causal"
    return "tiles"


@dataclass(frozen=True)
class ContextPlan:
    """How one context-parallel attention call runs on this rank; the same on every rank.

    Attributes:
        length: global query length.
        kv_length: global key length (``length`` for self-attention).
        world: ranks in the group.
        rank: this rank.
        layout: ``"contiguous"`` or ``"zigzag"``.
        grid: ``(B, H, Hkv)`` the plan was made for.
        segments: per rank, the global segments of its queries.
        kv_segments: per rank, the global segments of its keys.
        needs: ``needs[i][j]``: the global key ranges rank ``i`` receives from rank ``j``
            (``needs[i][i]`` the ranges of its own keys it uses).
        pairs: per source rank, the blocks this rank computes against its keys.
        mask: the global rule (None: no mask).
    """

    length: int
    kv_length: int
    world: int
    rank: int
    layout: Layout
    grid: tuple[int, int, int]
    segments: tuple[tuple[Segment, ...], ...]
    kv_segments: tuple[tuple[Segment, ...], ...]
    needs: tuple[tuple[tuple[Segment, ...], ...], ...]
    pairs: tuple[tuple[PairPlan, ...], ...]
    mask: StructuredMask | None

    def received(self, src: int) -> int:
        """Key positions this rank receives from ``src``."""
        return sum(b - a for a, b in self.needs[self.rank][src])

    def sent(self, dst: int) -> int:
        """Key positions this rank sends to ``dst``."""
        return sum(b - a for a, b in self.needs[dst][self.rank])

    @property
    def local_length(self) -> int:
        """This rank's number of query positions."""
        return sum(b - a for a, b in self.segments[self.rank])

    @property
    def kv_local_length(self) -> int:
        """This rank's number of key positions."""
        return sum(b - a for a, b in self.kv_segments[self.rank])

    def keys_sent(self, rank: int | None = None) -> int:
        """Key positions ``rank`` (default: this rank) sends in one forward."""
        r = self.rank if rank is None else rank
        return sum(b - a for i in range(self.world) if i != r for a, b in self.needs[i][r])

    def ring_keys_sent(self, rank: int | None = None) -> int:
        """Key positions a plain ring that sends everything would send from ``rank``."""
        r = self.rank if rank is None else rank
        return (self.world - 1) * sum(b - a for a, b in self.kv_segments[r])

    def pairs_computed(self, rank: int | None = None) -> int:
        """Query-key pairs this rank's tiles compute (a measure of its work)."""
        assert rank is None or rank == self.rank, "tile plans are kept for this rank only"
        return sum(p.tiles.computed_pairs for per in self.pairs for p in per)


def local_ranges(
    segs: list[Segment] | tuple[Segment, ...], ranges: tuple[Segment, ...]
) -> list[tuple[Segment, Segment]]:
    """For each global range inside one of ``segs``: ``(global range, local (start, stop))``,
    local meaning the index in a tensor that holds ``segs`` one after another."""
    out = []
    for a, b in ranges:
        offset = 0
        for s0, s1 in segs:
            if s0 <= a and b <= s1:
                out.append(((a, b), (offset + a - s0, offset + b - s0)))
                break
            offset += s1 - s0
    return out


def plan_context(
    mask: StructuredMask | None,
    *,
    batch: int,
    heads: int,
    kv_heads: int,
    length: int,
    kv_length: int | None = None,
    world: int,
    rank: int,
    layout: Layout = "contiguous",
    device: torch.device | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
) -> ContextPlan:
    """Make the plan of one context-parallel call (no communication).

    Args:
        mask: the rule in global coordinates, or None.
        batch: batch size ``B``.
        heads: query heads ``H``.
        kv_heads: key/value heads ``Hkv`` (dividing ``H``).
        length: the global query length.
        kv_length: the global key length (default ``length``: self-attention); keys are cut
            in the same layout as queries.
        world: ranks in the group.
        rank: this rank.
        layout: ``"contiguous"`` or ``"zigzag"``.
        device: where the rule's tensors live (default CPU).
        block_q: query rows per tile (default: the policy's, narrowed to a window).
        block_k: keys per tile (likewise).

    Returns:
        The plan.

    Raises:
        TypeError: a count that is not an int, or a mask that is not a rule.
        ValueError: an unknown layout, a rank outside the world, or a rule that does not fit
            ``[B, H, length, kv_length]``.
    """
    _check_grid(mask, batch, heads, kv_heads)
    layout = check_layout(layout)
    dev = torch.device("cpu") if device is None else device
    S = length if kv_length is None else kv_length
    if mask is not None:
        mask.validate(batch, heads, length, S, dev)
    segs = tuple(tuple(segments(length, world, r, layout)) for r in range(world))
    kv_segs = tuple(tuple(segments(S, world, r, layout)) for r in range(world))
    needs = _needs(mask, (batch, heads, length, S), segs, kv_segs, dev)
    blocks = resolve_blocks(mask, block_q, block_k)
    grid4 = (batch, heads, length, S)
    mine = (segs[rank], kv_segs[rank], needs[rank])
    pairs = tuple(_pairs(mask, grid4, mine, j == rank, j, blocks, dev) for j in range(world))
    grid = (batch, heads, kv_heads)
    return ContextPlan(length, S, world, rank, layout, grid, segs, kv_segs, needs, pairs, mask)


def _needs(
    mask: StructuredMask | None,
    grid: tuple[int, int, int, int],
    segs: tuple[tuple[Segment, ...], ...],
    kv_segs: tuple[tuple[Segment, ...], ...],
    dev: torch.device,
) -> tuple[tuple[tuple[Segment, ...], ...], ...]:
    """``needs[i][j]``: the key ranges of rank ``j`` that rank ``i``'s queries see."""
    B, H, T, S = grid
    world = len(segs)
    return tuple(
        tuple(
            tuple(
                rng
                for k_seg in kv_segs[j]
                if (rng := needed_ranges(mask, B, H, (T, S), list(segs[i]), k_seg, dev))
            )
            for j in range(world)
        )
        for i in range(world)
    )


def _check_grid(mask: object, batch: int, heads: int, kv_heads: int) -> None:
    """The counts and the mask's type of :func:`plan_context`, checked."""
    for name, value in (("batch", batch), ("heads", heads), ("kv_heads", kv_heads)):
        check_positive_int(name, value)
    if heads % kv_heads:
        raise ValueError(f"heads={heads} must be a multiple of kv_heads={kv_heads}")
    if mask is not None and not isinstance(mask, StructuredMask):
        raise TypeError(
            "mask must be a qkv mask rule in global coordinates (Causal, Padding, Documents, "
            f"SlidingWindow, MaskMod or a combination), got {type(mask).__name__}"
        )


def _pairs(
    mask: StructuredMask | None,
    grid: tuple[int, int, int, int],
    mine: tuple[tuple[Segment, ...], tuple[Segment, ...], tuple[tuple[Segment, ...], ...]],
    own: bool,
    src: int,
    blocks: tuple[int, int],
    dev: torch.device,
) -> tuple[PairPlan, ...]:
    """This rank's blocks against the keys of rank ``src``: one per query segment and key
    range, each with its tile plan (``grid``: ``(B, H, T, S)``; ``mine``: this rank's query
    segments, key segments and row of ``needs``)."""
    B, H, T, S = grid
    q_segs, kv_segs, needs = mine
    if own:  # own keys index the local tensor
        cols = local_ranges(kv_segs, needs[src])
    else:  # received ones the buffer, in needs order
        cols, offset = [], 0
        for a, b in needs[src]:
            cols.append(((a, b), (offset, offset + b - a)))
            offset += b - a
    per = []
    for (q0g, q1g), rows in local_ranges(q_segs, q_segs):
        for (k0g, k1g), cs in cols:
            rule = None if mask is None else Shifted(mask, T, S, q0g, k0g)
            tp = plan_tiles(rule, B, H, q1g - q0g, k1g - k0g, *blocks, dev, True)
            if tp.computed:
                per.append(PairPlan(rows, cs, tp, _kind(mask, tp, (q0g, q1g) == (k0g, k1g), T, S)))
    return tuple(per)
