"""Judging one attention call: which of the doctor's kinds it shows.

The judge reads an :class:`~qkv.doctor.calls.AttentionCall` (the mask as the API read it) and,
when the model's padding is known, which queries and keys are real tokens. Mask-only checks run
on the masks; weight checks recompute exact weights (:mod:`qkv.doctor.weights`) only for the
rows a mask leaves in doubt, so a clean call costs a few passes over its mask and one over its
output.

Shapes: B batch, H query heads, T queries, S keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from qkv.doctor.calls import AttentionCall
from qkv.doctor.findings import Severity
from qkv.doctor.weights import row_blocks, score_bound
from qkv.masks import causal_mask

__all__ = ["LEAK_WEIGHT", "Padding", "Verdict", "judge"]

LEAK_WEIGHT = 1e-3
"""A blocked or padding key with a larger weight than this is a finding (the issue's bound)."""


@dataclass(frozen=True)
class Padding:
    """Which queries and keys of one call are real tokens (from the model's attention mask).

    Attributes:
        live_queries: ``[B, T]`` bool, True = a real token.
        live_keys: ``[B, S]`` bool, True = a real token (keys past the model's mask, such as
            empty cache slots, are marked real: nothing is claimed about them).
    """

    live_queries: Tensor
    live_keys: Tensor


@dataclass(frozen=True)
class Verdict:
    """One finding of one call, before it is given a place."""

    kind: str
    severity: Severity
    message: str
    evidence: dict[str, Any]


def _float_mask_kind(additive: Tensor) -> tuple[str, float]:
    """("mask", m) for a {0, m} mask, ("keep01", 1) for a 0/1 mask, else ("bias", min)."""
    lo, hi = float(additive.min()), float(additive.max())
    if lo == 0.0 and hi == 1.0 and bool(((additive == 0) | (additive == 1)).all()):
        return "keep01", 1.0
    if hi == 0.0 and lo < 0.0 and bool(((additive == 0) | (additive == lo)).all()):
        return "mask", lo
    return "bias", lo


def _effective_blocked(
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


def _check_float_mask(call: AttentionCall, out: list[Verdict]) -> tuple[str, float]:
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


def _nonfinite_rows(call: AttentionCall) -> Tensor | None:
    """``[B, T]`` True where any head's output row holds NaN/inf, or None when all finite."""
    if call.output is None or not call.output.is_floating_point():
        return None
    if bool(torch.isfinite(call.output.sum())):  # NaN and inf survive a sum: one pass
        return None
    bad = ~torch.isfinite(call.output)
    if not bool(bad.any()):
        return None
    return bad.any(-1).any(1)  # [B, T]


def _where_nonfinite_came_from(call: AttentionCall) -> str:
    for name, t in (("query", call.query), ("key", call.key), ("value", call.value)):
        if not bool(torch.isfinite(t).all()):
            return f"the {name} already holds NaN/inf"
    bound = score_bound(call.query, call.key, call.scale)
    if bound > torch.finfo(torch.float32).max or (
        call.query.dtype in (torch.float16, torch.bfloat16)
        and bound > torch.finfo(call.query.dtype).max
    ):
        return f"scores overflow: |q·k|·scale reaches {bound:.3g}"
    return "not from the inputs, the mask or blocked rows: the kernel itself"


def _leak_rows(
    call: AttentionCall, blocked: Tensor | None, pad: Padding
) -> list[tuple[int, Tensor]]:
    """Samples whose live queries can reach a padding key through the mask: (b, rows [T])."""
    B, _H, _T, S = call.query.shape[0], call.query.shape[1], call.query.shape[2], call.key.shape[2]
    pad_keys = ~pad.live_keys  # [B, S]
    if not bool(pad_keys.any()):
        return []
    reach = pad_keys.view(B, 1, 1, S)  # [B, 1, 1, S]
    if blocked is not None:
        reach = reach & ~blocked  # [B, H|1, T, S]
    rows = reach.any(-1).any(1) & pad.live_queries  # [B, T]
    return [(b, rows[b]) for b in range(B) if bool(rows[b].any())]


def _leak_weight(
    call: AttentionCall, b: int, rows: Tensor, blocked: Tensor | None, keys: Tensor
) -> tuple[float, int]:
    """The largest weight a live row of sample ``b`` gives a key in ``keys`` [S], and its row."""
    worst, worst_row = 0.0, -1
    idx = torch.nonzero(rows).flatten()
    r_lo, r_hi = int(idx.min()), int(idx.max()) + 1
    for r0, r1 in row_blocks(r_hi - r_lo):
        w = call.weights(b, r_lo + r0, r_lo + r1, blocked=blocked)  # [H, rows, S]
        w = (w * keys).amax(-1).amax(0) * rows[r_lo + r0 : r_lo + r1]  # [rows]
        m, i = w.max(0)
        if float(m) > worst:
            worst, worst_row = float(m), r_lo + r0 + int(i)
    return worst, worst_row


def _leak_reason(call: AttentionCall, blocked: Tensor | None) -> str:
    if blocked is None and call.additive is None:
        return "no mask reached this call"
    return "the mask does not cover them"


def _last_real_query(pad: Padding) -> Tensor:
    """``[B]`` the index of each sample's last real query (0 for a sample with none)."""
    T = pad.live_queries.shape[1]
    idx = torch.arange(1, T + 1, device=pad.live_queries.device)
    return (pad.live_queries * idx).argmax(-1)  # [B]


def _check_mixing(call: AttentionCall, blocked: Tensor, pad: Padding, out: list[Verdict]) -> bool:
    """A real query blocked from real keys exactly where another sample has its padding.

    Asked only once a padding key leaked. The last real query of a sample sees every real key
    of it under a causal or padding mask; if, in some head, it is blocked from exactly another
    sample's padding instead, the mask was broadcast or laid out across the batch ([B, S] read
    as [T, S], [B, T, S] read as [H, T, S], a [B * H] mask built with repeat instead of
    repeat_interleave).
    """
    B, T, S = call.query.shape[0], call.query.shape[2], call.key.shape[2]
    pad_keys = ~pad.live_keys  # [B, S]
    has_pad = pad_keys.any(-1)  # [B]
    if int(has_pad.sum()) == 0:
        return False
    g = blocked.expand(B, blocked.shape[1], T, S)  # [B, Hm, T, S]
    last = _last_real_query(pad)  # [B]
    row = g[torch.arange(B, device=g.device), :, last]  # [B, Hm, S]
    blocks_real = (row & pad.live_keys.unsqueeze(1)).any(-1)  # [B, Hm]
    other = (row.unsqueeze(2) == pad_keys.view(1, 1, B, S)).all(-1)  # [B, Hm, B]
    other = (
        other & has_pad.view(1, 1, B) & ~torch.eye(B, dtype=torch.bool, device=g.device)[:, None]
    )
    hit = other.any(-1) & blocks_real & pad.live_queries.any(-1, keepdim=True)  # [B, Hm]
    if not bool(hit.any()):
        return False
    b, h = (int(i) for i in torch.nonzero(hit)[0])
    o = int(torch.nonzero(other[b, h])[0])
    out.append(
        Verdict(
            "mask_broadcast",
            "error",
            f"sample {b}'s query {int(last[b])} is masked with the padding of sample {o}"
            f"{f' in head {h}' if g.shape[1] > 1 else ''}: the mask {list(call.mask_shape or ())} "
            f"mixes samples",
            {"sample": b, "query": int(last[b]), "mask_of_sample": o, "head": h},
        )
    )
    return True


def _check_padding(
    call: AttentionCall, blocked: Tensor | None, pad: Padding, out: list[Verdict]
) -> None:
    B, S = call.query.shape[0], call.key.shape[2]
    pad_keys = ~pad.live_keys  # [B, S]
    for b, rows in _leak_rows(call, blocked, pad):
        if not call.exact:
            continue
        worst, row = _leak_weight(call, b, rows, blocked, pad_keys[b].to(call.query.dtype))
        if worst <= LEAK_WEIGHT:
            continue
        # the keys this sample's live rows may not see: another sample's padding?
        seen_blocked = torch.zeros(S, dtype=torch.bool, device=pad_keys.device)
        if blocked is not None:
            sb = blocked[b if blocked.shape[0] > 1 else 0]  # [H|1, T|1, S]
            r = rows if sb.shape[1] > 1 else rows[:1]
            seen_blocked = sb[:, r].all(0).all(0)  # [S]
        others = [
            o
            for o in range(B)
            if o != b and bool(pad_keys[o].any()) and bool((seen_blocked == pad_keys[o]).all())
        ]
        evidence = {
            "sample": b,
            "query": row,
            "weight": worst,
            "padding_keys": int(pad_keys[b].sum()),
            "keys": S,
        }
        if others:
            out.append(
                Verdict(
                    "mask_broadcast",
                    "error",
                    f"sample {b} is masked with the padding of sample {others[0]}: its query {row} "
                    f"gives weight {worst:.3g} to its own padding (mask shape "
                    f"{list(call.mask_shape or ())})",
                    evidence | {"mask_of_sample": others[0]},
                )
            )
        else:
            out.append(
                Verdict(
                    "padding_leak",
                    "error",
                    f"query {row} of sample {b} gives weight {worst:.3g} to padding keys "
                    f"({_leak_reason(call, blocked)})",
                    evidence,
                )
            )


def _check_inverted(
    call: AttentionCall, blocked: Tensor, pad: Padding | None, out: list[Verdict]
) -> bool:
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
            last = _last_real_query(pad)  # [B]
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


def _check_causal(call: AttentionCall, blocked_given: Tensor | None, out: list[Verdict]) -> None:
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


def _check_2d_broadcast(call: AttentionCall, pad: Padding | None, out: list[Verdict]) -> None:
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


def _check_weak(call: AttentionCall, block_value: float, out: list[Verdict]) -> None:
    a = call.additive
    if a is None or math.isinf(block_value) or not call.exact:
        return
    spread = 2 * score_bound(call.query, call.key, call.scale)
    if call.bias is not None:
        spread += 2 * float(call.bias.abs().max())
    if block_value + spread < math.log(LEAK_WEIGHT):
        return  # no score can lift a blocked key to the threshold
    B, T = call.query.shape[0], call.query.shape[2]
    soft = a == block_value  # [B|1, H|1, T|1, S]
    worst, where = 0.0, (0, 0)
    for b in range(B):
        for r0, r1 in row_blocks(T):
            w = call.weights(b, r0, r1)  # [H, rows, S]
            s = soft[b if soft.shape[0] > 1 else 0]
            s = s[:, r0:r1] if s.shape[1] > 1 else s  # [H|1, rows|1, S]
            m = (w * s).amax()
            if float(m) > worst:
                worst = float(m)
                where = (b, r0 + int((w * s).amax(-1).amax(0).argmax()))
    if worst > LEAK_WEIGHT:
        out.append(
            Verdict(
                "weak_mask",
                "error",
                f"the additive mask blocks with {block_value:g}, but at this call's score scale "
                f"(|q·k|·scale up to {spread / 2:.3g}) a blocked key still gets weight {worst:.3g}",
                {
                    "block_value": block_value,
                    "weight": worst,
                    "sample": where[0],
                    "query": where[1],
                },
            )
        )


def _check_blocked_rows(
    call: AttentionCall,
    blocked: Tensor | None,
    pad: Padding | None,
    bad_rows: Tensor | None,
    out: list[Verdict],
    explained: bool = False,
) -> Tensor | None:
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


def _check_hints(call: AttentionCall, out: list[Verdict]) -> None:
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


def judge(call: AttentionCall, pad: Padding | None = None, hints: bool = True) -> list[Verdict]:
    """Every finding one call shows.

    Args:
        call: the call, normalized.
        pad: which of its queries and keys are real tokens, when the model's mask is known.
        hints: look for speed hints (a caller that already has one for this place skips them).

    Returns:
        The verdicts, most severe first (an empty list for a clean call).
    """
    out: list[Verdict] = []
    float_kind, block_value = _check_float_mask(call, out)
    if float_kind == "invalid":
        return out
    blocked = _effective_blocked(call, float_kind, block_value, pad)
    bad_rows = _nonfinite_rows(call)
    # an inverted mask explains the blocked rows and the leaks it causes: report it alone
    inverted = blocked is not None and _check_inverted(call, blocked, pad, out)
    full = _check_blocked_rows(call, blocked, pad, bad_rows, out, explained=inverted)
    if bad_rows is not None:
        rest = bad_rows if full is None else bad_rows & ~full
        if bool(rest.any()):
            b, t = (int(i) for i in torch.nonzero(rest)[0])
            out.append(
                Verdict(
                    "nonfinite_output",
                    "error",
                    f"{call.api} returned NaN/inf in {int(rest.sum())} query rows (first: sample "
                    f"{b}, query {t}); it came from: {_where_nonfinite_came_from(call)}",
                    {"rows": int(rest.sum()), "sample": b, "query": t},
                )
            )
    _check_causal(call, call.blocked, out)
    _check_2d_broadcast(call, pad, out)
    if pad is not None and not inverted:
        leaks: list[Verdict] = []
        _check_padding(call, blocked, pad, leaks)
        # a mask laid out across the batch always leaks some sample's padding; a sliding window
        # blocks a prefix like left padding but leaks nothing, so mixing is looked for only here
        if not (leaks and blocked is not None and _check_mixing(call, blocked, pad, out)):
            out.extend(leaks)
    if float_kind == "mask":
        _check_weak(call, block_value, out)
    if hints:
        _check_hints(call, out)
    order = {"error": 0, "warning": 1, "hint": 2}
    return sorted(out, key=lambda v: order[v.severity])
