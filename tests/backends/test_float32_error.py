"""float32 error of every backend within 2x a naive float32 formula's (issue 10, item 7).

Runs ``benchmarks/float32_error.py``'s :func:`measure` on a few seeded random cases (shapes,
GQA, random masks, sharp softmax: inputs of magnitude up to 3, scale up to 4/sqrt(Dh)). The
measure, per case and tensor (output, dq, dk, dv): the norm-wise error ``‖got - want‖``
against a float64 recomputation, divided by the naive float32 implementation's norm-wise error
plus ``eps32 · ‖·‖`` of the computation with every term in absolute value (float32's rounding
floor of that tensor, so that a case the naive formula happens to round exactly cannot make the
ratio explode). The long run is ``python benchmarks/float32_error.py --cases N``.
"""

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
import torch

import qkv

CASES = 24
BOUND = 2.0


def _script() -> ModuleType:
    path = Path(__file__).parents[2] / "benchmarks" / "float32_error.py"
    spec = importlib.util.spec_from_file_location("float32_error", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def measured() -> tuple[ModuleType, dict[str, dict[str, list[float]]]]:
    script = _script()
    ratios = script.measure(CASES, seed=0)
    print("\n" + script.summary(ratios))  # the distribution, shown with pytest -s
    return script, ratios


@pytest.mark.parametrize("backend", ["reference", "fused", "blockwise"])
def test_float32_error_is_within_2x_naive(measured: tuple, backend: str) -> None:
    script, ratios = measured
    assert len(ratios[backend]["dk"]) == CASES
    worst = {name: max(xs) for name, xs in ratios[backend].items()}
    assert script.worst(ratios, backend) <= BOUND, (backend, worst, script.summary(ratios))


@pytest.fixture(scope="module")
def measured_bias() -> tuple[ModuleType, dict[str, dict[str, list[float]]]]:
    script = _script()
    ratios = script.measure(CASES, seed=0, bias=True)
    print("\n" + script.summary(ratios))
    return script, ratios


@pytest.mark.parametrize("backend", ["reference", "fused", "blockwise"])
def test_float32_error_with_a_bias_is_within_2x_naive(measured_bias: tuple, backend: str) -> None:
    """Issue 27: blockwise's backward rounded ``q · k - max`` before adding the bias (the
    shift inside the matmul), losing digits where a bias offsets a large ``q · k``; its dv
    error was up to 3.2x a naive formula's on these cases (median 1.06x), now 1.2x (0.64x)."""
    script, ratios = measured_bias
    worst = {name: max(xs) for name, xs in ratios[backend].items()}
    assert script.worst(ratios, backend) <= BOUND, (backend, worst, script.summary(ratios))


def test_auto_gradient_with_a_bias_is_within_2x_naive() -> None:
    """The issue's own call: ``auto`` (blockwise, for a CPU call needing a gradient) at
    T = S = 128 with q, k, v and the bias of magnitude 3; dv was 2.1-2.7x a naive formula's."""
    script = _script()
    for seed in range(3):
        gen = torch.Generator().manual_seed(seed)
        qkv64 = [torch.randn(2, 2, 128, 8, generator=gen, dtype=torch.float64) * 3 for _ in "qkv"]
        bias = torch.randn(128, 128, generator=gen) * 3  # [T, S]
        mask = torch.zeros(1, 1, 128, 128, dtype=torch.bool)  # [1, 1, T, S]
        leaves = [x.detach().requires_grad_() for x in qkv64]
        ref = script._naive(*leaves, mask, 1.1665, bias.double())
        d_out = torch.linspace(-1, 1, ref.numel(), dtype=ref.dtype).reshape(ref.shape)
        want = [ref.detach(), *torch.autograd.grad(ref, leaves, d_out)]
        ulp = script.EPS * script._abs_scales(*qkv64, mask, 1.1665, d_out, bias.double())[3]

        def naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return script._naive(q, k, v, mask, 1.1665, bias)  # noqa: B023 (called at once)

        def auto(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return qkv.attention(q, k, v, attn_bias=bias, scale=1.1665)[0]  # noqa: B023

        dv_auto = script._errors(auto, qkv64, want)[3]
        dv_naive = script._errors(naive, qkv64, want)[3]
        assert dv_auto / (dv_naive + ulp) <= BOUND, (seed, dv_auto, dv_naive, ulp)


def test_the_measure_sees_a_less_exact_formula(measured: tuple) -> None:
    """The measure is not blind: float32 attention whose queries are rounded to bfloat16 first
    (a backend with a real precision defect) is far above the bound."""
    script = measured[0]
    gen = torch.Generator().manual_seed(1)
    qkv64, mask, scale = script._case(gen)
    leaves = [x.detach().requires_grad_() for x in qkv64]
    ref = script._naive(*leaves, mask, scale)
    d_out = torch.linspace(-1, 1, ref.numel(), dtype=ref.dtype).reshape(ref.shape)
    want = [ref.detach(), *torch.autograd.grad(ref, leaves, d_out)]
    ulp = script.EPS * script._abs_scales(*qkv64, mask, scale, d_out)[0]
    naive = script._errors(lambda q, k, v: script._naive(q, k, v, mask, scale), qkv64, want)

    def coarse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return script._naive(q.bfloat16().float(), k, v, mask, scale)

    bad = script._errors(coarse, qkv64, want)
    assert bad[0] / (naive[0] + ulp) > 10 * BOUND


def test_sdpa_backward_is_why_exact_gradients_are_the_default(measured: tuple) -> None:
    """What :func:`qkv.allow_sdpa_backward` trades away: on the same seeded cases, SDPA's own
    CPU backward (torch 2.13) is above the bound qkv's default gradients meet (its dv error
    measured up to 15x a naive formula's). Should torch make it exact, this fails, and the
    default can be revisited."""
    script, ratios = measured
    assert script.worst(ratios, script.SDPA_BACKWARD) > BOUND, script.summary(ratios)
    assert script.worst(ratios, "fused") <= BOUND  # the same cases, exact gradients


def test_exact_backward_only_below_its_memory_bound() -> None:
    """Long sequences keep SDPA's O(T) backward memory: the exact backward has a size bound."""
    from qkv.backends import fused

    q = torch.randn(1, 2, 16, 8, requires_grad=True)
    out = fused.fused_attention(
        q, q, q, None, None, is_causal=False, scale=0.3, dropout_p=0.0, training=False
    )
    assert type(out.grad_fn).__name__ == "_ExactBackwardBackward"
    with qkv.use_policy(exact_backward_max_bytes=4 * 2 * 16 * 16 * 4 - 1):
        out = fused.fused_attention(
            q, q, q, None, None, is_causal=False, scale=0.3, dropout_p=0.0, training=False
        )
    assert type(out.grad_fn).__name__ != "_ExactBackwardBackward"
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
