"""Each intercepted torch function's arguments read into one :class:`AttentionCall`.

The watch's :class:`~qkv.doctor.interception.WatchMode` sees a call as ``(func, args, kwargs)``
and its output; :data:`READERS` maps each attention function it judges to the reader of its
signature: SDPA, ``F.multi_head_attention_forward``, ``qkv.attention`` and flex attention's
operator (whose ``mask_mod`` and ``score_mod`` take their buffers after the indices).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch._higher_order_ops.flex_attention import flex_attention as _FLEX_HOP

from qkv.doctor.calls import AttentionCall, from_flex, from_mha, from_qkv, from_sdpa
from qkv.functional import attention as qkv_attention

__all__ = ["READERS"]

_MHA_SIGNATURE = inspect.signature(F.multi_head_attention_forward)


def _read_sdpa(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> AttentionCall:
    return from_sdpa(args, kwargs, out)


def _read_mha(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> AttentionCall:
    bound = _MHA_SIGNATURE.bind(*args, **kwargs).arguments
    return from_mha((), bound, out, api="F.multi_head_attention_forward", batch_first=False)


def _read_qkv(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> AttentionCall:
    return from_qkv(args, kwargs, out)


def _read_flex(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> AttentionCall:
    """The flex operator's call: ``(q, k, v, score_mod, block_mask tuple, scale, kernel_options,
    score_mod buffers, mask_mod buffers)``; both mods take their buffers after the indices."""
    q, k, v, score_mod, block_tuple, scale = args[:6]
    score_buffers = (
        tuple(args[7]) if len(args) > 7 else tuple(kwargs.get("score_mod_other_buffers", ()))
    )
    mask_buffers = (
        tuple(args[8]) if len(args) > 8 else tuple(kwargs.get("mask_mod_other_buffers", ()))
    )
    mask_mod = block_tuple[-1] if isinstance(block_tuple, tuple) and block_tuple else None
    output = out[0] if isinstance(out, tuple) else out
    return from_flex(
        q,
        k,
        v,
        output,
        scale,
        None if mask_mod is None else functools.partial(_with_buffers, mask_mod, mask_buffers),
        has_score_mod=not _is_identity(score_mod, score_buffers),
    )


def _with_buffers(fn: Any, buffers: tuple[Any, ...], *indices: Any) -> Any:
    return fn(*indices, *buffers)


def _is_identity(score_mod: Any, buffers: tuple[Any, ...]) -> bool:
    """Whether a flex ``score_mod`` leaves scores unchanged (probed on a few values)."""
    if score_mod is None:
        return True
    probe = torch.linspace(-3.0, 3.0, 6).view(1, 1, 2, 3)  # [1, 1, 2, 3]
    idx = [torch.zeros((), dtype=torch.int64) for _ in range(4)]
    try:
        return bool(torch.equal(score_mod(probe, *idx, *buffers), probe))
    except Exception:  # a score_mod that needs real indices: not known to be the identity
        return False


READERS: dict[Any, Callable[..., AttentionCall]] = {
    F.scaled_dot_product_attention: _read_sdpa,
    F.multi_head_attention_forward: _read_mha,
    qkv_attention: _read_qkv,
    # flex_attention compiles its operator even in eager code; the compiled graph calls the
    # operator eagerly, and that call is what the mode sees
    _FLEX_HOP: _read_flex,
}
