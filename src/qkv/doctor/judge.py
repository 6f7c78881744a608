"""Judging one attention call: which of the doctor's kinds it shows.

The judge reads an :class:`~qkv.doctor.calls.AttentionCall` (the mask as the API read it) and,
when the model's padding is known, which queries and keys are real tokens. Mask-only checks run
on the masks (:mod:`qkv.doctor.mask_checks`); weight checks (:mod:`qkv.doctor.leak_checks`)
recompute exact weights (:mod:`qkv.doctor.weights`) only for the rows a mask leaves in doubt, so
a clean call costs a few passes over its mask and one over its output. This module is the driver:
which checks run, in which order, and which finding explains away another.

Shapes: B batch, H query heads, T queries, S keys.
"""

from __future__ import annotations

import torch
from torch import Tensor

from qkv.doctor.calls import AttentionCall
from qkv.doctor.leak_checks import check_mixing, check_padding, check_weak
from qkv.doctor.mask_checks import (
    check_2d_broadcast,
    check_blocked_rows,
    check_causal,
    check_float_mask,
    check_hints,
    check_inverted,
    effective_blocked,
)
from qkv.doctor.verdict import LEAK_WEIGHT, Padding, Verdict
from qkv.doctor.weights import score_bound

__all__ = ["LEAK_WEIGHT", "Padding", "Verdict", "judge"]


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
    float_kind, block_value = check_float_mask(call, out)
    if float_kind == "invalid":
        return out
    blocked = effective_blocked(call, float_kind, block_value, pad)
    bad_rows = _nonfinite_rows(call)
    # an inverted mask explains the blocked rows and the leaks it causes: report it alone
    inverted = blocked is not None and check_inverted(call, blocked, pad, out)
    full = check_blocked_rows(call, blocked, pad, bad_rows, out, explained=inverted)
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
    check_causal(call, call.blocked, out)
    check_2d_broadcast(call, pad, out)
    if pad is not None and not inverted:
        leaks: list[Verdict] = []
        check_padding(call, blocked, pad, leaks)
        # a mask laid out across the batch always leaks some sample's padding; a sliding window
        # blocks a prefix like left padding but leaks nothing, so mixing is looked for only here
        if not (leaks and blocked is not None and check_mixing(call, blocked, pad, out)):
            out.extend(leaks)
    if float_kind == "mask":
        check_weak(call, block_value, out)
    if hints:
        check_hints(call, out)
    order = {"error": 0, "warning": 1, "hint": 2}
    return sorted(out, key=lambda v: order[v.severity])
