"""Shape tracing: run qkv's own attention computation and record each intermediate's shape.

Nothing here re-implements the formula. :func:`trace_attention_shapes` calls
:func:`qkv.scaled_dot_product_attention` (the reference math) under a
:class:`torch.overrides.TorchFunctionMode` that records every torch call made inside it, then
reads ``Kᵀ`` and ``QKᵀ`` off that record: the shapes printed are the shapes the real
computation produced.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from qkv.functional import scaled_dot_product_attention
from qkv.masks import causal_mask, combine, padding_mask
from qkv.models.config import TransformerConfig
from qkv.models.transformer import Transformer
from qkv.nn.multihead import MultiHeadAttention

__all__ = ["MEMORY_BUDGET", "trace_attention_shapes", "trace_model_shapes"]

MEMORY_BUDGET = 2**30
"""Bytes the tracers may allocate (1 GiB): larger sizes are refused before anything is built."""


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
        "qkv.apps.shapes must be updated to follow it"
    )


def _check_sizes(estimate: int, **sizes: int) -> None:
    """Positive sizes whose float32 tensors (``estimate`` elements in all) fit the budget."""
    bad = {k: v for k, v in sizes.items() if v < 1}
    if bad:
        raise ValueError(f"sizes must be positive, got {bad}")
    if 4 * estimate > MEMORY_BUDGET:
        raise ValueError(
            f"sizes {sizes} need about {4 * estimate / 2**30:.1f} GiB of float32 tensors, more "
            f"than the {MEMORY_BUDGET / 2**30:.0f} GiB qkv shapes allows; the shapes do not "
            f"depend on the sizes' magnitude, so trace smaller ones"
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
    # Q, K, V, the output, and ~4 [B, H, T, S] tensors (scores, mask, weights, a temporary)
    _check_sizes(
        B * H * (T * Dh + S * Dh + S * Dv + T * Dv + 4 * T * S), B=B, H=H, T=T, S=S, Dh=Dh, Dv=Dv
    )
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


def trace_model_shapes(
    B: int = 2,
    S: int = 5,
    T: int = 3,
    H: int = 4,
    Dh: int = 8,
    *,
    num_layers: int = 2,
    seed: int = 0,
) -> list[tuple[str, list[tuple[str, tuple[int, ...]]], tuple[int, ...]]]:
    """Run one forward of a small :class:`qkv.Transformer` and record every layer's shapes.

    Forward hooks on the embeddings, each encoder/decoder layer and its attention and
    feed-forward blocks, the final norms and the head record the real tensors' shapes, including
    the masks each attention receives. The last source token of sample 0 is padding, so the
    padding mask shows up.

    Args:
        B: batch. S: source length. T: target length. H: heads. Dh: head width
        (``d_model = H * Dh``).
        num_layers: encoder and decoder layers.
        seed: random seed.

    Returns:
        ``(module name, [(input name, shape), ...], output shape)`` in call order.

    Raises:
        ValueError: a non-positive size.
    """
    D, L = H * Dh, max(S, T)
    # weights (~16 D^2 per layer and stack) + per layer activations and [B, H, L, L] scores
    estimate = num_layers * (32 * D * D + 2 * B * (16 * L * D + 4 * H * L * L))
    _check_sizes(estimate, B=B, S=S, T=T, H=H, Dh=Dh, num_layers=num_layers)
    cfg = TransformerConfig(
        src_vocab_size=20,
        tgt_vocab_size=20,
        d_model=H * Dh,
        num_heads=H,
        num_encoder_layers=num_layers,
        num_decoder_layers=num_layers,
        dim_feedforward=4 * H * Dh,
        dropout=0.0,
        max_positions=max(S, T),
    )
    with torch.random.fork_rng():  # seed the weights without touching the caller's generator
        torch.manual_seed(seed)
        model = Transformer(cfg).eval()
    rows: list[tuple[str, list[tuple[str, tuple[int, ...]]], tuple[int, ...]]] = []

    def hooks(name: str, module: nn.Module) -> tuple[Any, Any]:
        sig = inspect.signature(module.forward)
        slot: list[int] = []

        def before(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            slot.append(len(rows))  # reserve the row so that outer modules come first
            rows.append((name, [], ()))
            bound = sig.bind(*args, **kwargs).arguments
            inputs = [(k, tuple(v.shape)) for k, v in bound.items() if isinstance(v, Tensor)]
            if bound.get("is_causal") and isinstance(module, MultiHeadAttention):
                q, k = args[0], args[1] if len(args) > 1 else args[0]
                inputs.append(("causal", (1, 1, q.shape[1], k.shape[1])))
            rows[slot[-1]] = (name, inputs, ())

        def after(_: nn.Module, args: tuple[Any, ...], out: Any) -> None:
            result = out[0] if isinstance(out, tuple) else out
            idx = slot.pop()
            rows[idx] = (rows[idx][0], rows[idx][1], tuple(result.shape))

        return before, after

    watched = ("src_embed", "tgt_embed", "positional", "lm_head", "encoder.norm", "decoder.norm")
    handles = []
    for name, module in model.named_modules():
        parts = name.split(".")
        is_layer = len(parts) == 3 and parts[1] == "layers"
        is_block = len(parts) == 4 and parts[3] in ("self_attn", "cross_attn", "ffn")
        if name in watched or is_layer or is_block:
            before, after = hooks(name, module)
            handles.append(module.register_forward_pre_hook(before, with_kwargs=True))
            handles.append(module.register_forward_hook(after))
    gen = torch.Generator().manual_seed(seed)
    src = torch.randint(3, 20, (B, S), generator=gen)
    src[0, -1] = cfg.pad_id
    tgt = torch.randint(3, 20, (B, T), generator=gen)
    tgt[:, 0] = cfg.bos_id
    with torch.no_grad():
        logits = model(src, tgt)
    for h in handles:
        h.remove()
    rows.insert(
        0, ("ids", [("src", tuple(src.shape)), ("tgt", tuple(tgt.shape))], tuple(logits.shape))
    )
    return rows
