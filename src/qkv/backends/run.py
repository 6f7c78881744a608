"""Run a :class:`~qkv.backends.plan.Plan`: the kernel it names, on the pieces or tiles it cut.

Nothing is decided here that the plan did not say, with two exceptions that depend on values
only a run sees: flex's kernel budget running out (that call runs on blockwise, with a
warning), and a float32 / bfloat16 call whose scores overflowed (computed again in float64).
"""

from __future__ import annotations

import dataclasses
import warnings
from contextlib import nullcontext

import torch
from torch import Tensor

from qkv.backends.blockwise import blockwise_attention
from qkv.backends.call import Call
from qkv.backends.flex import FlexKernelsExhaustedError, flex_attention_qkv
from qkv.backends.fused import fused_attention
from qkv.backends.plan import Plan
from qkv.backends.policy import current_policy, use_policy
from qkv.backends.reductions import reduced_attention
from qkv.backends.reference import reference_attention
from qkv.masks import StructuredMask, causal_mask, combine

__all__ = ["overflowed", "run_in_float64", "run_plan"]


def run_plan(call: Call, plan: Plan) -> tuple[Tensor, Tensor | None]:
    """Run a validated call as ``plan`` says, under the plan's policy.

    Args:
        call: the call (its fit already checked against ``plan.fit``).
        plan: the plan.

    Returns:
        ``(output [B, H, T, Dv], weights [B, H, T, S] or None)``.
    """
    scope = nullcontext() if plan.policy is current_policy() else use_policy(plan.policy)
    with scope:
        return _run(call, plan)


def _run(call: Call, plan: Plan) -> tuple[Tensor, Tensor | None]:
    q, k, v = call.query, call.key, call.value
    if plan.backend == "blockwise":
        out = blockwise_attention(
            q,
            k,
            v,
            plan.mask,
            call.attn_bias,
            call.scale,
            call.dropout_p,
            call.training,
            block_q=call.block_q,
            block_k=call.block_k,
            tiles=plan.tiles,
        )  # [B, H, T, Dv]
        return out, None
    if plan.backend == "flex":
        try:
            return flex_attention_qkv(q, k, v, plan.mask, call.scale), None  # [B, H, T, Dv]
        except FlexKernelsExhaustedError as err:
            warnings.warn(
                f"{err}; this call runs on blockwise, later ones avoid flex", stacklevel=4
            )
        return blockwise_attention(q, k, v, plan.mask, None, call.scale, 0.0, False), None
    if plan.pieces is not None:
        out = reduced_attention(
            q,
            k,
            v,
            plan.pieces,
            call.attn_bias,
            scale=call.scale,
            dropout_p=call.dropout_p,
            training=call.training,
        )  # [B, H, T, Dv]
        return out, None
    return _run_dense(call, plan.backend)


def _run_dense(call: Call, backend: str) -> tuple[Tensor, Tensor | None]:
    """fused or reference over the whole grid, a structured mask materialized."""
    q, k, v, mask = call.query, call.key, call.value, call.mask
    B, H, T, _ = q.shape
    S = k.shape[2]
    if isinstance(mask, StructuredMask):
        mask = mask.materialize(B, H, T, S, q.device)  # [B|1, H|1, T|1, S]
    if backend == "fused":
        out = fused_attention(
            q,
            k,
            v,
            mask,
            call.attn_bias,
            is_causal=call.is_causal,
            scale=call.scale,
            dropout_p=call.dropout_p,
            training=call.training,
        )  # [B, H, T, Dv]
        return out, None
    if call.is_causal:
        mask = combine(mask, causal_mask(T, S, device=q.device))  # [B|1, H|1, T, S]
    out, weights = reference_attention(
        q, k, v, mask, call.attn_bias, call.scale, call.dropout_p, call.training
    )
    return out, (weights if call.need_weights else None)


def overflowed(call: Call, out: Tensor) -> bool:
    """Whether a float32 / bfloat16 call gave NaN from finite inputs: its float32 scores
    overflowed (``|q| · |k|`` beyond about 1e19), ``inf - inf`` in the softmax.

    One look at the output (no larger than the queries), a host sync; the inputs are read only
    when it holds a NaN. The caller asks only eagerly and when values are checked. float16
    cannot overflow float32 scores (65504² · Dh is far below 3e38) and float64 is computed in
    float64.
    """
    if out.dtype not in (torch.float32, torch.bfloat16):
        return False
    if not bool(torch.isnan(out).any()):
        return False
    finite = all(bool(torch.isfinite(x).all()) for x in (call.query, call.key, call.value))
    bias = call.attn_bias
    if bias is not None:  # -inf is a bias's way to block a key
        finite = finite and not bool((torch.isnan(bias) | torch.isposinf(bias)).any())
    return finite


def run_in_float64(call: Call, plan: Plan) -> tuple[Tensor, Tensor | None]:
    """``call`` computed in float64 (same backend; flex's compiled kernels become blockwise),
    the results cast back to the input dtype; gradients flow through the casts."""
    wide = dataclasses.replace(
        call,
        query=call.query.double(),
        key=call.key.double(),
        value=call.value.double(),
        attn_bias=None if call.attn_bias is None else call.attn_bias.double(),
    )
    if plan.backend == "flex":
        plan = dataclasses.replace(plan, backend="blockwise")
    out, weights = run_plan(wide, plan)
    dtype = call.query.dtype
    return out.to(dtype), None if weights is None else weights.to(dtype)
