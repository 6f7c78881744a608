"""The fused backend: PyTorch's ``F.scaled_dot_product_attention`` with qkv's semantics kept.

SDPA's fused CPU kernel is fast but its conventions differ from qkv's, so this module converts
at the edge and patches the two places where results would differ:

- masks: qkv's True = blocked becomes SDPA's True = may attend; an ``attn_bias`` is folded into a
  float mask (``attn_bias`` and ``-inf`` where blocked).
- ``is_causal``: qkv's is bottom-right aligned, SDPA's top-left; SDPA's flag (which skips the
  upper triangle inside the kernel) is used only when ``T == S`` and there is nothing else to
  mask, otherwise the bottom-right causal mask is materialized.
- fully masked rows: SDPA would produce NaN (or an undefined value) for a row with every key
  blocked. Such rows are unblocked before the call and their output set to 0 after it, which
  also gives them zero, finite gradients, as in the reference. Keys blocked for every query are
  zeroed first (:func:`~qkv.backends.reference.drop_blocked_keys`), so a NaN or inf at a padded
  position cannot reach the scores. Both with tensor ops, no data-dependent branch.
- low precision: float16/bfloat16 are upcast to float32 before the call (no trust in how the
  kernel accumulates), and the result is cast back.
- gradients on CPU: SDPA's CPU backward loses precision in float32 (its dv error was up to 15x
  a naive float32 formula's, ``benchmarks/float32_error.py``). Without dropout, eagerly, the
  gradients come instead from :class:`_ExactBackward`, which recomputes the reference formula
  in its backward (O(T · S) memory there, as the reference backend). Under torch.compile /
  export, with dropout, on other devices, or when the recomputed ``[B, H, T, S]`` scores would
  exceed :attr:`Policy.exact_backward_max_bytes <qkv.backends.policy.Policy>` (long sequences,
  where SDPA's O(T) memory matters more), SDPA's own backward is kept. Inside
  :func:`~qkv.backends.policy.allow_sdpa_backward` (the user's opt-in),
  SDPA's own backward is kept on CPU too: faster, less exact.

Grouped-query attention goes through SDPA's ``enable_gqa``. Inputs are validated by
:mod:`qkv.functional`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from qkv.backends.call import needs_grad
from qkv.backends.policy import current_policy
from qkv.backends.reference import compute_dtype, drop_blocked_keys, reference_attention
from qkv.masks import Align, causal_mask

__all__ = [
    "blockwise_trains_faster",
    "exact_backward_possible",
    "exact_backward_size_ok",
    "fused_attention",
    "uses_sdpa_is_causal",
]


def _python_bool(x: object) -> bool:
    """A Python bool even for a ``SymBool`` of symbolic shapes, which SDPA's flags refuse (and
    ``bool()`` keeps symbolic under torch.compile): the ``if`` makes the tracer guard on it."""
    if x:  # noqa: SIM103 (``return bool(x)`` stays a SymBool under torch.compile)
        return True
    return False


def uses_sdpa_is_causal(
    T: int,
    S: int,
    mask: object,
    attn_bias: object,
    is_causal: bool,
    align: Align = "bottom_right",
) -> bool:
    """True when a causal call (qkv's default bottom-right alignment, or ``align``) can be
    handed to SDPA's flag, which is top-left: for any lengths when top-left is asked for, for
    bottom-right only when ``T == S`` (the two then agree).

    Always a Python bool, also when ``T == S`` is a ``SymBool`` (see :func:`_python_bool`).
    """
    aligned = align == "top_left" or T == S
    return _python_bool(is_causal and mask is None and attn_bias is None and aligned)


def blockwise_trains_faster(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_bias: Tensor | None,
    dropout_p: float,
    training: bool,
) -> bool:
    """Whether this call would take :class:`_ExactBackward` and blockwise's exact tiled backward
    is faster: the dispatcher and the reductions then run blockwise instead."""
    B, H, T, _ = query.shape
    S = key.shape[2]
    pairs = T * S
    # Shape comparisons last: under torch.export / compile exact_backward_possible is False,
    # and a comparison of symbolic lengths would add a guard on them.
    return (
        needs_grad(query, key, value, attn_bias)
        and exact_backward_possible(query.device, dropout_p, training)
        and pairs >= current_policy().exact_grad_blockwise_min_pairs
        and exact_backward_size_ok(B, H, T, S, query.element_size())
    )


def exact_backward_size_ok(B: int, H: int, T: int, S: int, element_size: int) -> bool:
    """Whether a ``[B, H, T, S]`` call is small enough for :class:`_ExactBackward`."""
    return 4 * B * H * T * S * element_size <= current_policy().exact_backward_max_bytes


def exact_backward_possible(device: torch.device, dropout_p: float, training: bool) -> bool:
    """Whether a call that needs a gradient takes :class:`_ExactBackward` when small enough:
    on CPU, eagerly, without active dropout, outside
    :func:`~qkv.backends.policy.allow_sdpa_backward` (the
    planner asks this too)."""
    return (
        not current_policy().allow_sdpa_backward
        and (dropout_p == 0.0 or not training)
        and device.type == "cpu"
        and not torch.compiler.is_compiling()
    )


def fused_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: Tensor | None,
    attn_bias: Tensor | None,
    *,
    is_causal: bool,
    scale: float,
    dropout_p: float,
    training: bool,
    causal_align: Align = "bottom_right",
) -> Tensor:
    """Attention through SDPA; see :func:`qkv.attention` for the contract.

    Args:
        query, key, value: ``[B, H, T, Dh]``, ``[B, Hkv, S, Dh]``, ``[B, Hkv, S, Dv]``.
        mask, attn_bias: bool (True = blocked) and float, broadcastable to ``[B, H, T, S]``,
            or None.
        is_causal: also block future keys, aligned as ``causal_align`` says.
        scale: multiplies the scores.
        dropout_p, training: dropout on the weights, applied only when ``training``.
        causal_align: ``"bottom_right"`` (qkv's default) or ``"top_left"`` (query ``i`` sees
            keys ``0..i``: SDPA's own flag for any lengths; the reductions' causal pieces).

    Returns:
        Output ``[B, H, T, Dv]`` in the input dtype; rows with every key blocked are 0.
    """
    if _exact(query, key, value, attn_bias, dropout_p, training):
        return _ExactBackward.apply(  # [B, H, T, Dv]
            query, key, value, attn_bias, mask, is_causal, scale, causal_align
        )
    out_dtype = query.dtype
    work = compute_dtype(out_dtype)
    T, S = query.shape[2], key.shape[2]
    sdpa_causal = uses_sdpa_is_causal(T, S, mask, attn_bias, is_causal, causal_align)
    if is_causal and not sdpa_causal:
        mask = _with_causal(mask, T, S, query.device, causal_align)  # [B|1, H|1, T, S]
    dead: Tensor | None = None
    k, v = drop_blocked_keys(key, value, mask)  # [B, Hkv, S, Dh|Dv]
    if mask is not None:
        # Tensor ops only, no `if dead.any()`: that would wait for the device on every call and
        # break torch.export / torch.compile(fullgraph=True).
        dead = mask.all(dim=-1, keepdim=True)  # [B|1, H|1, T|1, 1]
        mask = mask & ~dead  # [B|1, H|1, T, S]: SDPA sees dead rows unblocked
    with torch.autocast(device_type=query.device.type, enabled=False):
        out = F.scaled_dot_product_attention(
            query.to(work),
            k.to(work),
            v.to(work),
            attn_mask=_sdpa_mask(mask, attn_bias, work),
            dropout_p=dropout_p if training else 0.0,
            is_causal=sdpa_causal,
            scale=scale,
            enable_gqa=_python_bool(key.shape[1] != query.shape[1]),
        )  # [B, H, T, Dv]
        if dead is not None:
            out = torch.where(dead, 0.0, out)  # [B, H, T, Dv]; 1.5x faster than masked_fill
    return out.to(out_dtype)


def _exact(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_bias: Tensor | None,
    dropout_p: float,
    training: bool,
) -> bool:
    """Whether this call's gradient comes from :class:`_ExactBackward` (False with grad mode
    off, hence inside ``_ExactBackward.forward`` itself)."""
    B, H, T, _ = query.shape
    return (
        needs_grad(query, key, value, attn_bias)
        and exact_backward_possible(query.device, dropout_p, training)
        and exact_backward_size_ok(B, H, T, key.shape[2], query.element_size())
    )


def _sdpa_mask(mask: Tensor | None, attn_bias: Tensor | None, work: torch.dtype) -> Tensor | None:
    """SDPA's ``attn_mask``: the bias with ``-inf`` where blocked, or the bool mask inverted
    (SDPA's True = may attend), or None."""
    if attn_bias is not None:
        attn_mask = attn_bias.to(work)  # [B|1, H|1, T|1, S|1]
        if mask is not None:
            attn_mask = attn_mask.masked_fill(mask, float("-inf"))  # [B|1, H|1, T, S]
        return attn_mask
    return None if mask is None else ~mask  # [B|1, H|1, T, S]


class _ExactBackward(torch.autograd.Function):
    """SDPA's forward; the backward of the reference formula, recomputed (float32 or float64)."""

    @staticmethod
    def forward(
        ctx: Any,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attn_bias: Tensor | None,
        mask: Tensor | None,
        is_causal: bool,
        scale: float,
        causal_align: Align,
    ) -> Tensor:
        ctx.save_for_backward(query, key, value, attn_bias, mask)
        ctx.is_causal, ctx.scale, ctx.align = is_causal, scale, causal_align
        # grad mode is off inside Function.forward, so this call runs SDPA, not _ExactBackward
        return fused_attention(
            query,
            key,
            value,
            mask,
            attn_bias,
            is_causal=is_causal,
            scale=scale,
            dropout_p=0.0,
            training=False,
            causal_align=causal_align,
        )  # [B, H, T, Dv]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, d_out: Tensor) -> tuple[Tensor | None, ...]:
        query, key, value, attn_bias, mask = ctx.saved_tensors
        inputs = [query, key, value, attn_bias]
        leaves = [
            None if x is None or not need else x.detach().requires_grad_()
            for x, need in zip(inputs, ctx.needs_input_grad[:4], strict=True)
        ]
        q, k, v, b = (
            x.detach() if leaf is None and x is not None else leaf
            for x, leaf in zip(inputs, leaves, strict=True)
        )
        assert q is not None and k is not None and v is not None
        if ctx.is_causal:
            mask = _with_causal(mask, query.shape[2], key.shape[2], query.device, ctx.align)
        with torch.enable_grad():
            out, _ = reference_attention(q, k, v, mask, b, ctx.scale, 0.0, False)  # [B, H, T, Dv]
            wanted = [x for x in leaves if x is not None]
            grads = iter(torch.autograd.grad(out, wanted, d_out))
        return (*(None if x is None else next(grads) for x in leaves), None, None, None, None)


def _with_causal(mask: Tensor | None, T: int, S: int, device: torch.device, align: Align) -> Tensor:
    """``mask`` OR the causal mask aligned as ``align``, for when SDPA's own flag cannot serve."""
    causal = causal_mask(T, S, align=align, device=device)  # [1, 1, T, S]
    return causal if mask is None else mask | causal  # [B|1, H|1, T, S]
