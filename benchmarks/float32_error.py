"""float32 error of every backend against a naive float32 implementation (issue 10, item 7).

For random cases (shapes, GQA, masks, and sharp softmax: inputs of magnitude up to 3 and a
scale up to 4/sqrt(Dh)), each backend's float32 output and gradients are compared with a float64
recomputation, and so is a naive float32 implementation (softmax(QKᵀ·scale) V written out, the
error a same-precision formula makes). The ratio backend error / naive error per case (max abs,
floored at float32's eps so that exact cases do not divide by 0) is summarized as median, p95
and worst. The goal is a worst ratio of at most 2.

Usage: ``python benchmarks/float32_error.py [--cases N] [--seed S]``.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from torch import Tensor

import qkv

BACKENDS = ("reference", "fused", "blockwise")
EPS = torch.finfo(torch.float32).eps


def _naive(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)  # [B, H, S, D]
    scores = (q @ k.transpose(-2, -1) * scale).masked_fill(mask, float("-inf"))  # [B, H, T, S]
    return torch.softmax(scores, dim=-1) @ v  # [B, H, T, Dv]


def _case(gen: torch.Generator) -> tuple[list[Tensor], Tensor, float]:
    def r(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    B, Hkv, T, S, Dh = r(1, 2), r(1, 2), r(1, 40), r(1, 40), r(4, 32)
    H = Hkv * r(1, 2)
    mag = float(torch.empty(1).uniform_(0.5, 3.0, generator=gen))
    qkv_in = [
        torch.randn(B, H, T, Dh, generator=gen, dtype=torch.float64) * mag,
        torch.randn(B, Hkv, S, Dh, generator=gen, dtype=torch.float64) * mag,
        torch.randn(B, Hkv, S, Dh, generator=gen, dtype=torch.float64) * mag,
    ]
    mask = torch.rand(B, 1, T, S, generator=gen) < 0.3  # [B, 1, T, S]
    mask[..., 0] = False  # no fully masked row: the naive formula would give NaN there
    scale = float(torch.empty(1).uniform_(0.25, 4.0, generator=gen)) / Dh**0.5
    return qkv_in, mask, scale


def _errors(fn, qkv64: list[Tensor], want: list[Tensor]) -> list[float]:  # type: ignore[no-untyped-def]
    leaves = [x.float().requires_grad_() for x in qkv64]
    out = fn(*leaves)
    d_out = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)
    got = [out, *torch.autograd.grad(out, leaves, d_out)]
    return [
        max(float((g.detach().double() - w).abs().max()), EPS)
        for g, w in zip(got, want, strict=True)
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", type=int, default=200, help="random cases")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    gen = torch.Generator().manual_seed(args.seed)
    names = ("out", "dq", "dk", "dv")
    ratios: dict[str, dict[str, list[float]]] = {b: {n: [] for n in names} for b in BACKENDS}
    for _ in range(args.cases):
        qkv64, mask, scale = _case(gen)
        leaves = [x.detach().requires_grad_() for x in qkv64]
        ref = _naive(*leaves, mask, scale)
        d_out = torch.linspace(-1, 1, ref.numel(), dtype=ref.dtype).reshape(ref.shape)
        want = [ref.detach(), *torch.autograd.grad(ref, leaves, d_out)]
        naive = _errors(lambda q, k, v, m=mask, s=scale: _naive(q, k, v, m, s), qkv64, want)
        for b in BACKENDS:
            got = _errors(
                lambda q, k, v, b=b, m=mask, s=scale: qkv.attention(
                    q, k, v, mask=m, scale=s, backend=b
                )[0],
                qkv64,
                want,
            )
            for n, e, e0 in zip(names, got, naive, strict=True):
                ratios[b][n].append(e / e0)
    print(f"{args.cases} cases; error / naive float32 error (median, p95, worst):")
    for b in BACKENDS:
        cells = []
        for n in names:
            xs = sorted(ratios[b][n])
            p95 = xs[min(len(xs) - 1, int(0.95 * len(xs)))]
            cells.append(f"{n} {statistics.median(xs):.2f}/{p95:.2f}/{xs[-1]:.2f}")
        print(f"  {b:9s} " + "  ".join(cells))


if __name__ == "__main__":
    main()
