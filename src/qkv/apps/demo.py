"""The default job of ``qkv demo``: one layer of masked multi-head self-attention, checked
against ``nn.MultiheadAttention`` holding the same weights."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from qkv.convert.torch_mha import to_torch_mha
from qkv.masks import causal_mask, combine, padding_mask, to_mha_bool
from qkv.nn.multihead import MultiHeadAttention

__all__ = ["DemoResult", "run_demo"]


@dataclass(frozen=True)
class DemoResult:
    """What the demo computed; ``max_abs_diff`` is qkv vs ``nn.MultiheadAttention``."""

    x: Tensor
    output: Tensor
    weights: Tensor
    max_abs_diff_output: float
    max_abs_diff_weights: float


def run_demo(
    B: int = 2,
    T: int = 5,
    D: int = 8,
    H: int = 2,
    lengths: tuple[int, ...] = (5, 3),
    seed: int = 0,
) -> DemoResult:
    """Run masked self-attention (padding + causal) and compare with PyTorch.

    Args:
        B: batch size.
        T: sequence length.
        D: model width.
        H: heads.
        lengths: valid length of each sample (the rest is padding).
        seed: random seed for weights and input.

    Returns:
        The input, output, per-head weights and the max differences against PyTorch.

    Raises:
        ValueError: ``len(lengths) != B``, or the errors of the modules.
    """
    if len(lengths) != B:
        raise ValueError(f"lengths must have B={B} entries, got {lengths}")
    gen = torch.Generator().manual_seed(seed)
    # Module construction draws from the global RNG: seed it without touching the caller's.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        mha = MultiHeadAttention(D, H).eval()
        ref = to_torch_mha(mha).eval()  # its own init is overwritten by the copy
    x = torch.randn(B, T, D, generator=gen)  # [B, T, D]
    pad = padding_mask(torch.tensor(lengths), T)  # [B, 1, 1, T]
    blocked = combine(pad, causal_mask(T))  # [B, 1, T, T]
    with torch.no_grad():
        out, weights = mha(x, mask=blocked, average_attn_weights=False)  # [B,T,D], [B,H,T,T]
        key_padding = to_mha_bool(pad[:, 0, 0, :])  # [B, T], True = ignore
        causal = to_mha_bool(causal_mask(T)[0, 0])  # [T, T], True = ignore
        ref_out, ref_w = ref(
            x, x, x, key_padding_mask=key_padding, attn_mask=causal, average_attn_weights=False
        )
    assert weights is not None and ref_w is not None
    return DemoResult(
        x=x,
        output=out,
        weights=weights,
        max_abs_diff_output=float((out - ref_out).abs().max()),
        max_abs_diff_weights=float((weights - ref_w).abs().max()),
    )


def print_demo(result: DemoResult) -> None:
    """Print the demo's shapes, head 0's weights of sample 0, and the PyTorch comparison."""
    print("qkv demo: multi-head self-attention, padding + causal mask")
    print(f"  input   {tuple(result.x.shape)}   [B, T, D]")
    print(f"  output  {tuple(result.output.shape)}   [B, T, D]")
    print(f"  weights {tuple(result.weights.shape)}   [B, H, T, S]")
    print("  weights of sample 0, head 0 (rows: queries, columns: keys):")
    for row in result.weights[0, 0].tolist():
        print("    " + " ".join(f"{w:.3f}" for w in row))
    ok = result.max_abs_diff_output < 1e-5 and result.max_abs_diff_weights < 1e-6
    print(
        f"  vs nn.MultiheadAttention with the same weights: max |Δoutput| = "
        f"{result.max_abs_diff_output:.2e}, max |Δweights| = {result.max_abs_diff_weights:.2e}"
        f" -> {'MATCH' if ok else 'MISMATCH'}"
    )
