"""Blockwise never allocates a [T, S] tensor for a structured mask, forward or backward.

A TorchDispatchMode sees every tensor an ATen op returns (including inside the custom
autograd.Function's backward); we record the largest one. Deterministic, unlike RSS sampling.
"""

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import qkv
from qkv.masks import Causal, Documents, MaskMod, Padding, SlidingWindow


class LargestTensor(TorchDispatchMode):
    """Records the element count of the largest tensor any op produces."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def _far_keys(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    return (q - kv).abs() < 100


def test_detector_sees_the_reference_scores() -> None:
    q, k, v = (torch.randn(1, 1, 256, 8) for _ in range(3))
    with LargestTensor() as probe:
        qkv.attention(q, k, v, mask=SlidingWindow(16), backend="reference")
    assert probe.largest >= 256 * 256


def test_blockwise_allocates_only_tiles_and_rows() -> None:
    L = 2048  # a [T, S] float32 tensor would be 16 MiB; a tile of 128 x 128 is 64 KiB
    ids = (torch.arange(L) // 500)[None]  # [1, L], five documents
    masks = [
        SlidingWindow(64),
        Causal() | Padding(torch.tensor([1500])),
        Documents(ids),
        MaskMod(_far_keys),
    ]
    for mask in masks:
        q, k, v = (torch.randn(1, 1, L, 8, requires_grad=True) for _ in range(3))
        with LargestTensor() as probe:
            out, _ = qkv.attention(
                q, k, v, mask=mask, backend="blockwise", block_q=128, block_k=128
            )
            out.sum().backward()
        assert q.grad is not None and bool(torch.isfinite(q.grad).all())
        assert probe.ops > 200  # forward and backward were both observed
        assert probe.largest <= max(128 * 128, L * 8), (mask, probe.largest)
