"""Which backend runs a call, and why: a :class:`Plan` with its reasons as records.

``auto`` is decided per call from facts about it, never by trying a backend and falling back.
Every threshold comes from the :class:`~qkv.backends.policy.Policy` in force, and each decision
is one :class:`Reason` naming the rule, the quantity measured, the threshold and the policy
field. The steps, in order:

1. weights requested: **reference**, the only backend that returns them; a call needing a
   gradient on CPU (eager, no dropout) of at least ``exact_grad_blockwise_min_pairs`` pairs
   where fused would take its exact, score-recomputing backward, and no reduction of step 2
   applies: **blockwise**, whose tiled backward is exact and faster (the pieces of a reduction
   make the same choice each);
2. a structured mask made of ``Causal`` / ``Padding`` / ``Documents`` parts (or ``is_causal``
   with ``T != S``, or a ``[B, 1, 1, S]`` padding tensor) that
   :func:`~qkv.backends.pieces.reduce_mask` cuts exactly into a few plain SDPA calls:
   **fused**, on those pieces (also when ``backend="fused"`` is asked for). With a
   ``SlidingWindow`` part too, when no gradient is needed: the band reduction, one SDPA call
   per ``band_block`` queries over its band of keys, where the band is at most
   ``band_max_share`` of the grid (forward measured faster than blockwise, SDPA over the dense
   mask, and compiled flex_attention: 0.69-0.78x flex for a 256 window at 1k-8k, so it comes
   before step 3; with a backward the per-call overhead loses to blockwise);
3. only inside :func:`~qkv.backends.policy.allow_compile`, a structured mask left by step 2 on a
   grid of at least ``blockwise_min_pairs``, when the call has no ``attn_bias`` or dropout and
   needs no gradient on CPU: **flex**;
4. otherwise, a structured mask (or ``is_causal`` with ``T != S``) on a grid of at least
   ``blockwise_min_pairs`` pairs where at least ``blockwise_min_skip`` of the tiles are fully
   masked (a ``mask_mod`` or tensor part is assumed sparse), or whose materialized mask would
   exceed ``materialize_limit_bytes``: **blockwise**;
5. everything else: **fused** (structured masks are then materialized in their broadcast shape).

A backend asked for by name is used as asked; if it cannot serve the call (weights from fused
or blockwise) :func:`make_plan` raises instead of switching.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal, NamedTuple

import torch
from torch import Tensor

from qkv.backends.call import Call, Fit
from qkv.backends.flex import flex_refusal
from qkv.backends.fused import blockwise_trains_faster, uses_sdpa_is_causal
from qkv.backends.pieces import Reduction, reduction_of
from qkv.backends.policy import POLICY, Policy, current_policy
from qkv.backends.tiles import TilePlan, dense_tile_skip, plan_tiles, resolve_blocks
from qkv.masks import StructuredMask
from qkv.masks.rules import Causal, Dense, Documents, MaskMod, Padding, SlidingWindow, parts_of
from qkv.masks.validate import as_4d

__all__ = ["Plan", "Reason", "Rule", "blockwise_mask", "make_plan"]

Rule = Literal[
    "requested",
    "need-weights",
    "exact-gradient",
    "reduced",
    "compile-allowed",
    "tensor-tiles-skipped",
    "tensor-mask",
    "sdpa-is-causal",
    "no-structured-mask",
    "mask-too-large",
    "too-small",
    "assumed-sparse",
    "tiles-skipped",
    "few-tiles-skipped",
    "no-band-with-gradient",
    "mask-materialized",
    "causal-materialized",
    "upcast",
    "dead-rows-zeroed",
    "sdpa-backward",
    "compile-cost",
]
"""The rules a :class:`Reason` names: the first reason of a plan says why its backend was
chosen; the ones after it how that backend runs the call (``upcast``, ``mask-materialized``,
...). :func:`qkv.backends.explain.explain` renders each as a sentence."""


_NO_FACTS: Mapping[str, object] = MappingProxyType({})


@dataclass(frozen=True)
class Reason:
    """One rule the planner applied, with what it measured.

    Attributes:
        rule: the rule (see :data:`Rule`).
        quantity: what was measured about the call, e.g. ``"T*S pairs"``, or None.
        value: the measured value, or None.
        threshold: the threshold it was compared with, or None.
        policy_field: the :class:`~qkv.backends.policy.Policy` field the threshold came
            from (or the opt-in that allowed the rule), or None.
        facts: what the explanation names besides (the mask, tile counts, dtype), by name.
    """

    rule: Rule
    quantity: str | None = None
    value: float | None = None
    threshold: float | None = None
    policy_field: str | None = None
    facts: Mapping[str, object] = dataclasses.field(default_factory=dict, compare=False, hash=False)


@dataclass(frozen=True)
class Plan:
    """How one call runs: a value, made by :func:`qkv.plan`, run by ``qkv.attention(plan=)``.

    Attributes:
        backend: ``"reference"``, ``"fused"``, ``"blockwise"`` or ``"flex"``.
        reasons: why, as records: the first says why this backend, the rest how it runs.
        pieces: for fused, the SDPA calls the mask was cut into, or None (one call).
        tiles: for blockwise, its tiles (which it computes, and their masks), or None when
            blockwise cuts them as it runs (a ``mask_mod`` or tensor part, or a forced call).
        mask: for blockwise and flex, the structured mask they run (the call's ``is_causal``
            joined, a tensor wrapped in :class:`~qkv.masks.Dense`).
        fit: what it was made for (see :class:`~qkv.backends.call.Fit`); None for a plan
            made inside one attention call, which runs no other.
        policy: the policy it was made under; it runs under it too.
    """

    backend: str
    reasons: tuple[Reason, ...]
    pieces: Reduction | None = dataclasses.field(default=None, compare=False)
    tiles: TilePlan | None = dataclasses.field(default=None, compare=False)
    mask: StructuredMask | None = dataclasses.field(default=None, compare=False)
    fit: Fit | None = dataclasses.field(default=None, compare=False)
    policy: Policy = dataclasses.field(default=POLICY, compare=False)
    mask_ref: object = dataclasses.field(default=None, compare=False, repr=False)


def blockwise_mask(mask: Tensor | StructuredMask | None, is_causal: bool) -> StructuredMask | None:
    """The structured mask the blockwise backend runs for a call's ``mask`` and ``is_causal``.

    Args:
        mask: bool tensor (wrapped in :class:`Dense`, made 4-D), structured mask, or None.
        is_causal: add a bottom-right :class:`Causal` part.

    Returns:
        The mask, or None when nothing is masked.
    """
    structured: StructuredMask | None
    if isinstance(mask, Tensor):
        dense = as_4d(mask)  # [B|1, H|1, T|1, S]
        structured = Dense(dense)
    else:
        structured = mask
    if is_causal:
        structured = Causal() if structured is None else Causal() | structured
    return structured


def _notes(call: Call, structured: bool) -> list[Reason]:
    """How SDPA runs a call over its whole grid: what is materialized, upcast, zeroed."""
    T, S = call.query.shape[2], call.key.shape[2]
    notes = []
    if structured:
        notes.append(_PLAIN["mask-materialized"])
    if call.is_causal and T != S:
        notes.append(Reason("causal-materialized", facts={"T": T, "S": S}))
    notes += _upcast(call)
    if call.mask is not None or call.is_causal:
        notes.append(_PLAIN["dead-rows-zeroed"])
    return notes + _grad_note(call)


def _upcast(call: Call) -> list[Reason]:
    dtype = call.query.dtype
    if dtype in (torch.float16, torch.bfloat16):
        return [Reason("upcast", facts={"dtype": dtype})]
    return []


def _grad_note(call: Call) -> list[Reason]:
    cpu = call.query.device.type == "cpu"
    if cpu and call.needs_grad and current_policy().allow_sdpa_backward:
        return [Reason("sdpa-backward", policy_field="allow_sdpa_backward")]
    return []


def _compile_cost(call: Call) -> Reason:
    q, k = call.query, call.key
    sig = (q.shape[2], k.shape[2], k.shape[1] != q.shape[1], str(q.device), q.dtype)
    return Reason("compile-cost", facts={"signature": sig})


_PLAIN: dict[str, Reason] = {
    rule: Reason(rule)
    for rule in (
        "no-structured-mask",
        "tensor-mask",
        "sdpa-is-causal",
        "dead-rows-zeroed",
        "mask-materialized",
        "need-weights",
        "no-band-with-gradient",
    )
}
"""The reasons that carry no measurement, made once (they are values: shared safely)."""


class _Choice(NamedTuple):
    """What the steps decide; :func:`make_plan` makes it a :class:`Plan` (one construction)."""

    backend: str
    reasons: tuple[Reason, ...]
    pieces: Reduction | None = None
    tiles: TilePlan | None = None
    mask: StructuredMask | None = None


def make_plan(call: Call, fit: Fit | None = None) -> Plan:
    """Plan one validated call (see the module docstring for the steps).

    Args:
        call: the call.
        fit: the call's :func:`~qkv.backends.call.fit_of`, which a plan needs to run another
            call (``attention(plan=)``); None for a plan only this call runs.

    Returns:
        The plan.

    Raises:
        ValueError: weights requested from a backend that cannot return them, or flex asked
            for a call it cannot run.
    """
    policy = current_policy()
    c = _choose(call, policy)
    return Plan(c.backend, c.reasons, c.pieces, c.tiles, c.mask, fit, policy, call.mask)


def _choose(call: Call, policy: Policy) -> _Choice:
    requested = call.backend
    if requested in ("fused", "blockwise", "flex") and call.need_weights:
        raise ValueError(
            f"backend={requested!r} cannot return weights (need_weights=True); "
            "use backend='reference' or 'auto'"
        )
    asked = [Reason("requested", facts={"backend": requested})] if requested != "auto" else []
    if requested == "reference":
        return _Choice("reference", tuple(asked))
    run_mask = blockwise_mask(call.mask, call.is_causal)
    if requested == "blockwise":
        return _blockwise_plan(call, run_mask, tuple(asked))
    if requested == "flex":
        refusal = _flex_refusal(call)
        if refusal is not None:
            raise ValueError(f"backend='flex' cannot run this call: {refusal}")
        return _Choice("flex", (*asked, _compile_cost(call)), mask=run_mask)
    if call.need_weights:
        return _Choice("reference", (_PLAIN["need-weights"],))
    grid = (*call.query.shape[:3], call.key.shape[2])
    strict = requested == "auto"
    red = reduction_of(call.mask, run_mask, grid, strict=strict, band=not call.needs_grad)
    if red is not None:
        how = (_reduced_reason(call, red), *_upcast(call), *_grad_note(call))
        return _Choice("fused", (*asked, *how), red)
    if (
        requested == "auto"
        and call.needs_grad
        and blockwise_trains_faster(
            call.query, call.key, call.value, call.attn_bias, call.dropout_p, call.training
        )
    ):
        pairs = call.query.shape[2] * call.key.shape[2]
        why = Reason(
            "exact-gradient",
            "T*S pairs",
            pairs,
            policy.exact_grad_blockwise_min_pairs,
            "exact_grad_blockwise_min_pairs",
        )
        return _blockwise_plan(call, run_mask, (why,))
    structured = isinstance(call.mask, StructuredMask)
    if requested == "fused":
        return _Choice("fused", (*asked, *_notes(call, structured)))
    T, S = call.query.shape[2], call.key.shape[2]
    if not (structured or (call.is_causal and T != S)):
        return _dense_plan(call, run_mask, policy)
    if _flex_first(call, policy):
        why = Reason(
            "compile-allowed",
            "T*S pairs",
            T * S,
            policy.blockwise_min_pairs,
            "allow_compile",
            {"mask": run_mask},
        )
        return _Choice("flex", (why, _compile_cost(call)), mask=run_mask)
    return _tile_plan(call, run_mask, policy)


def _flex_refusal(call: Call) -> str | None:
    return flex_refusal(
        call.query,
        call.key,
        call.value,
        attn_bias=call.attn_bias,
        dropout_p=call.dropout_p,
        training=call.training,
    )


def _flex_first(call: Call, policy: Policy) -> bool:
    pairs = call.query.shape[2] * call.key.shape[2]
    return (
        policy.allow_compile and pairs >= policy.blockwise_min_pairs and _flex_refusal(call) is None
    )


def _reduced_reason(call: Call, red: Reduction) -> Reason:
    B, _, T, S = red.grid
    share = red.pairs / (B * T * S)
    facts = {"from_tensor": isinstance(call.mask, Tensor)}
    if red.band:
        policy = current_policy()
        return Reason(
            "reduced",
            "share of pairs computed",
            share,
            policy.band_max_share,
            "band_max_share",
            facts,
        )
    return Reason("reduced", "share of pairs computed", share, facts=facts)


def _dense_plan(call: Call, run_mask: StructuredMask | None, policy: Policy) -> _Choice:
    """Step 5 for a call with no structured mask: a block-sparse mask tensor goes blockwise
    (its tiles classified in one pass), everything else to SDPA."""
    mask = call.mask
    T, S = call.query.shape[2], call.key.shape[2]
    pairs = T * S
    if isinstance(mask, Tensor) and pairs >= policy.blockwise_min_pairs:
        bq, bk = resolve_blocks(None, call.block_q, call.block_k)
        skipped = dense_tile_skip(mask, bq, bk)
        if skipped is not None and skipped >= policy.blockwise_min_skip:
            why = Reason(
                "tensor-tiles-skipped",
                "fully masked tile share",
                skipped,
                policy.blockwise_min_skip,
                "blockwise_min_skip",
                {"blocks": (bq, bk)},
            )
            return _Choice("blockwise", (why,), mask=run_mask)
    if isinstance(mask, Tensor):
        why = _PLAIN["tensor-mask"]
    elif uses_sdpa_is_causal(T, S, mask, call.attn_bias, call.is_causal):
        why = _PLAIN["sdpa-is-causal"]
    else:
        why = _PLAIN["no-structured-mask"]
    return _Choice("fused", (why, *_notes(call, False)))


def _tile_plan(call: Call, run_mask: StructuredMask | None, policy: Policy) -> _Choice:
    """Steps 4-5 for a structured mask no reduction or flex took: blockwise where it skips
    enough tiles or the materialized mask would be too large, else SDPA over the dense mask."""
    B, H, T, _ = call.query.shape
    S = call.key.shape[2]
    pairs = T * S
    no_band = [_PLAIN["no-band-with-gradient"]] if call.needs_grad and _has_window(run_mask) else []
    mat_bytes = 5 * pairs * (B if _per_batch(call.mask) else 1)
    if mat_bytes > policy.materialize_limit_bytes:
        limit = policy.materialize_limit_bytes
        why = Reason("mask-too-large", "materialized mask bytes", mat_bytes, limit)
        why = dataclasses.replace(why, policy_field="materialize_limit_bytes")
        return _blockwise_plan(call, run_mask, (why, *no_band))
    if pairs < policy.blockwise_min_pairs:
        why = Reason(
            "too-small", "T*S pairs", pairs, policy.blockwise_min_pairs, "blockwise_min_pairs"
        )
        return _Choice("fused", (why, *_notes(call, True)))
    # A tensor mask with is_causal and T != S is classified by its causal part alone (the
    # tensor is assumed dense); then the tiles are not the run mask's: blockwise cuts its own.
    sm = run_mask if isinstance(call.mask, StructuredMask) or call.mask is None else Causal()
    assert sm is not None
    if not _cheap_to_classify(sm):
        return _Choice("blockwise", (Reason("assumed-sparse", facts={"mask": sm}),), mask=run_mask)
    blocks = resolve_blocks(sm, call.block_q, call.block_k)
    own = sm is run_mask
    tiles = plan_tiles(sm, B, H, T, S, *blocks, call.query.device, keep_masks=own)
    skipped = 1.0 - tiles.computed / tiles.total
    facts = {"mask": sm, "skipped": tiles.total - tiles.computed, "total": tiles.total}
    rule: Rule = "tiles-skipped" if skipped >= policy.blockwise_min_skip else "few-tiles-skipped"
    why = Reason(
        rule,
        "fully masked tile share",
        skipped,
        policy.blockwise_min_skip,
        "blockwise_min_skip",
        facts,
    )
    if rule == "tiles-skipped":
        return _Choice("blockwise", (why, *no_band), tiles=tiles if own else None, mask=run_mask)
    return _Choice("fused", (why, *_notes(call, True)))


def _blockwise_plan(
    call: Call, run_mask: StructuredMask | None, reasons: tuple[Reason, ...]
) -> _Choice:
    """A blockwise plan with its tiles cut, where the mask's rules classify tiles cheaply
    (analytically); else blockwise cuts them as it runs, one tile at a time."""
    if run_mask is not None and not _cheap_to_classify(run_mask):
        return _Choice("blockwise", reasons, mask=run_mask)
    B, H, T, _ = call.query.shape
    S = call.key.shape[2]
    blocks = resolve_blocks(run_mask, call.block_q, call.block_k)
    tiles = plan_tiles(run_mask, B, H, T, S, *blocks, call.query.device, keep_masks=True)
    return _Choice("blockwise", reasons, tiles=tiles, mask=run_mask)


def _cheap_to_classify(mask: StructuredMask) -> bool:
    """Whether every part answers a tile analytically (``Causal`` is a ``SlidingWindow``)."""
    return all(isinstance(p, SlidingWindow | Padding | Documents) for p in parts_of(mask))


def _has_window(mask: StructuredMask | None) -> bool:
    """Whether a mask has a :class:`SlidingWindow` part with a window (not plain causal)."""
    return any(isinstance(p, SlidingWindow) and p.window is not None for p in parts_of(mask))


def _per_batch(mask: object) -> bool:
    return any(isinstance(p, Padding | Documents | MaskMod | Dense) for p in parts_of(mask))
