"""Unpadding: the real tokens of a padded batch packed into one sequence of rows.

A padded ``[B, T]`` batch of sentences of mixed lengths spends much of every linear layer,
feed-forward block and norm on padding. :func:`plan_packing` lists where the real tokens are,
once per forward: :meth:`Packing.pack` gathers them into ``[N, D]`` rows, :meth:`Packing.unpack`
scatters rows back to ``[B, T, D]``. Attention, the one step that mixes rows, runs on a compact
grid (:meth:`Packing.to_grid`): the samples that have tokens, each cut to the longest one's
length, so one batched call with a key-padding mask (:attr:`Packing.grid_padding`) serves the
whole batch; its padding slots hold zeros.

The plan reads the padding on the host (one sync per forward): it is eager planning, not for
tracing or compiling, which keep the padded path.

Shapes: B batch, T padded length, N real tokens, B' samples with a token, T' longest length,
C channels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["Packing", "plan_packing"]


@dataclass(frozen=True)
class Packing:
    """Where the real tokens of a padded batch sit in the packed rows and in the compact grid.

    Attributes:
        index: int64 ``[N]``, the flat position ``b * T + t`` of each packed row (batch order,
            each sample's tokens in order).
        grid_index: int64 ``[N]``, the flat position of each packed row in the ``[B', T']`` grid.
        grid_padding: bool ``[B', 1, 1, T']``, True at the grid's padding keys (qkv's mask
            convention), or None when the grid has none.
        batch: B.
        tokens: T.
        grid: ``(B', T')``.
    """

    index: Tensor
    grid_index: Tensor
    grid_padding: Tensor | None
    batch: int
    tokens: int
    grid: tuple[int, int]

    @property
    def rows(self) -> int:
        """N, the real tokens."""
        return int(self.index.numel())

    @property
    def is_identity(self) -> bool:
        """No padding at all: packing and the grid are plain reshapes."""
        return self.rows == self.batch * self.tokens

    def pack(self, x: Tensor) -> Tensor:
        """``[B, T, C]`` -> ``[N, C]``, the real tokens' rows."""
        flat = x.reshape(self.batch * self.tokens, x.shape[-1])  # [B * T, C]
        return flat if self.is_identity else flat.index_select(0, self.index)  # [N, C]

    def unpack(self, rows: Tensor) -> Tensor:
        """``[N, C]`` -> ``[B, T, C]``, zeros at the padding positions."""
        return _scatter(rows, self.index, self.batch, self.tokens, self.is_identity)

    def to_grid(self, rows: Tensor) -> Tensor:
        """``[N, C]`` -> ``[B', T', C]``, zeros at the grid's padding slots."""
        return _scatter(rows, self.grid_index, *self.grid, self.grid_padding is None)

    def from_grid(self, grid: Tensor) -> Tensor:
        """``[B', T', C]`` -> ``[N, C]``, the real tokens' rows."""
        flat = grid.reshape(self.grid[0] * self.grid[1], grid.shape[-1])  # [B' * T', C]
        return flat if self.grid_padding is None else flat.index_select(0, self.grid_index)


def _scatter(rows: Tensor, index: Tensor, B: int, T: int, identity: bool) -> Tensor:
    """``[N, C]`` rows to the flat positions ``index`` of a zero ``[B, T, C]``."""
    C = rows.shape[-1]
    if identity:
        return rows.view(B, T, C)  # [B, T, C]
    out = rows.new_zeros(B * T, C)  # [B * T, C]
    return out.index_copy(0, index, rows).view(B, T, C)  # [B, T, C]


def plan_packing(is_pad: Tensor) -> Packing:
    """The packing of a padding mask (any pattern: suffix, prefix or holes).

    Args:
        is_pad: bool ``[B, T]``, True = padding.

    Returns:
        The :class:`Packing`. A sample without any real token gets no row and no grid slot
        (it unpacks to zeros).

    Raises:
        ValueError: ``is_pad`` is not a bool ``[B, T]`` tensor.
    """
    if not isinstance(is_pad, Tensor) or is_pad.dtype != torch.bool or is_pad.dim() != 2:
        got = (is_pad.dtype, tuple(is_pad.shape)) if isinstance(is_pad, Tensor) else is_pad
        raise ValueError(f"is_pad must be a bool [B, T] tensor, got {got!r}")
    B, T = is_pad.shape
    live = ~is_pad  # [B, T]
    lengths = live.sum(dim=1)  # [B]
    counts = [int(n) for n in lengths.tolist()]  # one read from the device
    longest, samples = max(counts), sum(n > 0 for n in counts)
    if longest == 0:
        none = torch.zeros(0, dtype=torch.long, device=is_pad.device)  # [N = 0]
        return Packing(none, none, None, B, T, (0, 0))
    if sum(counts) == B * T:
        index = torch.arange(B * T, device=is_pad.device)  # [N = B * T]
        return Packing(index, index, None, B, T, (B, T))
    rows, cols = live.nonzero(as_tuple=True)  # [N] each, row-major
    slot = (lengths > 0).cumsum(0) - 1  # [B]: each sample's row of the grid
    rank = live.cumsum(dim=1) - 1  # [B, T]: each token's place among its sample's tokens
    grid_index = slot[rows] * longest + rank[rows, cols]  # [N]
    grid_lengths = lengths[lengths > 0]  # [B']
    keys = torch.arange(longest, device=is_pad.device)  # [T']
    padding = keys[None, :] >= grid_lengths[:, None]  # [B', T']
    grid_padding = padding[:, None, None, :] if min(n for n in counts if n) < longest else None
    return Packing(rows * T + cols, grid_index, grid_padding, B, T, (samples, longest))
