"""Exact reductions of structured masks to a few plain SDPA calls.

A mask made of :class:`~qkv.masks.Causal`, :class:`~qkv.masks.Padding` and
:class:`~qkv.masks.Documents` parts (any of them, combined with ``|``, plus the call's
``is_causal``) blocks whole rectangles and causal triangles of the attention grid. Each such
region is a call SDPA already runs at full speed, with no mask tensor at all:

- ``Causal`` whose queries start at key 0 (top-left, or bottom-right with ``T == S``): SDPA's own
  ``is_causal`` kernel, which skips the upper triangle; rows past the last key (a causal call
  whose padded keys were cut) stay in that one call, as SDPA's top-left flag has them;
- ``Padding``: keys past the longest live length are dropped (every query blocks them), so SDPA
  runs on the truncated keys; samples of different lengths keep a ``[B, 1, 1, S']`` mask, or,
  combined with a causal part, are grouped by length;
- ``Documents`` with sorted ids: one call per document on that document's queries and keys,
  never a dense ``[T, S]`` mask;
- ``SlidingWindow`` (a window that binds; one that never does is causal): the *band*: queries in
  blocks of :data:`BAND_BLOCK` rows, one call per block over just the keys its rows can see, with
  the window's own small mask on the band's ragged edges. Used only where the band is at most
  :data:`BAND_MAX_SHARE` of the grid and the caller allows it (the dispatcher: forward only);
- combinations compose: a document's keys are cut by the padding, then made causal (or cut into
  bands).

:func:`reduce_mask` finds these pieces for one call (eagerly, from the rule's lengths and ids:
this is planning, like the blockwise tile plan, and is skipped while tracing or compiling);
:func:`reduced_attention` runs them through :func:`qkv.backends.fused.fused_attention`, which
keeps qkv's semantics (fully masked rows 0 with finite gradients, upcast, GQA). A piece the
rules leave irregular (a causal edge not on the diagonal, holes in an ``is_pad`` mask) gets the
rule's own mask for that piece only, built by :meth:`StructuredMask.tile`. Rows no key is left
for are zeros.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from qkv.backends.blockwise import bias_tile, blockwise_attention
from qkv.backends.fused import blockwise_trains_faster, fused_attention
from qkv.backends.reference import compute_dtype
from qkv.masks import EMPTY, FULL, StructuredMask, Tile
from qkv.masks.rules import AnyOf, Causal, Dense, Documents, Padding, SlidingWindow
from qkv.masks.tiles import query_offset

MAX_CALLS = 256
"""A reduction needing more SDPA calls than this (many tiny documents) is not made."""
MAX_LENGTH_GROUPS = 1024
"""Suffix padding with at most this many distinct lengths runs one maskless call per length."""
BAND_BLOCK = 128
"""Query rows per band call of a sliding window: each call spans ``BAND_BLOCK + window - 1`` keys
at most, so smaller blocks compute fewer masked pairs but make more calls."""
BAND_MAX_SHARE = 0.5
"""A band reduction computing more than this share of the ``T x S`` pairs is not made."""
BAND_MAX_CALLS = 4096
"""A band reduction needing more SDPA calls than this is not made (each call has at most
:data:`BAND_BLOCK` rows, so :data:`MAX_CALLS` would cap it at 32k queries)."""

Kind = Literal["open", "causal", "masked", "dead"]

__all__ = [
    "BAND_BLOCK",
    "BAND_MAX_CALLS",
    "BAND_MAX_SHARE",
    "MAX_CALLS",
    "MAX_LENGTH_GROUPS",
    "Piece",
    "Reduction",
    "reduce_mask",
    "reduced_attention",
]


@dataclass(frozen=True)
class Piece:
    """Queries ``[q0, q1)`` against keys ``[k0, k1)``: one SDPA call (or zeros).

    Attributes:
        q0: first query row.
        q1: one past the last.
        k0: first key.
        k1: one past the last key; every key the rows may see lies in ``[k0, k1)``.
        kind: ``"open"`` (no key in the range blocked), ``"causal"`` (top-left causal: local
            query ``i`` sees local keys ``0..i``, so rows past the last key see them all; SDPA's
            own ``is_causal`` flag, one call whatever the lengths), ``"masked"`` (the rule's own
            mask of this range), ``"dead"`` (no key at all: output 0).
    """

    q0: int
    q1: int
    k0: int
    k1: int
    kind: Kind

    @property
    def pairs(self) -> int:
        """Query-key pairs computed: 0 for dead rows; for a causal piece the lower triangle of
        its square and every key for the rows below it."""
        n, nk = self.q1 - self.q0, self.k1 - self.k0
        if self.kind == "causal":
            square = min(n, nk)
            return square * (square + 1) // 2 + (n - square) * nk
        return 0 if self.kind == "dead" else n * nk


@dataclass(frozen=True)
class Group:
    """Samples that share one list of pieces.

    Attributes:
        batch: the sample indices, ascending.
        pieces: the pieces, covering the query rows ``[0, T)`` in order.
    """

    batch: tuple[int, ...]
    pieces: tuple[Piece, ...]


@dataclass(frozen=True)
class Reduction:
    """A call's mask as SDPA calls, and what was done, in words.

    Attributes:
        mask: the rule the pieces were cut from (masked pieces ask it for their tile).
        groups: samples grouped by their pieces.
        grid: ``(B, H, T, S)``.
        describe: makes the sentence for :func:`qkv.explain_backend` (see :attr:`summary`),
            only when asked: models reduce their mask in every layer of every forward.
        piece_mask: the rule masked pieces ask for their tile instead of ``mask``, or None: a
            band reduction whose keys are already cut to each sample's live keys and documents
            needs only its window parts there.
    """

    mask: StructuredMask
    groups: tuple[Group, ...]
    grid: tuple[int, int, int, int]
    describe: Callable[[], str] = field(compare=False, repr=False, default=lambda: "")
    piece_mask: StructuredMask | None = field(default=None, compare=False, repr=False)

    @property
    def summary(self) -> str:
        """The sentence for :func:`qkv.explain_backend`."""
        return self.describe()

    @property
    def calls(self) -> int:
        """SDPA calls made."""
        return sum(p.kind != "dead" for g in self.groups for p in g.pieces)

    @property
    def pairs(self) -> int:
        """Query-key pairs computed, over all samples."""
        return sum(len(g.batch) * p.pairs for g in self.groups for p in g.pieces)


def _causal_pieces(q0: int, q1: int, k0: int, k1: int, offset: int | None) -> list[Piece]:
    """Pieces of queries ``[q0, q1)`` over keys ``[k0, k1)`` where local query ``i`` may see
    local keys ``j <= i + offset`` (all of them when ``offset`` is None)."""
    nq, nk = q1 - q0, k1 - k0
    if nq <= 0:
        return []
    if nk <= 0:
        return [Piece(q0, q1, k0, k0, "dead")]
    if offset is None or offset >= nk - 1:
        return [Piece(q0, q1, k0, k1, "open")]
    if offset < 0:  # the first -offset rows see no key; the rest are causal from key k0
        r = min(-offset, nq)
        return [Piece(q0, q0 + r, k0, k0, "dead"), *_causal_pieces(q0 + r, q1, k0, k1, 0)]
    if offset == 0:  # top-left, SDPA's own flag: rows past nk see every key, keys past nq none
        return [Piece(q0, q1, k0, k0 + min(nq, nk), "causal")]
    # 0 < offset < nk - 1: the first r rows have a causal edge off the diagonal.
    r = min(nq, nk - 1 - offset)
    edge = Piece(q0, q0 + r, k0, k0 + min(nk, r + offset), "masked")
    return [edge, *_causal_pieces(q0 + r, q1, k0, k1, None)]


def _band_pieces(q0: int, q1: int, k0: int, k1: int, lo: int, hi: int) -> list[Piece]:
    """Band pieces of queries ``[q0, q1)`` over keys ``[k0, k1)``, where query ``q`` may see
    keys ``[q + lo, q + hi)`` of them: one piece per :data:`BAND_BLOCK` query rows, over the keys
    any of its rows can see; ``"open"`` when every row sees all of them."""
    pieces: list[Piece] = []
    for s in range(q0, q1, BAND_BLOCK):
        e = min(s + BAND_BLOCK, q1)
        a, b = max(k0, s + lo), min(k1, e - 1 + hi)  # the union of the rows' key ranges
        if b <= a:
            pieces.append(Piece(s, e, 0, 0, "dead"))
            continue
        every_row_sees_all = e - 1 + lo <= a and s + hi >= b
        pieces.append(Piece(s, e, a, b, "open" if every_row_sees_all else "masked"))
    return pieces


def _runs(ids: Tensor) -> list[tuple[int, int, int]]:
    """``(id, start, end)`` of each run of equal values in the 1-d ``ids``.

    Tensor ops and one read from the device: a Python loop over the ids cost 0.5 ms per 1k
    positions, 5 % of a 1k-token call's attention.
    """
    values, counts = torch.unique_consecutive(ids, return_counts=True)  # [R], [R]
    ends = counts.cumsum(0)  # [R]
    vals, stops = torch.stack([values.long(), ends]).tolist()
    starts = [0, *stops][: len(stops)]  # no run at all for empty ids
    return list(zip(vals, starts, stops, strict=True))


@dataclass
class _Parts:
    """The reducible parts of a mask, or ``ok=False`` when a part is not reducible."""

    ok: bool = True
    causal: list[SlidingWindow] | None = None
    padding: list[Padding] | None = None
    documents: list[Documents] | None = None
    windows: list[SlidingWindow] | None = None


def _split(mask: StructuredMask, T: int, S: int) -> _Parts:
    parts = mask.parts if isinstance(mask, AnyOf) else (mask,)
    out = _Parts(causal=[], padding=[], documents=[], windows=[])
    assert out.causal is not None and out.padding is not None and out.documents is not None
    assert out.windows is not None
    for p in parts:
        # A window wider than the largest query-key distance (T - 1 + offset) never binds.
        if isinstance(p, SlidingWindow) and (
            p.window is None or p.window > T - 1 + query_offset(T, S, p.align, p.offset)
        ):
            out.causal.append(p)
        elif isinstance(p, SlidingWindow):
            out.windows.append(p)
        elif isinstance(p, Padding):
            out.padding.append(p)
        elif isinstance(p, Documents):
            out.documents.append(p)
        else:
            return _Parts(ok=False)
    return out


def _key_limits(padding: list[Padding], B: int, S: int) -> tuple[list[int], list[bool]]:
    """Per sample: one past its last live key, and whether live keys have holes before it."""
    limit, holes = [S] * B, [False] * B
    for p in padding:
        if p.lengths is not None:
            lengths = p.lengths.tolist()
            limit = [min(a, int(n)) for a, n in zip(limit, lengths, strict=True)]
            continue
        assert p.is_pad is not None
        live = ~p.is_pad  # [B, S]
        pos = torch.arange(1, S + 1, device=live.device)  # [S]
        last = (live * pos).amax(dim=1)  # [B]: one past the last live key, 0 if none
        count = live.sum(dim=1)  # [B]: live keys; fewer than `last` means a hole before it
        lasts, counts = torch.stack([last, count]).tolist()  # one read from the device
        for b, (n, c) in enumerate(zip(lasts, counts, strict=True)):
            limit[b] = min(limit[b], int(n))
            holes[b] = holes[b] or c != n
    # Two paddings: a key live in one may be padding in the other, so there may be holes.
    if len(padding) > 1 and any(p.is_pad is not None for p in padding):
        holes = [True] * B
    return limit, holes


def _sample_pieces(
    parts: _Parts, b: int, T: int, S: int, limit: int, holes: bool
) -> list[Piece] | None:
    """The pieces of sample ``b``, or None when its documents are not contiguous runs."""
    assert parts.causal is not None and parts.documents is not None and parts.windows is not None
    offset = (
        min(query_offset(T, S, c.align, c.offset) for c in parts.causal) if parts.causal else None
    )
    band: tuple[int, int] | None = None
    if parts.windows:
        # Query q may see keys [q + lo, q + hi): each window allows keys q + off - w + 1 ..
        # q + off, each causal part keys up to q + off.
        offs = [query_offset(T, S, w.align, w.offset) for w in parts.windows]
        lo = max(o - (w.window or 0) + 1 for o, w in zip(offs, parts.windows, strict=True))
        hi = min(offs if offset is None else [*offs, offset]) + 1
        band = (lo, hi)
    segments: list[tuple[int, int, int, int]] = []  # (q0, q1, k0, k1)
    if not parts.documents:
        segments.append((0, T, 0, limit))
    else:
        if len(parts.documents) > 1:
            return None
        doc = parts.documents[0]
        q_runs = _runs(doc.q_ids[b])
        k_runs = q_runs if doc.kv_ids is doc.q_ids else _runs(doc.kv_ids[b])
        k_of = {d: (s, e) for d, s, e in k_runs}
        if len(k_of) != len(k_runs):
            return None  # an id in two places along the keys: not one range per document
        for d, qs, qe in q_runs:
            ks, ke = k_of.get(d, (0, 0))
            segments.append((qs, qe, ks, min(ke, limit)))
    pieces: list[Piece] = []
    for q0, q1, k0, k1 in segments:
        local = None if offset is None else q0 + offset - k0
        cut = (
            _causal_pieces(q0, q1, k0, k1, local)
            if band is None
            else _band_pieces(q0, q1, k0, k1, *band)
        )
        for p in cut:
            if holes and p.kind in ("open", "causal"):
                p = Piece(p.q0, p.q1, p.k0, p.k1, "masked")
            pieces.append(p)
    return _merge_dead(pieces)


def _merge_dead(pieces: list[Piece]) -> list[Piece]:
    out: list[Piece] = []
    for p in pieces:
        if out and p.kind == "dead" and out[-1].kind == "dead":
            out[-1] = Piece(out[-1].q0, p.q1, 0, 0, "dead")
        else:
            out.append(p)
    return out


def reduce_mask(
    mask: StructuredMask, B: int, H: int, T: int, S: int, *, band: bool = False
) -> Reduction | None:
    """Cut a (validated) mask into SDPA calls, if it is made of reducible parts and that pays.

    Args:
        mask: the call's structured mask, the call's ``is_causal`` already joined as a
            :class:`Causal` part.
        B: batch size.
        H: query heads.
        T: query length.
        S: key length.
        band: also cut a binding ``SlidingWindow`` into band calls (see the module docstring).

    Returns:
        The reduction, or None: a part that is not ``Causal`` / ``Padding`` / ``Documents`` (nor,
        with ``band``, ``SlidingWindow``), documents that are not contiguous runs, more than
        :data:`MAX_CALLS` calls (:data:`BAND_MAX_CALLS` for a band), a band over more than
        :data:`BAND_MAX_SHARE` of the pairs, a result that would only be the whole mask
        materialized, or a call being traced or compiled (the pieces are read from the rule's
        values).
    """
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return None
    parts = _split(mask, T, S)
    if not parts.ok or (parts.windows and not band):
        return None
    assert parts.padding is not None and parts.documents is not None and parts.causal is not None
    assert parts.windows is not None
    limits, holes = _key_limits(parts.padding, B, S)
    by_pieces: dict[tuple[Piece, ...], list[int]] = {}
    lengths = len(set(limits))
    if (
        parts.padding
        and not parts.documents
        and not parts.causal
        and not parts.windows
        and (any(holes) or lengths == 1 or lengths > MAX_LENGTH_GROUPS)
    ):
        # Padding alone: one batched call on the keys up to the longest live length, with the
        # [B, 1, 1, S'] mask only when the samples differ. Suffix padding of a few distinct
        # lengths is instead grouped by length below: one maskless call per length.
        longest = max(limits)
        kind: Kind = "open" if min(limits) == longest and not any(holes) else "masked"
        whole = (Piece(0, T, 0, longest, kind) if longest else Piece(0, T, 0, 0, "dead"),)
        by_pieces[whole] = list(range(B))
    else:
        for b in range(B):
            pieces = _sample_pieces(parts, b, T, S, limits[b], holes[b])
            if pieces is None:
                return None
            by_pieces.setdefault(tuple(pieces), []).append(b)
    groups = tuple(Group(tuple(bs), ps) for ps, bs in by_pieces.items())
    red = Reduction(mask, groups, (B, H, T, S))
    every = [p for g in groups for p in g.pieces]
    if red.calls == 0 or red.calls > (BAND_MAX_CALLS if parts.windows else MAX_CALLS):
        return None
    if red.pairs == B * T * S and all(p.kind == "masked" for p in every):
        return None  # nothing cut: that is the materialized mask
    if parts.windows and red.pairs > BAND_MAX_SHARE * B * T * S:
        return None  # a wide band: skipping tiles (blockwise) or the dense mask pays more
    piece_mask: StructuredMask | None = None
    if parts.windows and not any(holes):
        # Every piece's keys are live and of its queries' document: only the windows (and
        # causal parts) can block inside it.
        rules = [*parts.windows, *parts.causal]
        piece_mask = rules[0] if len(rules) == 1 else AnyOf(*rules)
    return Reduction(mask, groups, (B, H, T, S), lambda: _summary(red, parts, limits), piece_mask)


def _summary(red: Reduction, parts: _Parts, limits: list[int]) -> str:
    B, _, T, S = red.grid
    every = [p for g in red.groups for p in g.pieces]
    facts = []
    if any(p.kind == "causal" for p in every):
        facts.append("the causal part runs as SDPA's is_causal kernel")
    if parts.padding:
        facts.append(f"keys cut to the live length (longest {max(limits)} of S={S})")
        if len(red.groups) > 1 and not parts.documents:
            facts.append(f"samples grouped by length ({len(red.groups)} groups)")
    if parts.documents:
        facts.append("one SDPA call per document")
    if parts.windows:
        band = [p for p in every if p.kind != "dead"]
        widths = sorted({p.k1 - p.k0 for p in band})
        keys = f"{widths[0]}" if len(widths) == 1 else f"{widths[0]}-{widths[-1]}"
        facts.append(
            f"sliding window → {len(band)} band SDPA call(s) of up to {BAND_BLOCK} query rows "
            f"over {keys} keys each"
        )
    masked = [p for p in every if p.kind == "masked"]
    if masked:
        big = max(masked, key=lambda p: p.pairs)
        facts.append(
            f"{len(masked)} piece(s) keep the rule's own mask, at most "
            f"[{big.q1 - big.q0}, {big.k1 - big.k0}]"
        )
    dead = sum(
        len(g.batch) * (p.q1 - p.q0) for g in red.groups for p in g.pieces if p.kind == "dead"
    )
    if dead:
        facts.append(f"{dead} query row(s) with no key left are set to 0")
    share = red.pairs / (B * T * S)
    return (
        f"{red.mask!r} reduced exactly to {red.calls} SDPA call(s) on {share:.0%} of the "
        f"query-key pairs: {'; '.join(facts)}"
    )


def _rows(x: Tensor, batch: tuple[int, ...], B: int) -> Tensor:
    """``x``'s samples ``batch`` (``x`` has B or 1 rows on dim 0)."""
    if x.shape[0] == 1 or len(batch) == B:
        return x
    if batch == tuple(range(batch[0], batch[-1] + 1)):
        return x[batch[0] : batch[-1] + 1]
    return x[torch.tensor(batch, device=x.device)]


def reduced_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    reduction: Reduction,
    attn_bias: Tensor | None,
    *,
    scale: float,
    dropout_p: float,
    training: bool,
) -> Tensor:
    """Attention of a reduced mask: each piece through :func:`fused_attention`.

    Args:
        query: ``[B, H, T, Dh]``.
        key: ``[B, Hkv, S, Dh]`` with ``H % Hkv == 0``.
        value: ``[B, Hkv, S, Dv]``.
        reduction: from :func:`reduce_mask` for this call's mask and grid.
        attn_bias: float broadcastable to ``[B, H, T, S]``, or None.
        scale: multiplies the scores.
        dropout_p: dropout on the weights (only when ``training``).
        training: apply dropout.

    Returns:
        Output ``[B, H, T, Dv]`` in the input dtype; rows with every key blocked are 0.

    Raises:
        ValueError: a reduction made for another grid.
    """
    B, H, T, _ = query.shape
    S = key.shape[2]
    if reduction.grid != (B, H, T, S):
        raise ValueError(f"the reduction was made for grid {reduction.grid}, not {(B, H, T, S)}")
    Dv = value.shape[3]
    bias4 = None
    if attn_bias is not None:
        lead = (1,) * (4 - attn_bias.dim())
        bias4 = attn_bias.reshape(lead + tuple(attn_bias.shape))  # [B|1, H|1, T|1, S|1]
    outs = []
    bands: dict[tuple[int, int, int], tuple[Tensor, bool] | None] = {}
    for g in reduction.groups:
        q, k, v = (_rows(x, g.batch, B) for x in (query, key, value))
        bias = None if bias4 is None else _rows(bias4, g.batch, B)
        rows = []
        for p in g.pieces:
            if p.kind == "dead":
                rows.append(query.new_zeros(len(g.batch), H, p.q1 - p.q0, Dv))  # [g, H, bq, Dv]
                continue
            band = None
            if p.kind == "masked" and reduction.piece_mask is not None:
                band = _band_bias(reduction.piece_mask, p, reduction.grid, query, bands)
            if band is not None and band[1]:
                # No row or key of this band piece is fully blocked: its mask goes to SDPA as
                # the additive bias it would make of it, built once per distinct pattern.
                b = bias_tile(bias, p.q0, p.q1, p.k0, p.k1)
                rows.append(
                    _piece_attention(
                        q[:, :, p.q0 : p.q1],
                        k[:, :, p.k0 : p.k1],
                        v[:, :, p.k0 : p.k1],
                        None,
                        band[0] if b is None else b + band[0],
                        False,
                        scale,
                        dropout_p,
                        training,
                    )  # [g, H, bq, Dv]
                )
                continue
            mask: Tensor | None = None
            if p.kind == "masked":
                rule = reduction.piece_mask or reduction.mask
                tm = rule.tile(Tile(B, H, T, S, p.q0, p.q1, p.k0, p.k1, query.device))
                if tm is EMPTY:
                    rows.append(query.new_zeros(len(g.batch), H, p.q1 - p.q0, Dv))
                    continue
                if tm is not FULL:
                    assert isinstance(tm, Tensor)
                    mask = _rows(tm, g.batch, B)  # [g|1, H|1, bq, bk]
            rows.append(
                _piece_attention(
                    q[:, :, p.q0 : p.q1],
                    k[:, :, p.k0 : p.k1],
                    v[:, :, p.k0 : p.k1],
                    mask,
                    bias_tile(bias, p.q0, p.q1, p.k0, p.k1),
                    p.kind == "causal",
                    scale,
                    dropout_p,
                    training,
                )  # [g, H, bq, Dv]
            )
        outs.append(rows[0] if len(rows) == 1 else torch.cat(rows, dim=2))  # [g, H, T, Dv]
    if len(outs) == 1:
        return outs[0]
    order = [b for g in reduction.groups for b in g.batch]
    inverse = torch.empty(B, dtype=torch.long)
    inverse[torch.tensor(order)] = torch.arange(B)
    return torch.cat(outs, dim=0).index_select(0, inverse.to(query.device))  # [B, H, T, Dv]


def _band_bias(
    rule: StructuredMask,
    p: Piece,
    grid: tuple[int, int, int, int],
    like: Tensor,
    seen: dict[tuple[int, int, int], tuple[Tensor, bool] | None],
) -> tuple[Tensor, bool] | None:
    """A band piece's mask as an additive ``0 / -inf`` bias, and whether no query row and no
    key of the piece is fully blocked (then SDPA needs none of fused's dead-row handling).

    ``rule`` is a band reduction's :attr:`Reduction.piece_mask`: sliding-window and causal
    parts only, which block by ``q - k`` alone, so pieces of the same size at the same
    diagonal offset share one mask; ``seen`` holds them for one call (a 4k band of 32 pieces
    has 3 distinct ones). None when the tile is not a tensor (or under tracing, where reading
    the mask's values to tell would break the graph).
    """
    if torch.compiler.is_compiling():
        return None
    shape = (p.q0 - p.k0, p.q1 - p.q0, p.k1 - p.k0)
    if shape not in seen:
        tm = rule.tile(Tile(*grid, p.q0, p.q1, p.k0, p.k1, like.device))
        if not isinstance(tm, Tensor):
            seen[shape] = None
        else:
            work = compute_dtype(like.dtype)
            add = torch.where(tm, float("-inf"), 0.0).to(work)  # [1, 1, bq, bk]
            clean = not bool(tm.all(dim=-1).any() | tm.all(dim=-2).any())
            seen[shape] = (add, clean)
    return seen[shape]


def _piece_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    bias: Tensor | None,
    causal: bool,
    scale: float,
    dropout_p: float,
    training: bool,
) -> Tensor:
    """One piece: SDPA, or blockwise where fused would train it through its slower exact
    backward (:func:`~qkv.backends.fused.blockwise_trains_faster`). ``causal`` is top-left
    (a ``"causal"`` piece)."""
    if not blockwise_trains_faster(q, k, v, bias, dropout_p, training):
        return fused_attention(
            q,
            k,
            v,
            mask,
            bias,
            is_causal=causal,
            scale=scale,
            dropout_p=dropout_p,
            training=training,
            causal_align="top_left",
        )  # [g, H, bq, Dv]
    rule: StructuredMask | None = Causal(align="top_left") if causal else None
    if mask is not None:
        rule = Dense(mask) if rule is None else rule | Dense(mask)
    return blockwise_attention(q, k, v, rule, bias, scale, dropout_p, training)  # [g, H, bq, Dv]
