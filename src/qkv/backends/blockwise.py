"""The blockwise backend: online-softmax attention over tiles that skips fully masked ones.

This is the FlashAttention algorithm written with PyTorch ops. Queries are cut into blocks of
``block_q`` rows and keys into blocks of ``block_k``; each (query block, key block) tile asks the
mask (a :class:`qkv.masks.StructuredMask`) whether it is fully blocked (skipped),
fully open (computed with no mask) or partial (its own small mask). The forward keeps a running
max ``m`` and sum ``l`` per query row, so memory is O(block_q · block_k) for the tile plus
O(T + S) for the rows, never O(T · S). It saves only the output and the row max and sum; the
backward recomputes each tile's probabilities from them (FlashAttention-2), in a custom
:class:`torch.autograd.Function` rather than autograd over the loop.

Inputs are validated by :mod:`qkv.attention`; float16/bfloat16 are computed in float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from qkv.backends.reference import compute_dtype
from qkv.checks import check_positive_int
from qkv.masks import EMPTY, FULL, SlidingWindow, StructuredMask, Tile, TileMask

DEFAULT_BLOCK_Q = 256
DEFAULT_BLOCK_K = 512
MASK_CACHE_BYTES = 32 * 2**20
"""At most this many bytes of partial tile masks are kept between planning, forward, backward."""

__all__ = [
    "DEFAULT_BLOCK_K",
    "DEFAULT_BLOCK_Q",
    "TilePlan",
    "bias_tile",
    "blockwise_attention",
    "default_blocks",
    "plan_tiles",
    "resolve_blocks",
]

Bounds = tuple[int, int, int, int]
"""A tile's ``(q0, q1, k0, k1)``."""


def default_blocks(mask: StructuredMask | None) -> tuple[int, int]:
    """``(block_q, block_k)`` for a mask: 256 x 512, narrowed to a sliding window's width.

    A tile much wider than the window computes mostly masked pairs; a window-wide tile keeps
    the computed band within about twice the window.
    """
    windows = [
        p.window
        for p in getattr(mask, "parts", (mask,))
        if isinstance(p, SlidingWindow) and p.window is not None
    ]
    if not windows:
        return DEFAULT_BLOCK_Q, DEFAULT_BLOCK_K
    w = min(windows)
    return min(max(w, 64), DEFAULT_BLOCK_Q), min(max(w, 64), DEFAULT_BLOCK_K)


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
            :data:`MASK_CACHE_BYTES` of partial tiles, so a dense ``mask_mod`` can never make
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
                if stored + size <= MASK_CACHE_BYTES:
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


def _dropout_keep(seed: int, index: int, shape: tuple[int, ...], p: float, like: Tensor) -> Tensor:
    """The tile's dropout keep-mask, regenerated identically in the backward."""
    gen = torch.Generator(device=like.device)
    gen.manual_seed((seed + 1_000_003 * index) % (2**63))
    return torch.rand(shape, generator=gen, device=like.device, dtype=like.dtype) >= p


LOG2E = 1.4426950408889634
"""log2(e): the tile loops take ``exp(x)`` as ``exp2(x · log2 e)``. On CPU ``exp`` has a slow
path for inputs that underflow: ``exp(-inf)`` (every masked score) is 5x and ``exp(-150)`` (a
sharp softmax's far tail) 17x slower than ``exp(-10)``, while ``exp2`` is 1.3x faster than
``exp`` and at most 2.4x slower on such inputs. The product is taken after subtracting the row
max, so its rounding is relative to ``s - m``, as small as ``exp``'s own for the probabilities
that matter (a base-2 score ``q · (scale · log2 e) · k`` would round ``|s|``)."""


class _Ctx:
    """Everything the tile loops need besides tensors."""

    def __init__(
        self,
        mask: StructuredMask | None,
        shape: tuple[int, int, int, int],
        scale: float,
        dropout_p: float,
        seed: int,
        plan: TilePlan,
        finite: bool,
    ) -> None:
        self.masks = plan.masks  # tile -> its mask, for the tiles planning kept
        self.mask = mask
        self.shape = shape  # (B, H, T, S)
        self.scale = scale
        self.dropout_p = dropout_p
        self.seed = seed
        self.plan = plan
        self.blocks = plan.blocks  # (block_q, block_k)
        # Every input finite: a blocked score can be -inf by addition, and a key blocked for a
        # whole tile need not be zeroed (its probability 0 meets no NaN or inf).
        self.finite = finite
        self.additive: dict[Bounds, Tensor] = {}
        self.additive_bytes = 0

    def tile_mask(self, t: Bounds, device: torch.device) -> TileMask:
        """The mask of tile ``t``: kept from planning, else asked of the rule."""
        tm = self.masks.get(t)
        if tm is None:
            tm = FULL if self.mask is None else self.mask.tile(Tile(*self.shape, *t, device))
        return tm

    def additive_mask(self, t: Bounds, tm: Tensor, like: Tensor) -> Tensor:
        """Tile ``t``'s mask ``tm`` as 0 / -inf in ``like``'s dtype, kept for the backward
        within :data:`MASK_CACHE_BYTES`.

        Adding it is 30x faster than ``masked_fill_`` with the bool tile on CPU.
        """
        add = self.additive.get(t)
        if add is None:
            add = torch.where(tm, _NEG_INF.to(like), _ZERO.to(like))  # [B|1, H|1, bq, bk]
            size = add.numel() * add.element_size()
            if self.additive_bytes + size <= MASK_CACHE_BYTES:
                self.additive[t] = add
                self.additive_bytes += size
        return add

    def scores(
        self,
        qi: Tensor,
        k: Tensor,
        attn_bias: Tensor | None,
        t: Bounds,
        buf: Tensor,
        tm: TileMask,
        shift: Tensor | None = None,
    ) -> Tensor:
        """Masked scores of one tile (mask ``tm``) minus ``shift``, written into ``buf``.

        Args:
            qi: the tile's queries times the scale, ``[B, H, bq, Dh]``, contiguous.
            k: the tile's keys ``[B, Hkv, bk, Dh]``.
            attn_bias: the whole bias ``[B|1, H|1, T|1, S|1]``, or None.
            t: the tile.
            buf: the workspace.
            tm: the tile's mask.
            shift: ``[B, H, bq, 1]`` subtracted from every row inside the matmul, or None.

        Returns:
            ``[B, H, bq, bk]``, a view of ``buf``.
        """
        B, H, bq, _ = qi.shape
        n, rows = _grouped(B, H, bq, k)  # B·Hkv matmuls of G·bq rows
        bk = t[3] - t[2]
        s = _view(buf, (n, rows, bk))  # [B*Hkv, G*bq, bk]
        q3, kt3 = qi.reshape(n, rows, -1), k.reshape(n, bk, -1).transpose(1, 2)
        b = bias_tile(attn_bias, *t)
        # The shift goes inside the matmul only without a bias: with one, ``q · k - m`` is
        # rounded relative to the bias-sized gap between them before the bias is added back,
        # which made dv up to 3x less exact than a naive formula's (issue 27); ``(q · k + b)
        # - m`` rounds as the forward did.
        if shift is None or b is not None:
            torch.bmm(q3, kt3, out=s)  # [B*Hkv, G*bq, bk]
        else:
            torch.baddbmm(shift.reshape(n, rows, 1), q3, kt3, beta=-1.0, out=s)
        s4 = s.view(B, H, bq, bk)  # [B, H, bq, bk]: the same memory
        if b is not None:
            s4.add_(b)  # [B, H, bq, bk]
            if shift is not None:
                s4.sub_(shift)  # [B, H, bq, bk]
        if isinstance(tm, Tensor):
            if self.finite:
                s4.add_(self.additive_mask(t, tm, s4))  # [B, H, bq, bk]
            else:
                s4.masked_fill_(tm, float("-inf"))  # [B, H, bq, bk]
        return s4

    def tile_kv(self, k: Tensor, v: Tensor, t: Bounds, tm: TileMask) -> tuple[Tensor, Tensor]:
        """Tile ``t``'s keys and values; see :func:`_tile_kv`."""
        if self.finite:
            return k[:, :, t[2] : t[3]], v[:, :, t[2] : t[3]]
        return _tile_kv(k, v, t, tm)

    def keep(self, t: Bounds, shape: tuple[int, ...], like: Tensor) -> Tensor:
        nk = math.ceil(self.shape[3] / self.blocks[1])
        index = (t[0] // self.blocks[0]) * nk + t[2] // self.blocks[1]
        return _dropout_keep(self.seed, index, shape, self.dropout_p, like)


_NEG_INF = torch.tensor(float("-inf"))
_ZERO = torch.tensor(0.0)


def _tile_kv(k: Tensor, v: Tensor, t: Bounds, tm: TileMask) -> tuple[Tensor, Tensor]:
    """Tile ``t``'s keys and values, zeroed where ``tm`` blocks a key for every row of the tile.

    Such a key's probabilities are 0, but ``0 * NaN`` is NaN: a NaN or inf at a padded position
    would otherwise reach the output through ``p @ v`` and the gradients through ``ds @ k``.
    """
    kj, vj = k[:, :, t[2] : t[3]], v[:, :, t[2] : t[3]]  # [B, Hkv, bk, Dh], [B, Hkv, bk, Dv]
    if not isinstance(tm, Tensor):
        return kj, vj
    dead = tm.all(dim=2)  # [B|1, H|1, bk]
    Hkv = k.shape[1]
    if dead.shape[1] != 1 and dead.shape[1] != Hkv:
        # A key shared by a group of query heads is dead only if dead for all of them.
        dead = dead.unflatten(1, (Hkv, -1)).all(dim=2)  # [B|1, Hkv, bk]
    gone = dead[..., None]  # [B|1, Hkv|1, bk, 1]
    return torch.where(gone, 0.0, kj), torch.where(gone, 0.0, vj)  # 1.5x masked_fill's speed


def _view(buf: Tensor, shape: tuple[int, ...]) -> Tensor:
    """A contiguous tensor of ``shape`` over the front of the flat workspace ``buf``."""
    return buf[: math.prod(shape)].view(shape)


def _workspace(q: Tensor, c: _Ctx) -> Tensor:
    """One tile's worth of memory, reused by every tile.

    Reusing it is not only tidy: a fresh multi-megabyte tensor per tile costs page faults that
    take longer than the tile's arithmetic on CPU.
    """
    B, H, T, S = c.shape
    # No tile is larger than the grid: block_q=10**9 must not allocate 10**9 rows.
    bq, bk = min(c.blocks[0], T), min(c.blocks[1], S)
    return torch.empty(B * H * bq * bk, dtype=q.dtype, device=q.device)


class _BlockwiseFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, attn_bias: Tensor | None, c: _Ctx
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
        buf = _workspace(q, c)
        for row in c.plan.tiles:
            if not row:
                continue
            q0, q1 = row[0][0], row[0][1]
            bq = q1 - q0
            qi = q[:, :, q0:q1] * c.scale  # [B, H, bq, Dh]
            m = torch.full((B, H, bq), float("-inf"), dtype=q.dtype, device=q.device)
            l_sum = torch.zeros(B, H, bq, dtype=q.dtype, device=q.device)  # [B, H, bq]
            n, rows = _grouped(B, H, bq, k)
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
        c: _Ctx = ctx.c
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
        buf_s, buf_dp = _workspace(q, c), _workspace(q, c)
        for row in c.plan.tiles:
            if not row:
                continue
            q0, q1 = row[0][0], row[0][1]
            bq = q1 - q0
            qi = q[:, :, q0:q1] * c.scale  # [B, H, bq, Dh]
            n, rows = _grouped(B, H, bq, k)  # B·Hkv matmuls of G·bq rows
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
                dp = _view(buf_dp, (n, rows, bk))  # [B*Hkv, G*bq, bk]
                if drop:
                    keep = c.keep(t, tuple(e.shape), e).view(n, rows, bk)
                    e_used = e3 * keep * inv_keep  # [B*Hkv, G*bq, bk]
                    torch.bmm(do3, v3.transpose(1, 2), out=dp)  # [B*Hkv, G*bq, bk]
                    dp.mul_(keep).mul_(inv_keep).sub_(delta3)  # [B*Hkv, G*bq, bk]
                else:
                    e_used = e3
                    torch.baddbmm(delta3, do3, v3.transpose(1, 2), beta=-1.0, out=dp)
                _accumulate(dv, k0, k1, e_used.transpose(1, 2), do3)  # dv += eᵀ·do/l
                ds = dp.mul_(e3)  # [B*Hkv, G*bq, bk]: d(score) in natural units
                dq3.baddbmm_(ds, k3)  # [B*Hkv, G*bq, Dh]
                _accumulate(dk, k0, k1, ds.transpose(1, 2), q3)  # [B, Hkv, bk, Dh]
                if dbias is not None:
                    ds4 = ds.view(B, H, bq, bk)  # [B, H, bq, bk]
                    dims = [d for d in range(4) if dbias.shape[d] == 1]
                    red = ds4.sum(dim=dims, keepdim=True) if dims else ds4
                    qs = slice(q0, q1) if dbias.shape[2] != 1 else slice(None)
                    ks = slice(k0, k1) if dbias.shape[3] != 1 else slice(None)
                    dbias[:, :, qs, ks] += red
            dq[:, :, q0:q1] = dq3.view(B, H, bq, Dh) * c.scale
        return dq, dk, dv, dbias, None


def _grouped(B: int, H: int, bq: int, k: Tensor) -> tuple[int, int]:
    """``(B·Hkv, G·bq)``: a tile's matmuls for grouped-query attention without copying keys.

    The ``G = H / Hkv`` query heads that share a key head are consecutive, so a contiguous
    ``[B, H, bq, ·]`` tile is the same memory as ``[B·Hkv, G·bq, ·]``: each key head meets all
    the rows of its group in one matmul, and ``dk``/``dv`` sum over the group inside it.
    """
    Hkv = k.shape[1]
    return B * Hkv, (H // Hkv) * bq


def _accumulate(grad: Tensor, k0: int, k1: int, a: Tensor, b: Tensor) -> None:
    """``grad[:, :, k0:k1] += a @ b`` for ``grad [B, Hkv, S, D]`` and 3-d ``a [B*Hkv, bk, n]``,
    ``b [B*Hkv, n, D]``, inside the matmul (no temporary)."""
    B, Hkv, _, D = grad.shape
    part = grad[:, :, k0:k1]  # [B, Hkv, bk, D]
    flat = part.view(B * Hkv, k1 - k0, D)  # [B*Hkv, bk, D], strided over grad
    flat.baddbmm_(a, b)


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
    plan: TilePlan | None = None,
) -> Tensor:
    """Blockwise attention; see :func:`qkv.attention` for the contract.

    Args:
        query: ``[B, H, T, Dh]``.
        key: ``[B, Hkv, S, Dh]`` with ``H % Hkv == 0``.
        value: ``[B, Hkv, S, Dv]``.
        mask: a structured mask (bool tensors are wrapped in
            :class:`qkv.masks.Dense` by the caller), or None.
        attn_bias: float broadcastable to ``[B, H, T, S]``, added to the scores, or None.
        scale: multiplies the scores.
        dropout_p: dropout on the weights (only when ``training``).
        training: apply dropout.
        block_q: query rows per tile (any positive int; need not divide T); default from
            :func:`default_blocks`, or the plan's.
        block_k: keys per tile (any positive int; need not divide S); default likewise.
        dropout_seed: seed of the per-tile dropout masks; default drawn from torch's RNG.
        plan: the tile plan of this very call (the dispatcher made it for ``mask`` while
            choosing the backend); planned here when None.

    Returns:
        Output ``[B, H, T, Dv]`` in the input dtype; rows with every key blocked are 0.

    Raises:
        TypeError: block sizes that are not ints.
        ValueError: non-positive block sizes, or a plan made for another mask, grid or blocks.
    """
    B, H, T, _ = query.shape
    S = key.shape[2]
    if plan is None:
        blocks = resolve_blocks(mask, block_q, block_k)
        plan = plan_tiles(mask, B, H, T, S, *blocks, query.device, keep_masks=True)
    else:
        _check_plan(plan, mask, (B, H, T, S), block_q, block_k)
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
        # Contiguous, so that every tile is a view; grouped-query keys stay [B, Hkv, S, ·]:
        # the tile matmuls group the query heads (no repeat_interleave).
        q = query.to(work).contiguous()  # [B, H, T, Dh]
        k = key.to(work).contiguous()  # [B, Hkv, S, Dh]
        v = value.to(work).contiguous()  # [B, Hkv, S, Dv]
        b4 = None
        if attn_bias is not None:
            lead = (1,) * (4 - attn_bias.dim())
            b4 = attn_bias.to(work).reshape(lead + tuple(attn_bias.shape))  # [B|1, H|1, T|1, S|1]
        finite = _finite_inputs(q, k, v, b4)
        c = _Ctx(mask, (B, H, T, S), scale, p, dropout_seed or 0, plan, finite)
        out = _BlockwiseFunction.apply(q, k, v, b4, c)
    assert isinstance(out, Tensor)
    return out.to(out_dtype)


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


def _check_plan(
    plan: TilePlan,
    mask: StructuredMask | None,
    grid: tuple[int, int, int, int],
    block_q: int | None,
    block_k: int | None,
) -> None:
    if plan.mask is not mask:
        raise ValueError(f"the tile plan was made for {plan.mask!r}, not for {mask!r}")
    if plan.grid != grid:
        raise ValueError(f"the tile plan was made for grid {plan.grid}, not {grid}")
    for name, given, planned in zip(
        ("block_q", "block_k"), (block_q, block_k), plan.blocks, strict=True
    ):
        if given is not None and given != planned:
            raise ValueError(f"{name}={given} but the tile plan was made with {name}={planned}")
