"""The blockwise backend: online-softmax attention over tiles that skips fully masked ones.

This is the FlashAttention algorithm written with PyTorch ops, over the tiles of a
:class:`~qkv.backends.tiles.TilePlan` (fully masked tiles skipped, fully open ones computed with
no mask, partial ones with their own small mask). The forward keeps a running
max ``m`` and sum ``l`` per query row, so memory is O(block_q · block_k) for the tile plus
O(T + S) for the rows, never O(T · S). It saves only the output and the row max and sum; the
backward recomputes each tile's probabilities from them (FlashAttention-2), in a custom
:class:`torch.autograd.Function` rather than autograd over the loop.

Inputs are validated by :func:`qkv.attention`; float16/bfloat16 are computed in float32.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from qkv.backends.reference import compute_dtype
from qkv.backends.tile_ops import (
    LOG2E,
    TileContext,
    accumulate,
    accumulate_bias,
    grouped,
    workspace,
    workspace_view,
)
from qkv.backends.tiles import TilePlan, check_tiles, plan_tiles, resolve_blocks
from qkv.masks import StructuredMask
from qkv.masks.validate import as_4d

__all__ = ["blockwise_attention"]


class _BlockwiseFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, attn_bias: Tensor | None, c: TileContext
    ) -> Tensor:
        B, H, T, _ = q.shape
        Dv = v.shape[3]
        out = torch.zeros(B, H, T, Dv, dtype=q.dtype, device=q.device)  # [B, H, T, Dv]
        # The row max and sum, kept apart: exp(s - m) / l is as exact as a softmax, while
        # exp(s - (m + log l)) loses eps·|m| of every probability to lse's rounding (sharp
        # softmax: |m| is large), which made the gradients up to 3x less exact than a naive
        # float32 formula's (benchmarks/float32_error.py).
        row_max = torch.zeros(B, H, T, dtype=q.dtype, device=q.device)  # [B, H, T]
        row_sum = torch.ones(B, H, T, dtype=q.dtype, device=q.device)  # [B, H, T]
        drop = c.dropout_p > 0.0
        buf = workspace(q, c)
        for row in c.plan.tiles:
            if not row:
                continue
            q0, q1 = row[0][0], row[0][1]
            bq = q1 - q0
            qi = q[:, :, q0:q1] * c.scale  # [B, H, bq, Dh]
            m = torch.full((B, H, bq), float("-inf"), dtype=q.dtype, device=q.device)
            l_sum = torch.zeros(B, H, bq, dtype=q.dtype, device=q.device)  # [B, H, bq]
            n, rows = grouped(B, H, bq, k)
            acc = torch.zeros(n, rows, Dv, dtype=q.dtype, device=q.device)  # [B*Hkv, G*bq, Dv]
            for t in row:
                tm = c.tile_mask(t, q.device)
                kj, vj = c.tile_kv(k, v, t, tm)  # [B, Hkv, bk, Dh], [B, Hkv, bk, Dv]
                s = c.scores(qi, kj, attn_bias, t, buf, tm)  # [B, H, bq, bk], in place
                m_new = torch.maximum(m, s.amax(dim=-1))  # [B, H, bq]
                # Rows with every key so far blocked keep m = -inf; shift them by 0 instead.
                m_safe = m_new.masked_fill(torch.isneginf(m_new), 0.0)  # [B, H, bq]
                p = s.sub_(m_safe[..., None]).mul_(LOG2E).exp2_()  # [B, H, bq, bk]
                alpha = (m - m_safe).mul_(LOG2E).exp2_()  # [B, H, bq]
                l_sum.mul_(alpha).add_(p.sum(dim=-1))  # [B, H, bq]
                if drop:
                    p = p.mul_(c.keep(t, tuple(p.shape), p)).div_(1.0 - c.dropout_p)
                acc.mul_(alpha.view(n, rows, 1))  # [B*Hkv, G*bq, Dv]
                acc.baddbmm_(p.view(n, rows, -1), vj.reshape(n, -1, Dv))
                m = m_new
            dead = l_sum == 0  # [B, H, bq]: every key blocked
            l_safe = l_sum.masked_fill(dead, 1.0)  # [B, H, bq]
            acc4 = acc.view(B, H, bq, Dv)  # [B, H, bq, Dv]: the same memory
            # a select, not a multiply: a NaN value met by a dead row's zero probabilities stays out
            out[:, :, q0:q1] = torch.where(dead[..., None], 0.0, acc4 / l_safe[..., None])
            m_fin = m.masked_fill(torch.isneginf(m), 0.0)  # [B, H, bq]
            row_max[:, :, q0:q1] = m_fin.masked_fill(dead, 0.0)
            row_sum[:, :, q0:q1] = l_safe
        ctx.save_for_backward(q, k, v, attn_bias, out, row_max, row_sum)
        ctx.c = c
        return out

    @staticmethod
    def backward(ctx: Any, d_out: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, attn_bias, out, row_max, row_sum = ctx.saved_tensors
        c: TileContext = ctx.c
        B, H, _, Dh = q.shape
        Dv = v.shape[3]
        d_out = d_out.contiguous()
        # The softmax's 1/l goes into d_out and delta (per row) rather than into every
        # probability (per pair): with e = exp(s - m), p = e / l and
        #   dv = pᵀ·do = eᵀ·(do / l),   ds = p·(dp - delta) = e·(do/l · vᵀ - delta/l).
        inv_l = row_sum.reciprocal()[..., None]  # [B, H, T, 1]
        do_l = d_out * inv_l  # [B, H, T, Dv]
        delta_l = (d_out * out).sum(dim=-1, keepdim=True) * inv_l  # [B, H, T, 1]
        dq = torch.zeros_like(q)  # [B, H, T, Dh]
        dk = torch.zeros_like(k)  # [B, Hkv, S, Dh]
        dv = torch.zeros_like(v)  # [B, Hkv, S, Dv]
        want_bias = attn_bias is not None and ctx.needs_input_grad[3]
        dbias = torch.zeros_like(attn_bias) if want_bias else None
        drop = c.dropout_p > 0.0
        inv_keep = 1.0 / (1.0 - c.dropout_p) if drop else 1.0
        buf_s, buf_dp = workspace(q, c), workspace(q, c)
        for row in c.plan.tiles:
            if not row:
                continue
            q0, q1 = row[0][0], row[0][1]
            bq = q1 - q0
            qi = q[:, :, q0:q1] * c.scale  # [B, H, bq, Dh]
            n, rows = grouped(B, H, bq, k)  # B·Hkv matmuls of G·bq rows
            q3 = qi.view(n, rows, Dh)  # [B*Hkv, G*bq, Dh]
            do3 = do_l[:, :, q0:q1].contiguous().view(n, rows, Dv)  # [B*Hkv, G*bq, Dv]
            m_i = row_max[:, :, q0:q1, None]  # [B, H, bq, 1]
            delta3 = delta_l[:, :, q0:q1].contiguous().view(n, rows, 1)  # [B*Hkv, G*bq, 1]
            dq3 = torch.zeros(n, rows, Dh, dtype=q.dtype, device=q.device)  # [B*Hkv, G*bq, Dh]
            for t in row:
                k0, k1 = t[2], t[3]
                bk = k1 - k0
                tm = c.tile_mask(t, q.device)
                kj, vj = c.tile_kv(k, v, t, tm)  # [B, Hkv, bk, Dh], [B, Hkv, bk, Dv]
                k3, v3 = kj.reshape(n, bk, Dh), vj.reshape(n, bk, Dv)
                s = c.scores(qi, kj, attn_bias, t, buf_s, tm, shift=m_i)  # [B, H, bq, bk]
                e = s.mul_(LOG2E).exp2_()  # [B, H, bq, bk]: exp(s - m)
                e3 = e.view(n, rows, bk)  # [B*Hkv, G*bq, bk]
                dp = workspace_view(buf_dp, (n, rows, bk))  # [B*Hkv, G*bq, bk]
                if drop:
                    keep = c.keep(t, tuple(e.shape), e).view(n, rows, bk)
                    e_used = e3 * keep * inv_keep  # [B*Hkv, G*bq, bk]
                    torch.bmm(do3, v3.transpose(1, 2), out=dp)  # [B*Hkv, G*bq, bk]
                    dp.mul_(keep).mul_(inv_keep).sub_(delta3)  # [B*Hkv, G*bq, bk]
                else:
                    e_used = e3
                    torch.baddbmm(delta3, do3, v3.transpose(1, 2), beta=-1.0, out=dp)
                accumulate(dv, k0, k1, e_used.transpose(1, 2), do3)  # dv += eᵀ·do/l
                ds = dp.mul_(e3)  # [B*Hkv, G*bq, bk]: d(score) in natural units
                dq3.baddbmm_(ds, k3)  # [B*Hkv, G*bq, Dh]
                accumulate(dk, k0, k1, ds.transpose(1, 2), q3)  # [B, Hkv, bk, Dh]
                if dbias is not None:
                    accumulate_bias(dbias, ds.view(B, H, bq, bk), t)  # [B, H, bq, bk]
            dq[:, :, q0:q1] = dq3.view(B, H, bq, Dh) * c.scale
        return dq, dk, dv, dbias, None


class _DroppedAll(torch.autograd.Function):
    """Attention with ``dropout_p=1``: zeros ``[B, H, T, Dv]``, zero gradients for every input."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, attn_bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(q, k, v, attn_bias)
        return q.new_zeros(*q.shape[:3], v.shape[3])  # [B, H, T, Dv]

    @staticmethod
    def backward(ctx: Any, d_out: Tensor) -> tuple[Tensor | None, ...]:
        return tuple(None if x is None else torch.zeros_like(x) for x in ctx.saved_tensors)


def blockwise_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: StructuredMask | None,
    attn_bias: Tensor | None,
    scale: float,
    dropout_p: float,
    training: bool,
    *,
    block_q: int | None = None,
    block_k: int | None = None,
    dropout_seed: int | None = None,
    tiles: TilePlan | None = None,
) -> Tensor:
    """Blockwise attention; see :func:`qkv.attention` for the contract.

    Args:
        query, key, value: ``[B, H, T, Dh]``, ``[B, Hkv, S, Dh]``, ``[B, Hkv, S, Dv]``.
        mask: a structured mask (bool tensors are wrapped in
            :class:`qkv.masks.Dense` by the caller), or None.
        attn_bias: float broadcastable to ``[B, H, T, S]``, added to the scores, or None.
        scale: multiplies the scores.
        dropout_p, training: dropout on the weights, applied only when ``training``.
        block_q: query rows per tile (any positive int; need not divide T); default from
            :func:`default_blocks`, or the tile plan's.
        block_k: keys per tile (any positive int; need not divide S); default likewise.
        dropout_seed: seed of the per-tile dropout masks; default drawn from torch's RNG.
        tiles: the tile plan of this very call (the planner made it for ``mask`` while
            choosing the backend); planned here when None.

    Returns:
        Output ``[B, H, T, Dv]`` in the input dtype; rows with every key blocked are 0.

    Raises:
        TypeError: block sizes that are not ints.
        ValueError: non-positive block sizes, or a plan made for another mask, grid or blocks.
    """
    B, H, T, _ = query.shape
    S = key.shape[2]
    tiles = _tiles_of(tiles, mask, (B, H, T, S), block_q, block_k, query.device)
    out_dtype = query.dtype
    work = compute_dtype(out_dtype)
    p = dropout_p if training else 0.0
    if p >= 1.0:
        # Every weight dropped: output 0, gradients 0, but still part of the graph (as the
        # other backends), so that backward() works.
        zeros = _DroppedAll.apply(query, key, value, attn_bias)
        assert isinstance(zeros, Tensor)
        return zeros
    if p > 0.0 and dropout_seed is None:
        dropout_seed = int(torch.randint(0, 2**62, (1,)).item())
    with torch.autocast(device_type=query.device.type, enabled=False):
        q, k, v, b4 = _work_inputs(query, key, value, attn_bias, work)
        finite = _finite_inputs(q, k, v, b4)
        c = TileContext(mask, (B, H, T, S), scale, p, dropout_seed or 0, tiles, finite)
        out = _BlockwiseFunction.apply(q, k, v, b4, c)
    assert isinstance(out, Tensor)
    return out.to(out_dtype)


def _tiles_of(
    tiles: TilePlan | None,
    mask: StructuredMask | None,
    grid: tuple[int, int, int, int],
    block_q: int | None,
    block_k: int | None,
    device: torch.device,
) -> TilePlan:
    """The call's tile plan: the one given (checked to fit), else cut here."""
    if tiles is not None:
        check_tiles(tiles, mask, grid, block_q, block_k)
        return tiles
    blocks = resolve_blocks(mask, block_q, block_k)
    return plan_tiles(mask, *grid, *blocks, device, keep_masks=True)


def _work_inputs(
    query: Tensor, key: Tensor, value: Tensor, attn_bias: Tensor | None, work: torch.dtype
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """The inputs in the compute dtype, contiguous so that every tile is a view; grouped-query
    keys stay ``[B, Hkv, S, ·]`` (the tile matmuls group the query heads, no repeat)."""
    q = query.to(work).contiguous()  # [B, H, T, Dh]
    k = key.to(work).contiguous()  # [B, Hkv, S, Dh]
    v = value.to(work).contiguous()  # [B, Hkv, S, Dv]
    if attn_bias is None:
        return q, k, v, None
    return q, k, v, as_4d(attn_bias.to(work))  # ..., [B|1, H|1, T|1, S|1]


def _finite_inputs(q: Tensor, k: Tensor, v: Tensor, attn_bias: Tensor | None) -> bool:
    """Whether no input holds a NaN or inf (the bias may hold -inf): then the tile loops may
    mask by adding -inf and skip zeroing dead keys. Never under tracing (data-dependent)."""
    if torch.compiler.is_compiling():
        return False
    # One sum per tensor, no temporaries: NaN and inf survive a sum (a finite sum that
    # overflows only takes the safe path).
    total = q.sum() + k.sum() + v.sum()  # []
    ok = torch.isfinite(total)
    if attn_bias is not None:
        top = attn_bias.amax()  # []: NaN if any is NaN
        ok &= ~(torch.isnan(top) | torch.isposinf(top))
    return bool(ok)
