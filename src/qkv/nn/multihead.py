"""Multi-head attention: project, split heads, call :func:`qkv.attention`, merge, project.

Shapes: B batch, T query length, S key length, D = ``embed_dim``, H heads, Hkv key/value heads
(grouped-query attention when ``Hkv < H``), Dh = D // H.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from qkv._checks import check_bool, check_positive_int
from qkv.functional import Backend, attention
from qkv.masks import StructuredMask
from qkv.nn.mha_call import (
    WEIGHTLESS_BACKENDS,
    batch_first_inputs,
    check_flags,
    merge_masks,
    resolve_need_weights,
    torch_outputs,
)
from qkv.nn.positional import apply_rotary
from qkv.nn.sharded_attention import attend_sharded, check_shardable, sharded_scope

if TYPE_CHECKING:
    from qkv.nn.kv_cache import KVCache
    from qkv.nn.static_kv_cache import StaticKVCache

__all__ = ["WEIGHTLESS_BACKENDS", "MultiHeadAttention"]

# nn.MultiheadAttention's packed keys -> qkv's, for the state-dict pre-hook
_PACKED = ("in_proj_weight", "in_proj_bias")
_SEPARATE = {
    "q_proj_weight": "q_proj.weight",
    "k_proj_weight": "k_proj.weight",
    "v_proj_weight": "v_proj.weight",
}


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


def _check_arguments(
    embed_dim: int,
    num_heads: int,
    num_kv_heads: int,
    kdim: int,
    vdim: int,
    dropout: float,
    scale: float | None,
    add_bias_kv: bool,
    add_zero_attn: bool,
) -> None:
    """The constructor's sizes, rates and refused flags (see :class:`MultiHeadAttention`).

    Raises:
        TypeError: a size that is not an int, a flag that is not a bool.
        ValueError: a non-positive size or scale, a width that does not divide, dropout
            outside [0, 1], ``add_bias_kv`` or ``add_zero_attn`` set.
    """
    if scale is not None and (
        isinstance(scale, bool) or not isinstance(scale, int | float) or not scale > 0
    ):
        raise ValueError(f"scale must be a positive float or None, got {scale!r}")
    for name, val in (
        ("embed_dim", embed_dim),
        ("num_heads", num_heads),
        ("num_kv_heads", num_kv_heads),
        ("kdim", kdim),
        ("vdim", vdim),
    ):
        check_positive_int(name, val)
    if embed_dim % num_heads != 0:
        raise ValueError(
            f"embed_dim={embed_dim} is not divisible by num_heads={num_heads} "
            f"({embed_dim} / {num_heads} = {embed_dim / num_heads:g})"
        )
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads={num_heads} is not divisible by num_kv_heads={num_kv_heads}")
    if not 0.0 <= dropout <= 1.0:
        raise ValueError(f"dropout must lie in [0, 1], got {dropout}")
    for name, flag in (("add_bias_kv", add_bias_kv), ("add_zero_attn", add_zero_attn)):
        if check_bool(name, flag):
            raise ValueError(
                f"{name}=True has no qkv equivalent (qkv attends only to the given keys); "
                f"expected False"
            )


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
        fused_qkv_weight: None, except while :mod:`qkv.models.static_decode` runs the model
            through ``torch.func.functional_call`` with the three projections packed into one
            ``[D + 2 * Hkv * Dh, D]`` matrix (and ``fused_qkv_bias``); self-attention then
            reads that matrix in one product. Not a parameter: never saved or trained.

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
    # Packed self-attention projections, set on an instance only while
    # qkv.models.static_decode runs the model through torch.func.functional_call: the rows of
    # q_proj, k_proj and v_proj stacked ([D + 2 * Hkv * Dh, D], column-major) read by one matrix
    # product per step instead of three (one pass over the weights, as CTranslate2 packs them).
    fused_qkv_weight: Tensor | None = None
    fused_qkv_bias: Tensor | None = None

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
        kdim = embed_dim if kdim is None else kdim
        vdim = embed_dim if vdim is None else vdim
        _check_arguments(
            embed_dim,
            num_heads,
            num_kv_heads,
            kdim,
            vdim,
            dropout,
            scale,
            add_bias_kv,
            add_zero_attn,
        )
        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = embed_dim // num_heads
        self.kdim = kdim
        self.vdim = vdim
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
        return self._rotate_and_store(k, v, rope, kv_cache, layer_idx, cross)

    def _rotate_and_store(
        self,
        k: Tensor,
        v: Tensor,
        rope: tuple[Tensor, Tensor] | None,
        kv_cache: KVCache | StaticKVCache | None,
        layer_idx: int,
        cross: bool,
    ) -> tuple[Tensor, Tensor]:
        """New keys rotated, then both written to the cache (all cached ones returned)."""
        if rope is not None:
            k = apply_rotary(k, *rope)  # [B, Hkv, S, Dh]
        if kv_cache is not None:
            if cross:
                kv_cache.set_cross(layer_idx, k, v)
            else:
                k, v = kv_cache.update(layer_idx, k, v)  # [B, Hkv, S_cached + S, Dh] x 2
        return k, v

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
            key_padding_mask: ``[B, S]`` (``[S]`` unbatched): bool True = ignore, float added.
            need_weights: return the weights; default (None): True unless the backend returns
                none (``WEIGHTLESS_BACKENDS``), where True is a ValueError.
            attn_mask: ``[T, S]`` or ``[B * H, T, S]`` (``[H, T, S]`` unbatched) like PyTorch,
                or 4-D broadcastable to ``[B, H, T, S]``; bool True = ignore, float added.
            average_attn_weights: weights averaged over heads ``[B, T, S]``, or ``[B, H, T, S]``.
            is_causal: block future keys (bottom-right aligned), also with an ``attn_mask``.
            mask: qkv's mask (True = blocked) or a :mod:`qkv.masks` rule, joined to the above.
            attn_bias: float score bias broadcastable to ``[B, H, T, S]`` (ALiBi).
            rope: ``(cos, sin)``, each ``[T, Dh]`` or ``[B, 1, T, Dh]``, for the query positions:
                rotate queries and new keys (self-attention; see :mod:`qkv.nn.positional`).
            kv_cache: append the new keys/values (self-attention) or compute the cross-attention
                ones once and reuse them (``cross=True``); ``S`` then counts every cached key.
            layer_idx: this layer's slot in ``kv_cache``.
            cross: the keys/values come from a fixed source (encoder output), cached as such.

        Returns:
            ``(output in the query's layout, weights as above or None)``, unbatched: no B dim.

        Raises:
            TypeError: a non-tensor or nested input, a mask of another dtype, a non-bool flag.
            ValueError: wrong input widths or ranks, mismatched mask shapes.
        """
        check_flags(need_weights, average_attn_weights, is_causal)
        widths = (self.embed_dim, self.kdim, self.vdim)
        query, key, value, key_padding_mask, unbatched = batch_first_inputs(
            query, key, value, key_padding_mask, widths, self.batch_first
        )  # [B, T, D], [B, S, kdim], [B, S, vdim]
        torch_masks = {"key_padding_mask": key_padding_mask, "attn_mask": attn_mask}
        B, S = query.shape[0], key.shape[1]
        blocked, attn_bias = merge_masks(torch_masks, mask, attn_bias, B, self.num_heads, S)
        q, k, v = self._project(query, key, value, rope, kv_cache, layer_idx, cross)
        out, weights = self._attend(q, k, v, blocked, attn_bias, (is_causal, cross), need_weights)
        return torch_outputs(out, weights, average_attn_weights, unbatched, self.batch_first)

    def _project(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        rope: tuple[Tensor, Tensor] | None,
        kv_cache: KVCache | StaticKVCache | None,
        layer_idx: int,
        cross: bool,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Queries, keys and values projected and split into heads, rotated, cached."""
        if self.fused_qkv_weight is not None and not cross and key is query and value is query:
            kv_width = self.num_kv_heads * self.head_dim
            packed = F.linear(query, self.fused_qkv_weight, self.fused_qkv_bias)  # [B, T, P]
            q, k, v = packed.split((self.embed_dim, kv_width, kv_width), dim=-1)
            q = self._split(q, self.num_heads)  # [B, H, T, Dh]
            k = self._split(k, self.num_kv_heads)  # [B, Hkv, T, Dh]
            v = self._split(v, self.num_kv_heads)  # [B, Hkv, T, Dh]
            k, v = self._rotate_and_store(k, v, rope, kv_cache, layer_idx, cross)
        else:
            q = self._split(self.q_proj(query), self.num_heads)  # [B, H, T, Dh]
            k, v = self._keys_values(key, value, rope, kv_cache, layer_idx, cross)
        if rope is not None:
            q = apply_rotary(q, *rope)  # [B, H, T, Dh]
        return q, k, v  # [B, H, T, Dh], [B, Hkv, S, Dh] x 2

    def _attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        blocked: Tensor | StructuredMask | None,
        attn_bias: Tensor | None,
        flags: tuple[bool, bool],
        need_weights: bool | None,
    ) -> tuple[Tensor, Tensor | None]:
        """:func:`qkv.attention` on the heads, then the output projection; inside a model's
        context-parallel forward, the sharded call of :mod:`qkv.nn.sharded_attention`.

        ``flags`` is ``(is_causal, cross)``.

        Returns:
            ``(output [B, T, D], weights [B, H, T, S] if need_weights else None)``.

        Raises:
            ValueError: ``need_weights=True`` with a backend that returns no weights; what
                context parallelism does not compute (see :func:`check_shardable`).
        """
        is_causal, cross = flags
        if (scope := sharded_scope()) is not None:  # context parallelism: q, k, v are shards
            check_shardable(self, attn_bias, blocked, need_weights)
            return attend_sharded(self, scope, q, k, v, is_causal, cross), None
        need_weights = resolve_need_weights(need_weights, self.backend)
        B, _, T, _ = q.shape
        if is_causal and T == 1:
            # bottom-right alignment puts a lone query at the newest position: it may see every
            # key, so the causal mask would block nothing (the common cached decoding step)
            is_causal = False
        out, weights = attention(
            q,
            k,
            v,
            mask=blocked,
            attn_bias=attn_bias,
            is_causal=is_causal,
            scale=self.scale,
            need_weights=need_weights or self.record_weights,
            dropout_p=self.dropout,
            training=self.training,
            backend=self.backend,
        )  # [B, H, T, Dh], [B, H, T, S] or None
        if self.record_weights and weights is not None:
            self.last_weights = weights.detach()
        out = out.transpose(1, 2).reshape(B, T, self.embed_dim)  # [B, T, D]
        return self.out_proj(out), (weights if need_weights else None)  # [B, T, D]
