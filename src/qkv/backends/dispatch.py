"""Which backend runs a call, and why, in words.

``auto`` is decided per call from facts about it, never by trying a backend and falling back:

1. weights requested: **reference**, the only backend that returns them;
2. a structured mask (or ``is_causal`` with ``T != S``) on a grid of at least
   :data:`BLOCKWISE_MIN_PAIRS` query-key pairs, where at least :data:`BLOCKWISE_MIN_SKIP` of the
   tiles are fully masked (a ``mask_mod`` or tensor part is assumed sparse: telling would cost a
   pass over the whole grid), or whose materialized mask would exceed
   :data:`MATERIALIZE_LIMIT_BYTES`: **blockwise**;
3. everything else: **fused** (structured masks are then materialized).

A backend asked for by name is used as asked; if it cannot serve the call (weights from fused
or blockwise) :func:`choose_backend` raises instead of switching.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from qkv.backends.blockwise import default_blocks, plan_tiles
from qkv.backends.fused import uses_sdpa_is_causal
from qkv.masks import (
    Causal,
    Dense,
    Documents,
    MaskMod,
    Padding,
    SlidingWindow,
    StructuredMask,
    Union,
)

BLOCKWISE_MIN_PAIRS = 1024 * 1024
"""Below this many query-key pairs blockwise's Python tile loop costs more than it skips."""
BLOCKWISE_MIN_SKIP = 0.25
"""Fraction of fully masked tiles from which skipping them beats SDPA over the dense mask."""
MATERIALIZE_LIMIT_BYTES = 256 * 2**20
"""A bool ``[T, S]`` mask (plus SDPA's float copy, 5 bytes a pair) above this goes blockwise."""

__all__ = [
    "BLOCKWISE_MIN_PAIRS",
    "BLOCKWISE_MIN_SKIP",
    "MATERIALIZE_LIMIT_BYTES",
    "BackendChoice",
    "choose_backend",
]


@dataclass(frozen=True)
class BackendChoice:
    """The backend that runs a call and the sentence that says why."""

    backend: str
    reason: str


def _cheap_to_classify(mask: StructuredMask) -> bool:
    parts = mask.parts if isinstance(mask, Union) else (mask,)
    return all(isinstance(p, SlidingWindow | Padding | Documents) for p in parts)


def _mb(n_bytes: float) -> str:
    return f"{n_bytes / 2**20:.1f} MB"


def _fused_notes(
    dtype: torch.dtype, masked: bool, structured: bool, is_causal: bool, T: int, S: int
) -> str:
    notes = []
    if structured:
        notes.append(
            "SDPA takes no structured masks, so the mask is materialized as a [T, S] tensor"
        )
    if is_causal and T != S:
        notes.append(
            f"SDPA's is_causal is top-left aligned and T={T} != S={S}, so the bottom-right "
            "causal mask is materialized"
        )
    if dtype in (torch.float16, torch.bfloat16):
        notes.append(f"{dtype} is upcast to float32 before SDPA")
    if masked or is_causal:
        notes.append("rows with every key blocked are unblocked for SDPA and their output set to 0")
    return "; ".join(notes) if notes else "SDPA runs it unchanged"


def choose_backend(
    requested: str,
    query: Tensor,
    key: Tensor,
    *,
    mask: Tensor | StructuredMask | None,
    attn_bias: Tensor | None,
    is_causal: bool,
    need_weights: bool,
) -> BackendChoice:
    """Decide the backend of one (already validated) :func:`qkv.attention` call.

    Args:
        requested: ``"auto"``, ``"reference"``, ``"fused"`` or ``"blockwise"``.
        query: ``[B, H, T, Dh]``.
        key: ``[B, Hkv, S, Dh]``.
        mask: the call's mask (bool tensor or structured), or None.
        attn_bias: the call's attn_bias, or None.
        is_causal: the call's ``is_causal``.
        need_weights: the call's ``need_weights``.

    Returns:
        The backend and a sentence explaining the choice.

    Raises:
        ValueError: weights requested from a backend that cannot return them.
    """
    B, H, T, _ = query.shape
    S = key.shape[2]
    structured = isinstance(mask, StructuredMask)
    notes = _fused_notes(query.dtype, mask is not None, structured, is_causal, T, S)
    if requested in ("fused", "blockwise") and need_weights:
        raise ValueError(
            f"backend={requested!r} cannot return weights (need_weights=True); "
            "use backend='reference' or 'auto'"
        )
    if requested == "reference":
        return BackendChoice("reference", "backend='reference' was requested")
    if requested == "fused":
        return BackendChoice("fused", f"backend='fused' was requested; {notes}")
    if requested == "blockwise":
        return BackendChoice("blockwise", "backend='blockwise' was requested")
    if need_weights:
        return BackendChoice(
            "reference", "need_weights=True and only the reference backend returns weights"
        )
    sparse_kind = structured or (is_causal and T != S)
    if not sparse_kind:
        if isinstance(mask, Tensor):
            why = "an explicit mask tensor goes to SDPA as it is"
        elif uses_sdpa_is_causal(T, S, mask, attn_bias, is_causal):
            why = "is_causal with T == S: SDPA's own causal kernel skips the upper triangle"
        else:
            why = "no structured mask"
        return BackendChoice("fused", f"{why}; {notes}")
    pairs = T * S
    mat_bytes = 5 * pairs * (B if _per_batch(mask) else 1)
    if mat_bytes > MATERIALIZE_LIMIT_BYTES:
        return BackendChoice(
            "blockwise",
            f"materializing the mask for SDPA would take about {_mb(mat_bytes)} "
            f"(limit {_mb(MATERIALIZE_LIMIT_BYTES)}); blockwise never builds it",
        )
    if pairs < BLOCKWISE_MIN_PAIRS:
        return BackendChoice(
            "fused",
            f"T * S = {pairs} < {BLOCKWISE_MIN_PAIRS} pairs is too small for blockwise's tile "
            f"loop to pay off; {notes}",
        )
    sm: StructuredMask = mask if isinstance(mask, StructuredMask) else Causal()
    if isinstance(mask, StructuredMask) and is_causal:
        sm = Causal() | mask
    if not _cheap_to_classify(sm):
        return BackendChoice(
            "blockwise",
            f"{sm!r} has a mask_mod or tensor part, assumed sparse (classifying it would cost a "
            "pass over the grid); blockwise evaluates it one tile at a time",
        )
    plan = plan_tiles(sm, B, H, T, S, *default_blocks(sm), query.device)
    skipped = 1.0 - plan.computed / plan.total
    tiles = f"{plan.total - plan.computed} of {plan.total} tiles ({skipped:.0%}) fully masked"
    if skipped >= BLOCKWISE_MIN_SKIP:
        return BackendChoice("blockwise", f"{sm!r}: {tiles}, and blockwise skips them")
    return BackendChoice(
        "fused",
        f"{sm!r}: only {tiles} (< {BLOCKWISE_MIN_SKIP:.0%}), so SDPA over the dense mask is "
        f"faster; {notes}",
    )


def _per_batch(mask: object) -> bool:
    parts = mask.parts if isinstance(mask, Union) else (mask,)
    return any(isinstance(p, Padding | Documents | MaskMod | Dense) for p in parts)
