"""Position information: sinusoidal and learned absolute encodings, rotary embeddings (RoPE) and
ALiBi score biases.

Attention itself is permutation-equivariant: without positions, permuting the input tokens just
permutes the encoder output. Each scheme here breaks that symmetry differently:

* **sinusoidal** (Vaswani et al. 2017) and **learned** absolute encodings are *added* to the
  token embeddings once, before the first layer;
* **rotary** (RoPE, Su et al. 2021) *rotates* each query and key head vector by an angle
  proportional to its position, in every layer, so that ``q_i · k_j`` depends on ``i - j``; two
  layouts pair the head dims differently (:data:`ROPE_LAYOUTS`);
* **ALiBi** (Press et al. 2021) adds ``-slope_h · |i - j|`` to the attention scores of head ``h``
  (passed to :func:`qkv.attention` as ``bias=``).

All of them accept a position ``offset`` (the number of tokens already in a KV cache), so that a
token decoded alone gets the same encoding as in a full forward pass. The absolute and rotary
ones also take ``positions``, one position per row and token (``[B, T]``), for left-padded
batches whose rows start at different columns.

Shapes: B batch, T length (new tokens), S key length, D model width, H heads, Dh head width.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor, nn

__all__ = [
    "ROPE_LAYOUTS",
    "ALiBi",
    "LearnedPositionalEmbedding",
    "RopeLayout",
    "RotaryEmbedding",
    "SinusoidalPositionalEncoding",
    "alibi_bias",
    "alibi_slopes",
    "apply_rotary",
    "rotary_cos_sin",
    "sinusoidal_table",
]


def _check_span(offset: int, T: int, max_positions: int, what: str) -> None:
    if offset < 0:
        raise ValueError(f"offset must be >= 0, got {offset}")
    if offset + T > max_positions:
        raise ValueError(
            f"{what}: positions {offset}..{offset + T - 1} exceed max_positions={max_positions}; "
            "build the model with a larger max_positions"
        )


# --- sinusoidal ---------------------------------------------------------------------------------


def sinusoidal_table(max_positions: int, d_model: int, *, base: float = 10000.0) -> Tensor:
    """``PE[p, 2i] = sin(p / base^(2i/D))``, ``PE[p, 2i+1] = cos(p / base^(2i/D))``.

    Args:
        max_positions: number of positions.
        d_model: D (an odd D drops the last cosine column).
        base: the wavelength base (10000 in the paper).

    Returns:
        float32 ``[max_positions, D]``, computed in float64 on the CPU (the same values on every
        device; no Python reference ops on the meta device, see :mod:`qkv.nn.meta`).

    Raises:
        ValueError: non-positive sizes.
    """
    if max_positions < 1 or d_model < 1:
        raise ValueError(
            f"max_positions and d_model must be positive, got {max_positions}, {d_model}"
        )
    cpu = torch.device("cpu")
    pos = torch.arange(max_positions, dtype=torch.float64, device=cpu)[:, None]  # [L, 1]
    steps = torch.arange(0, d_model, 2, dtype=torch.float64, device=cpu)  # [ceil(D/2)]
    inv_freq = base ** (-steps / d_model)  # [ceil(D/2)]
    angles = pos * inv_freq[None, :]  # [L, ceil(D/2)]
    table = torch.zeros(max_positions, d_model, dtype=torch.float64, device=cpu)  # [L, D]
    table[:, 0::2] = torch.sin(angles)
    table[:, 1::2] = torch.cos(angles)[:, : d_model // 2]
    return table.to(torch.float32)


class SinusoidalPositionalEncoding(nn.Module):
    """Adds the fixed sinusoidal table to ``x`` (no parameters; the table is not saved).

    Args:
        d_model: D.
        max_positions: the longest sequence (including cached tokens).
    """

    table: Tensor

    def __init__(self, d_model: int, max_positions: int) -> None:
        super().__init__()
        self.max_positions = max_positions
        table = sinusoidal_table(max_positions, d_model).to(torch.get_default_device())  # [L, D]
        self.register_buffer("table", table, persistent=False)

    def forward(self, x: Tensor, offset: int = 0, positions: Tensor | None = None) -> Tensor:
        """Args: x ``[B, T, D]``; offset: position of ``x[:, 0]``; positions: long ``[B, T]``,
        each token's own position (each ``<= offset + its column``), instead of
        ``offset + column``. Returns ``[B, T, D]``.

        Raises:
            ValueError: positions beyond ``max_positions``.
        """
        T = x.shape[1]
        _check_span(offset, T, self.max_positions, "sinusoidal positions")
        if positions is not None:
            return x + self.table[positions].to(x.dtype)  # [B, T, D]
        return x + self.table[offset : offset + T].to(x.dtype)  # [B, T, D]


# --- learned ------------------------------------------------------------------------------------


class LearnedPositionalEmbedding(nn.Module):
    """Adds a trained embedding per absolute position (BERT, GPT-2).

    Args:
        d_model: D.
        max_positions: number of positions.
    """

    def __init__(self, d_model: int, max_positions: int) -> None:
        super().__init__()
        self.max_positions = max_positions
        self.embedding = nn.Embedding(max_positions, d_model)
        nn.init.normal_(self.embedding.weight, std=0.02)

    def forward(self, x: Tensor, offset: int = 0, positions: Tensor | None = None) -> Tensor:
        """Args: x ``[B, T, D]``; offset: position of ``x[:, 0]``; positions: long ``[B, T]``,
        each token's own position (each ``<= offset + its column``), instead of
        ``offset + column``. Returns ``[B, T, D]``.

        Raises:
            ValueError: positions beyond ``max_positions``.
        """
        T = x.shape[1]
        _check_span(offset, T, self.max_positions, "learned positions")
        if positions is not None:
            return x + self.embedding(positions).to(x.dtype)  # [B, T, D]
        return x + self.embedding.weight[offset : offset + T].to(x.dtype)  # [B, T, D]


# --- rotary -------------------------------------------------------------------------------------


RopeLayout = Literal["half_split", "interleaved"]
ROPE_LAYOUTS: tuple[RopeLayout, ...] = ("half_split", "interleaved")
"""Which head dims rotary embeddings rotate together, frequency ``i`` of ``Dh/2``:

* ``"half_split"``: the pair ``(x[i], x[i + Dh/2])`` (GPT-NeoX, Hugging Face Llama / Qwen2 /
  Mistral);
* ``"interleaved"``: the pair ``(x[2i], x[2i + 1])`` (the RoFormer paper, GPT-J, Meta's original
  Llama code).

The two give the same attention up to a fixed permutation of each head's query/key dims (which
is how Hugging Face converts Meta's weights). The tables of :func:`rotary_cos_sin` carry the
layout in their width: ``Dh`` for ``"half_split"`` (each angle twice, the "rotate half" form),
``Dh/2`` for ``"interleaved"`` (one angle per pair), and :func:`apply_rotary` pairs the dims
accordingly."""


def rotary_cos_sin(
    positions: Tensor,
    head_dim: int,
    *,
    base: float = 10000.0,
    layout: RopeLayout = "half_split",
) -> tuple[Tensor, Tensor]:
    """Cosines and sines of the RoPE angles ``p · base^(-2i/Dh)`` for each position.

    Args:
        positions: integer ``[T]``.
        head_dim: Dh, even.
        base: the wavelength base.
        layout: one of :data:`ROPE_LAYOUTS`.

    Returns:
        ``(cos, sin)``, each float32: ``[T, Dh]`` for ``"half_split"`` (the ``Dh/2`` frequencies
        repeated twice, the "rotate half" layout of GPT-NeoX and Hugging Face Llama), ``[T, Dh/2]``
        for ``"interleaved"`` (one angle per pair ``(x[2i], x[2i + 1])``).

    Raises:
        ValueError: odd ``head_dim``, unknown ``layout``.
    """
    if head_dim % 2 != 0:
        raise ValueError(f"rotary embeddings need an even head width, got head_dim={head_dim}")
    if layout not in ROPE_LAYOUTS:
        raise ValueError(f"rope layout must be one of {ROPE_LAYOUTS}, got {layout!r}")
    steps = torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device)  # [Dh/2]
    inv_freq = base ** (-steps / head_dim)  # [Dh/2]
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]  # [T, Dh/2]
    if layout == "half_split":
        angles = torch.cat([angles, angles], dim=-1)  # [T, Dh]
    return torch.cos(angles).to(torch.float32), torch.sin(angles).to(torch.float32)


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)  # 2 x [..., Dh/2]
    return torch.cat([-x2, x1], dim=-1)  # [..., Dh]


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate each pair of head dims by its position's angle, in the tables' layout.

    Tables ``Dh`` wide (``"half_split"``) rotate ``(x[i], x[i + Dh/2])``; tables ``Dh/2`` wide
    (``"interleaved"``) rotate ``(x[2i], x[2i + 1])``: ``(a, b) -> (a cos - b sin, a sin + b cos)``
    either way. The choice is by static shape, so it traces and exports.

    Args:
        x: ``[B, H, T, Dh]`` queries or keys.
        cos: ``[T, Dh]`` or ``[T, Dh/2]`` from :func:`rotary_cos_sin`.
        sin: the same shape as ``cos``.

    Returns:
        ``[B, H, T, Dh]`` in ``x``'s dtype.

    Raises:
        ValueError: tables neither ``Dh`` nor ``Dh/2`` wide.
    """
    cos = cos.to(x.dtype)
    sin = sin.to(x.dtype)
    Dh = x.shape[-1]
    if cos.shape[-1] == Dh:
        return x * cos + _rotate_half(x) * sin  # [B, H, T, Dh]
    if 2 * cos.shape[-1] == Dh:
        a, b = x.unflatten(-1, (Dh // 2, 2)).unbind(-1)  # 2 x [B, H, T, Dh/2]
        pairs = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1)  # [B, H, T, Dh/2, 2]
        return pairs.flatten(-2)  # [B, H, T, Dh]
    raise ValueError(
        f"rotary tables of width {cos.shape[-1]} do not fit head width {Dh} "
        f"(expected {Dh} for 'half_split' or {Dh // 2} for 'interleaved')"
    )


class RotaryEmbedding(nn.Module):
    """Holds the RoPE cos/sin tables up to ``max_positions`` (not saved) and slices them by offset.

    The model calls it once per forward and hands ``(cos, sin)`` to every attention layer, which
    rotates its queries and (new) keys before caching them.

    Args:
        head_dim: Dh, even.
        max_positions: the longest sequence.
        base: the wavelength base.
        layout: one of :data:`ROPE_LAYOUTS`.

    Raises:
        ValueError: odd ``head_dim``, unknown ``layout``.
    """

    cos: Tensor
    sin: Tensor

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        *,
        base: float = 10000.0,
        layout: RopeLayout = "half_split",
    ) -> None:
        super().__init__()
        self.max_positions = max_positions
        self.head_dim = head_dim
        self.layout = layout
        # computed on the CPU, then moved (no Python reference ops on the meta device)
        positions = torch.arange(max_positions, device="cpu")  # [L]
        cos, sin = rotary_cos_sin(positions, head_dim, base=base, layout=layout)  # [L, Dh]
        device = torch.get_default_device()
        self.register_buffer("cos", cos.to(device), persistent=False)
        self.register_buffer("sin", sin.to(device), persistent=False)

    def forward(
        self, T: int, offset: int = 0, positions: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """Returns ``(cos, sin)``, each ``[T, Dh]`` (``[T, Dh/2]`` interleaved), for positions
        ``offset .. offset + T - 1``; with ``positions`` (long ``[B, T]``, each ``<= offset +
        its column``) each ``[B, 1, T, Dh]`` (``[B, 1, T, Dh/2]``), one row of positions per
        batch row, broadcasting over the heads.

        Raises:
            ValueError: positions beyond ``max_positions``.
        """
        _check_span(offset, T, self.max_positions, "rotary positions")
        if positions is not None:
            return self.cos[positions][:, None], self.sin[positions][:, None]  # [B, 1, T, Dh(/2)]
        return self.cos[offset : offset + T], self.sin[offset : offset + T]  # [T, Dh(/2)] each


# --- ALiBi --------------------------------------------------------------------------------------


def alibi_slopes(num_heads: int) -> Tensor:
    """The head-specific slopes of ALiBi: a geometric sequence starting at ``2^(-8/n)``.

    For a power of two ``H = n`` the slopes are ``2^(-8/n), 2^(-16/n), ...``; otherwise those of
    the next lower power of two followed by every other slope of twice that (the paper's rule).

    Returns:
        float32 ``[H]``.

    Raises:
        ValueError: ``num_heads < 1``.
    """
    if num_heads < 1:
        raise ValueError(f"num_heads must be positive, got {num_heads}")

    def power_of_two(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    closest = 2 ** math.floor(math.log2(num_heads))
    slopes = power_of_two(closest)
    if closest != num_heads:
        slopes += power_of_two(2 * closest)[0::2][: num_heads - closest]
    return torch.tensor(slopes, dtype=torch.float32)


def alibi_bias(
    slopes: Tensor, T: int, S: int, *, causal: bool, device: torch.device | None = None
) -> Tensor:
    """ALiBi score bias ``-slope_h · |p_i - j|`` with query ``i`` at ``p_i = i + S - T``.

    The alignment is bottom-right (the last query is the newest token), as in
    :func:`qkv.attention`'s ``is_causal``, so it is right for cached decoding. With ``causal``
    the future keys (which the causal mask blocks anyway) get bias 0 instead of a penalty.

    Args:
        slopes: ``[H]``.
        T: query length.
        S: key length, ``>= T``.
        causal: the attention is causal.
        device: device of the result.

    Returns:
        float32 ``[1, H, T, S]``.

    Raises:
        ValueError: ``S < T``.
    """
    if S < T:
        raise ValueError(f"ALiBi expects key length S >= query length T, got T={T}, S={S}")
    q_pos = torch.arange(T, device=device) + (S - T)  # [T]
    k_pos = torch.arange(S, device=device)  # [S]
    dist = (q_pos[:, None] - k_pos[None, :]).to(torch.float32)  # [T, S]
    dist = dist.clamp(min=0) if causal else dist.abs()  # [T, S]
    return -slopes.to(device)[None, :, None, None] * dist[None, None]  # [1, H, T, S]


class ALiBi(nn.Module):
    """Holds the ALiBi slopes (not saved) and builds the score bias for a ``[T, S]`` attention.

    Args:
        num_heads: H.
    """

    slopes: Tensor

    def __init__(self, num_heads: int) -> None:
        super().__init__()
        self.register_buffer("slopes", alibi_slopes(num_heads), persistent=False)

    def forward(self, T: int, S: int, *, causal: bool) -> Tensor:
        """Returns float32 ``[1, H, T, S]``; see :func:`alibi_bias`."""
        return alibi_bias(self.slopes, T, S, causal=causal, device=self.slopes.device)
