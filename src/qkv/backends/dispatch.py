"""Which backend runs a call, and why, in words.

``auto`` is decided per call from facts about it, never by trying a backend and falling back:

1. weights requested: **reference**, the only backend that returns them; a call needing a
   gradient on CPU (eager, no dropout) of at least
   :data:`~qkv.backends.fused.EXACT_GRAD_BLOCKWISE_MIN_PAIRS` pairs where fused would take its
   exact, score-recomputing backward, and no reduction of step 2 applies: **blockwise**, whose
   tiled backward is exact and faster (the pieces of a reduction make the same choice each);
2. a structured mask made of ``Causal`` / ``Padding`` / ``Documents`` parts (or ``is_causal``
   with ``T != S``) that :func:`~qkv.backends.reductions.reduce_mask` cuts exactly into a few
   plain SDPA calls (``is_causal`` kernel, truncated keys, one call per document): **fused**,
   on those calls, with no ``[T, S]`` mask (also when ``backend="fused"`` is asked for). With a
   ``SlidingWindow`` part too, when no gradient is needed: the band reduction, one SDPA call
   per block of queries over its band of keys, where the band is a small share of the grid
   (forward measured faster than blockwise, than SDPA over the dense mask, and than compiled
   flex_attention too: 0.69-0.78x flex for a 256 window at 1k-8k, so it comes before step 3;
   with a backward the per-call overhead and the exact backward's recomputation lose to
   blockwise, so training keeps step 4);
3. only inside :func:`~qkv.backends.flex.allow_compile` (never otherwise: it compiles), a
   structured mask left by step 2 on a grid of at least :data:`BLOCKWISE_MIN_PAIRS`, when the
   call has no ``attn_bias`` or dropout and needs no gradient on CPU: **flex**, compiled
   ``flex_attention``, which skips masked blocks inside one kernel;
4. otherwise, a structured mask (or ``is_causal`` with ``T != S``) on a grid of at least
   :data:`BLOCKWISE_MIN_PAIRS` query-key pairs, where at least :data:`BLOCKWISE_MIN_SKIP` of the
   tiles are fully masked (a ``mask_mod`` or tensor part is assumed sparse: telling would cost a
   pass over the whole grid), or whose materialized mask would exceed
   :data:`MATERIALIZE_LIMIT_BYTES`: **blockwise**;
5. everything else: **fused** (structured masks are then materialized in their broadcast shape).

A backend asked for by name is used as asked; if it cannot serve the call (weights from fused
or blockwise) :func:`choose_backend` raises instead of switching.

When the choice is blockwise, the :class:`BackendChoice` carries the structured mask blockwise
runs (:func:`blockwise_mask`) and, where choosing it already classified that mask's tiles, the
:class:`~qkv.backends.blockwise.TilePlan`, so no call plans its tiles twice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from qkv.backends.blockwise import TilePlan, plan_tiles, resolve_blocks
from qkv.backends.flex import compile_allowed, compile_seconds
from qkv.backends.fused import sdpa_backward_allowed, uses_sdpa_is_causal
from qkv.backends.reductions import Reduction, reduce_mask
from qkv.backends.reference import compute_dtype
from qkv.masks import StructuredMask
from qkv.masks.rules import AnyOf, Causal, Dense, Documents, MaskMod, Padding, SlidingWindow

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
    "blockwise_mask",
    "choose_backend",
    "dense_tile_skip",
    "padding_of_tensor",
]


@dataclass(frozen=True)
class BackendChoice:
    """The backend that runs a call and the sentence that says why.

    Attributes:
        backend: ``"reference"``, ``"fused"`` or ``"blockwise"``.
        why: the sentence, or what makes it when asked (see :attr:`reason`).
        mask: for blockwise, the structured mask it runs (see :func:`blockwise_mask`).
        plan: for blockwise, the tile plan of ``mask`` made while choosing, or None.
        reduction: for fused, the SDPA calls the mask was reduced to (see
            :mod:`qkv.backends.reductions`), or None: the mask is materialized.
    """

    backend: str
    why: str | Callable[[], str] = field(compare=False)
    mask: StructuredMask | None = field(default=None, compare=False)
    plan: TilePlan | None = field(default=None, compare=False)
    reduction: Reduction | None = field(default=None, compare=False)

    @property
    def reason(self) -> str:
        """The sentence that says why (made only here: models choose in every layer)."""
        return self.why if isinstance(self.why, str) else self.why()


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
        dense = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))  # [B|1, H|1, T|1, S]
        structured = Dense(dense)
    else:
        structured = mask
    if is_causal:
        structured = Causal() if structured is None else Causal() | structured
    return structured


def _cheap_to_classify(mask: StructuredMask) -> bool:
    parts = mask.parts if isinstance(mask, AnyOf) else (mask,)
    return all(isinstance(p, SlidingWindow | Padding | Documents) for p in parts)


def _mb(n_bytes: float) -> str:
    return f"{n_bytes / 2**20:.1f} MB"


def _upcast_note(dtype: torch.dtype) -> str:
    return (
        f"{dtype} is upcast to float32 before SDPA"
        if dtype in (torch.float16, torch.bfloat16)
        else ""
    )


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
    if _upcast_note(dtype):
        notes.append(_upcast_note(dtype))
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
    block_q: int | None = None,
    block_k: int | None = None,
    flex_blocker: str | None = None,
    needs_grad: bool = False,
    blockwise_trains: bool = False,
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
        block_q: the call's blockwise tile height, or None for the default.
        block_k: the call's blockwise tile width, or None for the default.
        flex_blocker: why the flex backend cannot run this call
            (:func:`~qkv.backends.flex.flex_refusal`), or None when it can.
        needs_grad: the call computes a gradient (then a sliding window is not cut into bands).
        blockwise_trains: the whole call would train faster on blockwise than through fused's
            exact CPU backward (:func:`~qkv.backends.fused.blockwise_trains_faster`).

    Returns:
        The backend, a sentence explaining the choice, and for blockwise or flex its mask and
        for blockwise its plan.

    Raises:
        ValueError: weights requested from a backend that cannot return them, or flex asked
            for a call it cannot run.
    """
    B, H, T, _ = query.shape
    S = key.shape[2]
    structured = isinstance(mask, StructuredMask)
    notes = _fused_notes(query.dtype, mask is not None, structured, is_causal, T, S)
    grad_note = (
        "the gradient comes from SDPA's own CPU backward (qkv.allow_sdpa_backward: faster, "
        "less exact)"
        if needs_grad and query.device.type == "cpu" and sdpa_backward_allowed()
        else ""
    )
    if grad_note:
        notes += f"; {grad_note}"
    if requested in ("fused", "blockwise", "flex") and need_weights:
        raise ValueError(
            f"backend={requested!r} cannot return weights (need_weights=True); "
            "use backend='reference' or 'auto'"
        )
    if requested == "reference":
        return BackendChoice("reference", "backend='reference' was requested")
    run_mask = blockwise_mask(mask, is_causal)
    if requested == "blockwise":
        return BackendChoice("blockwise", "backend='blockwise' was requested", run_mask)
    if requested == "flex":
        if flex_blocker is not None:
            raise ValueError(f"backend='flex' cannot run this call: {flex_blocker}")
        return BackendChoice(
            "flex", lambda: f"backend='flex' was requested; {_compile_note(query, key)}", run_mask
        )
    if need_weights:
        return BackendChoice(
            "reference", "need_weights=True and only the reference backend returns weights"
        )
    pairs = T * S
    flex_first = compile_allowed() and flex_blocker is None and pairs >= BLOCKWISE_MIN_PAIRS
    band = not needs_grad
    red = _reduction(mask, run_mask, B, H, T, S, strict=requested == "auto", band=band)
    if requested == "auto" and red is None and blockwise_trains:
        return BackendChoice(
            "blockwise",
            "the call needs a gradient on CPU, where fused replaces SDPA's imprecise float32 "
            "backward by recomputing the [B, H, T, S] scores; blockwise's tiled backward is "
            "exact too and was measured 1.3-3x faster at these sizes",
            run_mask,
        )
    if red is not None:
        asked = "backend='fused' was requested; " if requested == "fused" else ""
        upcast = _upcast_note(query.dtype)
        read = "the [B, 1, 1, S] mask tensor is key padding: " if isinstance(mask, Tensor) else ""
        tail = "".join(f"; {note}" for note in (upcast, grad_note) if note)
        return BackendChoice("fused", lambda: f"{asked}{read}{red.summary}{tail}", reduction=red)
    if requested == "fused":
        return BackendChoice("fused", f"backend='fused' was requested; {notes}")
    sparse_kind = structured or (is_causal and T != S)
    if not sparse_kind:
        return _dense_choice(mask, run_mask, attn_bias, is_causal, T, S, block_q, block_k, notes)
    if flex_first:
        return BackendChoice(
            "flex",
            lambda: (
                f"compilation is allowed (qkv.backends.flex.allow_compile) and no plain SDPA "
                f"call covers {run_mask!r}: flex_attention skips its masked blocks in one compiled "
                f"kernel; {_compile_note(query, key)}"
            ),
            run_mask,
        )
    return _tile_choice(query, mask, run_mask, (B, H, T, S), block_q, block_k, needs_grad, notes)


def _dense_choice(
    mask: Tensor | StructuredMask | None,
    run_mask: StructuredMask | None,
    attn_bias: Tensor | None,
    is_causal: bool,
    T: int,
    S: int,
    block_q: int | None,
    block_k: int | None,
    notes: str,
) -> BackendChoice:
    """Step 5 for a call with no structured mask: a block-sparse mask tensor goes blockwise
    (its tiles classified in one pass), everything else to SDPA."""
    if isinstance(mask, Tensor) and T * S >= BLOCKWISE_MIN_PAIRS:
        bq, bk = resolve_blocks(None, block_q, block_k)
        skipped = dense_tile_skip(mask, bq, bk)
        if skipped is not None and skipped >= BLOCKWISE_MIN_SKIP:
            return BackendChoice(
                "blockwise",
                f"the mask tensor has {skipped:.0%} of its {bq}x{bk} tiles fully masked "
                "(classified in one pass over it), and blockwise skips them",
                run_mask,
            )
    if isinstance(mask, Tensor):
        why = "an explicit mask tensor goes to SDPA as it is"
    elif uses_sdpa_is_causal(T, S, mask, attn_bias, is_causal):
        why = "is_causal with T == S: SDPA's own causal kernel skips the upper triangle"
    else:
        why = "no structured mask"
    return BackendChoice("fused", f"{why}; {notes}")


def _tile_choice(
    query: Tensor,
    mask: Tensor | StructuredMask | None,
    run_mask: StructuredMask | None,
    grid: tuple[int, int, int, int],
    block_q: int | None,
    block_k: int | None,
    needs_grad: bool,
    notes: str,
) -> BackendChoice:
    """Steps 4-5 for a structured mask no reduction or flex took: blockwise where it skips
    enough tiles or the materialized mask would be too large, else SDPA over the dense mask."""
    B, H, T, S = grid
    pairs = T * S
    # Why a sliding window was not cut into bands, when that is the reason.
    no_band = (
        "; the sliding window is cut into band SDPA calls only when no gradient is needed "
        "(fwd+bwd through the bands was measured slower)"
        if needs_grad and _has_window(run_mask)
        else ""
    )
    mat_bytes = 5 * pairs * (B if _per_batch(mask) else 1)
    if mat_bytes > MATERIALIZE_LIMIT_BYTES:
        return BackendChoice(
            "blockwise",
            f"materializing the mask for SDPA would take about {_mb(mat_bytes)} "
            f"(limit {_mb(MATERIALIZE_LIMIT_BYTES)}); blockwise never builds it{no_band}",
            run_mask,
        )
    if pairs < BLOCKWISE_MIN_PAIRS:
        return BackendChoice(
            "fused",
            f"T * S = {pairs} < {BLOCKWISE_MIN_PAIRS} pairs is too small for blockwise's tile "
            f"loop to pay off; {notes}",
        )
    # A tensor mask with is_causal and T != S is classified by its causal part alone (the
    # tensor is assumed dense); then the plan is not the run mask's and blockwise makes its own.
    sm = run_mask if isinstance(mask, StructuredMask) or mask is None else Causal()
    assert sm is not None
    if not _cheap_to_classify(sm):
        return BackendChoice(
            "blockwise",
            f"{sm!r} has a mask_mod or tensor part, assumed sparse (classifying it would cost a "
            "pass over the grid); blockwise evaluates it one tile at a time",
            run_mask,
        )
    blocks = resolve_blocks(sm, block_q, block_k)
    plan = plan_tiles(sm, B, H, T, S, *blocks, query.device, keep_masks=sm is run_mask)
    skipped = 1.0 - plan.computed / plan.total
    tiles = f"{plan.total - plan.computed} of {plan.total} tiles ({skipped:.0%}) fully masked"
    if skipped >= BLOCKWISE_MIN_SKIP:
        return BackendChoice(
            "blockwise",
            f"{sm!r}: {tiles}, and blockwise skips them{no_band}",
            run_mask,
            plan if sm is run_mask else None,
        )
    return BackendChoice(
        "fused",
        f"{sm!r}: only {tiles} (< {BLOCKWISE_MIN_SKIP:.0%}), so SDPA over the dense mask is "
        f"faster; {notes}",
    )


def _compile_note(query: Tensor, key: Tensor) -> str:
    """The measured one-time compile cost of flex for this call's input signature."""
    T, S = query.shape[2], key.shape[2]
    sig = (str(query.device), compute_dtype(query.dtype), key.shape[1] != query.shape[1], T, S)
    seconds = compile_seconds().get(sig)
    if seconds is None:
        return "not compiled yet for these inputs: the first call compiles (its time is measured)"
    return f"its first call with these inputs took {seconds:.2f} s (compile included, measured)"


def _reduction(
    mask: Tensor | StructuredMask | None,
    run_mask: StructuredMask | None,
    B: int,
    H: int,
    T: int,
    S: int,
    *,
    strict: bool,
    band: bool,
) -> Reduction | None:
    """The exact SDPA reduction of a structured mask (or a causal call SDPA's flag cannot take
    as it is), if one exists and its own mask pieces stay within :data:`MATERIALIZE_LIMIT_BYTES`.

    ``strict`` (``auto``): on a grid blockwise would be considered for, also refuse one that
    leaves most pairs under a ``[T, S]``-shaped piece mask, where blockwise may skip more.
    ``band``: a sliding window may be cut into band calls.
    """
    if isinstance(mask, Tensor):
        padding = padding_of_tensor(mask, B)
        if padding is None:
            return None  # a tensor that is not key padding goes to SDPA as it is
        run_mask = padding if run_mask is None else _with_tensor_as(run_mask, padding)
    elif run_mask is None or (mask is None and T == S):
        return None  # is_causal with T == S goes to SDPA's own flag
    red = reduce_mask(run_mask, B, H, T, S, band=band)
    if red is None:
        return None
    masked = [(len(g.batch), p) for g in red.groups for p in g.pieces if p.kind == "masked"]
    if any(5 * n * p.pairs > MATERIALIZE_LIMIT_BYTES for n, p in masked):
        return None
    under_mask = sum(n * p.pairs for n, p in masked)
    if strict and T * S >= BLOCKWISE_MIN_PAIRS and _has_row_rules(run_mask):
        return None if 2 * under_mask > B * T * S else red
    return red


def dense_tile_skip(mask: Tensor, block_q: int, block_k: int) -> float | None:
    """The fraction of ``block_q x block_k`` tiles a bool mask tensor blocks entirely (for every
    sample and head): one vectorized pass over the mask, cheap next to the attention it saves.

    Args:
        mask: a validated 4-D bool mask, broadcastable to ``[B, H, T, S]``.
        block_q: query rows per tile.
        block_k: keys per tile.

    Returns:
        The fraction in ``[0, 1]``, or None while tracing or compiling (it reads the mask).
    """
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return None
    blocked = mask.all(dim=1).all(dim=0)  # [T|1, S]: blocked for every sample and head
    T, S = blocked.shape
    nq, nk = -(-T // block_q), -(-S // block_k)
    # Pad with True so a partial edge tile is judged on its real pairs only.
    grid = torch.nn.functional.pad(blocked, (0, nk * block_k - S, 0, nq * block_q - T), value=True)
    tiles = grid.reshape(nq, block_q, nk, block_k).all(dim=3).all(dim=1)  # [nq, nk]
    return float(tiles.float().mean())


def _with_tensor_as(run_mask: StructuredMask, padding: Padding) -> StructuredMask:
    """``run_mask`` (a :class:`Dense` tensor part, maybe ``| Causal``) with the tensor part
    replaced by the :class:`Padding` rule it is."""
    parts = run_mask.parts if isinstance(run_mask, AnyOf) else (run_mask,)
    rules = [padding if isinstance(p, Dense) else p for p in parts]
    out = rules[0]
    for r in rules[1:]:
        out = out | r
    return out


def padding_of_tensor(mask: Tensor, B: int) -> Padding | None:
    """A bool mask tensor of shape ``[B|1, 1, 1, S]`` (what models build from their padding) as
    the :class:`Padding` rule it is, so that the padding reductions see it; else None.

    Args:
        mask: a validated, 4-D bool mask tensor.
        B: the call's batch size.

    Returns:
        ``Padding(is_pad)`` with ``is_pad = mask[:, 0, 0, :]`` ``[B, S]``, or None.
    """
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] != 1:
        return None
    return Padding(mask[:, 0, 0, :].expand(B, mask.shape[3]))  # [B, S]


def _has_row_rules(mask: StructuredMask) -> bool:
    """Whether a mask's pieces may need ``[T, S]``-shaped masks (not only ``[B, 1, 1, S]``)."""
    parts = mask.parts if isinstance(mask, AnyOf) else (mask,)
    return any(not isinstance(p, Padding) for p in parts)


def _has_window(mask: StructuredMask | None) -> bool:
    """Whether a mask has a :class:`SlidingWindow` part with a window (not plain causal)."""
    parts = mask.parts if isinstance(mask, AnyOf) else (mask,)
    return any(isinstance(p, SlidingWindow) and p.window is not None for p in parts)


def _per_batch(mask: object) -> bool:
    parts = mask.parts if isinstance(mask, AnyOf) else (mask,)
    return any(isinstance(p, Padding | Documents | MaskMod | Dense) for p in parts)
