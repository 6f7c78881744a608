"""Converters between qkv's mask convention (bool, True = blocked) and the others people meet.

================================  ==================  ==========================================
convention                        meaning of a value  converter into / out of qkv
================================  ==================  ==========================================
PyTorch SDPA bool ``attn_mask``   True = may attend   :func:`from_sdpa_bool` / :func:`to_sdpa_bool`
``nn.MultiheadAttention`` bool    True = ignore       :func:`from_mha_bool` / :func:`to_mha_bool`
Hugging Face ``attention_mask``   1 = keep, 0 = pad   :func:`from_hf` / :func:`to_hf`
additive float mask               0 keep, -inf block  :func:`from_additive` / :func:`to_additive`
================================  ==================  ==========================================
"""

from __future__ import annotations

import torch
from torch import Tensor

from qkv._checks import checks_values
from qkv.masks.builders import _check_bool, _check_tensor

__all__ = [
    "from_additive",
    "from_hf",
    "from_mha_attn_mask",
    "from_mha_bool",
    "from_sdpa_bool",
    "reshape_mha_attn_mask",
    "to_additive",
    "to_hf",
    "to_mha_bool",
    "to_sdpa_bool",
]


def from_sdpa_bool(mask: Tensor) -> Tensor:
    """PyTorch SDPA bool mask (True = may attend) to qkv (True = blocked)."""
    return ~_check_bool("mask", mask)


def to_sdpa_bool(blocked: Tensor) -> Tensor:
    """qkv mask (True = blocked) to PyTorch SDPA's bool ``attn_mask`` (True = may attend)."""
    return ~_check_bool("blocked", blocked)


def from_mha_bool(mask: Tensor) -> Tensor:
    """``nn.MultiheadAttention`` bool mask (True = ignore) to qkv: the same sense, checked."""
    return _check_bool("mask", mask)


def to_mha_bool(blocked: Tensor) -> Tensor:
    """qkv mask to ``nn.MultiheadAttention``'s bool sense (True = ignore): the same values."""
    return _check_bool("blocked", blocked)


def reshape_mha_attn_mask(attn_mask: Tensor, batch_size: int, num_heads: int) -> Tensor:
    """An ``nn.MultiheadAttention`` ``attn_mask`` of any dtype as 4-D, values untouched.

    Args:
        attn_mask: ``[T, S]`` or ``[B * H, T, S]``.
        batch_size: B.
        num_heads: H.

    Returns:
        ``[1, 1, T, S]`` or ``[B, H, T, S]``.

    Raises:
        ValueError: a 3-D mask whose first dim is not ``B * H``, or another rank.
    """
    m = attn_mask
    if m.dim() == 2:
        return m[None, None]  # [1, 1, T, S]
    if m.dim() == 3:
        if m.shape[0] != batch_size * num_heads:
            raise ValueError(
                f"3-D attn_mask must be [B * H, T, S] = [{batch_size * num_heads}, T, S], "
                f"got {tuple(m.shape)}"
            )
        return m.view(batch_size, num_heads, m.shape[1], m.shape[2])  # [B, H, T, S]
    raise ValueError(f"attn_mask must be 2-D [T, S] or 3-D [B*H, T, S], got {tuple(m.shape)}")


def from_mha_attn_mask(attn_mask: Tensor, batch_size: int, num_heads: int) -> Tensor:
    """Reshape an ``nn.MultiheadAttention`` ``attn_mask`` into a 4-D qkv mask.

    Args:
        attn_mask: bool (True = ignore) or additive float, ``[T, S]`` or ``[B * H, T, S]``.
        batch_size: B.
        num_heads: H.

    Returns:
        Bool ``[1, 1, T, S]`` or ``[B, H, T, S]``, True = blocked.

    Raises:
        ValueError: a 3-D mask whose first dim is not ``B * H``, or another rank.
    """
    m = attn_mask if attn_mask.dtype == torch.bool else from_additive(attn_mask)
    return reshape_mha_attn_mask(m, batch_size, num_heads)


def from_hf(attention_mask: Tensor, *, validate: bool = True) -> Tensor:
    """Hugging Face ``attention_mask`` ``[B, S]`` (1 = keep, 0 = padding) to ``[B, 1, 1, S]``.

    Args:
        attention_mask: the mask, bool or numeric.
        validate: check that it holds only 0 and 1 (a host sync); skipped anyway while tracing
            or compiling (see :func:`qkv._checks.checks_values`).

    Returns:
        bool ``[B, 1, 1, S]``, True = padding.

    Raises:
        ValueError: not 2-D, or (when values are checked) values other than 0 and 1.
    """
    m = _check_tensor("attention_mask", attention_mask)
    if m.dim() != 2:
        raise ValueError(f"attention_mask must be [B, S], got shape {tuple(m.shape)}")
    values = m.dtype != torch.bool and checks_values(validate)
    if values and not bool(((m == 0) | (m == 1)).all()):
        raise ValueError("attention_mask must hold only 0 (padding) and 1 (keep)")
    return (m == 0)[:, None, None, :]  # [B, 1, 1, S]


def to_hf(blocked: Tensor) -> Tensor:
    """A qkv key-padding mask (``[B, S]`` or ``[B, 1, 1, S]``) to an int64 HF mask, 1 = keep.

    Raises:
        ValueError: the mask is not a pure key-padding mask.
    """
    m = _check_bool("blocked", blocked)
    if m.dim() == 4:
        if m.shape[1] != 1 or m.shape[2] != 1:
            raise ValueError(
                f"only a key-padding mask [B, 1, 1, S] converts to HF, got {tuple(m.shape)}"
            )
        m = m[:, 0, 0, :]  # [B, S]
    if m.dim() != 2:
        raise ValueError(f"expected [B, S] or [B, 1, 1, S], got {tuple(m.shape)}")
    return (~m).to(torch.int64)


def from_additive(mask: Tensor) -> Tensor:
    """Additive float mask (0 = keep, ``-inf`` or a huge negative = blocked) to bool.

    A value counts as blocked when it is ``-inf`` or at most half the dtype's most negative
    finite value (Hugging Face fills with ``torch.finfo(dtype).min``).

    Raises:
        TypeError: not a floating tensor.
        ValueError: the mask holds other values (a bias such as ALiBi is not a mask; pass it
            as ``bias=`` to :func:`qkv.attention`).
    """
    m = _check_tensor("mask", mask)
    if not m.is_floating_point():
        raise TypeError(f"an additive mask must be floating point, got {m.dtype}")
    blocked = m <= torch.finfo(m.dtype).min / 2
    if not bool(((m == 0) | blocked).all()):
        raise ValueError(
            "additive mask holds values other than 0 and -inf; that is a score bias, not a mask: "
            "pass it as bias= to qkv.attention"
        )
    return blocked


def to_additive(blocked: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """qkv mask to an additive float mask: 0 where allowed, ``-inf`` where blocked.

    Raises:
        TypeError: ``blocked`` is not bool, or ``dtype`` is not a floating dtype.
    """
    m = _check_bool("blocked", blocked)
    if not dtype.is_floating_point:
        raise TypeError(f"an additive mask needs a floating dtype (it holds -inf), got {dtype}")
    out = torch.zeros(m.shape, dtype=dtype, device=m.device)
    return out.masked_fill(m, float("-inf"))
