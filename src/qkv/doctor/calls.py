"""One attention call as the doctor sees it, whatever API made it.

Every intercepted call (PyTorch SDPA, ``F.multi_head_attention_forward``, flex attention,
``qkv.attention``, a ``transformers`` attention function) is read into one
:class:`AttentionCall`: the query and keys as ``[B, H, T, Dh]`` / ``[B, Hkv, S, Dh]``, the output
as ``[B, H|1, T, Dv]``, and the mask **as the API read it**, in qkv's sense (bool, True =
blocked) or as an additive float tensor. The readers here only reshape and translate
conventions; judging is :mod:`qkv.doctor.judge`'s.

Shapes: B batch, H query heads, Hkv key/value heads, T queries, S keys, Dh head width.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from qkv.doctor.weights import weights_rows
from qkv.masks import causal_mask
from qkv.masks.validate import as_4d

__all__ = [
    "AttentionCall",
    "CausalAlign",
    "MaskReading",
    "from_flex",
    "from_hf_function",
    "from_mha",
    "from_qkv",
    "from_sdpa",
]

CausalAlign = Literal["top_left", "bottom_right"]
MaskReading = Literal["sdpa", "mha", "qkv", "flex", "hf"]

_READING_TEXT: dict[str, str] = {
    "sdpa": "PyTorch SDPA reads a bool mask as True = may attend",
    "mha": "nn.MultiheadAttention reads a bool mask as True = ignore",
    "qkv": "qkv reads a bool mask as True = blocked",
    "flex": "flex attention's mask_mod returns True = may attend",
    "hf": "transformers reads a bool mask as True = may attend",
}


@dataclass
class AttentionCall:
    """One attention call, normalized.

    Attributes:
        api: the function called (``"F.scaled_dot_product_attention"``, ...).
        query: ``[B, H, T, Dh]``.
        key: ``[B, Hkv, S, Dh]``.
        value: ``[B, Hkv, S, Dv]``.
        output: ``[B, H|1, T, Dv]`` view of what the call returned, or None.
        scale: the score multiplier the call used.
        blocked: bool mask as the API read it, True = blocked, 4-D broadcastable to
            ``[B, H, T, S]``, or None.
        additive: float mask added to the scores, 4-D broadcastable, or None.
        bias: a float score bias that is not a mask (T5 position bias), 4-D, or None.
        causal: the causal flag's alignment, or None when no flag was set.
        reading: how the API reads a bool mask (for ``inverted_mask``).
        mask_shape: the mask's shape as the caller passed it (for ``mask_broadcast``).
        exact: False when a part of the scores is unknown (a flex ``score_mod``): weight-based
            checks are skipped.
    """

    api: str
    query: Tensor
    key: Tensor
    value: Tensor
    output: Tensor | None
    scale: float
    blocked: Tensor | None = None
    additive: Tensor | None = None
    bias: Tensor | None = None
    causal: CausalAlign | None = None
    reading: MaskReading = "sdpa"
    mask_shape: tuple[int, ...] | None = None
    exact: bool = True

    def hard_blocked(self) -> Tensor | None:
        """The bool mask with the causal flag folded in (True = blocked), 4-D, or None."""
        if self.causal is None:
            return self.blocked
        T, S = self.query.shape[2], self.key.shape[2]
        align: CausalAlign | None = "top_left" if self.causal == "top_left" else None
        causal = causal_mask(T, S, align=align, device=self.query.device)  # [1, 1, T, S]
        return causal if self.blocked is None else self.blocked | causal

    def weights(
        self,
        b: int,
        r0: int,
        r1: int,
        *,
        heads: slice = slice(None),
        blocked: Tensor | None = None,
    ) -> Tensor:
        """The exact weights of sample ``b``, query rows ``r0:r1``, as this call computes them
        (its mask, additive mask, bias and causal flag; ``blocked`` replaces the bool mask).

        Returns:
            ``[h, r1 - r0, S]`` (see :func:`qkv.doctor.weights.weights_rows`).
        """
        return weights_rows(
            self.query,
            self.key,
            self.scale,
            b,
            r0,
            r1,
            blocked=self.blocked if blocked is None else blocked,
            additive=self.additive,
            bias=self.bias,
            heads=heads,
            causal=self.causal,
        )  # [h, rows, S]

    @property
    def reading_text(self) -> str:
        """How the API reads a bool mask, in words."""
        return _READING_TEXT[self.reading]


def _split_mask(mask: Tensor | None, attend_is_true: bool) -> tuple[Tensor | None, Tensor | None]:
    """A mask of either dtype as (bool blocked, additive float), 4-D."""
    if mask is None:
        return None, None
    if mask.dtype == torch.bool:
        return as_4d(~mask if attend_is_true else mask), None
    return None, as_4d(mask)


def _default_scale(query: Tensor, scale: float | None) -> float:
    return 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)


def from_sdpa(args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> AttentionCall:
    """``F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale, ...)``."""
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
    bound = dict(zip(names, args, strict=False)) | kwargs
    q, k, v = bound["query"], bound["key"], bound["value"]
    mask = bound.get("attn_mask")
    blocked, additive = _split_mask(mask, attend_is_true=True)
    return AttentionCall(
        api="F.scaled_dot_product_attention",
        query=as_4d(q),
        key=as_4d(k),
        value=as_4d(v),
        output=as_4d(output) if isinstance(output, Tensor) else None,
        scale=_default_scale(q, bound.get("scale")),
        blocked=blocked,
        additive=additive,
        causal="top_left" if bound.get("is_causal") else None,
        reading="sdpa",
        mask_shape=None if mask is None else tuple(mask.shape),
    )


def _mha_project(
    query: Tensor,
    key: Tensor,
    num_heads: int,
    in_proj_weight: Tensor | None,
    in_proj_bias: Tensor | None,
    separate: tuple[Tensor | None, Tensor | None],
    bias_k: Tensor | None,
    add_zero_attn: bool,
) -> tuple[Tensor, Tensor]:
    """The per-head queries and keys ``F.multi_head_attention_forward`` computes.

    ``query`` / ``key`` are ``[T, B, E]`` / ``[S, B, Ek]`` (PyTorch's internal layout).
    """
    E = query.shape[-1]
    Dh = E // num_heads
    if in_proj_weight is not None:
        w_q, w_k = in_proj_weight[:E], in_proj_weight[E : 2 * E]
    else:
        sep_q, sep_k = separate  # q_proj_weight, k_proj_weight
        assert sep_q is not None and sep_k is not None
        w_q, w_k = sep_q, sep_k
    b_q = b_k = None
    if in_proj_bias is not None:
        b_q, b_k = in_proj_bias[:E], in_proj_bias[E : 2 * E]
    q = F.linear(query, w_q, b_q)  # [T, B, E]
    k = F.linear(key, w_k, b_k)  # [S, B, E]
    if bias_k is not None:
        k = torch.cat([k, bias_k.expand(1, k.shape[1], E)])  # [S+1, B, E]
    if add_zero_attn:
        k = torch.cat([k, k.new_zeros(1, k.shape[1], E)])  # [S+1, B, E]
    T, B = q.shape[0], q.shape[1]
    q = q.reshape(T, B, num_heads, Dh).permute(1, 2, 0, 3)  # [B, H, T, Dh]
    k = k.reshape(k.shape[0], B, num_heads, Dh).permute(1, 2, 0, 3)  # [B, H, S, Dh]
    return q, k


def _mha_extra_keys(mask: Tensor, extra: int, dim: int) -> Tensor:
    """Pad a mask with ``extra`` attended key columns (for ``bias_k`` / ``add_zero_attn``)."""
    if extra == 0:
        return mask
    shape = list(mask.shape)
    shape[dim] = extra
    return torch.cat([mask, mask.new_zeros(shape)], dim=dim)


def from_mha(
    args: tuple[Any, ...], kwargs: dict[str, Any], output: Any, *, api: str, batch_first: bool
) -> AttentionCall:
    """``F.multi_head_attention_forward``'s arguments (or an ``nn.MultiheadAttention`` call
    re-expressed as them): query/key/value ``[T, B, E]`` (``[B, T, E]`` when ``batch_first``),
    ``key_padding_mask`` ``[B, S]`` and ``attn_mask`` ``[T, S]`` / ``[B*H, T, S]``, bool True =
    ignore or additive float."""
    query, key = kwargs["query"], kwargs["key"]
    if query.dim() == 2:  # unbatched [T, E]
        query, key = query.unsqueeze(1), key.unsqueeze(1)  # [T, 1, E]
    elif batch_first:
        query, key = query.transpose(0, 1), key.transpose(0, 1)  # [T, B, E]
    H = int(kwargs["num_heads"])
    extra = int(kwargs.get("bias_k") is not None) + int(bool(kwargs.get("add_zero_attn")))
    q, k = _mha_project(
        query,
        key,
        H,
        kwargs.get("in_proj_weight"),
        kwargs.get("in_proj_bias"),
        (kwargs.get("q_proj_weight"), kwargs.get("k_proj_weight")),
        kwargs.get("bias_k"),
        bool(kwargs.get("add_zero_attn")),
    )  # [B, H, T, Dh], [B, H, S, Dh]
    B, T, S = q.shape[0], q.shape[2], k.shape[2]
    blocked: Tensor | None = None
    additive: Tensor | None = None
    shapes: list[tuple[int, ...]] = []
    kpm = kwargs.get("key_padding_mask")
    if kpm is not None:
        shapes.append(tuple(kpm.shape))
        kpm = _mha_extra_keys(kpm.reshape(B, -1), extra, 1).reshape(B, 1, 1, S)  # [B, 1, 1, S]
        blocked, additive = _split_mask(kpm, attend_is_true=False)
    am = kwargs.get("attn_mask")
    if am is not None:
        shapes.append(tuple(am.shape))
        am = _mha_extra_keys(am, extra, -1)
        am = am.reshape(B, H, T, S) if am.dim() == 3 else am.reshape(1, 1, T, S)  # 4-D
        b2, a2 = _split_mask(am, attend_is_true=False)
        blocked = b2 if blocked is None else (blocked if b2 is None else blocked | b2)
        additive = a2 if additive is None else (additive if a2 is None else additive + a2)
    out = output[0] if isinstance(output, tuple) else output
    if isinstance(out, Tensor):
        if out.dim() == 2:
            out = out.unsqueeze(1)  # [T, 1, E]
        out4 = (out if batch_first else out.transpose(0, 1)).unsqueeze(1)  # [B, 1, T, E]
        if out4.shape[0] != B and out.dim() == 3:  # batch_first module re-laid out its input
            out4 = out.transpose(0, 1).unsqueeze(1)
    else:
        out4 = None
    scale = 1.0 / math.sqrt(q.shape[-1])
    return AttentionCall(
        api=api,
        query=q,
        key=k,
        value=k,
        output=out4,
        scale=scale,
        blocked=blocked,
        additive=additive,
        causal=None,  # F.mha_forward's is_causal is only a hint about attn_mask
        reading="mha",
        mask_shape=shapes[-1] if shapes else None,
    )


def from_qkv(args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> AttentionCall:
    """``qkv.attention(query, key, value, *, mask, attn_bias, is_causal, scale, ...)``."""
    q, k, v = ((*args, None, None, None))[:3]
    q, k, v = kwargs.get("query", q), kwargs.get("key", k), kwargs.get("value", v)
    mask = kwargs.get("mask")
    B, H, T, S = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    if mask is not None and not isinstance(mask, Tensor):
        mask = mask.materialize(B, H, T, S, q.device)  # a rule, True = blocked
    bias = kwargs.get("attn_bias", kwargs.get("bias"))
    out = output[0] if isinstance(output, tuple) else output
    return AttentionCall(
        api="qkv.attention",
        query=q,
        key=k,
        value=v,
        output=out if isinstance(out, Tensor) else None,
        scale=_default_scale(q, kwargs.get("scale")),
        blocked=None if mask is None else as_4d(mask),
        bias=None if bias is None else as_4d(bias),
        causal="bottom_right" if kwargs.get("is_causal") else None,
        reading="qkv",
        mask_shape=None if mask is None else tuple(mask.shape),
    )


def flex_blocked(mask_mod: Any, B: int, H: int, T: int, S: int, device: torch.device) -> Tensor:
    """A flex ``mask_mod`` (True = may attend) evaluated on the whole grid, in qkv's sense."""
    b = torch.arange(B, device=device).view(B, 1, 1, 1)
    h = torch.arange(H, device=device).view(1, H, 1, 1)
    qi = torch.arange(T, device=device).view(1, 1, T, 1)
    ki = torch.arange(S, device=device).view(1, 1, 1, S)
    keep = torch.as_tensor(mask_mod(b, h, qi, ki), device=device)
    return ~keep.expand(B, H, T, S)  # [B, H, T, S]


def from_flex(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    output: Tensor | None,
    scale: float | None,
    mask_mod: Any,
    has_score_mod: bool,
    api: str = "flex_attention",
) -> AttentionCall:
    """A flex attention call: its block mask's ``mask_mod`` read on the whole grid."""
    B, H, T, S = query.shape[0], query.shape[1], query.shape[2], key.shape[2]
    blocked = None if mask_mod is None else flex_blocked(mask_mod, B, H, T, S, query.device)
    return AttentionCall(
        api=api,
        query=query,
        key=key,
        value=value,
        output=output,
        scale=_default_scale(query, scale),
        blocked=blocked,
        reading="flex",
        mask_shape=None if blocked is None else (B, H, T, S),
        exact=not has_score_mod,
    )


def from_hf_function(
    implementation: str,
    module: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    output: Any,
) -> AttentionCall:
    """A ``transformers`` attention function's call, read with the ``eager`` semantics: the
    mask is additive (float) or bool True = attend, ``is_causal`` is not applied, and a
    ``position_bias`` (T5) is a score bias."""
    names = ("query", "key", "value", "attention_mask")
    bound = dict(zip(names, args, strict=False)) | kwargs
    q, k, v, mask = bound["query"], bound["key"], bound["value"], bound.get("attention_mask")
    if mask is not None and not isinstance(mask, Tensor):  # a flex BlockMask
        mask_mod = getattr(mask, "mask_mod", None)
        out = output[0] if isinstance(output, tuple) else output
        return from_flex(
            q,
            k,
            v,
            out.transpose(1, 2) if isinstance(out, Tensor) else None,
            bound.get("scaling"),
            mask_mod,
            has_score_mod=False,
            api=f"transformers[{implementation}]",
        )
    blocked, additive = _split_mask(mask, attend_is_true=True)
    out = output[0] if isinstance(output, tuple) else output
    bias = bound.get("position_bias")
    return AttentionCall(
        api=f"transformers[{implementation}]",
        query=q,
        key=k,
        value=v,
        output=out.transpose(1, 2) if isinstance(out, Tensor) else None,  # [B, H, T, Dv]
        scale=_default_scale(q, bound.get("scaling")),
        blocked=blocked,
        additive=additive,
        bias=None if not isinstance(bias, Tensor) else as_4d(bias),
        reading="hf",
        mask_shape=None if mask is None else tuple(mask.shape),
    )
