"""The arithmetic of one block: this rank's queries against one set of keys.

The forward folds a block into a running row max ``m``, row sum ``l`` and unnormalised output
``acc`` that persist across blocks (the online softmax of FlashAttention), so blocks from every
rank merge exactly as if they were tiles of one call: ``out = acc / l`` and ``lse = m + log l``
at the end. The backward recomputes each block's probabilities from the *final* ``lse``
(FlashAttention-2) and adds the block's share of ``dQ`` and its ``dK``/``dV``.

How a block runs: its :class:`~qkv.distributed.plan.PairPlan` lists the tiles the rule does
not leave empty. On CPU each row of tiles whose keys are contiguous runs as **one** call of
PyTorch's fused flash kernel (``_scaled_dot_product_flash_attention_for_cpu``, which returns the
call's log-sum-exp; its backward takes the final output and log-sum-exp), with the partial
tiles' masks as an additive ``-inf`` mask, or ``is_causal`` for a causal square on the diagonal.
Elsewhere (a GPU) a tile loop in PyTorch ops does the same arithmetic. A row that sees no key
of a call gets ``lse = -inf`` there, so it adds nothing, whatever the kernel writes for it.

Grouped-query attention: query head ``h`` uses key/value head ``h // G`` with ``G = H / Hkv``
(as ``F.scaled_dot_product_attention(enable_gqa=True)``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from qkv.backends.tiles import Bounds
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


@dataclass(frozen=True)
class _Call:
    """One piece of a block: local query ``rows`` by key ``cols``, how it is masked."""

    rows: slice
    cols: slice
    tiles: tuple[Bounds, ...]  # the tiles it covers, in the pair's coordinates
    causal: bool = False  # a causal square on the diagonal (no tile masks then)


def _tile_mask(pair: PairPlan, t: Bounds, B: int, H: int, dev: torch.device) -> TileMask:
    tp = pair.tiles
    if t in tp.masks:
        return tp.masks[t]
    if tp.mask is None:
        return FULL
    T, S = tp.grid[2], tp.grid[3]
    return tp.mask.tile(Tile(B, H, T, S, *t, dev))


def _calls(pair: PairPlan, cpu: bool) -> list[_Call]:
    """The calls of a block: on CPU the whole block for ``kind`` full / causal; else one per
    run of tiles with contiguous keys in each row of tiles (memory: a row of tiles)."""
    r0, c0 = pair.rows[0], pair.cols[0]
    if cpu and pair.kind != "tiles":
        return [_Call(slice(*pair.rows), slice(*pair.cols), (), pair.kind == "causal")]
    calls = []
    for row in pair.tiles.tiles:
        run: list[Bounds] = []
        for t in (*row, None):
            if run and (t is None or t[2] != run[-1][3]):
                q0, q1, k0, k1 = run[0][0], run[0][1], run[0][2], run[-1][3]
                calls.append(_Call(slice(r0 + q0, r0 + q1), slice(c0 + k0, c0 + k1), tuple(run)))
                run = []
            if t is not None:
                run.append(t)
    return calls


def _call_mask(
    pair: PairPlan, call: _Call, B: int, H: int, dtype: torch.dtype, dev: torch.device
) -> tuple[Tensor | None, Tensor | None]:
    """``(additive mask [B|1, H|1, bq, bk] or None, rows with no open key [B|1, H|1, bq] or
    None)``; the mask keeps the tiles' own broadcast dims (a window's is one ``[bq, bk]``)."""
    masks = [_tile_mask(pair, t, B, H, dev) for t in call.tiles]
    tensors = [m for m in masks if isinstance(m, Tensor)]
    if not tensors:
        return None, None
    lead = torch.broadcast_shapes(*(tuple(m.shape[:2]) for m in tensors))  # (B|1, H|1)
    bq = call.rows.stop - call.rows.start
    parts = []
    for t, m in zip(call.tiles, masks, strict=True):
        shape = (*lead, bq, t[3] - t[2])
        if isinstance(m, Tensor):
            parts.append(m.expand(shape))  # [B|1, H|1, bq, bk]
        else:
            parts.append(torch.zeros(shape, dtype=torch.bool, device=dev))
    blocked = torch.cat(parts, dim=-1)  # [B|1, H|1, bq, K]
    additive = torch.zeros(blocked.shape, dtype=dtype, device=dev)  # [B|1, H|1, bq, K]
    return additive.masked_fill_(blocked, float("-inf")), blocked.all(dim=-1)


def _heads(x: Tensor, groups: int) -> Tensor:
    """Keys or values ``[B, Hkv, L, D]`` repeated for each query head: ``[B, H, L, D]``."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)  # [B, H, L, D]


def _flash(
    q: Tensor, k: Tensor, v: Tensor, call: _Call, mask: Tensor | None, scale: float
) -> tuple[Tensor, Tensor]:
    """The fused kernel on CPU; a tile-loop equivalent of it elsewhere."""
    G = q.shape[1] // k.shape[1]
    qi, kj, vj = q[:, :, call.rows], _heads(k[:, :, call.cols], G), _heads(v[:, :, call.cols], G)
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qi, kj, vj, 0.0, call.causal, attn_mask=mask, scale=scale
        )  # [B, H, bq, Dv], [B, H, bq]
        return out, lse.to(q.dtype)
    s = torch.matmul(qi, kj.transpose(-1, -2)) * scale  # [B, H, bq, bk]
    if call.causal:
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
    if mask is not None:
        s = s + mask  # [B, H, bq, bk]
    lse = s.logsumexp(dim=-1)  # [B, H, bq]
    p = (s - lse.masked_fill(torch.isneginf(lse), 0.0)[..., None]).exp()  # [B, H, bq, bk]
    return torch.matmul(p, vj), lse  # [B, H, bq, Dv], [B, H, bq]


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
    B, H = q.shape[:2]
    k, v = k.to(q.dtype), v.to(q.dtype)
    for call in _calls(pair, q.device.type == "cpu"):
        mask, dead = _call_mask(pair, call, B, H, q.dtype, q.device)
        out, lse = _flash(q, k, v, call, mask, scale)  # [B, H, bq, Dv], [B, H, bq]
        if dead is not None:
            lse = lse.masked_fill(dead, float("-inf"))  # [B, H, bq]
        rows = call.rows
        m_old = state.m[..., rows]  # [B, H, bq]
        m_new = torch.maximum(m_old, lse)  # [B, H, bq]
        m_safe = m_new.masked_fill(torch.isneginf(m_new), 0.0)  # [B, H, bq]
        alpha, beta = (m_old - m_safe).exp(), (lse - m_safe).exp()  # [B, H, bq]
        out = out.nan_to_num(0.0)  # a row with no open key: whatever the kernel wrote, 0
        state.l[..., rows] = state.l[..., rows] * alpha + beta
        state.acc[:, :, rows] = state.acc[:, :, rows] * alpha[..., None] + out * beta[..., None]
        state.m[..., rows] = m_new


def backward_block(
    q: Tensor,
    kv: tuple[Tensor, Tensor],
    dout: Tensor,
    out: Tensor,
    lse: Tensor,
    pair: PairPlan,
    scale: float,
    grads: tuple[Tensor, Tensor, Tensor],
) -> None:
    """Add one block's gradients: to ``dq`` (local rows) and to ``dk``/``dv`` (its keys).

    Args:
        q: local queries ``[B, H, T, Dh]`` (compute dtype).
        kv: the keys ``[B, Hkv, L, Dh]`` and values ``[B, Hkv, L, Dv]`` the pair's columns
            index.
        dout: gradient of the local output, ``[B, H, T, Dv]`` (compute dtype).
        out: the final local output, ``[B, H, T, Dv]`` (compute dtype).
        lse: the final log-sum-exp of each row, ``[B, H, T]``, ``+inf`` where no key is seen
            (so every probability of that row is 0).
        pair: the block's rows, columns and tiles.
        scale: the score scale.
        grads: ``(dq [B, H, T, Dh], dk, dv)`` with ``dk``/``dv`` shaped like ``kv``, added to.
    """
    dq, dk, dv = grads
    B, H = q.shape[:2]
    k, v = (x.to(q.dtype) for x in kv)
    G = H // k.shape[1]
    for call in _calls(pair, q.device.type == "cpu"):
        mask, _ = _call_mask(pair, call, B, H, q.dtype, q.device)
        rows, cols = call.rows, call.cols
        gq, gk, gv = _flash_backward(q, k, v, dout, out, lse, call, mask, scale)
        dq[:, :, rows] += gq
        dk[:, :, cols] += gk.view(B, -1, G, *gk.shape[2:]).sum(dim=2)
        dv[:, :, cols] += gv.view(B, -1, G, *gv.shape[2:]).sum(dim=2)


def _flash_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dout: Tensor,
    out: Tensor,
    lse: Tensor,
    call: _Call,
    mask: Tensor | None,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """One call's ``(dq [B, H, bq, Dh], dk [B, H, bk, Dh], dv [B, H, bk, Dv])``."""
    G = q.shape[1] // k.shape[1]
    rows, cols = call.rows, call.cols
    qi, kj, vj = q[:, :, rows], _heads(k[:, :, cols], G), _heads(v[:, :, cols], G)
    doi, oi, li = dout[:, :, rows].contiguous(), out[:, :, rows].contiguous(), lse[..., rows]
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            doi, qi, kj, vj, oi, li.contiguous(), 0.0, call.causal, attn_mask=mask, scale=scale
        )
    s = torch.matmul(qi, kj.transpose(-1, -2)) * scale  # [B, H, bq, bk]
    if call.causal:
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
    if mask is not None:
        s = s + mask  # [B, H, bq, bk]
    p = (s - li[..., None]).exp()  # [B, H, bq, bk]
    dvj = torch.matmul(p.transpose(-1, -2), doi)  # [B, H, bk, Dv]
    dp = torch.matmul(doi, vj.transpose(-1, -2))  # [B, H, bq, bk]
    ds = p * (dp - (doi * oi).sum(dim=-1, keepdim=True)) * scale  # [B, H, bq, bk]
    return torch.matmul(ds, kj), torch.matmul(ds.transpose(-1, -2), qi), dvj
