"""Worst max-abs error of qkv.scaled_dot_product_attention against a float64 recomputation.

Runs the cases of tests/test_attention.py's parity tests (B=2, H=3, T=5, S=9, Dh=8, Dv=6,
every mask kind, a few seeds) and prints, per dtype, the worst error of qkv's output and
weights next to that of a naive same-precision implementation and of torch's SDPA.

    .venv/bin/python benchmarks/attention_error.py
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

import qkv
from qkv.masks import causal_mask, combine, padding_mask, sliding_window_mask, to_sdpa_bool

B, H, T, S, Dh, Dv = 2, 3, 5, 9, 8, 6


def reference_f64(q: Tensor, k: Tensor, v: Tensor, blocked: Tensor | None) -> tuple[Tensor, Tensor]:
    """softmax(QKᵀ/√Dh, blocked removed) V in float64; no row here is fully blocked."""
    scores = q.double() @ k.double().transpose(-2, -1) / math.sqrt(Dh)  # [B, H, T, S]
    if blocked is not None:
        scores = scores.masked_fill(blocked, float("-inf"))
    weights = torch.softmax(scores, dim=-1)  # [B, H, T, S]
    return weights @ v.double(), weights  # [B, H, T, Dv]


def naive(q: Tensor, k: Tensor, v: Tensor, blocked: Tensor | None) -> Tensor:
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(Dh)  # [B, H, T, S] in the input dtype
    if blocked is not None:
        scores = scores.masked_fill(blocked, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v  # [B, H, T, Dv]


def masks() -> dict[str, Tensor | None]:
    pad = padding_mask(torch.tensor([9, 4]), S)
    rand = torch.rand(B, H, T, S, generator=torch.Generator().manual_seed(0)) > 0.6
    rand[..., 0] = False
    return {
        "none": None,
        "padding": pad,
        "causal_top_left": causal_mask(T, S, align="top_left"),
        "causal_bottom_right": causal_mask(T, S, align="bottom_right"),
        "causal_offset": causal_mask(T, S, offset=2),
        "sliding_window": sliding_window_mask(T, S, window=3, align="bottom_right"),
        "combined": combine(
            pad, causal_mask(T, S, offset=1), sliding_window_mask(T, S, window=4, align="top_left")
        ),
        "random_4d": rand,
    }


def main() -> None:
    torch.set_num_threads(1)
    dtypes = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
    print(f"{'dtype':<16}{'qkv out':>12}{'qkv weights':>14}{'naive out':>12}{'torch SDPA':>12}")
    for dtype in dtypes:
        worst = {"out": 0.0, "w": 0.0, "naive": 0.0, "sdpa": 0.0}
        for seed in range(5):
            gen = torch.Generator().manual_seed(seed)
            q = torch.randn(B, H, T, Dh, generator=gen).to(dtype)
            k = torch.randn(B, H, S, Dh, generator=gen).to(dtype)
            v = torch.randn(B, H, S, Dv, generator=gen).to(dtype)
            for blocked in masks().values():
                out, w = qkv.scaled_dot_product_attention(q, k, v, blocked)
                ref_out, ref_w = reference_f64(q, k, v, blocked)
                sdpa = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=None if blocked is None else to_sdpa_bool(blocked)
                )
                errs = {
                    "out": (out.double() - ref_out).abs().max(),
                    "w": (w.double() - ref_w).abs().max(),
                    "naive": (naive(q, k, v, blocked).double() - ref_out).abs().max(),
                    "sdpa": (sdpa.double() - ref_out).abs().max(),
                }
                for name, e in errs.items():
                    worst[name] = max(worst[name], float(e))
        print(
            f"{dtype!s:<16}{worst['out']:>12.3e}{worst['w']:>14.3e}"
            f"{worst['naive']:>12.3e}{worst['sdpa']:>12.3e}"
        )


if __name__ == "__main__":
    main()
