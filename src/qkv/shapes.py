"""Shape tracing: run qkv's own attention computation and record each intermediate's shape.

Nothing here re-implements the formula. :func:`trace_attention_shapes` calls
:func:`qkv.scaled_dot_product_attention` (the reference math) under a
:class:`torch.overrides.TorchFunctionMode` that records every torch call made inside it, then
reads ``Kᵀ`` and ``QKᵀ`` off that record: the shapes printed are the shapes the real
computation produced.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from qkv.attention import scaled_dot_product_attention
from qkv.masks import causal_mask, combine, padding_mask

__all__ = ["trace_attention_shapes"]


class _CallRecorder(TorchFunctionMode):
    """Record ``(function name, output shape)`` of every tensor-returning torch call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, tuple[int, ...]]] = []

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        if isinstance(out, Tensor):
            self.calls.append((getattr(func, "__name__", str(func)), tuple(out.shape)))
        return out


def _first(calls: list[tuple[str, tuple[int, ...]]], names: set[str]) -> tuple[int, ...]:
    for name, shape in calls:
        if name in names:
            return shape
    raise RuntimeError(
        f"the reference attention made no call to any of {sorted(names)}; "
        "qkv.shapes must be updated to follow it"
    )


def trace_attention_shapes(
    B: int, H: int, T: int, S: int, Dh: int, Dv: int, *, seed: int = 0
) -> list[tuple[str, tuple[int, ...]]]:
    """Run attention on random tensors and return ``(name, shape)`` of every intermediate.

    The mask is a key-padding mask (the last key of sample 0 is padding) combined with a
    bottom-right causal mask, so its broadcast shape ``[B, 1, T, S]`` shows up too.

    Args:
        B: batch.
        H: heads.
        T: query length.
        S: key length.
        Dh: query/key width.
        Dv: value width.
        seed: random seed.

    Returns:
        ``(name, shape)`` for Q, K, V, Kᵀ, QKᵀ, mask, weights and output, in computation order.

    Raises:
        ValueError: a non-positive size.
    """
    sizes = {"B": B, "H": H, "T": T, "S": S, "Dh": Dh, "Dv": Dv}
    bad = {k: v for k, v in sizes.items() if v < 1}
    if bad:
        raise ValueError(f"sizes must be positive, got {bad}")
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, Dh, generator=gen)  # [B, H, T, Dh]
    k = torch.randn(B, H, S, Dh, generator=gen)  # [B, H, S, Dh]
    v = torch.randn(B, H, S, Dv, generator=gen)  # [B, H, S, Dv]
    lengths = torch.full((B,), S)
    lengths[0] = max(S - 1, 1)
    mask = combine(padding_mask(lengths, S), causal_mask(T, S, align="bottom_right"))
    assert mask is not None
    recorder = _CallRecorder()
    with recorder:
        out, weights = scaled_dot_product_attention(q, k, v, mask)  # [B,H,T,Dv], [B,H,T,S]
    return [
        ("Q", tuple(q.shape)),
        ("K", tuple(k.shape)),
        ("V", tuple(v.shape)),
        ("K^T", _first(recorder.calls, {"transpose"})),
        ("QK^T", _first(recorder.calls, {"matmul", "__matmul__", "bmm"})),
        ("mask", tuple(mask.shape)),
        ("weights", tuple(weights.shape)),
        ("output", tuple(out.shape)),
    ]
