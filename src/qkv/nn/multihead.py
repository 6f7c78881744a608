"""Multi-head attention: project, split heads, call :func:`qkv.attention`, merge, project.

Shapes: B batch, T query length, S key length, D = ``embed_dim``, H heads, Hkv key/value heads
(grouped-query attention when ``Hkv < H``), Dh = D // H.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor, nn

from qkv.checks import check_bool, check_positive_int
from qkv.functional import Backend, attention
from qkv.masks import Dense, StructuredMask, combine
from qkv.masks.convert import reshape_mha_attn_mask
from qkv.nn.positional import apply_rotary

if TYPE_CHECKING:
    from qkv.nn.kv_cache import KVCache
    from qkv.nn.static_kv_cache import StaticKVCache

__all__ = ["WEIGHTLESS_BACKENDS", "MultiHeadAttention"]

WEIGHTLESS_BACKENDS = ("fused", "blockwise", "flex")
"""Backends that compute no ``[B, H, T, S]`` weights; a module built for one defaults to
``need_weights=False``."""


# nn.MultiheadAttention's packed keys -> qkv's, for the state-dict pre-hook
_PACKED = ("in_proj_weight", "in_proj_bias")
_SEPARATE = {
    "q_proj_weight": "q_proj.weight",
    "k_proj_weight": "k_proj.weight",
    "v_proj_weight": "v_proj.weight",
}


def _torch_mask(name: str, m: Tensor, B: int, H: int, S: int) -> Tensor:
    """``nn.MultiheadAttention``'s mask shapes as 4-D, broadcastable to ``[B, H, T, S]``.

    ``key_padding_mask``: ``[B, S]``. ``attn_mask``: ``[T, S]``, ``[B * H, T, S]``, or (qkv's
    extension, which PyTorch refuses) any 4-D shape broadcastable to ``[B, H, T, S]``.
    """
    if not isinstance(m, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(m).__name__}")
    if m.dtype != torch.bool and not m.is_floating_point():
        raise TypeError(f"{name} must be bool (True = ignore) or additive float, got {m.dtype}")
    if name == "key_padding_mask":
        if tuple(m.shape) != (B, S):
            raise ValueError(f"key_padding_mask must be [B, S] = [{B}, {S}], got {tuple(m.shape)}")
        return m[:, None, None, :]  # [B, 1, 1, S]
    if m.dim() == 4:
        return m  # [B|1, H|1, T|1, S|1], qkv's extension
    return reshape_mha_attn_mask(m, B, H)  # [1, 1, T, S] or [B, H, T, S]


def _check_flags(**flags: bool | None) -> None:
    """``forward``'s flags are bools (``need_weights`` may be None: the backend's default).

    Raises:
        TypeError: a flag that is not a bool, a tensor named as such (a mask passed where a flag
            stands in the positional order).
    """
    for name, flag in flags.items():
        if isinstance(flag, Tensor):
            raise TypeError(
                f"{name} must be a bool, got a Tensor; the positional order is "
                f"nn.MultiheadAttention's (query, key, value, key_padding_mask, "
                f"need_weights, attn_mask, average_attn_weights, is_causal)"
            )
        if flag is not None:
            check_bool(name, flag)


def _merge_masks(
    torch_masks: dict[str, Tensor | None],
    mask: Tensor | StructuredMask | None,
    attn_bias: Tensor | None,
    B: int,
    H: int,
    S: int,
) -> tuple[Tensor | StructuredMask | None, Tensor | None]:
    """PyTorch-style masks joined to qkv's: bool ones to ``mask``, float ones to ``attn_bias``.

    Args:
        torch_masks: ``key_padding_mask`` / ``attn_mask`` by name, in ``nn.MultiheadAttention``'s
            shapes and senses (see :func:`_torch_mask`), or None.
        mask: qkv's blocked mask (True = blocked) or a :mod:`qkv.masks` rule, or None.
        attn_bias: float score bias broadcastable to ``[B, H, T, S]``, or None.
        B: batch size.
        H: heads.
        S: key length.

    Returns:
        ``(blocked, attn_bias)`` for :func:`qkv.attention`; a rule keeps its structure, with the
        bool PyTorch masks as a ``Dense`` part.

    Raises:
        TypeError / ValueError: as :func:`_torch_mask`.
    """
    blocked_parts: list[Tensor] = []
    for name, m in torch_masks.items():
        if m is None:
            continue
        m4 = _torch_mask(name, m, B, H, S)  # [B|1, H|1, T|1, S]
        if m4.dtype == torch.bool:
            blocked_parts.append(m4)
        else:  # PyTorch adds a float mask to the scores: so does qkv
            attn_bias = m4 if attn_bias is None else attn_bias + m4  # [B|1, H|1, T|1, S]
    dense = combine(*blocked_parts)
    if isinstance(mask, StructuredMask):
        # keep the structure (blockwise skips its empty tiles); PyTorch-style masks join it
        # as a dense part
        return (mask if dense is None else mask | Dense(dense)), attn_bias
    return combine(mask, dense), attn_bias


def _load_torch_keys(
    module: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    *_: Any,
) -> None:
    """Load-state-dict pre-hook: rename ``nn.MultiheadAttention`` keys to qkv's in place.

    ``in_proj_weight [3D, D]`` / ``in_proj_bias [3D]`` are split into the three projections
    (by their widths, so a grouped-query module takes only a matching packed tensor);
    ``q_proj_weight`` & co. are renamed; ``out_proj.*`` is spelled alike. A qkv state dict
    passes unchanged.

    Raises:
        ValueError: the state dict holds ``bias_k`` / ``bias_v`` (``add_bias_kv``), which qkv
            does not have.
    """
    assert isinstance(module, MultiHeadAttention)
    for extra in ("bias_k", "bias_v"):
        if prefix + extra in state_dict:
            raise ValueError(
                f"state dict key {prefix + extra!r} comes from add_bias_kv=True, which "
                f"qkv.MultiHeadAttention does not have"
            )
    projs = ("q_proj", "k_proj", "v_proj")
    widths = [getattr(module, p).out_features for p in projs]
    for key, kind in zip(_PACKED, ("weight", "bias"), strict=True):
        packed = state_dict.pop(prefix + key, None)
        if packed is None:
            continue
        if packed.shape[0] != sum(widths):
            raise ValueError(
                f"{prefix + key} has {packed.shape[0]} rows, expected {sum(widths)} "
                f"(q, k, v widths {widths})"
            )
        for proj, part in zip(projs, packed.split(widths), strict=True):
            state_dict[f"{prefix}{proj}.{kind}"] = part  # [width, D] or [width]
    for torch_key, qkv_key in _SEPARATE.items():
        if prefix + torch_key in state_dict:
            state_dict[prefix + qkv_key] = state_dict.pop(prefix + torch_key)


class MultiHeadAttention(nn.Module):
    """Multi-head attention with independent Q, K, V and output projections.

    A drop-in for ``nn.MultiheadAttention``: the same positional constructor and call orders,
    mask senses (bool True = ignore, float added to the scores), unbatched ``[L, E]`` input and
    state dicts (``in_proj_weight`` & co. load through a hook). The differences, each deliberate:
    ``batch_first=True`` by default; a fully blocked query row gives weights 0 (PyTorch: NaN)
    with bool masks; ``key``/``value`` default to ``query``; ``is_causal=True`` needs no
    ``attn_mask`` and is applied, not just a hint; ``add_bias_kv`` / ``add_zero_attn`` are refused.

    Args:
        embed_dim: D, width of queries and of the output.
        num_heads: H; must divide ``embed_dim``.
        dropout: dropout on the attention weights in training.
        bias: add biases to the four projections.
        add_bias_kv: PyTorch's learned extra key/value; must be False (no qkv equivalent).
        add_zero_attn: PyTorch's extra zero key/value; must be False (no qkv equivalent).
        kdim: width of the key input (cross-attention from a source of another width).
        vdim: width of the value input.
        batch_first: inputs are ``[B, T, D]`` (True, the default) or ``[T, B, D]`` (False).
        qkv_bias: biases on the query/key/value projections only (default ``bias``; Qwen2 has
            them without an output bias).
        out_bias: a bias on the output projection (default ``bias``).
        device: parameter device.
        dtype: parameter dtype.
        num_kv_heads: Hkv for grouped-query (``1``: multi-query) attention; must divide
            ``num_heads``. Default: ``num_heads`` (standard multi-head attention).
        backend: attention backend passed to :func:`qkv.attention` (see ``qkv.explain_backend``).
        scale: score multiplier (default ``1 / sqrt(Dh)``; T5 folds it into its weights: 1.0).

    Attributes:
        record_weights: when True, every forward keeps its per-head weights ``[B, H, T, S]``
            (detached) in ``last_weights``, for plots. Off by default: it costs the fast path.

    Raises:
        TypeError: a size that is not an int (a bool included: ``num_heads=True`` is no count),
            or a flag that is not a bool.
        ValueError: a width that does not divide, non-positive sizes, dropout outside [0, 1],
            ``add_bias_kv`` or ``add_zero_attn`` set.
    """

    # What PyTorch code reads on an nn.MultiheadAttention (nn.TransformerEncoderLayer's fast-path
    # check among it). qkv never packs Q, K, V into one in_proj_weight, so the answer is the one
    # PyTorch gives for separate projections: the fast path (which would read packed weights)
    # is declined and the layer calls this module.
    _qkv_same_embed_dim: ClassVar[bool] = False
    in_proj_weight: ClassVar[None] = None
    bias_k: ClassVar[None] = None
    bias_v: ClassVar[None] = None
    add_zero_attn: ClassVar[bool] = False

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        num_kv_heads: int | None = None,
        qkv_bias: bool | None = None,
        out_bias: bool | None = None,
        backend: Backend = "auto",
        scale: float | None = None,
    ) -> None:
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if scale is not None and (
            isinstance(scale, bool) or not isinstance(scale, int | float) or not scale > 0
        ):
            raise ValueError(f"scale must be a positive float or None, got {scale!r}")
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
        for name, flag in (("add_bias_kv", add_bias_kv), ("add_zero_attn", add_zero_attn)):
            if check_bool(name, flag):
                raise ValueError(
                    f"{name}=True has no qkv equivalent (qkv attends only to the given keys); "
                    f"expected False"
                )
        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = embed_dim // num_heads
        self.kdim = embed_dim if kdim is None else kdim
        self.vdim = embed_dim if vdim is None else vdim
        self.dropout = dropout
        self.batch_first = check_bool("batch_first", batch_first)
        kv_width = num_kv_heads * self.head_dim
        in_bias = bias if qkv_bias is None else qkv_bias
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=in_bias, **factory)
        self.k_proj = nn.Linear(self.kdim, kv_width, bias=in_bias, **factory)
        self.v_proj = nn.Linear(self.vdim, kv_width, bias=in_bias, **factory)
        out_b = bias if out_bias is None else out_bias
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=out_b, **factory)
        self.record_weights = False
        self.backend: Backend = backend
        self.scale = None if scale is None else float(scale)
        self.last_weights: Tensor | None = None
        self.register_load_state_dict_pre_hook(_load_torch_keys)

    @property
    def in_proj_bias(self) -> Tensor | None:
        """The three input biases concatenated ``[D + 2 * Hkv * Dh]`` (PyTorch's packed bias,
        read by its fast-path checks), or None without biases."""
        biases = [p.bias for p in (self.q_proj, self.k_proj, self.v_proj)]
        if any(b is None for b in biases):
            return None
        return torch.cat([b for b in biases if b is not None])  # [D + 2 * Hkv * Dh]

    @property
    def q_proj_weight(self) -> Tensor:
        """``q_proj.weight`` under PyTorch's name for separate projections."""
        return self.q_proj.weight

    @property
    def k_proj_weight(self) -> Tensor:
        """``k_proj.weight`` under PyTorch's name for separate projections."""
        return self.k_proj.weight

    @property
    def v_proj_weight(self) -> Tensor:
        """``v_proj.weight`` under PyTorch's name for separate projections."""
        return self.v_proj.weight

    def _split(self, x: Tensor, heads: int) -> Tensor:
        B, L, _ = x.shape
        return x.view(B, L, heads, self.head_dim).transpose(1, 2)  # [B, heads, L, Dh]

    def _keys_values(
        self,
        key: Tensor,
        value: Tensor,
        rope: tuple[Tensor, Tensor] | None,
        kv_cache: KVCache | StaticKVCache | None,
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

    def _check_input(self, name: str, x: object, width: int, rank: int) -> None:
        if not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.is_nested:
            raise TypeError(
                f"{name} is a nested tensor, which qkv.MultiHeadAttention does not take (build "
                f"nn.TransformerEncoder with enable_nested_tensor=False)"
            )
        if x.dim() != rank or x.shape[-1] != width:
            layout = {2: "[L, D] (unbatched)", 3: "[B, L, D]" if self.batch_first else "[L, B, D]"}
            raise ValueError(f"{name} must be {layout[rank]} with D={width}, got {tuple(x.shape)}")

    def _need_weights(self, need_weights: bool | None) -> bool:
        """``need_weights`` resolved: None is True unless the backend returns no weights.

        Raises:
            ValueError: True with a backend that returns no weights.
        """
        weightless = self.backend in WEIGHTLESS_BACKENDS
        if need_weights is None:
            return not weightless
        if need_weights and weightless:
            raise ValueError(
                f"need_weights=True, but this module was built with backend={self.backend!r}, "
                "which returns no weights: call it with need_weights=False (or leave it unset), "
                "or build it with backend='reference' or 'auto'"
            )
        return need_weights

    def _to_batch_first(self, x: Tensor, unbatched: bool) -> Tensor:
        if unbatched:
            return x[None]  # [1, L, D]
        return x if self.batch_first else x.transpose(0, 1)  # [B, L, D]

    def forward(
        self,
        query: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        need_weights: bool | None = None,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
        *,
        mask: Tensor | StructuredMask | None = None,
        attn_bias: Tensor | None = None,
        rope: tuple[Tensor, Tensor] | None = None,
        kv_cache: KVCache | StaticKVCache | None = None,
        layer_idx: int = 0,
        cross: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """Attend from ``query`` to ``key``/``value``; ``nn.MultiheadAttention.forward``'s order.

        Args:
            query: ``[B, T, D]`` (``[T, B, D]`` if not ``batch_first``; ``[T, D]`` unbatched).
            key: ``[B, S, kdim]``, same layout; default ``query``.
            value: ``[B, S, vdim]``, same layout; default ``key``.
            key_padding_mask: ``[B, S]`` (``[S]`` unbatched), bool True = ignore, or float
                added to the scores (``nn.MultiheadAttention``'s senses).
            need_weights: return the attention weights. Default (None): True, as in
                ``nn.MultiheadAttention``, unless the module was built for a backend that
                cannot return them (``"fused"``, ``"blockwise"``): then False. True with such
                a backend is a ValueError.
            attn_mask: ``[T, S]`` or ``[B * H, T, S]`` (``[H, T, S]`` unbatched) like PyTorch,
                or 4-D broadcastable to ``[B, H, T, S]``; bool True = ignore, or float added
                to the scores.
            average_attn_weights: average the weights over heads (``[B, T, S]``) or not
                (``[B, H, T, S]``).
            is_causal: block future keys (bottom-right aligned, see :func:`qkv.attention`);
                with an ``attn_mask`` both apply (PyTorch treats it as a hint that the mask is
                causal, which gives the same result when the hint is right).
            mask: a mask in qkv's convention (True = blocked, broadcastable to
                ``[B, H, T, S]``) or a :mod:`qkv.masks` object, combined with the
                two above.
            attn_bias: float score bias broadcastable to ``[B, H, T, S]`` (ALiBi).
            rope: ``(cos, sin)``, each ``[T, Dh]`` (or ``[B, 1, T, Dh]``: positions per row), for
                the query positions: rotate queries and the new keys (self-attention only; see
                :mod:`qkv.nn.positional`).
            kv_cache: append the new keys/values to this cache (self-attention) or compute the
                cross-attention keys/values once and reuse them (``cross=True``). ``S`` then
                counts every cached key; masks must cover all of them.
            layer_idx: this layer's slot in ``kv_cache``.
            cross: the keys/values come from a fixed source (encoder output) and are cached as
                such.

        Returns:
            ``(output, weights or None)``: output in the query's layout, weights
            ``[B, T, S]`` averaged or ``[B, H, T, S]`` (without the B dim when unbatched).

        Raises:
            TypeError: a non-tensor input, a nested tensor, a mask of another dtype, a flag that
                is not a bool (e.g. a mask passed where ``need_weights`` stands).
            ValueError: wrong input widths or ranks, mismatched mask shapes.
        """
        _check_flags(
            need_weights=need_weights,
            average_attn_weights=average_attn_weights,
            is_causal=is_causal,
        )
        key = query if key is None else key
        value = key if value is None else value
        unbatched = isinstance(query, Tensor) and query.dim() == 2
        rank = 2 if unbatched else 3
        self._check_input("query", query, self.embed_dim, rank)
        self._check_input("key", key, self.kdim, rank)
        self._check_input("value", value, self.vdim, rank)
        query, key, value = (self._to_batch_first(x, unbatched) for x in (query, key, value))
        if unbatched and key_padding_mask is not None:
            key_padding_mask = key_padding_mask[None]  # [1, S]
        B, T, _ = query.shape
        S = key.shape[1]
        if key.shape[0] != B or value.shape[:2] != key.shape[:2]:
            raise ValueError(
                f"query, key and value must share B (and key/value S): got query "
                f"{tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}"
            )
        torch_masks = {"key_padding_mask": key_padding_mask, "attn_mask": attn_mask}
        blocked, attn_bias = _merge_masks(torch_masks, mask, attn_bias, B, self.num_heads, S)
        q = self._split(self.q_proj(query), self.num_heads)  # [B, H, T, Dh]
        k, v = self._keys_values(key, value, rope, kv_cache, layer_idx, cross)
        if rope is not None:
            q = apply_rotary(q, *rope)  # [B, H, T, Dh]
        if is_causal and T == 1:
            # bottom-right alignment puts a lone query at the newest position: it may see every
            # key, so the causal mask would block nothing (the common cached decoding step)
            is_causal = False
        need_weights = self._need_weights(need_weights)
        want_weights = need_weights or self.record_weights
        out, weights = attention(
            q,
            k,
            v,
            mask=blocked,
            attn_bias=attn_bias,
            is_causal=is_causal,
            scale=self.scale,
            need_weights=want_weights,
            dropout_p=self.dropout,
            training=self.training,
            backend=self.backend,
        )  # [B, H, T, Dh], [B, H, T, S] or None
        if self.record_weights and weights is not None:
            self.last_weights = weights.detach()
        out = out.transpose(1, 2).reshape(B, T, self.embed_dim)  # [B, T, D]
        out = self.out_proj(out)  # [B, T, D]
        if unbatched:
            out = out[0]  # [T, D]
        elif not self.batch_first:
            out = out.transpose(0, 1)  # [T, B, D]
        if not need_weights or weights is None:
            return out, None
        weights = weights.mean(dim=1) if average_attn_weights else weights  # [B, (H,) T, S]
        return out, (weights[0] if unbatched else weights)
