"""A model's inputs under context parallelism: global masks and positions from local shards.

A model's forward with ``context_parallel=`` gets this rank's shard of each sequence (see
:mod:`qkv.distributed.layout`). Its attention layers need the masks in global coordinates and
its position encodings the global position of each local token; both are built here, once per
forward, from the shards: the padding shards are gathered (one all-gather of ``[B, T_local]``
bytes per sequence), so every rank holds the same global rule and plans the same exchanges.
"""

from __future__ import annotations

import torch
from torch import Tensor

from qkv.distributed import ContextParallel, GlobalMask, local_positions, shard, unshard
from qkv.masks import Causal, Padding, StructuredMask

__all__ = ["GlobalPadding", "global_padding", "sharded_positions", "sharded_rule"]


class GlobalPadding:
    """One sequence's padding over all ranks.

    Attributes:
        is_pad: bool ``[B, n]`` (True = padding), or None when no rank has padding.
        length: the global length ``n``.
    """

    def __init__(self, is_pad: Tensor | None, length: int) -> None:
        self.is_pad = is_pad
        self.length = length


def global_padding(
    is_pad: Tensor | None,
    batch: int,
    local_length: int,
    setting: ContextParallel,
    device: torch.device,
) -> GlobalPadding:
    """Gather a sequence's padding shards (every rank calls it, padding or not).

    Args:
        is_pad: this rank's bool ``[B, T_local]`` padding, or None for none.
        batch: ``B``.
        local_length: ``T_local``.
        setting: the group and layout.
        device: where the ids live.

    Returns:
        The whole padding (None when no rank has any) and the global length.
    """
    local = torch.zeros(batch, local_length, dtype=torch.uint8, device=device)  # [B, T_local]
    if is_pad is not None:
        local = is_pad.to(torch.uint8)  # [B, T_local]
    whole = unshard(local, 1, setting.group, setting.layout).bool()  # [B, n]
    return GlobalPadding(whole if bool(whole.any()) else None, whole.shape[1])


def sharded_positions(
    pad: GlobalPadding,
    batch: int,
    setting: ContextParallel,
    *,
    from_padding: bool,
    device: torch.device,
) -> Tensor:
    """Each local token's global position, ``[B, T_local]``.

    Args:
        pad: the sequence's global padding.
        batch: ``B``.
        setting: the group and layout.
        from_padding: count positions from each row's first real token (left padding, as a
            decoder does: see :func:`qkv.models.inputs.self_attention_padding`); else columns.
        device: where to build them.

    Returns:
        Long ``[B, T_local]``.
    """
    rank, world = setting.rank, setting.world
    if pad.is_pad is None or not from_padding:
        cols = local_positions(pad.length, world, rank, setting.layout, device)  # [T_local]
        return cols.expand(batch, -1)  # [B, T_local]
    real = (~pad.is_pad).long().cumsum(dim=1)  # [B, n] real tokens up to each one
    column = torch.arange(pad.length, device=device)  # [n]
    whole = torch.where(pad.is_pad, column, real - 1)  # [B, n]
    return shard(whole, 1, setting.group, setting.layout)  # [B, T_local]


def sharded_rule(
    keys: GlobalPadding, *, causal: bool, queries: GlobalPadding | None = None
) -> GlobalMask:
    """The global mask of one attention: the keys' padding, causal if asked.

    Args:
        keys: the key sequence's padding (its length is ``S``).
        causal: add a causal rule (bottom-right, as every qkv causal mask).
        queries: the query sequence, for cross-attention (its length is ``T``); None: self.

    Returns:
        The mask with its global lengths.
    """
    rule: StructuredMask | None = None if keys.is_pad is None else Padding(keys.is_pad)
    if causal:
        rule = Causal() if rule is None else rule | Causal()
    T = keys.length if queries is None else queries.length
    return GlobalMask(rule, T, keys.length)
