"""How a model turns its ``positional`` setting into inputs for its layers.

Absolute encodings (sinusoidal, learned) are added to the embeddings; rotary tables, ALiBi
biases and T5's relative position biases are handed to every self-attention layer. One helper
serves both models.

Shapes: B batch, T new tokens, S keys (cached + new), D model width, H heads, Dh head width.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torch import Tensor, nn

from qkv.nn.positional import (
    ROPE_LAYOUTS,
    ALiBi,
    LearnedPositionalEmbedding,
    RopeLayout,
    RotaryEmbedding,
    SinusoidalPositionalEncoding,
)
from qkv.nn.relative_bias import RelativePositionBias

__all__ = [
    "POSITIONALS",
    "ROPE_LAYOUTS",
    "LayerPositions",
    "Positional",
    "RopeLayout",
    "make_positional",
    "position_inputs",
]

Positional = Literal["sinusoidal", "learned", "rotary", "alibi", "relative", "none"]
POSITIONALS: tuple[Positional, ...] = (
    "sinusoidal",
    "learned",
    "rotary",
    "alibi",
    "relative",
    "none",
)


@dataclass
class LayerPositions:
    """What the self-attention layers need: rotary ``(cos, sin)`` and/or an ALiBi bias."""

    rope: tuple[Tensor, Tensor] | None = None
    attn_bias: Tensor | None = None


def make_positional(
    kind: Positional,
    d_model: int,
    num_heads: int,
    max_positions: int,
    *,
    rope_theta: float = 10000.0,
    rope_layout: RopeLayout = "half_split",
    relative_buckets: int = 32,
    relative_max_distance: int = 128,
) -> nn.Module | None:
    """The module for ``positional=kind``, or None for ``"none"``.

    Args:
        kind: one of :data:`POSITIONALS`.
        d_model: D.
        num_heads: H (rotary tables are per head width, ALiBi slopes per head).
        max_positions: the longest sequence the tables cover.
        rope_theta: the rotary wavelength base (``"rotary"`` only).
        rope_layout: which head dims rotate together (``"rotary"`` only; :data:`ROPE_LAYOUTS`).
        relative_buckets: buckets of T5's relative position bias (``"relative"`` only).
        relative_max_distance: its longest bucketed distance (``"relative"`` only).

    Returns:
        The positional module, or None.

    Raises:
        ValueError: unknown kind or rope layout.
    """
    if kind == "sinusoidal":
        return SinusoidalPositionalEncoding(d_model, max_positions)
    if kind == "learned":
        return LearnedPositionalEmbedding(d_model, max_positions)
    if kind == "rotary":
        return RotaryEmbedding(
            d_model // num_heads, max_positions, base=rope_theta, layout=rope_layout
        )
    if kind == "alibi":
        return ALiBi(num_heads)
    if kind == "relative":
        return RelativePositionBias(num_heads, relative_buckets, relative_max_distance)
    if kind == "none":
        return None
    raise ValueError(f"positional must be one of {POSITIONALS}, got {kind!r}")


def position_inputs(
    positional: nn.Module | None,
    x: Tensor,
    offset: int,
    *,
    causal: bool,
    positions: Tensor | None = None,
) -> tuple[Tensor, LayerPositions]:
    """Add absolute positions to ``x`` or build the per-layer inputs.

    Args:
        positional: from :func:`make_positional`.
        x: embeddings ``[B, T, D]`` of tokens at positions ``offset .. offset + T - 1``.
        offset: tokens already in the KV cache (0 without one).
        causal: the self-attention is causal (changes the ALiBi bias).
        positions: long ``[B, T]``, each token's own position (a left-padded row's first real
            token is at 0), or None for ``offset + column``. ALiBi and T5's relative bias ignore
            it: they depend only on distances, which left padding (blocked keys, contiguous real
            tokens) keeps.

    Returns:
        ``(x [B, T, D], LayerPositions)``; rotary tables are ``[B, 1, T, *]`` with
        ``positions``.
    """
    T = x.shape[1]
    if isinstance(positional, SinusoidalPositionalEncoding | LearnedPositionalEmbedding):
        return positional(x, offset, positions), LayerPositions()
    if isinstance(positional, RotaryEmbedding):
        return x, LayerPositions(rope=positional(T, offset, positions))
    if isinstance(positional, ALiBi | RelativePositionBias):
        return x, LayerPositions(attn_bias=positional(T, offset + T, causal=causal))  # [1, H, T, S]
    return x, LayerPositions()
