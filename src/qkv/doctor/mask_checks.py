"""The checks of one attention call that read its mask alone: a float mask's kind (0/1 keep
mask passed as additive, NaN / +inf values), an inverted polarity, query rows with every key
blocked, a top-left causal alignment over cached keys, a ``[B, S]`` mask read as ``[T, S]``, and
the speed hints (a dense mask that is exactly causal, or a padding mask). Each appends its
:class:`~qkv.doctor.verdict.Verdict` to ``out``.

Shapes: B batch, H query heads, T queries, S keys.
"""

from __future__ import annotations

import torch
from torch import Tensor

from qkv.doctor.calls import AttentionCall
from qkv.doctor.verdict import Padding, Verdict, last_real_query
from qkv.masks import causal_mask

__all__ = [
    "check_2d_broadcast",
    "check_blocked_rows",
    "check_causal",
    "check_float_mask",
    "check_hints",
    "check_inverted",
    "effective_blocked",
]


def _float_mask_kind(additive: Tensor) -> tuple[str, float]:
    """("mask", m) for a {0, m} mask, ("keep01", 1) for a 0/1 mask, else ("bias", min)."""
    lo, hi = float(additive.min()), float(additive.max())
    if lo == 0.0 and hi == 1.0 and bool(((additive == 0) | (additive == 1)).all()):
        return "keep01", 1.0
    if hi == 0.0 and lo < 0.0 and bool(((additive == 0) | (additive == lo)).all()):
        return "mask", lo
    return "bias", lo


def effective_blocked(
    call: AttentionCall, float_kind: str, block_value: float, pad: Padding | None
) -> Tensor | None:
    """Everything the call blocks or means to block, bool 4-D, True = blocked.

    A causal flag alone is left out where it changes no verdict (it blocks no whole row and no
    padding is known), so a long causal call costs no ``[T, S]`` mask.
    """
    T, S = call.query.shape[2], call.key.shape[2]
    causal_matters = (
        call.blocked is not None
        or call.additive is not None
        or (pad is not None and bool((~pad.live_keys).any()))
        or (call.causal == "bottom_right" and T > S)
    )
    parts: list[Tensor] = []
    hard = call.hard_blocked() if causal_matters else call.blocked
    if hard is not None:
        parts.append(hard)
    if call.additive is not None:
        a = call.additive
        if float_kind == "mask":
            parts.append(a == block_value)
        elif float_kind == "bias":
            parts.append((a == float("-inf")) | (a <= torch.finfo(a.dtype).min / 2))
    if not parts:
        return None
    out = parts[0]
    for p in parts[1:]:
        out = out | p
    return out


def _is_top_left_causal(blocked: Tensor, T: int, S: int) -> bool:
    tl = torch.ones(T, S, dtype=torch.bool, device=blocked.device).triu(1)  # [T, S]
    return bool((blocked == tl).all())


def _empty_slots(key: Tensor, start: int) -> bool:
    """Keys ``start..S-1`` are all exactly zero: unfilled slots of a preallocated cache."""
    return bool((key[:, :, start:] == 0).all())


def _prefix_or_suffix(keep: Tensor) -> Tensor:
    """Per row of ``[R, S]`` bool: True where the kept keys are one run touching an end."""
    S = keep.shape[-1]
    n = keep.sum(-1)  # [R]
    idx = torch.arange(S, device=keep.device)
    prefix = keep == (idx < n.unsqueeze(-1))  # [R, S]
    suffix = keep == (idx >= (S - n).unsqueeze(-1))  # [R, S]
    return prefix.all(-1) | suffix.all(-1)  # [R]


def check_float_mask(call: AttentionCall, out: list[Verdict]) -> tuple[str, float]:
    """NaN / +inf in an additive mask, or a 0/1 keep mask passed as one; its kind and block value
    (``("invalid", 0)`` after NaN / +inf, ``("none", 0)`` without an additive mask)."""
    a = call.additive
    if a is None:
        return "none", 0.0
    bad = torch.isnan(a) | (a == float("inf"))
    if bool(bad.any()):
        out.append(
            Verdict(
                "nonfinite_mask",
                "error",
                f"the additive mask ({a.dtype}) holds {int(torch.isnan(a).sum())} NaN and "
                f"{int((a == float('inf')).sum())} +inf values",
                {"mask_dtype": str(a.dtype), "mask_shape": list(a.shape)},
            )
        )
        return "invalid", 0.0
    kind, value = _float_mask_kind(a)
    if kind == "keep01":
        out.append(
            Verdict(
                "inverted_mask",
                "error",
                "a 0/1 keep mask was passed as an additive float mask: 1 is added to the kept "
                "scores and nothing is blocked (convert with qkv.masks.from_hf, then to_additive)",
                {"mask_dtype": str(a.dtype), "values": [0.0, 1.0]},
            )
        )
    return kind, value


def _rows_all_blocked(blocked: Tensor, B: int, H: int, T: int) -> Tensor:
    return blocked.all(-1).expand(B, H, T)  # [B, H, T]


def check_inverted(
    call: AttentionCall, blocked: Tensor, pad: Padding | None, out: list[Verdict]
) -> bool:
    """An inverted bool mask: it blocks exactly the real tokens, or every open row's diagonal;
    True when one was found."""
    B, _H, T, S = call.query.shape[0], call.query.shape[1], call.query.shape[2], call.key.shape[2]
    given = call.blocked
    if given is None:
        return False
    if pad is not None:
        live_k = pad.live_keys  # [B, S]
        has_pad = (~live_k).any(-1) & pad.live_queries.any(-1)  # [B]
        if bool(has_pad.any()):
            # the last real query sees every real key under any correct mask (causal too):
            # an inverted mask blocks exactly them there, and lets the padding through
            last = last_real_query(pad)  # [B]
            g = given.expand(B, given.shape[1], T, S)  # [B, H|1, T, S], a view
            row = g[torch.arange(B, device=g.device), :, last].any(1)  # [B, S] in some head
            sample_inv = (row == live_k).all(-1) & has_pad  # [B]
            if bool(sample_inv.any()):
                b = int(torch.nonzero(sample_inv)[0])
                out.append(
                    Verdict(
                        "inverted_mask",
                        "error",
                        f"the bool mask blocks exactly the real tokens of sample {b} and lets its "
                        f"padding through: inverted polarity ({call.reading_text})",
                        {"sample": b, "mask_shape": list(call.mask_shape or ())},
                    )
                )
                return True
    if T == S and T > 1:
        g = given.expand(B, given.shape[1], T, S)  # [B, H|1, T, S]
        diag = torch.diagonal(g, dim1=-2, dim2=-1)  # [B, H|1, T]
        if int(diag.sum(-1).max()) < 2:
            return False  # a correct mask keeps the diagonal of its real rows: nothing to see
        open_rows = ~g.all(-1)  # [B, H|1, T]
        if pad is not None:
            open_rows = open_rows & pad.live_queries.unsqueeze(1)
        n_open = open_rows.sum(-1)  # [B, H|1]
        # an inverted causal or right-padding mask leaves open only keys after the diagonal;
        # a strictly causal (off-by-one) mask leaves keys before it: not inverted
        before = torch.ones(T, S, dtype=torch.bool, device=g.device).tril(-1)  # [T, S]
        sees_past = (~g & before).any(-1)  # [B, H|1, T]
        inverted_rows = diag & ~sees_past  # [B, H|1, T]
        all_diag = ((inverted_rows | ~open_rows).all(-1)) & (n_open >= 2)  # [B, H|1]
        if bool(all_diag.any()):
            out.append(
                Verdict(
                    "inverted_mask",
                    "error" if pad is not None else "warning",
                    f"every open query row blocks its own position (the diagonal): the mask looks "
                    f"inverted ({call.reading_text})",
                    {"mask_shape": list(call.mask_shape or ()), "rows": int(n_open.max())},
                )
            )
            return True
    return False


def check_causal(call: AttentionCall, blocked_given: Tensor | None, out: list[Verdict]) -> None:
    """A causal mask aligned top-left over cached keys (T < S and the keys after T not empty)."""
    T, S = call.query.shape[2], call.key.shape[2]
    if not T < S:
        return
    top_left = call.causal == "top_left"
    if not top_left and blocked_given is not None and blocked_given.shape[-2] == T:
        top_left = T > 1 and _is_top_left_causal(blocked_given, T, S)
    if not top_left or _empty_slots(call.key, T):
        return
    how = "is_causal=True" if call.causal == "top_left" else "a top-left triangular mask"
    out.append(
        Verdict(
            "causal_misaligned",
            "error",
            f"{how} with T={T} queries and S={S} keys aligns top-left: query 0 sees key 0 only, "
            f"not the {S - T} cached keys before it",
            {"T": T, "S": S, "filled_keys": S},
        )
    )


def check_2d_broadcast(call: AttentionCall, pad: Padding | None, out: list[Verdict]) -> None:
    """A ``[B, S]`` padding mask read as ``[T, S]`` where B == T."""
    shape = call.mask_shape
    B, T, _S = call.query.shape[0], call.query.shape[2], call.key.shape[2]
    if shape is None or len(shape) != 2 or call.reading == "mha" or call.blocked is None:
        return
    if not (B == T == shape[0] and B > 1):
        return
    keep = ~call.blocked[0, 0]  # [T, S] as given
    if pad is not None:
        if bool((keep == pad.live_keys).all()) and bool((~pad.live_keys).any()):
            out.append(
                Verdict(
                    "mask_broadcast",
                    "error",
                    f"a [B, S] padding mask {list(shape)} was read as [T, S] (B == T == {B}): "
                    f"query i of every sample uses sample i's padding",
                    {"mask_shape": list(shape)},
                )
            )
        return
    diag_kept = bool(torch.diagonal(keep).all())
    rows_differ = bool((keep != keep[:1]).any())
    if rows_differ and not diag_kept and bool(_prefix_or_suffix(keep).all()):
        out.append(
            Verdict(
                "mask_broadcast",
                "warning",
                f"a 2-D mask {list(shape)} whose rows look like padding patterns was read as "
                f"[T, S] (B == T == {B}): if it is a [B, S] padding mask, samples mix",
                {"mask_shape": list(shape)},
            )
        )


def check_blocked_rows(
    call: AttentionCall,
    blocked: Tensor | None,
    pad: Padding | None,
    bad_rows: Tensor | None,
    out: list[Verdict],
    explained: bool = False,
) -> Tensor | None:
    """Query rows with every key blocked that return NaN, or that are real tokens; the ``[B, T]``
    rows fully blocked in some head (None when there are none)."""
    B, H, T = call.query.shape[0], call.query.shape[1], call.query.shape[2]
    if blocked is None:
        return None
    full = _rows_all_blocked(blocked, B, H, T).any(1)  # [B, T] some head fully blocked
    if not bool(full.any()):
        return None
    if bad_rows is not None and bool((bad_rows & full).any()):
        b, t = (int(i) for i in torch.nonzero(bad_rows & full)[0])
        out.append(
            Verdict(
                "all_blocked_rows",
                "error",
                f"{int((bad_rows & full).sum())} query rows with every key blocked return NaN "
                f"(first: sample {b}, query {t}) from {call.api}",
                {"rows": int((bad_rows & full).sum()), "sample": b, "query": t},
            )
        )
    if explained:  # another finding (an inverted mask) already says why rows are blocked
        return full
    if pad is not None and bool((full & pad.live_queries).any()):
        b, t = (int(i) for i in torch.nonzero(full & pad.live_queries)[0])
        out.append(
            Verdict(
                "all_blocked_rows",
                "error",
                f"{int((full & pad.live_queries).sum())} real (non-padding) queries have every key "
                f"blocked (first: sample {b}, query {t})",
                {"rows": int((full & pad.live_queries).sum()), "sample": b, "query": t},
            )
        )
    elif pad is None and T > 1:
        whole = full.all(-1)  # [B]
        if bool(whole.any()) and not bool(whole.all()) and call.blocked is not None:
            b = int(torch.nonzero(whole)[0])
            out.append(
                Verdict(
                    "all_blocked_rows",
                    "warning",
                    f"every query of sample {b} has every key blocked: an empty sequence, or an "
                    f"inverted padding mask ({call.reading_text})",
                    {"sample": b},
                )
            )
    return full


def check_hints(call: AttentionCall, out: list[Verdict]) -> None:
    """Speed hints: a dense mask that is exactly causal, or one whose query rows are all equal."""
    g = call.blocked
    T, S = call.query.shape[2], call.key.shape[2]
    if g is None or call.causal is not None or g.shape[-2] != T or T < 2:
        return
    if call.reading == "flex":  # a block mask already skips what it blocks
        return
    if bool((g == causal_mask(T, S, device=g.device)).all()):
        out.append(
            Verdict(
                "hint",
                "hint",
                f"a dense {list(call.mask_shape or ())} mask that is exactly causal: pass "
                f"is_causal=True (or qkv.Causal()) and let the kernel skip the blocked half",
                {"mask_shape": list(call.mask_shape or ())},
            )
        )
    elif g.shape[-1] == S and bool((g == g[..., :1, :]).all()) and bool(g.any()):
        out.append(
            Verdict(
                "hint",
                "hint",
                f"a dense {list(call.mask_shape or ())} mask whose query rows are all the same (a "
                f"padding mask): pass it as [B, 1, 1, S]",
                {"mask_shape": list(call.mask_shape or ())},
            )
        )
