"""The attention formula in float64, written out independently of qkv: what tests compare against.

One definition for every test that recomputes attention by hand (qkv's own reference backend is
checked against it, so it must not be built from qkv). Imported as a plain module (tests/ is put
on ``sys.path`` by ``tests/conftest.py``): ``from reference_f64 import attention_f64``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def attention_f64(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    blocked: Tensor | None = None,
    attn_bias: Tensor | None = None,
    scale: float | None = None,
) -> tuple[Tensor, Tensor]:
    """``softmax(q k^T * scale + attn_bias, blocked -> -inf) v``, every step in float64.

    Grouped-query keys and values (fewer heads than ``q``) are repeated per query head; a query
    row with every key blocked gives weights 0 and output 0.

    Args:
        q: ``[B, H, T, Dh]``.
        k: ``[B, Hkv, S, Dh]``, H a multiple of Hkv.
        v: ``[B, Hkv, S, Dv]``.
        blocked: bool broadcastable to ``[B, H, T, S]``, True = blocked, or None.
        attn_bias: added to the scores, broadcastable to ``[B, H, T, S]``, or None.
        scale: the score scale; default ``1 / sqrt(Dh)``.

    Returns:
        ``(output [B, H, T, Dv], weights [B, H, T, S])``, float64.
    """
    q, k, v = q.double(), k.double(), v.double()
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)  # [B, H, S, Dh]
    v = v.repeat_interleave(groups, dim=1)  # [B, H, S, Dv]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = q @ k.transpose(-2, -1) * scale  # [B, H, T, S]
    if attn_bias is not None:
        scores = scores + attn_bias.double()  # [B, H, T, S]
    if blocked is not None:
        scores = scores.masked_fill(blocked, float("-inf"))  # [B, H, T, S]
    dead = torch.isneginf(scores).all(dim=-1, keepdim=True)  # [B, H, T, 1]
    weights = torch.where(dead, 0.0, torch.softmax(scores.masked_fill(dead, 0.0), dim=-1))
    return weights @ v, weights  # [B, H, T, Dv], [B, H, T, S]
