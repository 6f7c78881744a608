"""The tile operations of the blockwise backend: one tile's scores, mask, keys and values,
its dropout, and the grouped-query matmul layout; the loops in :mod:`qkv.backends.blockwise`.

Shapes: B batch, H query heads, Hkv key/value heads, G = H / Hkv, bq x bk a tile.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from qkv.backends.policy import current_policy
from qkv.backends.tiles import Bounds, TilePlan, bias_tile
from qkv.masks import FULL, StructuredMask, Tile, TileMask

__all__ = [
    "LOG2E",
    "TileContext",
    "accumulate",
    "accumulate_bias",
    "grouped",
    "workspace",
    "workspace_view",
]


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


class TileContext:
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
        self.cache_bytes = current_policy().mask_cache_bytes

    def tile_mask(self, t: Bounds, device: torch.device) -> TileMask:
        """The mask of tile ``t``: kept from planning, else asked of the rule."""
        tm = self.masks.get(t)
        if tm is None:
            tm = FULL if self.mask is None else self.mask.tile(Tile(*self.shape, *t, device))
        return tm

    def additive_mask(self, t: Bounds, tm: Tensor, like: Tensor) -> Tensor:
        """Tile ``t``'s mask ``tm`` as 0 / -inf in ``like``'s dtype, kept for the backward
        within ``Policy.mask_cache_bytes``.

        Adding it is 30x faster than ``masked_fill_`` with the bool tile on CPU.
        """
        add = self.additive.get(t)
        if add is None:
            add = torch.where(tm, _NEG_INF.to(like), _ZERO.to(like))  # [B|1, H|1, bq, bk]
            size = add.numel() * add.element_size()
            if self.additive_bytes + size <= self.cache_bytes:
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
        n, rows = grouped(B, H, bq, k)  # B·Hkv matmuls of G·bq rows
        bk = t[3] - t[2]
        s = workspace_view(buf, (n, rows, bk))  # [B*Hkv, G*bq, bk]
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


def workspace_view(buf: Tensor, shape: tuple[int, ...]) -> Tensor:
    """A contiguous tensor of ``shape`` over the front of the flat workspace ``buf``."""
    return buf[: math.prod(shape)].view(shape)


def workspace(q: Tensor, c: TileContext) -> Tensor:
    """One tile's worth of memory, reused by every tile.

    Reusing it is not only tidy: a fresh multi-megabyte tensor per tile costs page faults that
    take longer than the tile's arithmetic on CPU.
    """
    B, H, T, S = c.shape
    # No tile is larger than the grid: block_q=10**9 must not allocate 10**9 rows.
    bq, bk = min(c.blocks[0], T), min(c.blocks[1], S)
    return torch.empty(B * H * bq * bk, dtype=q.dtype, device=q.device)


def grouped(B: int, H: int, bq: int, k: Tensor) -> tuple[int, int]:
    """``(B·Hkv, G·bq)``: a tile's matmuls for grouped-query attention without copying keys.

    The ``G = H / Hkv`` query heads that share a key head are consecutive, so a contiguous
    ``[B, H, bq, ·]`` tile is the same memory as ``[B·Hkv, G·bq, ·]``: each key head meets all
    the rows of its group in one matmul, and ``dk``/``dv`` sum over the group inside it.
    """
    Hkv = k.shape[1]
    return B * Hkv, (H // Hkv) * bq


def accumulate(grad: Tensor, k0: int, k1: int, a: Tensor, b: Tensor) -> None:
    """``grad[:, :, k0:k1] += a @ b`` for ``grad [B, Hkv, S, D]`` and 3-d ``a [B*Hkv, bk, n]``,
    ``b [B*Hkv, n, D]``, inside the matmul (no temporary)."""
    B, Hkv, _, D = grad.shape
    part = grad[:, :, k0:k1]  # [B, Hkv, bk, D]
    flat = part.view(B * Hkv, k1 - k0, D)  # [B*Hkv, bk, D], strided over grad
    flat.baddbmm_(a, b)


def accumulate_bias(dbias: Tensor, ds: Tensor, t: Bounds) -> None:
    """``dbias [B|1, H|1, T|1, S|1] += ds [B, H, bq, bk]`` of tile ``t``, summed over the
    bias's broadcast dims."""
    dims = [d for d in range(4) if dbias.shape[d] == 1]
    red = ds.sum(dim=dims, keepdim=True) if dims else ds
    qs = slice(t[0], t[1]) if dbias.shape[2] != 1 else slice(None)
    ks = slice(t[2], t[3]) if dbias.shape[3] != 1 else slice(None)
    dbias[:, :, qs, ks] += red
