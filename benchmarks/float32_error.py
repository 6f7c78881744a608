"""float32 error of every backend against a naive float32 implementation (issue 10, item 7).

For random cases (shapes, GQA, masks, and sharp softmax: inputs of magnitude up to 3 and a
scale up to 4/sqrt(Dh)), each backend's float32 output and gradients (dq, dk, dv) are compared
with a float64 recomputation, and so is a naive float32 implementation (softmax(QKᵀ·scale) V
written out, the error a same-precision formula makes).

The measure, per case and tensor: ``err / (naive_err + ulp)``. ``err`` is the norm-wise error
``‖got - want‖`` (Frobenius) against float64, ``naive_err`` the naive implementation's, and
``ulp = eps32 · ‖·‖`` of the same computation done in float64 with every term in absolute value
(``P @ |V|`` for the output, ``scale · (P ∘ (|dO Vᵀ| + |δ|)) @ |K|`` for dq, and so on): the
scale float32's rounding errors of those sums are proportional to. Norm-wise, because the max
abs error of two equally good float32 formulas varies by 3x from case to case (one element's
rounding); the ``ulp`` term, because a case where the naive formula happens to round exactly
(``naive_err`` ~ 0, e.g. dq = 0 when only one key is open) would make any backend's ratio
explode. The ratio is summarized as median, p95 and worst per backend; the goal is a worst
ratio of at most 2. One more contestant, ``sdpa-backward`` (fused inside
:func:`qkv.allow_sdpa_backward`: SDPA's forward and its own CPU backward), shows what that
opt-in trades away; it is not held to the goal.

``tests/backends/test_float32_error.py`` runs :func:`measure` on a few seeded cases; this script
is the long run.

With ``--bias`` every case also adds a random float32 ``attn_bias`` to the scores.

Usage: ``python benchmarks/float32_error.py [--cases N] [--seed S] [--bias]``.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from functools import partial

import torch
from torch import Tensor

import qkv

BACKENDS = ("reference", "fused", "blockwise")
SDPA_BACKWARD = "sdpa-backward"
"""The contestant that is not held to the goal: fused with SDPA's own backward."""
NAMES = ("out", "dq", "dk", "dv")
EPS = torch.finfo(torch.float32).eps
TINY = torch.finfo(torch.float32).tiny

Ratios = dict[str, dict[str, list[float]]]
"""contestant -> tensor name -> one ratio per case."""
Formula = Callable[[Tensor, Tensor, Tensor, Tensor, float, Tensor | None], Tensor]
"""``(q, k, v, mask, scale, bias) -> output``, float32 in, float32 out (bias may be None)."""


def _backend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor,
    scale: float,
    bias: Tensor | None = None,
    *,
    backend: str,
) -> Tensor:
    return qkv.attention(q, k, v, mask=mask, attn_bias=bias, scale=scale, backend=backend)[0]


def _sdpa_backward(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float, bias: Tensor | None = None
) -> Tensor:
    with qkv.allow_sdpa_backward():
        return qkv.attention(q, k, v, mask=mask, attn_bias=bias, scale=scale, backend="fused")[0]


CONTESTANTS: dict[str, Formula] = {
    **{b: partial(_backend, backend=b) for b in BACKENDS},
    SDPA_BACKWARD: _sdpa_backward,
}
"""Every formula measured: the backends, held to the goal, and SDPA's own backward."""


def _naive(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float, bias: Tensor | None = None
) -> Tensor:
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)  # [B, H, S, D]
    scores = q @ k.transpose(-2, -1) * scale  # [B, H, T, S]
    if bias is not None:
        scores = scores + bias.to(scores.dtype)  # [B, H, T, S]
    scores = scores.masked_fill(mask, float("-inf"))  # [B, H, T, S]
    return torch.softmax(scores, dim=-1) @ v  # [B, H, T, Dv]


def _abs_scales(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor,
    scale: float,
    d_out: Tensor,
    bias: Tensor | None = None,
) -> list[float]:
    """‖·‖ of out, dq, dk, dv computed in float64 with every term in absolute value."""
    Hkv, g = k.shape[1], q.shape[1] // k.shape[1]
    ke, ve = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)  # [B, H, S, D]
    scores = q @ ke.transpose(-2, -1) * scale  # [B, H, T, S]
    if bias is not None:
        scores = scores + bias.to(scores.dtype)  # [B, H, T, S]
    scores = scores.masked_fill(mask, float("-inf"))  # [B, H, T, S]
    p = torch.softmax(scores, dim=-1)  # [B, H, T, S]
    out = p @ ve  # [B, H, T, Dv]
    delta = (d_out * out).sum(-1, keepdim=True).abs()  # [B, H, T, 1]
    ds = p * ((d_out @ ve.transpose(-2, -1)).abs() + delta)  # [B, H, T, S]
    dq = scale * ds @ ke.abs()  # [B, H, T, Dh]
    dk = scale * ds.transpose(-2, -1) @ q.abs()  # [B, H, S, Dh]
    dv = p.transpose(-2, -1) @ d_out.abs()  # [B, H, S, Dv]
    dk, dv = (x.unflatten(1, (Hkv, g)).sum(2) for x in (dk, dv))  # [B, Hkv, S, D]
    return [float(x.norm()) for x in (p @ ve.abs(), dq, dk, dv)]


def _case(gen: torch.Generator, max_len: int = 40) -> tuple[list[Tensor], Tensor, float]:
    def r(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    B, Hkv, T, S, Dh = r(1, 2), r(1, 2), r(1, max_len), r(1, max_len), r(4, 32)
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


def _errors(
    fn: Callable[[Tensor, Tensor, Tensor], Tensor], qkv64: list[Tensor], want: list[Tensor]
) -> list[float]:
    """Norm-wise error of ``fn``'s float32 output and gradients against ``want`` (float64)."""
    leaves = [x.float().requires_grad_() for x in qkv64]
    out = fn(*leaves)
    d_out = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)
    got = [out, *torch.autograd.grad(out, leaves, d_out)]
    return [float((g.detach().double() - w).norm()) for g, w in zip(got, want, strict=True)]


BIAS_MAX_LEN = 160
"""The longest T and S of a case with a bias: the error a bias case tests grows with S (issue 27
measured it at T = S = 128)."""


def _bias(gen: torch.Generator, mask: Tensor) -> Tensor:
    """A float32 score bias ``[T, S]`` (shared by every batch and head, as a relative-position
    or ALiBi bias), of standard deviation up to 10 (an ALiBi bias reaches ``slope · S``): a
    score near its row max then holds a large ``q · k`` offset by the bias, the case where
    rounding ``q · k - max`` before adding the bias lost digits (issue 27)."""
    T, S = mask.shape[-2:]
    mag = float(torch.empty(1).uniform_(0.5, 10.0, generator=gen))
    return torch.randn(T, S, generator=gen) * mag  # [T, S]


def measure(cases: int, seed: int = 0, *, bias: bool = False) -> Ratios:
    """Each contestant's error / (naive float32 error + ulp) on ``cases`` random cases.

    Args:
        cases: how many random cases.
        seed: seed of the case generator.
        bias: add a random float32 ``attn_bias`` to the scores of every case (the gradients
            measured stay those of q, k, v).

    Returns:
        contestant (:data:`CONTESTANTS`) -> ``"out" | "dq" | "dk" | "dv"`` -> the ratio of each
        case.
    """
    gen = torch.Generator().manual_seed(seed)
    ratios: Ratios = {c: {n: [] for n in NAMES} for c in CONTESTANTS}
    for _ in range(cases):
        qkv64, mask, scale = _case(gen, BIAS_MAX_LEN if bias else 40)
        b = _bias(gen, mask) if bias else None
        b64 = None if b is None else b.double()  # the float32 bias, exactly
        leaves = [x.detach().requires_grad_() for x in qkv64]
        ref = _naive(*leaves, mask, scale, b64)
        d_out = torch.linspace(-1, 1, ref.numel(), dtype=ref.dtype).reshape(ref.shape)
        want = [ref.detach(), *torch.autograd.grad(ref, leaves, d_out)]
        scales = _abs_scales(*qkv64, mask, scale, d_out, b64)
        ulps = [EPS * max(x, TINY) for x in scales]  # > 0 also for a tensor of zeros
        naive = _errors(partial(_naive, mask=mask, scale=scale, bias=b), qkv64, want)
        for c, formula in CONTESTANTS.items():
            got = _errors(partial(formula, mask=mask, scale=scale, bias=b), qkv64, want)
            for n, e, e0, ulp in zip(NAMES, got, naive, ulps, strict=True):
                ratios[c][n].append(e / (e0 + ulp))
    return ratios


def worst(ratios: Ratios, backend: str) -> float:
    """The largest ratio of ``backend`` over every case and tensor."""
    return max(max(xs) for xs in ratios[backend].values())


def summary(ratios: Ratios) -> str:
    """One line per contestant: median / p95 / worst ratio of each tensor."""
    cases = len(next(iter(ratios.values()))[NAMES[0]])
    lines = [f"{cases} cases; error / (naive float32 error + ulp), median/p95/worst:"]
    for b in ratios:
        cells = []
        for n in NAMES:
            xs = sorted(ratios[b][n])
            p95 = xs[min(len(xs) - 1, int(0.95 * len(xs)))]
            cells.append(f"{n} {statistics.median(xs):.2f}/{p95:.2f}/{xs[-1]:.2f}")
        lines.append(f"  {b:13s} " + "  ".join(cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--cases", type=int, default=300, help="random cases")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bias", action="store_true", help="add a random attn_bias to each case")
    args = parser.parse_args(argv)
    print(summary(measure(args.cases, args.seed, bias=args.bias)))


if __name__ == "__main__":
    main()
