"""``nn.MultiheadAttention`` <-> :class:`qkv.MultiHeadAttention` weight conversion.

PyTorch packs the three input projections into ``in_proj_weight [3D, D]`` when key and value
have the query's width, and keeps ``q_proj_weight`` / ``k_proj_weight`` / ``v_proj_weight``
otherwise; qkv always keeps four named ``nn.Linear`` layers.
"""

from __future__ import annotations

import torch
from torch import nn

from qkv.nn.multihead import MultiHeadAttention

__all__ = ["from_torch_mha", "to_torch_mha"]


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
    D = module.embed_dim
    ref = module.out_proj.weight
    has_bias = module.in_proj_bias is not None
    out = MultiHeadAttention(
        D,
        module.num_heads,
        kdim=module.kdim,
        vdim=module.vdim,
        bias=has_bias,
        dropout=module.dropout,
        batch_first=module.batch_first,
        device=ref.device,
        dtype=ref.dtype,
    )
    with torch.no_grad():
        if module.in_proj_weight is not None:
            wq, wk, wv = module.in_proj_weight.chunk(3, dim=0)  # 3 x [D, D]
        else:
            wq, wk, wv = module.q_proj_weight, module.k_proj_weight, module.v_proj_weight
        for proj, w in ((out.q_proj, wq), (out.k_proj, wk), (out.v_proj, wv)):
            proj.weight.copy_(w)
        if module.in_proj_bias is not None:
            for proj, b in zip(
                (out.q_proj, out.k_proj, out.v_proj), module.in_proj_bias.chunk(3), strict=True
            ):
                assert proj.bias is not None
                proj.bias.copy_(b)
        out.out_proj.weight.copy_(module.out_proj.weight)
        if out.out_proj.bias is not None and module.out_proj.bias is not None:
            out.out_proj.bias.copy_(module.out_proj.bias)
    out.train(module.training)
    return out


def to_torch_mha(module: MultiHeadAttention) -> nn.MultiheadAttention:
    """Build an ``nn.MultiheadAttention`` holding copies of a qkv module's weights.

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
    ref = module.q_proj.weight
    has_bias = module.q_proj.bias is not None
    out = nn.MultiheadAttention(
        module.embed_dim,
        module.num_heads,
        dropout=module.dropout,
        bias=has_bias,
        kdim=module.kdim,
        vdim=module.vdim,
        batch_first=module.batch_first,
        device=ref.device,
        dtype=ref.dtype,
    )
    with torch.no_grad():
        ws = [module.q_proj.weight, module.k_proj.weight, module.v_proj.weight]
        if out.in_proj_weight is not None:
            out.in_proj_weight.copy_(torch.cat(ws, dim=0))  # [3D, D]
        else:
            out.q_proj_weight.copy_(ws[0])
            out.k_proj_weight.copy_(ws[1])
            out.v_proj_weight.copy_(ws[2])
        if out.in_proj_bias is not None:
            bs = [module.q_proj.bias, module.k_proj.bias, module.v_proj.bias]
            out.in_proj_bias.copy_(torch.cat([b for b in bs if b is not None]))  # [3D]
        out.out_proj.weight.copy_(module.out_proj.weight)
        if out.out_proj.bias is not None and module.out_proj.bias is not None:
            out.out_proj.bias.copy_(module.out_proj.bias)
    out.train(module.training)
    return out
