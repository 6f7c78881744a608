"""The arithmetic of one block: this rank's queries against one set of keys, tile by tile.

The forward is the online softmax of FlashAttention over the tiles of a
:class:`~qkv.distributed.plan.PairPlan`, updating a running row max ``m``, row sum ``l`` and
unnormalised output ``acc`` that persist across blocks, so that blocks from every rank merge
exactly as if they were tiles of one call: ``out = acc / l`` and ``lse = m + log l`` at the end.
The backward recomputes each tile's probabilities from the final ``lse`` (FlashAttention-2) and
returns the block's contribution to ``dQ`` and the block's ``dK``/``dV``.

Grouped-query attention: query head ``h`` uses key/value head ``h // G`` with ``G = H / Hkv``
(as ``F.scaled_dot_product_attention(enable_gqa=True)``); tensors are viewed
``[B, Hkv, G, ..]`` so no key or value is copied per query head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from qkv.distributed.plan import PairPlan
from qkv.masks import FULL, Tile, TileMask

__all__ = ["RowState", "backward_block", "finish", "forward_block", "start"]


@dataclass
class RowState:
    """The running softmax of every local query row (compute dtype).

    Attributes:
        m: row max so far, ``[B, H, T]`` (``-inf`` before any visible key).
        l: row sum of ``exp(s - m)``, ``[B, H, T]``.
        acc: unnormalised output, ``[B, H, T, Dv]``.
    """

    m: Tensor
    l: Tensor  # noqa: E741 (the name of the papers)
    acc: Tensor


def start(q: Tensor, dv: int) -> RowState:
    """The state before any block: no key seen by any row."""
    B, H, T, _ = q.shape
    return RowState(
        torch.full((B, H, T), float("-inf"), dtype=q.dtype, device=q.device),  # [B, H, T]
        torch.zeros(B, H, T, dtype=q.dtype, device=q.device),  # [B, H, T]
        torch.zeros(B, H, T, dv, dtype=q.dtype, device=q.device),  # [B, H, T, Dv]
    )


def finish(state: RowState) -> tuple[Tensor, Tensor]:
    """``(out [B, H, T, Dv], lse [B, H, T])``; a row that saw no key gives 0 and ``-inf``."""
    dead = state.l == 0  # [B, H, T]
    l_safe = state.l.masked_fill(dead, 1.0)  # [B, H, T]
    out = state.acc / l_safe[..., None]  # [B, H, T, Dv]
    lse = (state.m + l_safe.log()).masked_fill(dead, float("-inf"))  # [B, H, T]
    return out, lse


def _tile_mask(
    pair: PairPlan, t: tuple[int, int, int, int], B: int, H: int, dev: torch.device
) -> TileMask:
    tp = pair.tiles
    if t in tp.masks:
        return tp.masks[t]
    if tp.mask is None:
        return FULL
    T, S = tp.grid[2], tp.grid[3]
    return tp.mask.tile(Tile(B, H, T, S, *t, dev))


def _scores(
    q5: Tensor, k: Tensor, pair: PairPlan, t: tuple[int, int, int, int], scale: float
) -> Tensor:
    """Masked scores of one tile, ``[B, Hkv, G, bq, bk]`` (blocked: ``-inf``)."""
    B, Hkv, G = q5.shape[:3]
    r0, c0 = pair.rows[0], pair.cols[0]
    q0, q1, k0, k1 = t
    qi = q5[:, :, :, r0 + q0 : r0 + q1]  # [B, Hkv, G, bq, Dh]
    kj = k[:, :, None, c0 + k0 : c0 + k1]  # [B, Hkv, 1, bk, Dh]
    s = torch.matmul(qi, kj.transpose(-1, -2)).mul_(scale)  # [B, Hkv, G, bq, bk]
    tm = _tile_mask(pair, t, B, Hkv * G, q5.device)
    if tm is not FULL:
        assert isinstance(tm, Tensor)
        blocked = tm.expand(B, Hkv * G, q1 - q0, k1 - k0).reshape(s.shape)  # [B, Hkv, G, bq, bk]
        s = s.masked_fill_(blocked, float("-inf"))
    return s


def forward_block(
    q: Tensor, k: Tensor, v: Tensor, pair: PairPlan, scale: float, state: RowState
) -> None:
    """Fold one block into ``state``.

    Args:
        q: local queries ``[B, H, T, Dh]`` (compute dtype).
        k: the keys the pair's columns index, ``[B, Hkv, L, Dh]``.
        v: their values, ``[B, Hkv, L, Dv]``.
        pair: the block's rows, columns and tiles.
        scale: the score scale.
        state: the running softmax, updated in place.
    """
    B, H, T, Dh = q.shape
    Hkv = k.shape[1]
    G = H // Hkv
    q5 = q.view(B, Hkv, G, T, Dh)  # [B, Hkv, G, T, Dh]
    m5 = state.m.view(B, Hkv, G, T)  # [B, Hkv, G, T]
    l5 = state.l.view(B, Hkv, G, T)  # [B, Hkv, G, T]
    acc5 = state.acc.view(B, Hkv, G, T, -1)  # [B, Hkv, G, T, Dv]
    r0, c0 = pair.rows[0], pair.cols[0]
    k = k.to(q.dtype)
    v = v.to(q.dtype)
    for row in pair.tiles.tiles:
        for t in row:
            q0, q1, k0, k1 = t
            rows = slice(r0 + q0, r0 + q1)
            s = _scores(q5, k, pair, t, scale)  # [B, Hkv, G, bq, bk]
            m_old = m5[..., rows]  # [B, Hkv, G, bq]
            m_new = torch.maximum(m_old, s.amax(dim=-1))  # [B, Hkv, G, bq]
            m_safe = m_new.masked_fill(torch.isneginf(m_new), 0.0)  # [B, Hkv, G, bq]
            p = s.sub_(m_safe[..., None]).exp_()  # [B, Hkv, G, bq, bk]
            alpha = (m_old - m_safe).exp()  # [B, Hkv, G, bq]
            l5[..., rows] = l5[..., rows] * alpha + p.sum(dim=-1)
            vj = v[:, :, None, c0 + k0 : c0 + k1]  # [B, Hkv, 1, bk, Dv]
            acc5[:, :, :, rows] = acc5[:, :, :, rows] * alpha[..., None] + torch.matmul(p, vj)
            m5[..., rows] = m_new


def backward_block(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dout: Tensor,
    lse: Tensor,
    delta: Tensor,
    pair: PairPlan,
    scale: float,
    dq: Tensor,
    dk: Tensor,
    dv: Tensor,
) -> None:
    """Add one block's gradients: to ``dq`` (local rows) and to ``dk``/``dv`` (its keys).

    Args:
        q: local queries ``[B, H, T, Dh]`` (compute dtype).
        k: the keys the pair's columns index, ``[B, Hkv, L, Dh]``.
        v: their values, ``[B, Hkv, L, Dv]``.
        dout: gradient of the local output, ``[B, H, T, Dv]``.
        lse: the final log-sum-exp of each row, ``[B, H, T]``, ``+inf`` where no key is seen
            (so every probability of that row is 0).
        delta: ``rowsum(dout * out)``, ``[B, H, T]``.
        pair: the block's rows, columns and tiles.
        scale: the score scale.
        dq: ``[B, H, T, Dh]``, added to.
        dk: ``[B, Hkv, L, Dh]`` matching ``k``, added to.
        dv: ``[B, Hkv, L, Dv]`` matching ``v``, added to.
    """
    B, H, T, Dh = q.shape
    Hkv = k.shape[1]
    G = H // Hkv
    q5 = q.view(B, Hkv, G, T, Dh)  # [B, Hkv, G, T, Dh]
    do5 = dout.view(B, Hkv, G, T, -1)  # [B, Hkv, G, T, Dv]
    lse5 = lse.view(B, Hkv, G, T)  # [B, Hkv, G, T]
    delta5 = delta.view(B, Hkv, G, T)  # [B, Hkv, G, T]
    dq5 = dq.view(B, Hkv, G, T, Dh)  # [B, Hkv, G, T, Dh]
    r0, c0 = pair.rows[0], pair.cols[0]
    kc = k.to(q.dtype)
    vc = v.to(q.dtype)
    for row in pair.tiles.tiles:
        for t in row:
            q0, q1, k0, k1 = t
            rows = slice(r0 + q0, r0 + q1)
            cols = slice(c0 + k0, c0 + k1)
            s = _scores(q5, kc, pair, t, scale)  # [B, Hkv, G, bq, bk]
            p = s.sub_(lse5[..., rows, None]).exp_()  # [B, Hkv, G, bq, bk]
            doi = do5[:, :, :, rows]  # [B, Hkv, G, bq, Dv]
            dv[:, :, cols] += torch.matmul(p.transpose(-1, -2), doi).sum(dim=2)
            dp = torch.matmul(doi, vc[:, :, None, cols].transpose(-1, -2))  # [B, Hkv, G, bq, bk]
            ds = p.mul_(dp.sub_(delta5[..., rows, None])).mul_(scale)  # [B, Hkv, G, bq, bk]
            dq5[:, :, :, rows] += torch.matmul(ds, kc[:, :, None, cols])
            dk[:, :, cols] += torch.matmul(ds.transpose(-1, -2), q5[:, :, :, rows]).sum(dim=2)
