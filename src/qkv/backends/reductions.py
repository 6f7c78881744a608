"""The fused backend over a reduction's pieces: each piece one SDPA call (see
:mod:`qkv.backends.pieces` for how a mask is cut), the outputs put back in place.

Each piece runs through :func:`qkv.backends.fused.fused_attention`, which keeps qkv's semantics
(fully masked rows 0 with finite gradients, upcast, GQA), or through blockwise where fused would
train it through its slower exact CPU backward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from qkv.backends.blockwise import blockwise_attention
from qkv.backends.fused import blockwise_trains_faster, fused_attention
from qkv.backends.pieces import Group, Piece, Reduction
from qkv.backends.reference import compute_dtype
from qkv.backends.tiles import bias_tile
from qkv.masks import EMPTY, FULL, StructuredMask, Tile
from qkv.masks.rules import Causal, Dense
from qkv.masks.validate import as_4d

__all__ = ["reduced_attention"]


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
    bias4 = None
    if attn_bias is not None:
        bias4 = as_4d(attn_bias)  # [B|1, H|1, T|1, S|1]
    run = _Run(reduction, query, value.shape[3], scale, dropout_p, training)
    outs = []
    for g in reduction.groups:
        q, k, v = (_rows(x, g.batch, B) for x in (query, key, value))
        bias = None if bias4 is None else _rows(bias4, g.batch, B)
        rows = [run.piece(g, p, q, k, v, bias) for p in g.pieces]  # [g, H, bq, Dv] each
        outs.append(rows[0] if len(rows) == 1 else torch.cat(rows, dim=2))  # [g, H, T, Dv]
    if len(outs) == 1:
        return outs[0]
    order = [b for g in reduction.groups for b in g.batch]
    inverse = torch.empty(B, dtype=torch.long)
    inverse[torch.tensor(order)] = torch.arange(B)
    return torch.cat(outs, dim=0).index_select(0, inverse.to(query.device))  # [B, H, T, Dv]


@dataclass
class _Run:
    """One reduced call's pieces being run: what every piece shares."""

    reduction: Reduction
    like: Tensor  # the query: dtype and device of new tensors
    Dv: int
    scale: float
    dropout_p: float
    training: bool
    bands: dict[tuple[int, int, int], tuple[Tensor, bool] | None] = field(default_factory=dict)

    def piece(
        self, g: Group, p: Piece, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None
    ) -> Tensor:
        """Piece ``p`` of group ``g`` (``q``, ``k``, ``v``, ``bias``: the group's rows):
        ``[g, H, bq, Dv]``."""
        red = self.reduction
        B, H, T, S = red.grid
        if p.kind == "dead":
            return self.like.new_zeros(len(g.batch), H, p.q1 - p.q0, self.Dv)  # [g, H, bq, Dv]
        qkv_ = (q[:, :, p.q0 : p.q1], k[:, :, p.k0 : p.k1], v[:, :, p.k0 : p.k1])
        b = bias_tile(bias, p.q0, p.q1, p.k0, p.k1)
        band = None
        if p.kind == "masked" and red.piece_mask is not None:
            band = _band_bias(red.piece_mask, p, red.grid, self.like, self.bands)
        if band is not None and band[1]:
            # No row or key of this band piece is fully blocked: its mask goes to SDPA as the
            # additive bias it would make of it, built once per distinct pattern.
            b = band[0] if b is None else b + band[0]
            return self.attend(*qkv_, None, b, False)
        mask: Tensor | None = None
        if p.kind == "masked":
            rule = red.piece_mask or red.mask
            tm = rule.tile(Tile(B, H, T, S, p.q0, p.q1, p.k0, p.k1, self.like.device))
            if tm is EMPTY:
                return self.like.new_zeros(len(g.batch), H, p.q1 - p.q0, self.Dv)
            if tm is not FULL:
                assert isinstance(tm, Tensor)
                mask = _rows(tm, g.batch, B)  # [g|1, H|1, bq, bk]
        return self.attend(*qkv_, mask, b, p.kind == "causal")

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, b: Tensor | None, causal: bool
    ) -> Tensor:
        return _piece_attention(
            q, k, v, mask, b, causal, self.scale, self.dropout_p, self.training
        )  # [g, H, bq, Dv]


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
