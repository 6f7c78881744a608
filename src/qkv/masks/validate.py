"""The one check every mask tensor passes, whichever path it takes into attention.

A bool tensor given as ``mask=``, a :class:`~qkv.masks.rules.Dense` part of a rule (also the one
``MultiHeadAttention`` builds from ``attn_mask`` / ``key_padding_mask`` next to a rule) and the
tensors the rules materialize are all checked here against the ``[B, H, T, S]`` grid of the call.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["as_4d", "validate_mask"]

_PAD_HINT = "use qkv.masks.padding_mask(lengths or is_pad [B, S]) to get [B, 1, 1, S]"


def as_4d(x: Tensor) -> Tensor:
    """``x`` with leading 1s added up to 4 dims: ``[S]`` becomes ``[1, 1, 1, S]``."""
    return x.reshape((1,) * (4 - x.dim()) + tuple(x.shape))  # [B|1, H|1, T|1, S|1]


def _check_rows(shape: tuple[int, ...], B: int, T: int, S: int) -> None:
    """Refuse a ``[X, S]`` trailing pair (a 2-D mask, or a 3-D one with a leading 1) that reads
    as a ``[B, S]`` key-padding mask: broadcasting would take it for ``[T, S]``."""
    rows, cols = shape[-2], shape[-1]
    if rows == B != 1 and rows != T and cols == S:
        raise ValueError(
            f"mask of shape {shape} looks like a key-padding mask [B, S]; broadcasting would "
            f"read it as [T, S]. {_PAD_HINT}"
        )
    if B == T > 1 and rows == T:
        explicit = "mask[None, None]" if len(shape) == 2 else "mask[None]"
        raise ValueError(
            f"{len(shape)}-D mask {shape} is ambiguous when B == T == {T}: it could be a [B, S] "
            f"key-padding mask. Pass {explicit} for a [T, S] mask, or {_PAD_HINT}"
        )


def validate_mask(
    mask: object, B: int, H: int, T: int, S: int, device: torch.device, *, name: str = "mask"
) -> Tensor:
    """Check a qkv mask against ``[B, H, T, S]``; return it unchanged if it is sound.

    Masks of fewer than 4 dimensions broadcast from the right, which silently turns a
    ``[B, S]`` key-padding mask into a ``[T, S]`` one when ``B == T``. So: a 1-D mask must be
    ``[S]``; a 2-D mask ``[T, S]`` (or ``[1, S]``), refused as ambiguous when ``B == T > 1``; a
    3-D mask must have a leading 1 and is then read as a 2-D one (``[1, B, S]`` is refused like
    ``[B, S]``). Use 4-D masks (every builder in :mod:`qkv.masks` returns one) to say exactly
    what is meant. A mask larger than the grid is refused, never cropped.

    Args:
        mask: the mask, bool, True = blocked.
        B: batch size of the call.
        H: query heads.
        T: query length.
        S: key length.
        device: the query's device.
        name: what the mask is called, for the message.

    Returns:
        ``mask``.

    Raises:
        TypeError: the mask is not a bool tensor.
        ValueError: another device, not broadcastable, or one of the ambiguous shapes above.
    """
    if not isinstance(mask, Tensor):
        raise TypeError(f"{name} must be a bool torch.Tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(
            f"{name} must be bool (True = blocked), got {mask.dtype}; convert float or int masks "
            "with qkv.masks.from_additive / from_hf / from_sdpa_bool"
        )
    if mask.device != device:
        raise ValueError(f"{name} is on {mask.device} but query is on {device}")
    shape = tuple(mask.shape)
    if mask.dim() > 4 or mask.dim() == 0:
        raise ValueError(f"{name} must have 1 to 4 dims broadcastable to [B, H, T, S], got {shape}")
    if mask.dim() == 3 and shape[0] != 1:
        raise ValueError(
            f"3-D {name} {shape} is ambiguous ([B, T, S] or [H, T, S]); make it 4-D, e.g. "
            "mask[:, None] for [B, 1, T, S]"
        )
    if mask.dim() in (2, 3):
        _check_rows(shape, B, T, S)
    try:
        full = torch.broadcast_shapes(shape, (B, H, T, S))
    except RuntimeError:
        full = None
    if full != (B, H, T, S):
        raise ValueError(
            f"{name} of shape {shape} is not broadcastable to [B, H, T, S] = {[B, H, T, S]}"
        )
    return mask
