"""Multi-head attention: project, split heads, call :func:`qkv.attention`, merge, project.

Shapes: B batch, T query length, S key length, D = ``embed_dim``, H heads, Hkv key/value heads
(grouped-query attention when ``Hkv < H``), Dh = D // H.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from qkv.checks import check_positive_int
from qkv.functional import Backend, attention
from qkv.masks import (
    Dense,
    StructuredMask,
    combine,
    from_additive,
    from_mha_attn_mask,
    padding_mask,
)
from qkv.nn.positional import apply_rotary

if TYPE_CHECKING:
    from qkv.nn.kv_cache import KVCache

__all__ = ["WEIGHTLESS_BACKENDS", "MultiHeadAttention"]

WEIGHTLESS_BACKENDS = ("fused", "blockwise")
"""Backends that compute no ``[B, H, T, S]`` weights; a module built for one defaults to
``need_weights=False``."""


def _mha_key_padding(key_padding_mask: Tensor, B: int, S: int) -> Tensor:
    kpm = key_padding_mask
    if kpm.dtype != torch.bool:
        if not kpm.is_floating_point():
            raise TypeError(
                f"key_padding_mask must be bool (True = ignore) or additive float, got {kpm.dtype}"
            )
        kpm = from_additive(kpm)
    if tuple(kpm.shape) != (B, S):
        raise ValueError(f"key_padding_mask must be [B, S] = [{B}, {S}], got {tuple(kpm.shape)}")
    return padding_mask(kpm)  # [B, 1, 1, S]


class MultiHeadAttention(nn.Module):
    """Multi-head attention with independent Q, K, V and output projections.

    A drop-in for ``nn.MultiheadAttention``'s call (same mask senses: True = ignore there), with
    three differences: ``batch_first=True`` by default, a fully padded sample gives output 0
    instead of NaN, and ``key``/``value`` default to ``query`` (self-attention).

    Args:
        embed_dim: D, width of queries and of the output.
        num_heads: H; must divide ``embed_dim``.
        num_kv_heads: Hkv for grouped-query (``1``: multi-query) attention; must divide
            ``num_heads``. Default: ``num_heads`` (standard multi-head attention).
        kdim: width of the key input (cross-attention from a source of another width).
        vdim: width of the value input.
        bias: add biases to the four projections.
        dropout: dropout on the attention weights in training.
        batch_first: inputs are ``[B, T, D]`` (True) or ``[T, B, D]`` (False).
        device: parameter device.
        dtype: parameter dtype.
        backend: attention backend passed to :func:`qkv.attention` (see ``qkv.explain_backend``).

    Attributes:
        record_weights: when True, every forward keeps its per-head weights ``[B, H, T, S]``
            (detached) in ``last_weights``, for plots. Off by default: it costs the fast path.

    Raises:
        TypeError: a size that is not an int (a bool included: ``num_heads=True`` is no count).
        ValueError: a width that does not divide, non-positive sizes, dropout outside [0, 1].
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        kdim: int | None = None,
        vdim: int | None = None,
        bias: bool = True,
        dropout: float = 0.0,
        batch_first: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        backend: Backend = "auto",
    ) -> None:
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        for name, val in (
            ("embed_dim", embed_dim),
            ("num_heads", num_heads),
            ("num_kv_heads", num_kv_heads),
            ("kdim", embed_dim if kdim is None else kdim),
            ("vdim", embed_dim if vdim is None else vdim),
        ):
            check_positive_int(name, val)
        if embed_dim % num_heads != 0:
            raise ValueError(
                f"embed_dim={embed_dim} is not divisible by num_heads={num_heads} "
                f"({embed_dim} / {num_heads} = {embed_dim / num_heads:g})"
            )
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_heads={num_heads} is not divisible by num_kv_heads={num_kv_heads}"
            )
        if not 0.0 <= dropout <= 1.0:
            raise ValueError(f"dropout must lie in [0, 1], got {dropout}")
        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = embed_dim // num_heads
        self.kdim = embed_dim if kdim is None else kdim
        self.vdim = embed_dim if vdim is None else vdim
        self.dropout = dropout
        self.batch_first = batch_first
        kv_width = num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.k_proj = nn.Linear(self.kdim, kv_width, bias=bias, **factory)
        self.v_proj = nn.Linear(self.vdim, kv_width, bias=bias, **factory)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.record_weights = False
        self.backend: Backend = backend
        self.last_weights: Tensor | None = None

    def _split(self, x: Tensor, heads: int) -> Tensor:
        B, L, _ = x.shape
        return x.view(B, L, heads, self.head_dim).transpose(1, 2)  # [B, heads, L, Dh]

    def _keys_values(
        self,
        key: Tensor,
        value: Tensor,
        rope: tuple[Tensor, Tensor] | None,
        kv_cache: KVCache | None,
        layer_idx: int,
        cross: bool,
    ) -> tuple[Tensor, Tensor]:
        if kv_cache is not None and cross:
            stored = kv_cache.get_cross(layer_idx)
            if stored is not None:
                return stored  # [B, Hkv, S, Dh] x 2, projected at the first step
        k = self._split(self.k_proj(key), self.num_kv_heads)  # [B, Hkv, S, Dh]
        v = self._split(self.v_proj(value), self.num_kv_heads)  # [B, Hkv, S, Dh]
        if rope is not None:
            k = apply_rotary(k, *rope)  # [B, Hkv, S, Dh]
        if kv_cache is not None:
            if cross:
                kv_cache.set_cross(layer_idx, k, v)
            else:
                k, v = kv_cache.update(layer_idx, k, v)  # [B, Hkv, S_cached + S, Dh] x 2
        return k, v

    def _check_input(self, name: str, x: Tensor, width: int) -> None:
        if not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 3 or x.shape[-1] != width:
            layout = "[B, L, D]" if self.batch_first else "[L, B, D]"
            raise ValueError(f"{name} must be {layout} with D={width}, got {tuple(x.shape)}")

    def forward(
        self,
        query: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        attn_mask: Tensor | None = None,
        need_weights: bool | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
        *,
        mask: Tensor | StructuredMask | None = None,
        attn_bias: Tensor | None = None,
        rope: tuple[Tensor, Tensor] | None = None,
        kv_cache: KVCache | None = None,
        layer_idx: int = 0,
        cross: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """Attend from ``query`` to ``key``/``value``.

        Args:
            query: ``[B, T, D]`` (``[T, B, D]`` if not ``batch_first``).
            key: ``[B, S, kdim]``; default ``query``.
            value: ``[B, S, vdim]``; default ``key``.
            key_padding_mask: ``[B, S]``, bool True = ignore, or additive float
                (``nn.MultiheadAttention``'s sense).
            attn_mask: ``[T, S]`` or ``[B * H, T, S]``, bool True = ignore, or additive float.
            need_weights: return the attention weights. Default (None): True, as in
                ``nn.MultiheadAttention``, unless the module was built for a backend that
                cannot return them (``"fused"``, ``"blockwise"``): then False. True with such
                a backend is a ValueError.
            average_attn_weights: average the weights over heads (``[B, T, S]``) or not
                (``[B, H, T, S]``).
            is_causal: block future keys (bottom-right aligned, see :func:`qkv.attention`).
            mask: a mask in qkv's convention (True = blocked, broadcastable to
                ``[B, H, T, S]``) or a :mod:`qkv.masks` object, combined with the
                two above.
            attn_bias: float score bias broadcastable to ``[B, H, T, S]`` (ALiBi).
            rope: ``(cos, sin)``, each ``[T, Dh]``, for the query positions: rotate queries and
                the new keys (self-attention only; see :mod:`qkv.nn.positional`).
            kv_cache: append the new keys/values to this cache (self-attention) or compute the
                cross-attention keys/values once and reuse them (``cross=True``). ``S`` then
                counts every cached key; masks must cover all of them.
            layer_idx: this layer's slot in ``kv_cache``.
            cross: the keys/values come from a fixed source (encoder output) and are cached as
                such.

        Returns:
            ``(output [B, T, D], weights or None)``.

        Raises:
            TypeError / ValueError: wrong input widths or ranks, mismatched mask shapes.
        """
        key = query if key is None else key
        value = key if value is None else value
        self._check_input("query", query, self.embed_dim)
        self._check_input("key", key, self.kdim)
        self._check_input("value", value, self.vdim)
        if not self.batch_first:
            query, key, value = (x.transpose(0, 1) for x in (query, key, value))  # [B, L, *]
        B, T, _ = query.shape
        S = key.shape[1]
        if key.shape[0] != B or value.shape[:2] != key.shape[:2]:
            raise ValueError(
                f"query, key and value must share B (and key/value S): got query "
                f"{tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}"
            )
        torch_masks = combine(
            None if key_padding_mask is None else _mha_key_padding(key_padding_mask, B, S),
            None if attn_mask is None else from_mha_attn_mask(attn_mask, B, self.num_heads),
        )
        blocked: Tensor | StructuredMask | None
        if isinstance(mask, StructuredMask):
            # keep the structure (blockwise skips its empty tiles); PyTorch-style masks join it
            # as a dense part
            blocked = mask if torch_masks is None else mask | Dense(torch_masks)
        else:
            blocked = combine(mask, torch_masks)
        q = self._split(self.q_proj(query), self.num_heads)  # [B, H, T, Dh]
        k, v = self._keys_values(key, value, rope, kv_cache, layer_idx, cross)
        if rope is not None:
            q = apply_rotary(q, *rope)  # [B, H, T, Dh]
        if is_causal and T == 1:
            # bottom-right alignment puts a lone query at the newest position: it may see every
            # key, so the causal mask would block nothing (the common cached decoding step)
            is_causal = False
        weightless = self.backend in WEIGHTLESS_BACKENDS
        if need_weights is None:
            need_weights = not weightless
        elif need_weights and weightless:
            raise ValueError(
                f"need_weights=True, but this module was built with backend={self.backend!r}, "
                "which returns no weights: call it with need_weights=False (or leave it unset), "
                "or build it with backend='reference' or 'auto'"
            )
        want_weights = need_weights or self.record_weights
        out, weights = attention(
            q,
            k,
            v,
            mask=blocked,
            attn_bias=attn_bias,
            is_causal=is_causal,
            need_weights=want_weights,
            dropout_p=self.dropout,
            training=self.training,
            backend=self.backend,
        )  # [B, H, T, Dh], [B, H, T, S] or None
        if self.record_weights and weights is not None:
            self.last_weights = weights.detach()
        out = out.transpose(1, 2).reshape(B, T, self.embed_dim)  # [B, T, D]
        out = self.out_proj(out)  # [B, T, D]
        if not self.batch_first:
            out = out.transpose(0, 1)  # [T, B, D]
        if not need_weights or weights is None:
            return out, None
        return out, (weights.mean(dim=1) if average_attn_weights else weights)
