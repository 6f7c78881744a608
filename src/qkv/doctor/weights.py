"""Attention weights recomputed exactly, a block of query rows at a time.

The doctor never asks a model for its weights (that would force the eager path) and never holds
the whole ``[B, H, T, S]`` at once: it runs qkv's reference formula
(:func:`qkv.backends.reference.reference_attention`) in float32 (float64 stays float64) on the
rows it needs, with blocked keys at weight 0 and a fully blocked row at 0 (never NaN).

Shapes: B batch, H query heads, Hkv key/value heads, T queries, S keys, Dh head width.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from qkv.backends.reference import compute_dtype, expand_kv_heads, reference_attention

__all__ = ["ROW_BLOCK", "row_blocks", "score_bound", "weights_rows"]

ROW_BLOCK = 256
"""Query rows recomputed at once: one block is ``H * ROW_BLOCK * S`` floats."""


def _pick(x: Tensor | None, b: int, heads: slice, r0: int, r1: int) -> Tensor | None:
    """Sample ``b``, heads ``heads`` and rows ``r0:r1`` of a 4-D broadcastable tensor."""
    if x is None:
        return None
    x = x[b if x.shape[0] > 1 else 0]  # [H|1, T|1, S]
    x = x[heads] if x.shape[0] > 1 else x
    return x[:, r0:r1] if x.shape[1] > 1 else x  # [H|1, rows|1, S]


def weights_rows(
    query: Tensor,
    key: Tensor,
    scale: float,
    b: int,
    r0: int,
    r1: int,
    *,
    blocked: Tensor | None = None,
    additive: Tensor | None = None,
    bias: Tensor | None = None,
    heads: slice = slice(None),
    causal: str | None = None,
) -> Tensor:
    """The exact weights of sample ``b``, query rows ``r0:r1``.

    Args:
        query: ``[B, H, T, Dh]``.
        key: ``[B, Hkv, S, Dh]`` (``Hkv`` divides ``H``).
        scale: score multiplier.
        b: the sample.
        r0: first row.
        r1: one past the last row.
        blocked: bool, True = blocked, 4-D broadcastable to ``[B, H, T, S]``.
        additive: float added to the scores, 4-D broadcastable.
        bias: another float added to the scores, 4-D broadcastable.
        heads: which query heads.
        causal: ``"top_left"`` or ``"bottom_right"`` to block future keys too (built for these
            rows only, never as a whole ``[T, S]`` mask), or None.

    Returns:
        ``[h, r1 - r0, S]`` in the compute dtype (float32, or float64 for float64 inputs).
    """
    dtype = compute_dtype(query.dtype)
    q = query[b : b + 1, heads, r0:r1].to(dtype)  # [1, h, rows, Dh]
    k = expand_kv_heads(key[b : b + 1], query.shape[1])[:, heads].to(dtype)  # [1, h, S, Dh]
    mask = _pick(blocked, b, heads, r0, r1)  # [h|1, rows|1, S]
    if causal is not None:
        T, S = query.shape[2], key.shape[2]
        shift = S - T if causal == "bottom_right" else 0
        rows = torch.arange(r0, r1, device=q.device).unsqueeze(-1) + shift  # [rows, 1]
        future = torch.arange(S, device=q.device) > rows  # [rows, S]
        mask = future if mask is None else mask | future  # [h|1, rows, S]
    score_bias = None
    for extra in (_pick(additive, b, heads, r0, r1), _pick(bias, b, heads, r0, r1)):
        if extra is not None:
            score_bias = extra.to(dtype) if score_bias is None else score_bias + extra.to(dtype)
    # the reference formula itself, on these rows (keys stand in for the values it also needs)
    _, weights = reference_attention(q, k, k, mask, score_bias, scale, 0.0, False)
    return weights[0]  # [h, rows, S]


def row_blocks(T: int, size: int = ROW_BLOCK) -> Iterator[tuple[int, int]]:
    """``(r0, r1)`` for consecutive blocks of at most ``size`` rows covering ``0..T``."""
    for r0 in range(0, T, size):
        yield r0, min(T, r0 + size)


def score_bound(query: Tensor, key: Tensor, scale: float) -> float:
    """An upper bound of ``|q · k| * scale`` over the whole call (Cauchy-Schwarz), cheap."""
    dtype = compute_dtype(query.dtype)
    qn = float(torch.linalg.vector_norm(query.to(dtype), dim=-1).max())
    kn = float(torch.linalg.vector_norm(key.to(dtype), dim=-1).max())
    return qn * kn * abs(scale)
