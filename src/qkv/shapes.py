"""Shape tracing: run the attention computation step by step and record each tensor's shape."""

from __future__ import annotations

import math

import torch

from qkv.masks import causal_mask, combine, padding_mask

__all__ = ["trace_attention_shapes"]


def trace_attention_shapes(
    B: int, H: int, T: int, S: int, Dh: int, Dv: int, *, seed: int = 0
) -> list[tuple[str, tuple[int, ...]]]:
    """Compute attention on random tensors and return ``(name, shape)`` of every intermediate.

    The mask is a key-padding mask (the last key of sample 0 is padding) combined with a
    bottom-right causal mask, so its broadcast shape shows up too.

    Args:
        B: batch. H: heads. T: query length. S: key length. Dh: query/key width. Dv: value width.
        seed: random seed.

    Returns:
        A list of (name, shape) in computation order.

    Raises:
        ValueError: a non-positive size.
    """
    sizes = {"B": B, "H": H, "T": T, "S": S, "Dh": Dh, "Dv": Dv}
    bad = {k: v for k, v in sizes.items() if v < 1}
    if bad:
        raise ValueError(f"sizes must be positive, got {bad}")
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, Dh, generator=gen)  # [B, H, T, Dh]
    k = torch.randn(B, H, S, Dh, generator=gen)  # [B, H, S, Dh]
    v = torch.randn(B, H, S, Dv, generator=gen)  # [B, H, S, Dv]
    lengths = torch.full((B,), S)
    lengths[0] = max(S - 1, 1)
    mask = combine(padding_mask(lengths, S), causal_mask(T, S, align="bottom_right"))
    assert mask is not None
    kt = k.transpose(-2, -1)  # [B, H, Dh, S]
    scores = (q @ kt) / math.sqrt(Dh)  # [B, H, T, S]
    scores = scores.masked_fill(mask, float("-inf"))  # [B, H, T, S]
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # [B, H, T, S] (display only)
    out = weights @ v  # [B, H, T, Dv]
    return [
        ("Q", tuple(q.shape)),
        ("K", tuple(k.shape)),
        ("V", tuple(v.shape)),
        ("K^T", tuple(kt.shape)),
        ("QK^T", tuple(scores.shape)),
        ("mask", tuple(mask.shape)),
        ("weights", tuple(weights.shape)),
        ("output", tuple(out.shape)),
    ]
