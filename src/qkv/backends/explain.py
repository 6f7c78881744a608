"""A plan's reasons in words: what :func:`qkv.explain_backend` prints.

The planner decides with records (:class:`~qkv.backends.plan.Reason`); the sentences are made
here, only when asked, from those records and the plan's pieces. Tests assert on the records.
"""

from __future__ import annotations

from collections.abc import Callable

from qkv.backends.flex import compile_seconds
from qkv.backends.pieces import Reduction
from qkv.backends.plan import Plan, Reason
from qkv.backends.reference import compute_dtype

__all__ = ["explain", "reduction_summary"]


def _mb(n_bytes: float | None) -> str:
    return f"{(n_bytes or 0) / 2**20:.1f} MB"


def _tiles(r: Reason) -> str:
    skipped, total = r.facts["skipped"], r.facts["total"]
    return f"{skipped} of {total} tiles ({r.value or 0:.0%}) fully masked"


def _requested(r: Reason, plan: Plan) -> str:
    return f"backend='{r.facts['backend']}' was requested"


def _reduced(r: Reason, plan: Plan) -> str:
    assert plan.pieces is not None
    read = "the [B, 1, 1, S] mask tensor is key padding: " if r.facts.get("from_tensor") else ""
    return read + reduction_summary(plan.pieces)


def _compile_cost(r: Reason, plan: Plan) -> str:
    sig = r.facts["signature"]
    assert isinstance(sig, tuple)
    T, S, gqa, device, dtype = sig
    seconds = compile_seconds().get((device, compute_dtype(dtype), gqa, T, S))
    if seconds is None:
        return "not compiled yet for these inputs: the first call compiles (its time is measured)"
    return f"its first call with these inputs took {seconds:.2f} s (compile included, measured)"


_SENTENCES: dict[str, Callable[[Reason, Plan], str]] = {
    "requested": _requested,
    "need-weights": lambda r, p: "need_weights=True and only the reference backend returns weights",
    "exact-gradient": lambda r, p: (
        "the call needs a gradient on CPU, where fused replaces SDPA's imprecise float32 "
        "backward by recomputing the [B, H, T, S] scores; blockwise's tiled backward is "
        "exact too and was measured 1.3-3x faster at these sizes"
    ),
    "reduced": _reduced,
    "compile-allowed": lambda r, p: (
        "compilation is allowed (qkv.allow_compile) and no plain SDPA call covers "
        f"{r.facts['mask']!r}: flex_attention skips its masked blocks in one compiled kernel"
    ),
    "compile-cost": _compile_cost,
    "tensor-tiles-skipped": lambda r, p: (
        f"the mask tensor has {r.value or 0:.0%} of its {r.facts['blocks'][0]}x"  # type: ignore[index]
        f"{r.facts['blocks'][1]} tiles fully masked (classified in one pass over it), and "  # type: ignore[index]
        "blockwise skips them"
    ),
    "tensor-mask": lambda r, p: "an explicit mask tensor goes to SDPA as it is",
    "sdpa-is-causal": lambda r, p: (
        "is_causal with T == S: SDPA's own causal kernel skips the upper triangle"
    ),
    "no-structured-mask": lambda r, p: "no structured mask",
    "mask-too-large": lambda r, p: (
        f"materializing the mask for SDPA would take about {_mb(r.value)} "
        f"(limit {_mb(r.threshold)}); blockwise never builds it"
    ),
    "too-small": lambda r, p: (
        f"T * S = {r.value} < {r.threshold} pairs is too small for blockwise's tile loop to pay off"
    ),
    "assumed-sparse": lambda r, p: (
        f"{r.facts['mask']!r} has a mask_mod or tensor part, assumed sparse (classifying it "
        "would cost a pass over the grid); blockwise evaluates it one tile at a time"
    ),
    "tiles-skipped": lambda r, p: f"{r.facts['mask']!r}: {_tiles(r)}, and blockwise skips them",
    "few-tiles-skipped": lambda r, p: (
        f"{r.facts['mask']!r}: only {_tiles(r)} (< {r.threshold or 0:.0%}), so SDPA over the "
        "dense mask is faster"
    ),
    "no-band-with-gradient": lambda r, p: (
        "the sliding window is cut into band SDPA calls only when no gradient is needed "
        "(fwd+bwd through the bands was measured slower)"
    ),
    "mask-materialized": lambda r, p: (
        "SDPA takes no structured masks, so the mask is materialized as a [T, S] tensor"
    ),
    "causal-materialized": lambda r, p: (
        f"SDPA's is_causal is top-left aligned and T={r.facts['T']} != S={r.facts['S']}, so "
        "the bottom-right causal mask is materialized"
    ),
    "upcast": lambda r, p: f"{r.facts['dtype']} is upcast to float32 before SDPA",
    "dead-rows-zeroed": lambda r, p: (
        "rows with every key blocked are unblocked for SDPA and their output set to 0"
    ),
    "sdpa-backward": lambda r, p: (
        "the gradient comes from SDPA's own CPU backward (qkv.allow_sdpa_backward: faster, "
        "less exact)"
    ),
}


def explain(plan: Plan) -> str:
    """``"<backend>: <why>; <how>"``: the plan's reasons as sentences, joined by ``"; "``.

    Args:
        plan: a plan from :func:`qkv.plan`.

    Returns:
        e.g. ``"blockwise: Causal(align='bottom_right'): 28 of 64 tiles (44%) fully masked,
        and blockwise skips them"``.
    """
    sentences = [_SENTENCES[r.rule](r, plan) for r in plan.reasons]
    if plan.backend == "fused" and plan.pieces is None and len(plan.reasons) == 1:
        sentences.append("SDPA runs it unchanged")  # nothing cut, materialized, or upcast
    return f"{plan.backend}: {'; '.join(sentences)}"


def reduction_summary(red: Reduction) -> str:
    """What a reduction cut, in one sentence (see :mod:`qkv.backends.pieces`)."""
    B, _, T, S = red.grid
    every = [p for g in red.groups for p in g.pieces]
    facts = []
    if any(p.kind == "causal" for p in every):
        facts.append("the causal part runs as SDPA's is_causal kernel")
    if red.longest is not None:
        facts.append(f"keys cut to the live length (longest {red.longest} of S={S})")
        if len(red.groups) > 1 and not red.documents:
            facts.append(f"samples grouped by length ({len(red.groups)} groups)")
    if red.documents:
        facts.append("one SDPA call per document")
    if red.band:
        band = [p for p in every if p.kind != "dead"]
        widths = sorted({p.k1 - p.k0 for p in band})
        keys = f"{widths[0]}" if len(widths) == 1 else f"{widths[0]}-{widths[-1]}"
        facts.append(
            f"sliding window → {len(band)} band SDPA call(s) of up to {red.band_block} query "
            f"rows over {keys} keys each"
        )
    masked = [p for p in every if p.kind == "masked"]
    if masked:
        big = max(masked, key=lambda p: p.pairs)
        facts.append(
            f"{len(masked)} piece(s) keep the rule's own mask, at most "
            f"[{big.q1 - big.q0}, {big.k1 - big.k0}]"
        )
    dead = sum(
        len(g.batch) * (p.q1 - p.q0) for g in red.groups for p in g.pieces if p.kind == "dead"
    )
    if dead:
        facts.append(f"{dead} query row(s) with no key left are set to 0")
    share = red.pairs / (B * T * S)
    return (
        f"{red.mask!r} reduced exactly to {red.calls} SDPA call(s) on {share:.0%} of the "
        f"query-key pairs: {'; '.join(facts)}"
    )
