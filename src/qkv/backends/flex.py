"""The flex backend: PyTorch's compiled ``flex_attention`` running qkv's structured masks.

``torch.nn.attention.flex_attention`` skips fully masked blocks inside one compiled kernel, which
makes it the fastest exact kernel for masks no plain SDPA calls can express (a ``mask_mod``, a
sliding window too wide for the band reduction; a narrow window's band of SDPA calls was
measured faster, and ``auto`` takes that first). It needs ``torch.compile``, so qkv uses it
only where asked:

- ``backend="flex"`` asks for it by name, call by call;
- :func:`~qkv.backends.policy.allow_compile` (a context manager, per thread) or
  :func:`~qkv.backends.policy.set_compile_allowed` (process-wide) lets ``auto`` choose it.
  Without that opt-in ``auto`` never compiles anything.

qkv's semantics are kept at this edge: qkv's rules (True = blocked) become flex ``mask_mod``
predicates (True = may attend) and a cached ``BlockMask``; fully masked rows give 0 (flex's own
result for a row with no key, asserted by the tests); keys that a ``Padding`` (or tensor) part
blocks for every query are zeroed first, so NaN or inf there cannot leak through ``0 * NaN``;
float16/bfloat16 are computed in float32; grouped-query attention uses flex's ``enable_gqa``.

Limits (each refused with a ValueError saying what to use instead): no weights, no dropout, no
``attn_bias``, and on CPU no backward (torch 2.13's flex_attention has none there: training on
CPU keeps ``blockwise``).

The one-time compile cost is measured: :func:`compile_seconds` returns the time of the first
call of each input signature in this process (the kernel's compile included), which
``explain_backend`` reports.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from qkv.backends.call import needs_grad
from qkv.backends.policy import current_policy
from qkv.backends.reference import compute_dtype, drop_blocked_keys
from qkv.masks.rules import (
    AnyOf,
    Dense,
    Documents,
    MaskMod,
    Padding,
    SlidingWindow,
    StructuredMask,
    parts_of,
)
from qkv.masks.tiles import EMPTY, Tile, TileMask, query_offset
from qkv.masks.validate import as_4d

__all__ = [
    "FlexKernelsExhaustedError",
    "compile_seconds",
    "flex_attention_qkv",
    "flex_refusal",
]


class FlexKernelsExhaustedError(RuntimeError):
    """Raised by :func:`flex_attention_qkv` when the call would need one kernel more than
    :attr:`Policy.flex_max_kernels <qkv.backends.policy.Policy>`."""


_state = {"exhausted": False}
_compiled: list[Callable[..., Any]] = []
_compile_seconds: dict[tuple[object, ...], float] = {}
_block_masks: OrderedDict[tuple[object, ...], tuple[StructuredMask, BlockMask]] = OrderedDict()

Predicate = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


def compile_seconds() -> dict[tuple[object, ...], float]:
    """The measured time of the first (compiling) flex call of each input signature so far.

    Returns:
        ``{(device, dtype, gqa, T, S): seconds}``, a copy.
    """
    return dict(_compile_seconds)


def flex_refusal(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    attn_bias: Tensor | None,
    dropout_p: float,
    training: bool,
) -> str | None:
    """Why the flex backend cannot run a call, or None when it can.

    Args:
        query: ``[B, H, T, Dh]``.
        key: ``[B, Hkv, S, Dh]``.
        value: ``[B, Hkv, S, Dv]``.
        attn_bias: the call's score tensor, or None.
        dropout_p: the call's dropout probability.
        training: whether dropout is active.

    Returns:
        A sentence, or None.
    """
    if _state["exhausted"]:
        return (
            f"flex has compiled its {current_policy().flex_max_kernels} kernels in this "
            "process (Policy.flex_max_kernels); use backend='blockwise'"
        )
    if attn_bias is not None:
        return "flex takes no attn_bias in qkv (use backend='fused' or 'blockwise')"
    if dropout_p > 0 and training:
        return "flex has no attention dropout (use backend='blockwise' or 'fused')"
    if needs_grad(query, key, value) and query.device.type == "cpu":
        return (
            "torch's flex_attention has no backward on CPU (inputs require grad); "
            "use backend='blockwise' for training on CPU"
        )
    return None


def _predicate(rule: StructuredMask, B: int, H: int, T: int, S: int) -> Predicate:
    """``rule`` as a flex ``mask_mod``: True where the query may attend the key."""
    if isinstance(rule, AnyOf):
        preds = [_predicate(p, B, H, T, S) for p in rule.parts]

        def all_allow(b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
            out = preds[0](b, h, q, k)
            for p in preds[1:]:
                out = out & p(b, h, q, k)
            return out

        return all_allow
    if isinstance(rule, SlidingWindow):
        # 0-d tensors, not Python ints: dynamo would compile a kernel per window and offset.
        off = torch.tensor(query_offset(T, S, rule.align, rule.offset))
        if rule.window is None:

            def causal(b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
                return q + off - k >= 0  # query position - key position

            return causal
        w = torch.tensor(rule.window)

        def window(b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
            delta = q + off - k  # query position - key position
            return (delta >= 0) & (delta < w)

        return window
    if isinstance(rule, Padding):
        if rule.lengths is not None:
            lengths = rule.lengths.to(torch.int64)  # [B]

            def within(b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
                return k < lengths[b]

            return within
        assert rule.is_pad is not None
        live = ~rule.is_pad.expand(B, S)  # [B, S]

        def unpadded(b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
            return live[b, k]

        return unpadded
    if isinstance(rule, Documents):
        q_ids, kv_ids = rule.q_ids.expand(B, T), rule.kv_ids.expand(B, S)  # [B, T], [B, S]

        def same_document(b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
            return q_ids[b, q] == kv_ids[b, k]

        return same_document
    if isinstance(rule, MaskMod):
        return rule.mask_mod
    if isinstance(rule, Dense):
        allowed = ~rule.mask.expand(B, H, T, S)  # [B, H, T, S] (a view)

        def dense(b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
            return allowed[b, h, q, k]

        return dense
    raise TypeError(f"the flex backend cannot run a {type(rule).__name__} mask")


def _block_status(
    rule: StructuredMask, B: int, H: int, T: int, S: int, device: torch.device
) -> Tensor:
    """Each ``Policy.flex_block``-square block of the grid: 0 every pair blocked, 1 partly
    blocked, 2 nothing blocked; from the rule's own tile classification (an analytic answer for most
    tiles; a small bool tile where it is partial).

    Returns ``[B|1, H|1, nq, nk]``: a dim is kept only if some partial tile varies along it (a
    tile that is FULL or EMPTY is so for every sample and head). A block mask broadcast over
    heads runs faster: flex's CPU kernel took 1.13x the time with the same blocks repeated per
    head (sliding window 256, 4k, 8 heads).
    """
    block = current_policy().flex_block
    nq, nk = -(-T // block), -(-S // block)
    found: list[tuple[int, int, TileMask]] = []
    Bs, Hs = 1, 1
    for i in range(nq):
        q0, q1 = i * block, min((i + 1) * block, T)
        for j in range(nk):
            k0, k1 = j * block, min((j + 1) * block, S)
            tm = rule.tile(Tile(B, H, T, S, q0, q1, k0, k1, device))
            if tm is EMPTY:
                continue
            if isinstance(tm, Tensor):
                tm = as_4d(tm)  # [B|1, H|1, ·, ·]
                Bs, Hs = max(Bs, tm.shape[0]), max(Hs, tm.shape[1])
            found.append((i, j, tm))
    status = torch.zeros(Bs, Hs, nq, nk, dtype=torch.int8, device=device)
    for i, j, tm in found:
        if not isinstance(tm, Tensor):  # FULL
            status[:, :, i, j] = 2
            continue
        blocked = tm.expand(Bs, Hs, *tm.shape[2:])  # [B|1, H|1, bq, bk]
        none = ~blocked.any(dim=3).any(dim=2)  # [B|1, H|1]
        every = blocked.all(dim=3).all(dim=2)  # [B|1, H|1]
        status[:, :, i, j] = torch.where(none, 2, torch.where(every, 0, 1)).to(torch.int8)
    return status


def _kv_blocks(selected: Tensor) -> tuple[Tensor, Tensor]:
    """``(counts [B, H, nq], indices [B, H, nq, nk])`` of the selected key blocks of each query
    block, the selected ones first (what ``BlockMask.from_kv_blocks`` takes)."""
    counts = selected.sum(dim=-1, dtype=torch.int32)  # [B, H, nq]
    order = torch.argsort((~selected).to(torch.int8), dim=-1, stable=True)  # [B, H, nq, nk]
    return counts, order.to(torch.int32)


def block_mask_for(
    rule: StructuredMask, B: int, H: int, T: int, S: int, device: torch.device
) -> BlockMask:
    """The flex ``BlockMask`` of ``rule`` on a ``[B, H, T, S]`` grid, cached.

    Built from qkv's own tile classification (:func:`_block_status`), not flex's
    ``create_block_mask``: eagerly that evaluates the predicate on all ``T · S`` pairs (0.25 s at
    4k here), and compiled it hit an inductor C++ codegen error on CPU for an indexed
    ``Padding`` predicate. The cache (``Policy.block_mask_cache_size`` entries) is keyed by the
    rule object itself (kept alive by its entry, so its id is not reused) and the grid.

    Args:
        rule: the mask (qkv's convention, True = blocked).
        B, H, T, S: the grid.
        device: where the call runs.

    Returns:
        The block mask.
    """
    policy = current_policy()
    key = (id(rule), B, H, T, S, str(device), policy.flex_block)
    hit = _block_masks.get(key)
    if hit is not None and hit[0] is rule:
        _block_masks.move_to_end(key)
        return hit[1]
    status = _block_status(rule, B, H, T, S, device)  # [B, H, nq, nk]
    partial, partial_idx = _kv_blocks(status == 1)
    full, full_idx = _kv_blocks(status == 2)
    block = BlockMask.from_kv_blocks(
        partial,
        partial_idx,
        full,
        full_idx,
        BLOCK_SIZE=policy.flex_block,
        mask_mod=_predicate(rule, B, H, T, S),
        seq_lengths=(T, S),
    )
    _block_masks[key] = (rule, block)
    while len(_block_masks) > policy.block_mask_cache_size:
        _block_masks.popitem(last=False)
    return block


def _compiled_flex() -> Callable[..., Any]:
    """The compiled kernel, built once. ``dynamic=False``: inductor's dynamic-shape CPU flex
    template fails to compile in torch 2.13 (an undeclared ``cur_qSplitSize`` in the generated
    C++, met after a second sequence length), so each new ``(T, S)`` compiles its own kernel,
    up to ``Policy.flex_max_kernels`` (:func:`flex_attention_qkv` raises past it)."""
    if not _compiled:
        _compiled.append(torch.compile(flex_attention, dynamic=False))
    return _compiled[0]


def _dead_keys(rule: StructuredMask, B: int, S: int, device: torch.device) -> Tensor | None:
    """``[B|1, 1, 1, S]`` True at keys a ``Padding`` or tensor part blocks for every query."""
    parts = parts_of(rule)
    dead: Tensor | None = None
    for p in parts:
        if isinstance(p, Padding):
            m = p.materialize(B, 1, 1, S, device)  # [B, 1, 1, S]
        elif isinstance(p, Dense):
            m = p.mask.all(dim=2, keepdim=True).all(dim=1, keepdim=True)  # [B|1, 1, 1, S]
        else:
            continue
        dead = m if dead is None else dead | m
    return dead


def flex_attention_qkv(
    query: Tensor, key: Tensor, value: Tensor, mask: StructuredMask | None, scale: float
) -> Tensor:
    """Attention through compiled ``flex_attention`` with qkv's semantics.

    Args:
        query: ``[B, H, T, Dh]``.
        key: ``[B, Hkv, S, Dh]``.
        value: ``[B, Hkv, S, Dv]``.
        mask: the structured mask (True = blocked), or None.
        scale: score multiplier.

    Returns:
        ``[B, H, T, Dv]`` in the input dtype; rows with every key blocked are 0.
    """
    B, H, T, _ = query.shape
    Hkv, S = key.shape[1], key.shape[2]
    dtype = query.dtype
    work = compute_dtype(dtype)
    q, k, v = query.to(work), key.to(work), value.to(work)
    if not torch.is_grad_enabled():
        # torch refuses inputs that require grad on CPU even under no_grad; no graph is built.
        q, k, v = q.detach(), k.detach(), v.detach()
    if mask is not None:
        dead = _dead_keys(mask, B, S, query.device)
        k, v = drop_blocked_keys(k, v, dead)  # [B, Hkv, S, Dh], [B, Hkv, S, Dv]
    sig = (str(query.device), work, Hkv != H, T, S)
    first = sig not in _compile_seconds and not torch.compiler.is_compiling()
    start = time.perf_counter()
    block = None if mask is None else block_mask_for(mask, B, H, T, S, query.device)
    kernels = current_policy().flex_max_kernels
    limits = {"recompile_limit": kernels, "fail_on_recompile_limit_hit": True}
    try:
        with torch._dynamo.config.patch(limits):
            out = _compiled_flex()(
                q, k, v, block_mask=block, scale=scale, enable_gqa=Hkv != H
            )  # [B, H, T, Dv]
    except torch._dynamo.exc.FailOnRecompileLimitHit as err:
        _state["exhausted"] = True
        raise FlexKernelsExhaustedError(
            f"flex has compiled {kernels} kernels in this process"
        ) from err
    if first:
        _compile_seconds[sig] = time.perf_counter() - start
    return out.to(dtype)
