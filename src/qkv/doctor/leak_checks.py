"""The checks of one attention call that recompute exact weights (:mod:`qkv.doctor.weights`)
where its mask leaves them in doubt: a padding key given weight by a real query (a leak), or by
the mask of another sample (samples mixed across the batch), and an additive mask too weak for
the call's score scale. Each appends its :class:`~qkv.doctor.verdict.Verdict` to ``out``.

Shapes: B batch, H query heads, T queries, S keys.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from qkv.doctor.calls import AttentionCall
from qkv.doctor.verdict import LEAK_WEIGHT, Padding, Verdict, last_real_query
from qkv.doctor.weights import row_blocks, score_bound

__all__ = ["check_mixing", "check_padding", "check_weak"]


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


def check_mixing(call: AttentionCall, blocked: Tensor, pad: Padding, out: list[Verdict]) -> bool:
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
    last = last_real_query(pad)  # [B]
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


def check_padding(
    call: AttentionCall, blocked: Tensor | None, pad: Padding, out: list[Verdict]
) -> None:
    """Real queries that give a padding key more than ``LEAK_WEIGHT`` (or samples mixed, when
    the keys they may not see are exactly another sample's padding)."""
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


def check_weak(call: AttentionCall, block_value: float, out: list[Verdict]) -> None:
    """An additive mask whose block value leaves a blocked key more than ``LEAK_WEIGHT``."""
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
