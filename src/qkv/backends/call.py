"""One validated attention call, and what of it a plan depends on (its :class:`Fit`).

:func:`qkv.functional.attention` validates its arguments into a :class:`Call`; the planner
decides from it, and a plan made for one call runs another only if their fits are equal.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from qkv.masks import StructuredMask

__all__ = ["Call", "Fit", "fit_of", "mask_token", "needs_grad"]


@dataclass(frozen=True)
class Fit:
    """What a plan was made for: a call runs a plan only if it has the same fit.

    ``mask`` is a token of the call's mask: the rule object's identity, or for a tensor its
    memory, shape, strides and version (an in-place change makes it another mask).
    """

    query: tuple[int, ...]
    key: tuple[int, ...]
    value: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    mask: tuple[object, ...] | None
    attn_bias: tuple[int, ...] | None
    is_causal: bool
    need_weights: bool
    dropout_p: float
    training: bool
    needs_grad: bool
    backend: str
    block_q: int | None
    block_k: int | None


@dataclass(frozen=True)
class Call:
    """One validated :func:`qkv.attention` call: what the planner decides from.

    Attributes:
        query: ``[B, H, T, Dh]``.
        key: ``[B, Hkv, S, Dh]``.
        value: ``[B, Hkv, S, Dv]``.
        mask: a 4-D bool tensor, a structured mask, or None.
        attn_bias: a 4-D float tensor, or None.
        is_causal, scale, need_weights, dropout_p, training: the call's arguments.
        backend: the backend asked for (``"auto"`` or a name).
        block_q, block_k: blockwise tile sizes asked for, or None.
    """

    query: Tensor
    key: Tensor
    value: Tensor
    mask: Tensor | StructuredMask | None
    attn_bias: Tensor | None
    is_causal: bool
    scale: float
    need_weights: bool
    dropout_p: float
    training: bool
    backend: str
    block_q: int | None
    block_k: int | None

    @property
    def needs_grad(self) -> bool:
        """Whether the call builds a graph for a gradient."""
        return needs_grad(self.query, self.key, self.value, self.attn_bias)


def needs_grad(*tensors: Tensor | None) -> bool:
    """Whether a call on ``tensors`` builds a graph for a gradient: grad mode is on and one of
    them (None skipped) requires grad."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def mask_token(mask: Tensor | StructuredMask | None) -> tuple[object, ...] | None:
    """A hashable token that is equal for two calls only if their masks are the same (while
    tracing, where a tensor has no memory to read, the object's identity)."""
    if mask is None:
        return None
    if isinstance(mask, Tensor) and not torch.compiler.is_compiling():
        # An inference tensor (made under torch.inference_mode) has no version counter: plans
        # are shared within one forward (share_plans), which builds its masks once and never
        # writes them in place.
        v = -1 if mask.is_inference() else mask._version
        return ("tensor", mask.data_ptr(), tuple(mask.shape), mask.stride(), v, mask.device)
    return ("rule", id(mask))


def fit_of(call: Call) -> Fit:
    """The :class:`Fit` of a validated call."""
    q, bias = call.query, call.attn_bias
    return Fit(
        tuple(q.shape),
        tuple(call.key.shape),
        tuple(call.value.shape),
        q.dtype,
        q.device,
        mask_token(call.mask),
        None if bias is None else tuple(bias.shape),
        call.is_causal,
        call.need_weights,
        call.dropout_p,
        call.training,
        call.needs_grad,
        call.backend,
        call.block_q,
        call.block_k,
    )
