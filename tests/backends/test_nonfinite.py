"""Nothing silently wrong at blocked positions, on every backend (issue 10, items 5, 8, 9).

A key blocked for every query of a sample (padding) never influences any output or gradient,
whatever its value (NaN, +inf, -inf); rows with every key blocked are 0; all backends agree
with the float64 reference computed on the same inputs with those keys replaced by finite ones.
"""

from collections.abc import Callable

import pytest
import torch

import qkv
from qkv.masks import Causal, Padding, padding_mask
from reference_f64 import attention_f64

BACKENDS = ("reference", "fused", "blockwise", "auto")
B, H, HKV, T, S, DH, DV = 3, 4, 2, 6, 9, 8, 5
LENGTHS = torch.tensor([9, 4, 0])  # sample 2 is all padding: every one of its rows is dead
POISONS = (float("nan"), float("inf"), float("-inf"))


def _tensor_padding() -> object:
    return padding_mask(LENGTHS, S)  # [B, 1, 1, S]


def _rule_padding() -> object:
    return Padding(LENGTHS)


def _causal_and_padding() -> object:
    return Causal() | Padding(LENGTHS)


MASKS: dict[str, Callable[[], object]] = {
    "tensor_padding": _tensor_padding,
    "rule_padding": _rule_padding,
    "causal_and_padding": _causal_and_padding,
}


def _clean_inputs(dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [
        torch.randn(B, H, T, DH, generator=g, dtype=dtype),
        torch.randn(B, HKV, S, DH, generator=g, dtype=dtype),
        torch.randn(B, HKV, S, DV, generator=g, dtype=dtype),
    ]


def _poisoned(x: torch.Tensor, value: float) -> torch.Tensor:
    """``x`` [B, Hkv, S, *] with ``value`` at every padded key position."""
    pad = torch.arange(S)[None, :] >= LENGTHS[:, None]  # [B, S]
    return x.masked_fill(pad[:, None, :, None], value)  # [B, Hkv, S, *]


def _out_and_grads(
    backend: str, inputs: list[torch.Tensor], mask: object
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    leaves = [x.detach().requires_grad_() for x in inputs]
    out, _ = qkv.attention(*leaves, mask=mask, backend=backend)  # type: ignore[arg-type]
    d_out = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)
    return out, torch.autograd.grad(out, leaves, d_out)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mask_name", list(MASKS))
@pytest.mark.parametrize(
    ("where", "poison"),
    [("key", p) for p in POISONS] + [("value", p) for p in POISONS] + [("both", POISONS[0])],
)
def test_padded_keys_never_leak(backend: str, mask_name: str, where: str, poison: float) -> None:
    clean = _clean_inputs()
    q, k, v = clean
    if where in ("key", "both"):
        k = _poisoned(k, poison)
    if where in ("value", "both"):
        v = _poisoned(v, poison)
    out, grads = _out_and_grads(backend, [q, k, v], MASKS[mask_name]())
    # the reference: float64, padded keys finite (random)
    want, want_grads = _out_and_grads("reference", [x.double() for x in clean], MASKS[mask_name]())
    torch.testing.assert_close(out, want.float(), atol=1e-5, rtol=1.3e-6)
    for got_g, want_g in zip(grads, want_grads, strict=True):
        # gradients at padded keys are 0 in the reference, so the poison gets no gradient either
        torch.testing.assert_close(got_g, want_g.float(), atol=1e-5, rtol=1.3e-6)
    assert torch.equal(out[2], torch.zeros_like(out[2]))  # the all-padding sample


@pytest.mark.parametrize("backend", BACKENDS)
def test_fully_masked_rows_are_zero_even_next_to_nan(backend: str) -> None:
    """Row 0 sees no key; key 3 is NaN and visible to the other rows (which are NaN then)."""
    q, k, v = _clean_inputs()
    v = v.clone()
    v[:, :, 3] = float("nan")
    mask = torch.zeros(1, 1, T, S, dtype=torch.bool)
    mask[..., 0, :] = True  # row 0: every key blocked
    out, _ = qkv.attention(q, k, v, mask=mask, backend=backend)  # type: ignore[arg-type]
    assert torch.equal(out[:, :, 0], torch.zeros_like(out[:, :, 0]))
    assert out[:, :, 1:].isnan().all()  # the NaN is real data for them: nothing hides it


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_dim_mask_and_bias_are_key_vectors(backend: str) -> None:
    """A ``[S]`` mask or bias means ``[1, 1, 1, S]`` on every backend (fused used to crash)."""
    q, k, v = (x.double().requires_grad_() for x in _clean_inputs())
    mask = torch.arange(S) % 4 == 1  # [S]
    bias = torch.linspace(-2, 2, S, dtype=torch.float64)  # [S]
    got, _ = qkv.attention(q, k, v, mask=mask, attn_bias=bias, backend=backend)  # type: ignore[arg-type]
    want, _ = attention_f64(q, k, v, mask, bias)  # independent recomputation, broadcasting
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-8)


def test_multihead_attention_takes_a_one_dim_mask() -> None:
    mha = qkv.MultiHeadAttention(16, 4, backend="fused").double()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    mask = torch.tensor([False, True, False, False, True])  # [S]
    got, _ = mha(x, mask=mask, need_weights=False)
    mha.backend = "reference"
    want, _ = mha(x, mask=mask[None, None, None], need_weights=False)  # the 4-D spelling
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-8)


def test_blockwise_dropout_one_keeps_the_graph() -> None:
    """``dropout_p=1`` drops every weight: output 0, gradients 0 (not a detached tensor)."""
    grads = {}
    for backend in ("reference", "blockwise"):
        leaves = [x.requires_grad_() for x in _clean_inputs()]
        out, _ = qkv.attention(*leaves, dropout_p=1.0, training=True, backend=backend)  # type: ignore[arg-type]
        assert torch.equal(out, torch.zeros_like(out))
        out.sum().backward()
        grads[backend] = [x.grad for x in leaves]
    for got, want in zip(grads["blockwise"], grads["reference"], strict=True):
        assert got is not None and want is not None
        torch.testing.assert_close(got, want)
        assert torch.equal(got, torch.zeros_like(got))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("dtype", "magnitude"), [(torch.bfloat16, 1e20), (torch.float32, 1e19)])
def test_scores_beyond_float32_are_computed_not_nan(
    backend: str, dtype: torch.dtype, magnitude: float
) -> None:
    """Issue 27: finite q and k whose float32 scores overflow (bfloat16 has float32's range)
    gave NaN on every backend, while the float64 result is finite. Now the call is computed
    again in float64: the output and gradients are the float64 ones, rounded."""
    g = torch.Generator().manual_seed(3)
    q, k = (torch.randn(2, 2, n, 8, generator=g) * magnitude for n in (5, 7))
    v = torch.randn(2, 2, 7, 8, generator=g)
    bias = torch.randn(5, 7, generator=g)  # [T, S]
    inputs = [x.to(dtype) for x in (q, k, v)]
    leaves = [x.detach().requires_grad_() for x in inputs]
    out, _ = qkv.attention(*leaves, attn_bias=bias.to(dtype), backend=backend)  # type: ignore[arg-type]
    d_out = torch.linspace(-1, 1, out.numel()).reshape(out.shape)
    grads = torch.autograd.grad(out, leaves, d_out.to(dtype))
    wide = [x.detach().double().requires_grad_() for x in inputs]
    want, _ = qkv.attention(*wide, attn_bias=bias.to(dtype).double(), backend="reference")
    want_grads = torch.autograd.grad(want, wide, d_out.double())
    assert torch.isfinite(want).all()
    torch.testing.assert_close(out, want.to(dtype))
    for got, expected in zip(grads, want_grads, strict=True):
        assert not got.isnan().any()
        torch.testing.assert_close(got, expected.to(dtype))


def test_a_nan_input_still_gives_nan() -> None:
    """The float64 retry is for overflow only: a NaN the inputs hold stays in the output."""
    q, k, v = (torch.randn(1, 1, 3, 4) for _ in range(3))
    v[0, 0, 1, 0] = float("nan")
    out, _ = qkv.attention(q, k, v)
    assert out[..., 0].isnan().all() and not out[..., 1:].isnan().any()
