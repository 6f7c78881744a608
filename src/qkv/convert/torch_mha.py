"""``nn.MultiheadAttention`` <-> :class:`qkv.MultiHeadAttention` weight conversion.

PyTorch packs the three input projections into ``in_proj_weight [3D, D]`` when key and value
have the query's width, and keeps ``q_proj_weight`` / ``k_proj_weight`` / ``v_proj_weight``
otherwise; qkv always keeps four named ``nn.Linear`` layers. State dicts load both ways through
load-state-dict pre-hooks: every :class:`qkv.MultiHeadAttention` takes PyTorch's keys, and
:func:`accept_qkv_state_dict` teaches an ``nn.MultiheadAttention`` qkv's (the modules
:func:`to_torch_mha` builds have it). The converters below are a build plus a hooked load.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from qkv.nn.multihead import MultiHeadAttention

__all__ = ["accept_qkv_state_dict", "from_torch_mha", "to_torch_mha"]


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


_PROJS = ("q_proj", "k_proj", "v_proj")


def _load_qkv_keys(module: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
    """Load-state-dict pre-hook for an ``nn.MultiheadAttention``: rename qkv's keys in place.

    ``q_proj.weight`` & co. are packed into ``in_proj_weight`` (or renamed to ``q_proj_weight``
    & co. when the module keeps separate projections), the three biases into ``in_proj_bias``;
    ``out_proj.*`` is spelled alike. A PyTorch state dict passes unchanged.
    """
    assert isinstance(module, nn.MultiheadAttention)
    weights = [state_dict.pop(f"{prefix}{p}.weight", None) for p in _PROJS]
    biases = [state_dict.pop(f"{prefix}{p}.bias", None) for p in _PROJS]
    if all(w is not None for w in weights):
        if module._qkv_same_embed_dim:
            state_dict[prefix + "in_proj_weight"] = torch.cat(weights, dim=0)  # [3D, D]
        else:
            for p, w in zip(_PROJS, weights, strict=True):
                state_dict[f"{prefix}{p}_weight"] = w  # [D, kdim | vdim | D]
    if all(b is not None for b in biases):
        state_dict[prefix + "in_proj_bias"] = torch.cat(biases)  # [3D]


def accept_qkv_state_dict(module: nn.MultiheadAttention) -> nn.MultiheadAttention:
    """Let ``module.load_state_dict`` take a :class:`qkv.MultiHeadAttention` state dict too.

    Args:
        module: a PyTorch multi-head attention module (changed in place: a pre-hook is added;
            its own state dicts still load as before).

    Returns:
        ``module``.

    Raises:
        TypeError: ``module`` is not an ``nn.MultiheadAttention``.
    """
    if not isinstance(module, nn.MultiheadAttention):
        raise TypeError(f"expected nn.MultiheadAttention, got {type(module).__name__}")
    module.register_load_state_dict_pre_hook(_load_qkv_keys)
    return module


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
    out.load_state_dict(module.state_dict())  # renamed by MultiHeadAttention's pre-hook
    return out.train(module.training)


def to_torch_mha(module: MultiHeadAttention) -> nn.MultiheadAttention:
    """Build an ``nn.MultiheadAttention`` holding copies of a qkv module's weights.

    Args:
        module: a qkv multi-head attention module.

    Returns:
        An ``nn.MultiheadAttention`` with the same outputs and weights (same ``batch_first``,
        dropout and training mode), whose ``load_state_dict`` takes qkv's keys too.

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
    out = accept_qkv_state_dict(nn.MultiheadAttention(**_same_shape(module, module.q_proj.weight)))
    out.load_state_dict(module.state_dict())  # renamed by the pre-hook above
    return out.train(module.training)
