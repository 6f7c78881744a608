"""Which positions of a sequence each rank holds, and moving tensors between whole and shards.

A sequence of ``n`` positions is cut for ``W`` ranks in one of two layouts:

- ``"contiguous"``: rank ``r`` holds the ``r``-th of ``W`` consecutive pieces;
- ``"zigzag"``: the sequence is cut into ``2W`` pieces and rank ``r`` holds pieces ``r`` and
  ``2W - 1 - r``. Under a causal mask a later piece sees more keys; pairing an early piece with
  a late one gives every rank about the same work.

Pieces follow :func:`torch.tensor_split`: when ``W`` (or ``2W``) does not divide ``n`` the first
pieces are one longer, so any length works. A rank's *segments* are its pieces as global
``(start, stop)`` ranges, in the order its local tensor stores them.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor

from qkv._checks import check_nonnegative_int, check_positive_int

Layout = Literal["contiguous", "zigzag"]
LAYOUTS: tuple[Layout, ...] = ("contiguous", "zigzag")

Segment = tuple[int, int]
"""A global ``(start, stop)`` range of positions."""

__all__ = [
    "LAYOUTS",
    "Layout",
    "Segment",
    "check_layout",
    "group_rank",
    "local_positions",
    "segments",
    "shard",
    "unshard",
]


def check_layout(layout: object) -> Layout:
    """Return ``layout`` if it is one of :data:`LAYOUTS`.

    Raises:
        ValueError: any other value.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def _pieces(n: int, count: int) -> list[Segment]:
    """``(start, stop)`` of :func:`torch.tensor_split`'s ``count`` pieces of ``n``."""
    base, extra = divmod(n, count)
    out = []
    start = 0
    for i in range(count):
        stop = start + base + (1 if i < extra else 0)
        out.append((start, stop))
        start = stop
    return out


def segments(length: int, world: int, rank: int, layout: Layout = "contiguous") -> list[Segment]:
    """The global ranges rank ``rank`` of ``world`` holds of ``length`` positions.

    Args:
        length: positions in the whole sequence.
        world: number of ranks.
        rank: this rank, in ``[0, world)``.
        layout: ``"contiguous"`` or ``"zigzag"`` (see the module docstring).

    Returns:
        Non-empty ``(start, stop)`` ranges in local storage order (empty pieces dropped, which
        happens only when ``length`` is below the piece count).

    Raises:
        TypeError: a count that is not an int.
        ValueError: ``rank`` outside ``[0, world)`` or an unknown layout.
    """
    check_nonnegative_int("length", length)
    check_positive_int("world", world)
    check_nonnegative_int("rank", rank)
    if rank >= world:
        raise ValueError(f"rank must be in [0, world={world}), got {rank}")
    if check_layout(layout) == "contiguous":
        chosen = [_pieces(length, world)[rank]]
    else:
        pieces = _pieces(length, 2 * world)
        chosen = [pieces[rank], pieces[2 * world - 1 - rank]]
    return [s for s in chosen if s[1] > s[0]]


def local_positions(
    length: int,
    world: int,
    rank: int,
    layout: Layout = "contiguous",
    device: torch.device | str | None = None,
) -> Tensor:
    """The global position of each local position, ``[T_local]`` int64 (for position
    embeddings and rotary offsets of a sharded sequence)."""
    parts = [torch.arange(a, b) for a, b in segments(length, world, rank, layout)]
    out = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)  # [T_local]
    return out.to(device) if device is not None else out


def group_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """``(rank, world)`` of this process in ``group``; ``(0, 1)`` with no process group."""
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError("a group was given but torch.distributed is not initialized")
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _check_dim(x: Tensor, dim: int, name: str) -> int:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim must be an int, got {type(dim).__name__}")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim={dim} is out of range for {name} of shape {list(x.shape)}")
    return dim % x.dim()


def shard(
    x: Tensor, dim: int, group: dist.ProcessGroup | None = None, layout: Layout = "contiguous"
) -> Tensor:
    """This rank's part of the whole tensor ``x`` along ``dim`` (no communication).

    Args:
        x: the whole tensor, the same on every rank.
        dim: the sequence dimension.
        group: the process group (default: the world; no group: the whole ``x``).
        layout: ``"contiguous"`` or ``"zigzag"``.

    Returns:
        The local shard, its segments concatenated in order along ``dim``.

    Raises:
        TypeError: ``x`` not a tensor or ``dim`` not an int.
        ValueError: ``dim`` out of range or an unknown layout.
    """
    d = _check_dim(x, dim, "x")
    rank, world = group_rank(group)
    segs = segments(x.shape[d], world, rank, check_layout(layout))
    if not segs:
        return x.narrow(d, 0, 0)
    return torch.cat([x.narrow(d, a, b - a) for a, b in segs], dim=d)


def unshard(
    x_local: Tensor,
    dim: int,
    group: dist.ProcessGroup | None = None,
    layout: Layout = "contiguous",
) -> Tensor:
    """The whole tensor from every rank's shard along ``dim`` (an all-gather).

    Every rank calls it; each passes its own shard (shards of uneven length are fine: the
    lengths are gathered first). Autograd does not flow through it.

    Args:
        x_local: this rank's shard, as :func:`shard` made it.
        dim: the sequence dimension.
        group: the process group (default: the world; no group: ``x_local`` itself).
        layout: the layout the shards were cut in.

    Returns:
        The whole tensor, the same on every rank.

    Raises:
        TypeError: ``x_local`` not a tensor or ``dim`` not an int.
        ValueError: ``dim`` out of range, an unknown layout, or shards whose lengths no
            sequence cut in ``layout`` has.
    """
    d = _check_dim(x_local, dim, "x_local")
    check_layout(layout)
    _, world = group_rank(group)
    if world == 1:
        return x_local
    mine = torch.tensor([x_local.shape[d]], dtype=torch.long, device=x_local.device)
    sizes = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(sizes, mine, group=group)
    lengths = [int(s) for s in sizes]
    n = sum(lengths)
    expected = [sum(b - a for a, b in segments(n, world, r, layout)) for r in range(world)]
    if lengths != expected:
        raise ValueError(
            f"shards of lengths {lengths} along dim {d} are not a {layout} cut of {n} "
            f"positions (expected {expected})"
        )
    return _gather(x_local, d, lengths, group, layout)


def _gather(
    x_local: Tensor, d: int, lengths: list[int], group: dist.ProcessGroup | None, layout: Layout
) -> Tensor:
    """Every rank's shard (of the ``lengths`` given) gathered and put back in its place."""
    rank, world = group_rank(group)
    n = sum(lengths)
    shape = list(x_local.shape)
    shape[d] = max(lengths)
    padded = torch.zeros(shape, dtype=x_local.dtype, device=x_local.device)  # [..., longest, ...]
    padded.narrow(d, 0, lengths[rank]).copy_(x_local.detach())
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded, group=group)
    out = torch.empty(
        *x_local.shape[:d], n, *x_local.shape[d + 1 :], dtype=x_local.dtype, device=x_local.device
    )  # [..., n, ...]
    for r, g in enumerate(gathered):
        offset = 0
        for a, b in segments(n, world, r, layout):
            out.narrow(d, a, b - a).copy_(g.narrow(d, offset, b - a))
            offset += b - a
    return out
