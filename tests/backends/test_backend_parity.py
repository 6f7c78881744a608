"""Every backend against the reference recomputed in float64: outputs and gradients."""

from collections.abc import Callable

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import qkv
from qkv.masks import (
    Causal,
    Documents,
    MaskMod,
    Padding,
    SlidingWindow,
    StructuredMask,
)

TOL = {torch.float32: {"atol": 1e-5, "rtol": 1.3e-6}, torch.float64: {"atol": 1e-10, "rtol": 1e-8}}
B, H, HKV, T, S = 2, 4, 2, 7, 11


def _stripes(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    return ((q + kv + h) % 3 != 0) & (kv <= q + 4 + b)


def _masks() -> dict[str, Callable[[], object]]:
    ids_q = torch.tensor([[0, 0, 0, 1, 1, 2, 2], [0, 1, 1, 1, 1, 1, 3]])
    ids_k = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2], [0, 0, 1, 1, 1, 1, 1, 1, 1, 2, 2]])
    return {
        "none": lambda: None,
        "tensor": lambda: torch.rand(B, 1, T, S) < 0.4,
        "causal_bottom_right": lambda: Causal(),
        "causal_top_left": lambda: Causal(align="top_left"),
        "sliding_window": lambda: SlidingWindow(3),
        # sample 1 has no keys at all: every row fully masked.
        "padding_with_empty_sample": lambda: Padding(torch.tensor([6, 0])),
        "documents": lambda: Documents(ids_q, ids_k),
        "mask_mod": lambda: MaskMod(_stripes),
        "causal_top_left_and_padding": lambda: (
            Causal(align="top_left") | Padding(torch.tensor([11, 3]))
        ),
    }


def _inputs(
    dtype: torch.dtype, t: int = T, s: int = S, h: int = H, hkv: int = HKV
) -> list[torch.Tensor]:
    return [
        torch.randn(B, h, t, 16, dtype=dtype, requires_grad=True),
        torch.randn(B, hkv, s, 16, dtype=dtype, requires_grad=True),
        torch.randn(B, hkv, s, 8, dtype=dtype, requires_grad=True),
    ]


def _run(backend: str, qkv_in: list[torch.Tensor], **kw: object) -> list[torch.Tensor]:
    out, _ = qkv.attention(*qkv_in, backend=backend, **kw)  # type: ignore[arg-type]
    d_out = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)
    grads = torch.autograd.grad(out, qkv_in, d_out)
    return [out, *grads]


def _reference64(qkv_in: list[torch.Tensor], **kw: object) -> list[torch.Tensor]:
    wide = [x.detach().double().requires_grad_() for x in qkv_in]
    kw = {
        k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
        for k, v in kw.items()
    }
    return _run("reference", wide, **kw)


@pytest.mark.parametrize("backend", ["fused", "blockwise"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", list(_masks()))
def test_matches_reference(backend: str, dtype: torch.dtype, name: str) -> None:
    mask = _masks()[name]()
    qkv_in = _inputs(dtype)
    kw: dict[str, object] = {"mask": mask, "block_q": 3, "block_k": 4}
    got = _run(backend, qkv_in, **kw)
    want = _reference64(qkv_in, **kw)
    for g, w in zip(got, want, strict=True):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, w.to(dtype), **TOL[dtype])


@pytest.mark.parametrize("backend", ["fused", "blockwise"])
@pytest.mark.parametrize("t,s", [(7, 11), (9, 9), (11, 5)])
def test_is_causal_bottom_right_with_padding(backend: str, t: int, s: int) -> None:
    qkv_in = _inputs(torch.float64, t, s)
    kw: dict[str, object] = {
        "is_causal": True,
        "mask": Padding(torch.tensor([s, 1])),
        "block_q": 4,
        "block_k": 3,
    }
    for g, w in zip(_run(backend, qkv_in, **kw), _reference64(qkv_in, **kw), strict=True):
        torch.testing.assert_close(g, w, **TOL[torch.float64])


@pytest.mark.parametrize("backend", ["fused", "blockwise"])
def test_fully_masked_rows_are_zero_with_finite_gradients(backend: str) -> None:
    qkv_in = _inputs(torch.float32)
    blocked = torch.zeros(B, 1, T, S, dtype=torch.bool)
    blocked[0, :, 2] = True  # query row 2 of sample 0 sees nothing
    out, _ = qkv.attention(*qkv_in, mask=blocked, backend=backend)  # type: ignore[arg-type]
    assert bool((out[0, :, 2] == 0).all())
    grads = torch.autograd.grad(out.sum(), qkv_in)
    assert all(bool(torch.isfinite(g).all()) for g in grads)
    assert bool((grads[0][0, :, 2] == 0).all())


@pytest.mark.parametrize("backend", ["fused", "blockwise"])
@pytest.mark.parametrize("bias_shape", [(1, H, T, S), (B, 1, 1, S), (T, S)])
def test_bias_and_its_gradient(backend: str, bias_shape: tuple[int, ...]) -> None:
    qkv_in = _inputs(torch.float64)
    bias = torch.randn(bias_shape, dtype=torch.float64, requires_grad=True)
    kw: dict[str, object] = {"attn_bias": bias, "mask": Causal(), "block_q": 2, "block_k": 5}
    out, _ = qkv.attention(*qkv_in, backend=backend, **kw)  # type: ignore[arg-type]
    (g_bias,) = torch.autograd.grad(out.square().sum(), bias)
    ref, _ = qkv.attention(*qkv_in, backend="reference", **kw)  # type: ignore[arg-type]
    (r_bias,) = torch.autograd.grad(ref.square().sum(), bias)
    torch.testing.assert_close(out, ref, **TOL[torch.float64])
    torch.testing.assert_close(g_bias, r_bias, **TOL[torch.float64])


def _naive_low_precision(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocked: torch.Tensor
) -> torch.Tensor:
    """The straightforward implementation run entirely in the low precision."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # [B, H, S, Dh]
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)  # [B, H, S, Dv]
    scores = (q @ k.transpose(-2, -1)) / q.shape[-1] ** 0.5  # [B, H, T, S]
    weights = torch.softmax(scores.masked_fill(blocked, float("-inf")), dim=-1)  # [B, H, T, S]
    return weights @ v  # [B, H, T, Dv]


@pytest.mark.parametrize("backend", ["reference", "fused", "blockwise"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_error_at_most_twice_naive(backend: str, dtype: torch.dtype) -> None:
    q, k, v = (x.detach().to(dtype) * 3 for x in _inputs(torch.float32, 33, 47))
    mask = SlidingWindow(20)
    blocked = mask.materialize(B, H, 33, 47)
    exact, _ = qkv.attention(q.double(), k.double(), v.double(), mask=mask, backend="reference")
    out, _ = qkv.attention(q, k, v, mask=mask, backend=backend, block_q=8, block_k=16)  # type: ignore[arg-type]
    assert out.dtype == dtype
    err = (out.double() - exact).abs().max()
    naive_err = (_naive_low_precision(q, k, v, blocked).double() - exact).abs().max()
    assert err <= 2 * naive_err, (float(err), float(naive_err))


@given(
    t=st.integers(1, 20),
    s=st.integers(1, 20),
    block_q=st.integers(1, 9),
    block_k=st.integers(1, 9),
    groups=st.sampled_from([1, 2, 3]),
    kind=st.sampled_from(["none", "causal", "window", "padding", "top_left"]),
)
def test_blockwise_any_shape_and_block_size(
    t: int, s: int, block_q: int, block_k: int, groups: int, kind: str
) -> None:
    masks: dict[str, StructuredMask | None] = {
        "none": None,
        "causal": Causal(),
        "window": SlidingWindow(5),
        "padding": Padding(torch.tensor([s, s // 2])),
        "top_left": Causal(align="top_left"),
    }
    qkv_in = _inputs(torch.float64, t, s, h=2 * groups, hkv=2)
    kw: dict[str, object] = {"mask": masks[kind], "block_q": block_q, "block_k": block_k}
    for g, w in zip(_run("blockwise", qkv_in, **kw), _reference64(qkv_in, **kw), strict=True):
        torch.testing.assert_close(g, w, **TOL[torch.float64])
