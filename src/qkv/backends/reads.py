"""What the planner reads from a mask's values: the one host read a plan may cost.

A ``Padding`` rule's live lengths and a ``Documents`` rule's runs of ids decide how a call is
cut (:mod:`qkv.backends.pieces`); they live on the device, so reading them is a host sync on an
accelerator. Each read goes through :func:`host_list`: one explicit copy to the host per rule,
made once per plan (and, with :func:`qkv.backends.shared.share_plans`, once per forward).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from qkv.masks.rules import Padding

__all__ = ["host_list", "key_limits", "runs"]


def host_list(x: Tensor) -> list[Any]:
    """``x.tolist()`` through one explicit copy to the host: the planner's only way to read
    values, a single device-to-host transfer (a host sync on an accelerator) that a dispatch
    mode sees as ``aten._to_copy`` to the CPU, also for a CPU tensor (``tolist`` alone is not
    dispatched there), so the syncs of a forward can be counted on any device."""
    return x.to("cpu", copy=True).tolist()


def runs(ids: Tensor) -> list[tuple[int, int, int]]:
    """``(id, start, end)`` of each run of equal values in the 1-d ``ids``.

    Tensor ops and one read from the device: a Python loop over the ids cost 0.5 ms per 1k
    positions, 5 % of a 1k-token call's attention.
    """
    values, counts = torch.unique_consecutive(ids, return_counts=True)  # [R], [R]
    ends = counts.cumsum(0)  # [R]
    vals, stops = host_list(torch.stack([values.long(), ends]))
    starts = [0, *stops][: len(stops)]  # no run at all for empty ids
    return list(zip(vals, starts, stops, strict=True))


def key_limits(padding: list[Padding], B: int, S: int) -> tuple[list[int], list[bool]]:
    """Per sample: one past its last live key, and whether live keys have holes before it."""
    limit, holes = [S] * B, [False] * B
    for p in padding:
        if p.lengths is not None:
            lengths = host_list(p.lengths)
            limit = [min(a, int(n)) for a, n in zip(limit, lengths, strict=True)]
            continue
        assert p.is_pad is not None
        live = ~p.is_pad  # [B, S]
        pos = torch.arange(1, S + 1, device=live.device)  # [S]
        last = (live * pos).amax(dim=1)  # [B]: one past the last live key, 0 if none
        count = live.sum(dim=1)  # [B]: live keys; fewer than `last` means a hole before it
        lasts, counts = host_list(torch.stack([last, count]))  # one read from the device
        for b, (n, c) in enumerate(zip(lasts, counts, strict=True)):
            limit[b] = min(limit[b], int(n))
            holes[b] = holes[b] or c != n
    # Two paddings: a key live in one may be padding in the other, so there may be holes.
    if len(padding) > 1 and any(p.is_pad is not None for p in padding):
        holes = [True] * B
    return limit, holes
