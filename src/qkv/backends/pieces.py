"""How a structured mask is cut exactly into a few plain SDPA calls: the pieces.

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
  blocks of ``Policy.band_block`` rows, one call per block over just the keys its rows can see,
  with the window's own small mask on the band's ragged edges. Used only where the band is at
  most ``Policy.band_max_share`` of the grid and the caller allows it (the planner: forward
  only);
- combinations compose: a document's keys are cut by the padding, then made causal (or cut into
  bands).

:func:`reduce_mask` finds these pieces for one call (eagerly, from the rule's lengths and ids,
one read from the device: this is planning, like the blockwise tile plan, and is skipped while
tracing or compiling); :func:`qkv.backends.reductions.reduced_attention` runs them. A piece the
rules leave irregular (a causal edge not on the diagonal, holes in an ``is_pad`` mask) gets the
rule's own mask for that piece only. Rows no key is left for are zeros.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from qkv.backends.policy import Policy, current_policy
from qkv.backends.reads import key_limits, runs
from qkv.masks import StructuredMask
from qkv.masks.rules import AnyOf, Dense, Documents, Padding, SlidingWindow, parts_of
from qkv.masks.tiles import query_offset

__all__ = [
    "Group",
    "Kind",
    "Piece",
    "Reduction",
    "padding_of_tensor",
    "reduce_mask",
    "reduction_of",
]

Kind = Literal["open", "causal", "masked", "dead"]


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
    """A call's mask as SDPA calls, and which of the mask's parts shaped them.

    Attributes:
        mask: the rule the pieces were cut from (masked pieces ask it for their tile).
        groups: samples grouped by their pieces.
        grid: ``(B, H, T, S)``.
        piece_mask: the rule masked pieces ask for their tile instead of ``mask``, or None: a
            band reduction whose keys are already cut to each sample's live keys and documents
            needs only its window parts there.
        longest: with a ``Padding`` part, the longest live length over the samples; else None.
        documents: the pieces follow a ``Documents`` part.
        band: a sliding window was cut into band calls of ``band_block`` query rows.
        band_block: the query rows per band call (``Policy.band_block`` when planned).
    """

    mask: StructuredMask
    groups: tuple[Group, ...]
    grid: tuple[int, int, int, int]
    piece_mask: StructuredMask | None = None
    longest: int | None = None
    documents: bool = False
    band: bool = False
    band_block: int = 0

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


def _band_pieces(q0: int, q1: int, k0: int, k1: int, lo: int, hi: int, block: int) -> list[Piece]:
    """Band pieces of queries ``[q0, q1)`` over keys ``[k0, k1)``, where query ``q`` may see
    keys ``[q + lo, q + hi)`` of them: one piece per ``block`` query rows, over the keys any of
    its rows can see; ``"open"`` when every row sees all of them."""
    pieces: list[Piece] = []
    for s in range(q0, q1, block):
        e = min(s + block, q1)
        a, b = max(k0, s + lo), min(k1, e - 1 + hi)  # the union of the rows' key ranges
        if b <= a:
            pieces.append(Piece(s, e, 0, 0, "dead"))
            continue
        every_row_sees_all = e - 1 + lo <= a and s + hi >= b
        pieces.append(Piece(s, e, a, b, "open" if every_row_sees_all else "masked"))
    return pieces


@dataclass
class _Parts:
    """The reducible parts of a mask, or ``ok=False`` when a part is not reducible."""

    ok: bool = True
    causal: list[SlidingWindow] | None = None
    padding: list[Padding] | None = None
    documents: list[Documents] | None = None
    windows: list[SlidingWindow] | None = None


def _split(mask: StructuredMask, T: int, S: int) -> _Parts:
    parts = parts_of(mask)
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


def _sample_pieces(
    parts: _Parts, b: int, T: int, S: int, limit: int, holes: bool, band_block: int
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
        q_runs = runs(doc.q_ids[b])
        k_runs = q_runs if doc.kv_ids is doc.q_ids else runs(doc.kv_ids[b])
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
            else _band_pieces(q0, q1, k0, k1, *band, band_block)
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
        ``Policy.max_calls`` calls (``Policy.band_max_calls`` for a band), a band over more than
        ``Policy.band_max_share`` of the pairs, a result that would only be the whole mask
        materialized, or a call being traced or compiled (the pieces are read from the rule's
        values).
    """
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return None
    parts = _split(mask, T, S)
    if not parts.ok or (parts.windows and not band):
        return None
    assert parts.padding is not None and parts.windows is not None
    policy = current_policy()
    limits, holes = key_limits(parts.padding, B, S)
    by_pieces = _pieces_by_sample(parts, B, T, S, limits, holes, policy)
    if by_pieces is None:
        return None
    groups = tuple(Group(tuple(bs), ps) for ps, bs in by_pieces.items())
    red = Reduction(
        mask,
        groups,
        (B, H, T, S),
        _piece_mask(parts, holes),
        max(limits) if parts.padding else None,
        bool(parts.documents),
        bool(parts.windows),
        policy.band_block if parts.windows else 0,
    )
    every = [p for g in groups for p in g.pieces]
    if red.calls == 0 or red.calls > (policy.band_max_calls if parts.windows else policy.max_calls):
        return None
    if red.pairs == B * T * S and all(p.kind == "masked" for p in every):
        return None  # nothing cut: that is the materialized mask
    if parts.windows and red.pairs > policy.band_max_share * B * T * S:
        return None  # a wide band: skipping tiles (blockwise) or the dense mask pays more
    return red


def _pieces_by_sample(
    parts: _Parts,
    B: int,
    T: int,
    S: int,
    limits: list[int],
    holes: list[bool],
    policy: Policy,
) -> dict[tuple[Piece, ...], list[int]] | None:
    """Each distinct list of pieces and the samples that share it, or None when a sample's
    documents are not contiguous runs."""
    by_pieces: dict[tuple[Piece, ...], list[int]] = {}
    lengths = len(set(limits))
    if (
        parts.padding
        and not parts.documents
        and not parts.causal
        and not parts.windows
        and (any(holes) or lengths == 1 or lengths > policy.max_length_groups)
    ):
        # Padding alone: one batched call on the keys up to the longest live length, with the
        # [B, 1, 1, S'] mask only when the samples differ. Suffix padding of a few distinct
        # lengths is instead grouped by length below: one maskless call per length.
        longest = max(limits)
        kind: Kind = "open" if min(limits) == longest and not any(holes) else "masked"
        whole = (Piece(0, T, 0, longest, kind) if longest else Piece(0, T, 0, 0, "dead"),)
        by_pieces[whole] = list(range(B))
        return by_pieces
    for b in range(B):
        pieces = _sample_pieces(parts, b, T, S, limits[b], holes[b], policy.band_block)
        if pieces is None:
            return None
        by_pieces.setdefault(tuple(pieces), []).append(b)
    return by_pieces


def _piece_mask(parts: _Parts, holes: list[bool]) -> StructuredMask | None:
    """The rule a band reduction's masked pieces ask for their tile, or None (see
    :attr:`Reduction.piece_mask`)."""
    if not parts.windows or any(holes):
        return None
    # Every piece's keys are live and of its queries' document: only the windows (and
    # causal parts) can block inside it.
    assert parts.causal is not None
    rules = [*parts.windows, *parts.causal]
    return rules[0] if len(rules) == 1 else AnyOf(*rules)


def reduction_of(
    mask: Tensor | StructuredMask | None,
    run_mask: StructuredMask | None,
    grid: tuple[int, int, int, int],
    *,
    strict: bool,
    band: bool,
) -> Reduction | None:
    """The exact SDPA reduction of a call's mask (or of a causal call SDPA's flag cannot take
    as it is), if one exists and its masked pieces stay within
    ``Policy.materialize_limit_bytes``.

    Args:
        mask: the call's validated mask: a 4-D bool tensor (reduced only when it is a
            ``[B|1, 1, 1, S]`` key padding, see :func:`padding_of_tensor`), a rule, or None.
        run_mask: the rule the call runs, ``is_causal`` joined (see
            :func:`qkv.backends.plan.blockwise_mask`).
        grid: ``(B, H, T, S)``.
        strict: (``auto``) on a grid blockwise would be considered for, also refuse a reduction
            that leaves most pairs under a ``[T, S]``-shaped piece mask, where blockwise may
            skip more.
        band: a sliding window may be cut into band calls.

    Returns:
        The reduction, or None.
    """
    B, H, T, S = grid
    if isinstance(mask, Tensor):
        padding = padding_of_tensor(mask, B)
        if padding is None:
            return None  # a tensor that is not key padding goes to SDPA as it is
        run_mask = padding if run_mask is None else _with_tensor_as(run_mask, padding)
    elif run_mask is None or (mask is None and T == S):
        return None  # is_causal with T == S goes to SDPA's own flag
    red = reduce_mask(run_mask, B, H, T, S, band=band)
    if red is None:
        return None
    policy = current_policy()
    masked = [(len(g.batch), p) for g in red.groups for p in g.pieces if p.kind == "masked"]
    if any(5 * n * p.pairs > policy.materialize_limit_bytes for n, p in masked):
        return None
    under_mask = sum(n * p.pairs for n, p in masked)
    pairs = T * S
    if strict and pairs >= policy.blockwise_min_pairs and _has_row_rules(run_mask):
        return None if 2 * under_mask > B * pairs else red
    return red


def _with_tensor_as(run_mask: StructuredMask, padding: Padding) -> StructuredMask:
    """``run_mask`` (a :class:`Dense` tensor part, maybe ``| Causal``) with the tensor part
    replaced by the :class:`Padding` rule it is."""
    parts = parts_of(run_mask)
    rules = [padding if isinstance(p, Dense) else p for p in parts]
    out = rules[0]
    for r in rules[1:]:
        out = out | r
    return out


def padding_of_tensor(mask: Tensor, B: int) -> Padding | None:
    """A bool mask tensor of shape ``[B|1, 1, 1, S]`` (what models build from their padding) as
    the :class:`Padding` rule it is, so that the padding reductions see it; else None.

    Args:
        mask: a validated, 4-D bool mask tensor.
        B: the call's batch size.

    Returns:
        ``Padding(is_pad)`` with ``is_pad = mask[:, 0, 0, :]`` ``[B, S]``, or None.
    """
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] != 1:
        return None
    return Padding(mask[:, 0, 0, :].expand(B, mask.shape[3]))  # [B, S]


def _has_row_rules(mask: StructuredMask) -> bool:
    """Whether a mask's pieces may need ``[T, S]``-shaped masks (not only ``[B, 1, 1, S]``)."""
    parts = parts_of(mask)
    return any(not isinstance(p, Padding) for p in parts)
