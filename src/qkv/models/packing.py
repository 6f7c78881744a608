"""Unpadding: the real tokens of a padded batch packed into one sequence, grouped by length.

A padded ``[B, T]`` batch of sentences of mixed lengths spends much of every linear layer,
feed-forward block and norm on padding. :func:`plan_packing` lists where the real tokens are,
once per forward: :meth:`Packing.pack` gathers them into ``[N, D]`` rows and
:meth:`Packing.unpack` scatters rows back to ``[B, T, D]``. Samples are ordered by their number
of real tokens, so the samples of one length occupy one contiguous run of rows
(:attr:`Packing.groups`): attention runs one maskless call per length on a plain view
``[count, length, ...]``, with no gather per layer and no mask.

The plan reads the padding on the host (one sync per forward): it is eager planning, not for
tracing or compiling, which keep the padded path.

Shapes: B batch, T padded length, N real tokens, D width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["Packing", "plan_packing"]


@dataclass(frozen=True)
class Packing:
    """Where the real tokens of a padded batch sit in the packed rows.

    Attributes:
        index: int64 ``[N]``, the flat position ``b * T + t`` of each packed row; samples by
            ascending length (ties in batch order), each sample's tokens in their order.
        groups: ``(start, count, length)`` per distinct length: ``count`` samples of
            ``length`` real tokens each fill rows ``[start, start + count * length)``.
        batch: B.
        tokens: T.
    """

    index: Tensor
    groups: tuple[tuple[int, int, int], ...]
    batch: int
    tokens: int

    @property
    def rows(self) -> int:
        """N, the real tokens."""
        return int(self.index.numel())

    @property
    def is_identity(self) -> bool:
        """No padding at all: packing is a plain reshape."""
        return self.rows == self.batch * self.tokens

    def pack(self, x: Tensor) -> Tensor:
        """``[B, T, D]`` -> ``[N, D]``, the real tokens' rows."""
        flat = x.reshape(self.batch * self.tokens, x.shape[-1])  # [B * T, D]
        return flat if self.is_identity else flat.index_select(0, self.index)  # [N, D]

    def unpack(self, packed: Tensor) -> Tensor:
        """``[N, D]`` -> ``[B, T, D]``, zeros at the padding positions."""
        B, T, D = self.batch, self.tokens, packed.shape[-1]
        if self.is_identity:
            return packed.view(B, T, D)  # [B, T, D]
        out = packed.new_zeros(B * T, D)  # [B * T, D]
        return out.index_copy_(0, self.index, packed).view(B, T, D)  # [B, T, D]


def plan_packing(is_pad: Tensor) -> Packing:
    """The packing of a padding mask (any pattern: suffix, prefix or holes).

    Args:
        is_pad: bool ``[B, T]``, True = padding.

    Returns:
        The :class:`Packing`; a sample without any real token gets no row (it unpacks to
        zeros).

    Raises:
        ValueError: ``is_pad`` is not a bool ``[B, T]`` tensor.
    """
    if not isinstance(is_pad, Tensor) or is_pad.dtype != torch.bool or is_pad.dim() != 2:
        got = (is_pad.dtype, tuple(is_pad.shape)) if isinstance(is_pad, Tensor) else is_pad
        raise ValueError(f"is_pad must be a bool [B, T] tensor, got {got!r}")
    B, T = is_pad.shape
    live = ~is_pad  # [B, T]
    lengths = live.sum(dim=1).tolist()  # [B], one read from the device
    order = sorted(range(B), key=lambda b: lengths[b])  # stable: ties keep batch order
    groups: list[tuple[int, int, int]] = []
    start = 0
    for b in order:
        n = int(lengths[b])
        if n == 0:
            continue
        if groups and groups[-1][2] == n:
            s, count, _ = groups[-1]
            groups[-1] = (s, count + 1, n)
        else:
            groups.append((start, 1, n))
        start += n
    if start == B * T:
        index = torch.arange(B * T, device=is_pad.device)  # [N = B * T]
        return Packing(index, ((0, B, T),), B, T)
    perm = torch.tensor(order, device=is_pad.device)  # [B]
    rows, cols = live.index_select(0, perm).nonzero(as_tuple=True)  # [N] each, row-major
    index = perm[rows] * T + cols  # [N]
    return Packing(index, tuple(groups), B, T)
