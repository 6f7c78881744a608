"""Context-parallel attention: each rank holds a shard of the sequence; the output is exact.

``context_parallel_attention(q, k, v, mask=rule)`` runs one attention call over a sequence cut
across the ranks of a process group (:mod:`qkv.distributed.layout`). Each rank computes its own
queries against its own keys, then, round by round (:mod:`qkv.distributed.comm`), against the
keys other ranks send it — only those its queries may see (:mod:`qkv.distributed.plan`) — while
the next round's keys are in flight. Blocks merge by the online softmax in float32 (float64
stays float64; :mod:`qkv.distributed.block`). The backward is exact: it recomputes each block's
probabilities from the saved log-sum-exp, sends the keys again, and sends each block's dK/dV
back to the rank that owns those keys.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from qkv.backends.reference import compute_dtype
from qkv.distributed.block import backward_block, finish, forward_block, start
from qkv.distributed.comm import Exchange
from qkv.distributed.layout import Layout, check_layout, group_rank
from qkv.distributed.plan import ContextPlan, local_ranges, plan_context
from qkv.masks import Causal, StructuredMask

__all__ = ["context_parallel_attention", "global_length"]


def global_length(*local_lengths: int, group: dist.ProcessGroup | None = None) -> list[int]:
    """Whole sequences' lengths: each the sum of every rank's local length (one all-reduce).

    Args:
        local_lengths: this rank's length of each sequence.
        group: the process group (default: the world).

    Returns:
        The global length of each, in order.
    """
    _, world = group_rank(group)
    if world == 1:
        return list(local_lengths)
    n = torch.tensor(local_lengths, dtype=torch.long)
    dist.all_reduce(n, group=group)
    return [int(x) for x in n]


def _gather_keys(k: Tensor, plan: ContextPlan, dst: int) -> Tensor:
    """This rank's keys (or values) that ``dst`` needs, concatenated: ``[B, Hkv, L, D]``."""
    mine = plan.kv_segments[plan.rank]
    parts = [k[:, :, a:b] for _, (a, b) in local_ranges(mine, plan.needs[dst][plan.rank])]
    return torch.cat(parts, dim=2).contiguous()  # [B, Hkv, L, D]


def _buffer(like: Tensor, n: int, dtype: torch.dtype) -> Tensor:
    """An empty ``[B, Hkv, n, D]`` buffer shaped like ``like`` for ``n`` positions."""
    B, Hkv, _, D = like.shape
    return torch.empty(B, Hkv, n, D, dtype=dtype, device=like.device)  # [B, Hkv, L, D]


def _kv_round(
    k: Tensor, v: Tensor, plan: ContextPlan, s: int, group: dist.ProcessGroup | None
) -> Exchange:
    """Round ``s``'s keys and values: send what rank ``r + s`` needs, receive from ``r - s``."""
    r, w = plan.rank, plan.world
    dst, src = (r + s) % w, (r - s) % w
    ex = Exchange(group)
    if plan.needs[dst][r]:
        ex.sends += [(dst, _gather_keys(k, plan, dst)), (dst, _gather_keys(v, plan, dst))]
    if plan.needs[r][src]:
        n = plan.received(src)
        ex.recvs += [(src, _buffer(k, n, k.dtype)), (src, _buffer(v, n, v.dtype))]
    return ex.start()


class _ContextParallel(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        plan: ContextPlan,
        scale: float,
        group: dist.ProcessGroup | None,
    ) -> Tensor:
        cd = compute_dtype(q.dtype)
        qc = q.to(cd)
        state = start(qc, v.shape[3])
        r, w = plan.rank, plan.world
        pending = _kv_round(k, v, plan, 1, group) if w > 1 else None
        for pair in plan.pairs[r]:
            forward_block(qc, k, v, pair, scale, state)
        for s in range(1, w):
            assert pending is not None
            received = pending.wait()
            pending = _kv_round(k, v, plan, s + 1, group) if s + 1 < w else None
            if received:
                kr, vr = received
                for pair in plan.pairs[(r - s) % w]:
                    forward_block(qc, kr, vr, pair, scale, state)
        out, lse = finish(state)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.scale, ctx.group = plan, scale, group
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        plan: ContextPlan = ctx.plan
        scale, group = ctx.scale, ctx.group
        cd = out.dtype
        qc, do = q.to(cd), dout.to(cd)
        lse_safe = lse.masked_fill(torch.isneginf(lse), float("inf"))  # [B, H, T]
        dq = torch.zeros_like(qc)  # [B, H, T, Dh]
        dk = torch.zeros(k.shape, dtype=cd, device=k.device)  # [B, Hkv, T, Dh]
        dv = torch.zeros(v.shape, dtype=cd, device=v.device)  # [B, Hkv, T, Dv]
        r, w = plan.rank, plan.world
        pending = _kv_round(k, v, plan, 1, group) if w > 1 else None
        for pair in plan.pairs[r]:
            backward_block(qc, (k, v), do, out, lse_safe, pair, scale, (dq, dk, dv))
        grads_in_flight: list[tuple[int, Exchange]] = []
        for s in range(1, w):
            assert pending is not None
            received = pending.wait()
            pending = _kv_round(k, v, plan, s + 1, group) if s + 1 < w else None
            src, dst = (r - s) % w, (r + s) % w
            ex = Exchange(group)
            if received:
                kr, vr = received
                gk = torch.zeros(kr.shape, dtype=cd, device=kr.device)  # [B, Hkv, L, Dh]
                gv = torch.zeros(vr.shape, dtype=cd, device=vr.device)  # [B, Hkv, L, Dv]
                for pair in plan.pairs[src]:
                    backward_block(qc, (kr, vr), do, out, lse_safe, pair, scale, (dq, gk, gv))
                ex.sends += [(src, gk), (src, gv)]
            if plan.needs[dst][r]:
                n = plan.sent(dst)
                ex.recvs += [(dst, _buffer(k, n, cd)), (dst, _buffer(v, n, cd))]
            grads_in_flight.append((dst, ex.start()))
        for dst, ex in grads_in_flight:
            got = ex.wait()
            if got:
                _add_back(dk, got[0], plan, dst)
                _add_back(dv, got[1], plan, dst)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def _add_back(grad: Tensor, got: Tensor, plan: ContextPlan, dst: int) -> None:
    """Add the gradient ``dst`` computed for the keys this rank sent it, at their places."""
    offset = 0
    for _, (a, b) in local_ranges(plan.kv_segments[plan.rank], plan.needs[dst][plan.rank]):
        grad[:, :, a:b] += got[:, :, offset : offset + b - a]
        offset += b - a


def context_parallel_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: StructuredMask | None = None,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    group: dist.ProcessGroup | None = None,
    layout: Layout = "contiguous",
    length: int | None = None,
    kv_length: int | None = None,
    plan: ContextPlan | None = None,
) -> Tensor:
    """Exact attention over sequences sharded across the ranks of ``group``.

    Every rank calls it with its own shards, e.g. from :func:`qkv.distributed.shard`. In
    self-attention queries, keys and values are cut from one sequence; in cross-attention the
    keys and values come from another sequence (of length ``S``), cut in the same layout.

    Args:
        query: this rank's queries ``[B, H, T_local, Dh]``.
        key: this rank's keys ``[B, Hkv, S_local, Dh]`` (``Hkv`` dividing ``H``: GQA).
        value: this rank's values ``[B, Hkv, S_local, Dv]``.
        mask: a qkv rule in **global** coordinates (``Causal``, ``Padding``, ``Documents``,
            ``SlidingWindow``, ``MaskMod`` or a combination), True = blocked; None: no mask.
        is_causal: add a causal rule (the same as ``mask=Causal()`` combined with ``mask``).
        scale: score scale; default ``1 / sqrt(Dh)``.
        group: the process group (default: the world; with torch.distributed not
            initialized, one process holding the whole sequence).
        layout: how the sequence was cut: ``"contiguous"`` or ``"zigzag"``.
        length: the global query length ``T``, if known.
        kv_length: the global key length ``S``, if known (both known, or a ``plan``: no
            all-reduce to learn them).
        plan: a plan from :func:`qkv.distributed.plan_context` to reuse (every layer of a model
            with the same mask and shapes); made here when None.

    Returns:
        This rank's output shard ``[B, H, T_local, Dv]`` in the input dtype; a row whose keys are
        all blocked everywhere gives 0 (and finite gradients).

    Raises:
        TypeError: tensors that are not floating point, a mask that is not a rule.
        ValueError: shapes that do not fit, a plan made for other shapes or another rank.
    """
    _check_shards(query, key, value)
    rule = mask
    if is_causal:
        rule = Causal() if mask is None else (mask | Causal())
    if plan is None:
        plan = _plan(query, key, rule, group, check_layout(layout), (length, kv_length))
    _check_plan(plan, query, key, group)
    s = 1.0 / math.sqrt(query.shape[3]) if scale is None else float(scale)
    out: Tensor = _ContextParallel.apply(query, key, value, plan, s, group)
    return out


def _check_shards(query: Tensor, key: Tensor, value: Tensor) -> None:
    """The shards' types and shapes, checked (see :func:`context_parallel_attention`)."""
    if not all(isinstance(t, Tensor) for t in (query, key, value)):
        raise TypeError("query, key and value must be torch.Tensors")
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError(
            "query, key and value must be 4-D [B, H, T_local, D], got shapes "
            f"{list(query.shape)}, {list(key.shape)}, {list(value.shape)}"
        )
    if not (query.is_floating_point() and query.dtype == key.dtype == value.dtype):
        raise TypeError(
            f"query, key and value must share one floating dtype, got {query.dtype}, "
            f"{key.dtype}, {value.dtype}"
        )
    B, H, _, Dh = query.shape
    Hkv = key.shape[1]
    if key.shape[0] != B or value.shape[0] != B or key.shape[2] != value.shape[2]:
        raise ValueError(
            "query, key and value shards must share the batch size, and key and value the "
            f"length, got {list(query.shape)}, {list(key.shape)}, {list(value.shape)}"
        )
    if key.shape[3] != Dh or value.shape[1] != Hkv or H % Hkv:
        raise ValueError(
            f"query [B, H, T, Dh] = {list(query.shape)} does not fit key {list(key.shape)} "
            f"and value {list(value.shape)} (Dh must match, Hkv must divide H)"
        )


def _plan(
    query: Tensor,
    key: Tensor,
    rule: StructuredMask | None,
    group: dist.ProcessGroup | None,
    layout: Layout,
    lengths: tuple[int | None, int | None],
) -> ContextPlan:
    """The plan of one call, its global lengths learned by one all-reduce if not given."""
    B, H, T, _ = query.shape
    length, kv_length = lengths
    if length is None or kv_length is None:
        n, m = global_length(T, key.shape[2], group=group)
        length = n if length is None else length
        kv_length = m if kv_length is None else kv_length
    rank, world = group_rank(group)
    return plan_context(
        rule, batch=B, heads=H, kv_heads=key.shape[1], length=length, kv_length=kv_length,
        world=world, rank=rank, layout=layout, device=query.device,
    )  # fmt: skip


def _check_plan(
    plan: ContextPlan, query: Tensor, key: Tensor, group: dist.ProcessGroup | None
) -> None:
    """A given plan must be this rank's, for these shapes."""
    B, H, T, _ = query.shape
    Hkv = key.shape[1]
    rank, world = group_rank(group)
    if plan.rank != rank or plan.world != world or plan.grid != (B, H, Hkv):
        raise ValueError(
            f"plan was made for rank {plan.rank} of {plan.world} and (B, H, Hkv) = {plan.grid}; "
            f"this call is rank {rank} of {world} with {(B, H, Hkv)}"
        )
    if plan.local_length != T or plan.kv_local_length != key.shape[2]:
        raise ValueError(
            f"this rank holds {plan.local_length} of {plan.length} queries and "
            f"{plan.kv_local_length} of {plan.kv_length} keys in the plan's {plan.layout} "
            f"layout, but the shards have T_local={T} and S_local={key.shape[2]}"
        )
