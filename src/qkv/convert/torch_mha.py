"""``nn.MultiheadAttention`` <-> :class:`qkv.MultiHeadAttention` weight conversion.

PyTorch packs the three input projections into ``in_proj_weight [3D, D]`` when key and value
have the query's width, and keeps ``q_proj_weight`` / ``k_proj_weight`` / ``v_proj_weight``
otherwise; qkv always keeps four named ``nn.Linear`` layers.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from qkv.nn.multihead import MultiHeadAttention

__all__ = ["from_torch_mha", "to_torch_mha"]


def _same_shape(module: nn.MultiheadAttention | MultiHeadAttention, ref: Tensor) -> dict[str, Any]:
    """Constructor arguments both classes spell alike, read from either (their attributes
    share the names)."""
    return {
        "embed_dim": module.embed_dim,
        "num_heads": module.num_heads,
        "kdim": module.kdim,
        "vdim": module.vdim,
        "dropout": module.dropout,
        "batch_first": module.batch_first,
        "bias": module.out_proj.bias is not None,
        "device": ref.device,
        "dtype": ref.dtype,
    }


def _copy_out_proj(dst: nn.Linear, src: nn.Linear) -> None:
    dst.weight.copy_(src.weight)
    if dst.bias is not None and src.bias is not None:
        dst.bias.copy_(src.bias)


def from_torch_mha(module: nn.MultiheadAttention) -> MultiHeadAttention:
    """Build a qkv module holding copies of ``module``'s weights.

    Args:
        module: a PyTorch multi-head attention module.

    Returns:
        A :class:`qkv.MultiHeadAttention` with the same outputs and weights (same
        ``batch_first``, dropout and training mode).

    Raises:
        TypeError: ``module`` is not an ``nn.MultiheadAttention``.
        ValueError: it uses ``bias_k``/``bias_v`` or ``add_zero_attn``, which qkv does not have.
    """
    if not isinstance(module, nn.MultiheadAttention):
        raise TypeError(f"expected nn.MultiheadAttention, got {type(module).__name__}")
    if module.bias_k is not None or module.add_zero_attn:
        raise ValueError("bias_k/bias_v and add_zero_attn have no qkv equivalent")
    out = MultiHeadAttention(**_same_shape(module, module.out_proj.weight))
    projs = (out.q_proj, out.k_proj, out.v_proj)
    with torch.no_grad():
        if module.in_proj_weight is not None:
            ws = module.in_proj_weight.chunk(3, dim=0)  # 3 x [D, D]
        else:
            ws = (module.q_proj_weight, module.k_proj_weight, module.v_proj_weight)
        bs = (None,) * 3 if module.in_proj_bias is None else module.in_proj_bias.chunk(3)  # [D]
        for proj, w, b in zip(projs, ws, bs, strict=True):
            proj.weight.copy_(w)
            if proj.bias is not None and b is not None:
                proj.bias.copy_(b)
        _copy_out_proj(out.out_proj, module.out_proj)
    return out.train(module.training)


def to_torch_mha(module: MultiHeadAttention) -> nn.MultiheadAttention:
    """Build an ``nn.MultiheadAttention`` holding copies of a qkv module's weights.

    Args:
        module: a qkv multi-head attention module.

    Returns:
        An ``nn.MultiheadAttention`` with the same outputs and weights (same ``batch_first``,
        dropout and training mode).

    Raises:
        TypeError: ``module`` is not a :class:`qkv.MultiHeadAttention`.
        ValueError: grouped-query attention (``num_kv_heads < num_heads``), which PyTorch's
            module cannot express.
    """
    if not isinstance(module, MultiHeadAttention):
        raise TypeError(f"expected qkv.MultiHeadAttention, got {type(module).__name__}")
    if module.num_kv_heads != module.num_heads:
        raise ValueError(
            f"nn.MultiheadAttention has no grouped-query attention: num_kv_heads="
            f"{module.num_kv_heads} != num_heads={module.num_heads}"
        )
    out = nn.MultiheadAttention(**_same_shape(module, module.q_proj.weight))
    projs = (module.q_proj, module.k_proj, module.v_proj)
    with torch.no_grad():
        ws = [p.weight for p in projs]
        if out.in_proj_weight is not None:
            out.in_proj_weight.copy_(torch.cat(ws, dim=0))  # [3D, D]
        else:
            separate = (out.q_proj_weight, out.k_proj_weight, out.v_proj_weight)
            for dst, w in zip(separate, ws, strict=True):
                dst.copy_(w)
        if out.in_proj_bias is not None:
            bs: list[Tensor] = [p.bias for p in projs if p.bias is not None]
            out.in_proj_bias.copy_(torch.cat(bs))  # [3D]
        _copy_out_proj(out.out_proj, module.out_proj)
    return out.train(module.training)
