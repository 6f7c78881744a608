"""scaled_dot_product_attention against PyTorch's SDPA and a float64 recomputation.

Tolerances (DESIGN.md): float32 vs the float64 recomputation atol 1e-5 / rtol 1.3e-6; float16 and
bfloat16: qkv's error against the float64 recomputation at most 2x the error of a naive
implementation computed entirely in that precision.
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

import qkv
from qkv.masks import causal_mask, combine, padding_mask, sliding_window_mask, to_sdpa_bool
from reference_f64 import attention_f64

B, H, T, S, Dh, Dv = 2, 3, 5, 9, 8, 6
LOW_PRECISION = (torch.float16, torch.bfloat16)
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def naive_same_precision(
    q: Tensor, k: Tensor, v: Tensor, blocked: Tensor | None
) -> tuple[Tensor, Tensor]:
    """The formula computed entirely in the inputs' dtype (what qkv must not be worse than)."""
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])  # [B, H, T, S]
    if blocked is not None:
        scores = scores.masked_fill(blocked, float("-inf"))
    weights = torch.softmax(scores, dim=-1)  # [B, H, T, S]
    return weights @ v, weights  # [B, H, T, Dv]


def make_masks() -> dict[str, Tensor | None]:
    """Every mask kind for T=5, S=9; none of them blocks a whole query row."""
    pad = padding_mask(torch.tensor([9, 4]), S)
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
        "random_4d": torch.rand(B, H, T, S) > 0.6,
    }


MASKS = make_masks()


def _inputs(dtype: torch.dtype, seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, Dh, generator=gen).to(dtype)
    k = torch.randn(B, H, S, Dh, generator=gen).to(dtype)
    v = torch.randn(B, H, S, Dv, generator=gen).to(dtype)
    return q, k, v


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", list(MASKS))
def test_matches_float64_reference(kind: str, dtype: torch.dtype) -> None:
    blocked = MASKS[kind]
    if blocked is not None and kind == "random_4d":
        blocked = blocked.clone()
        blocked[..., 0] = False  # keep every row alive; dead rows have their own tests
    q, k, v = _inputs(dtype)
    out, weights = qkv.scaled_dot_product_attention(q, k, v, blocked)
    ref_out, ref_w = attention_f64(q, k, v, blocked)
    assert out.dtype == dtype and weights.dtype == dtype
    assert out.shape == (B, H, T, Dv) and weights.shape == (B, H, T, S)
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1.3e-6)
        torch.testing.assert_close(weights.double(), ref_w, atol=1e-5, rtol=1.3e-6)
    elif dtype == torch.float64:
        torch.testing.assert_close(out, ref_out)
        torch.testing.assert_close(weights, ref_w)
    else:
        naive_out, naive_w = naive_same_precision(q, k, v, blocked)
        for got, naive, ref in ((out, naive_out, ref_out), (weights, naive_w, ref_w)):
            err = (got.double() - ref).abs().max()
            naive_err = (naive.double() - ref).abs().max()
            assert err <= 2 * naive_err, f"qkv error {err:.3g} > 2 x naive {dtype} {naive_err:.3g}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", list(MASKS))
def test_matches_torch_sdpa(kind: str, dtype: torch.dtype) -> None:
    blocked = MASKS[kind]
    if blocked is not None and kind == "random_4d":
        blocked = blocked.clone()
        blocked[..., 0] = False
    q, k, v = _inputs(dtype, seed=1)
    out, _ = qkv.scaled_dot_product_attention(q, k, v, blocked)
    sdpa_mask = None if blocked is None else to_sdpa_bool(blocked)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_mask)
    if dtype in LOW_PRECISION:
        # Both round differently from float64; neither may be more than 2x worse than naive.
        ref64, _ = attention_f64(q, k, v, blocked)
        err = (out.double() - ref64).abs().max()
        torch_err = (ref.double() - ref64).abs().max()
        assert err <= 2 * torch_err + torch.finfo(dtype).eps, (err, torch_err)
    else:
        torch.testing.assert_close(out, ref)


def test_is_causal_matches_torch_lower_right() -> None:
    from torch.nn.attention.bias import causal_lower_right

    q, k, v = _inputs(torch.float32)
    out, _ = qkv.attention(q, k, v, is_causal=True)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(T, S))
    torch.testing.assert_close(out, ref)


def test_square_is_causal_matches_torch_is_causal() -> None:
    q = torch.randn(2, 2, 6, 4)
    k = torch.randn(2, 2, 6, 4)
    v = torch.randn(2, 2, 6, 3)
    out, _ = qkv.attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True))


def test_fp16_overflowing_dot_products_stay_finite() -> None:
    gen = torch.Generator().manual_seed(0)
    Dh64 = 64
    q = (300 + torch.rand(1, 2, 4, Dh64, generator=gen)).half()
    k = (300 + torch.rand(1, 2, 6, Dh64, generator=gen)).half()
    v = torch.randn(1, 2, 6, 5, generator=gen).half()
    # In float16 the raw dot products (about 300 * 300 * 64 = 5.8e6) overflow to inf.
    assert torch.isinf(q @ k.transpose(-2, -1)).all()
    assert not torch.isfinite(naive_same_precision(q, k, v, None)[0]).all()
    out, weights = qkv.scaled_dot_product_attention(q, k, v)
    assert torch.isfinite(out).all() and torch.isfinite(weights).all()
    ref_out, ref_w = attention_f64(q, k, v, None)
    # Only the final rounding to float16 remains: within one float16 ulp of the reference.
    torch.testing.assert_close(out.double(), ref_out, atol=0, rtol=2 * 2**-10)
    torch.testing.assert_close(weights.double(), ref_w, atol=2**-11, rtol=2 * 2**-10)


def test_enclosing_autocast_is_disabled() -> None:
    q, k, v = _inputs(torch.float32)
    blocked = MASKS["combined"]
    expected, expected_w = qkv.scaled_dot_product_attention(q, k, v, blocked)
    # qkv.attention may pick another backend than the reference (auto): compare it with itself.
    expected_kw, _ = qkv.attention(q, k, v, mask=blocked)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert (q @ k.transpose(-2, -1)).dtype == torch.bfloat16  # autocast is really on
        out, weights = qkv.scaled_dot_product_attention(q, k, v, blocked)
        kw_out, _ = qkv.attention(q, k, v, mask=blocked)
    assert out.dtype == torch.float32 and weights.dtype == torch.float32
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    torch.testing.assert_close(weights, expected_w, atol=0, rtol=0)
    torch.testing.assert_close(kw_out, expected_kw, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=str)
def test_low_precision_is_computed_in_float32(dtype: torch.dtype) -> None:
    q, k, v = _inputs(dtype)
    out, weights = qkv.scaled_dot_product_attention(q, k, v, MASKS["padding"])
    f32_out, f32_w = qkv.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), MASKS["padding"]
    )
    torch.testing.assert_close(out, f32_out.to(dtype), atol=0, rtol=0)
    torch.testing.assert_close(weights, f32_w.to(dtype), atol=0, rtol=0)


# --- fully blocked rows ---------------------------------------------------------------------


def _mask_with_dead_rows() -> Tensor:
    blocked = padding_mask(torch.tensor([9, 0]), S).expand(B, H, T, S).clone()  # sample 1 dead
    blocked[0, 1, 2] = True  # one more dead row in sample 0, head 1, query 2
    return blocked


def test_fully_blocked_rows_give_exact_zero_and_finite_grads() -> None:
    blocked = _mask_with_dead_rows()
    q, k, v = (x.requires_grad_() for x in _inputs(torch.float32))
    out, weights = qkv.scaled_dot_product_attention(q, k, v, blocked)
    dead = blocked.all(dim=-1)  # [B, H, T]
    assert bool((out[dead] == 0).all()) and bool((weights[dead] == 0).all())
    (out.sum() + weights.sum()).backward()
    for g in (q.grad, k.grad, v.grad):
        assert g is not None and torch.isfinite(g).all()
    assert q.grad is not None and bool((q.grad[dead] == 0).all())
    ref_out, _ = attention_f64(q.detach(), k.detach(), v.detach(), blocked)
    torch.testing.assert_close(out.detach().double(), ref_out, atol=1e-5, rtol=1.3e-6)


def test_gradcheck_function_float64() -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 3, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    k = torch.randn(1, 2, 5, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    v = torch.randn(1, 2, 5, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    blocked = combine(causal_mask(3, 5, align="bottom_right"), torch.rand(1, 2, 3, 5) > 0.7)
    assert blocked is not None
    blocked = blocked.clone()
    blocked[0, 0, 1] = True  # a fully blocked row

    def fn(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return qkv.scaled_dot_product_attention(q, k, v, blocked)

    assert torch.autograd.gradcheck(fn, (q, k, v))
    assert torch.autograd.gradgradcheck(fn, (q, k, v))


# --- dropout --------------------------------------------------------------------------------


def test_dropout_is_off_unless_training() -> None:
    q, k, v = _inputs(torch.float32)
    plain = qkv.scaled_dot_product_attention(q, k, v, MASKS["padding"])
    evaluated = qkv.scaled_dot_product_attention(q, k, v, MASKS["padding"], dropout_p=0.5)
    for a, b in zip(plain, evaluated, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_dropout_weights_are_the_ones_multiplied_with_v() -> None:
    q, k, v = _inputs(torch.float64)
    blocked = MASKS["padding"]
    out, weights = qkv.scaled_dot_product_attention(q, k, v, blocked, 0.5, True)
    _, undropped = attention_f64(q, k, v, blocked)
    kept = weights != 0
    assert int((undropped != 0).sum() - kept.sum()) > 0  # some weights really were dropped
    torch.testing.assert_close(weights[kept], undropped[kept] / 0.5)  # survivors scaled 1/(1-p)
    torch.testing.assert_close(out, weights @ v)
    out_kw, w_kw = qkv.attention(
        q, k, v, mask=blocked, need_weights=True, dropout_p=0.5, training=True
    )
    assert w_kw is not None
    torch.testing.assert_close(out_kw, w_kw @ v)


def test_dropout_one_drops_everything() -> None:
    q, k, v = _inputs(torch.float32)
    out, weights = qkv.scaled_dot_product_attention(q, k, v, None, 1.0, True)
    assert bool((weights == 0).all()) and bool((out == 0).all())


# --- validation: one test per error ---------------------------------------------------------

sdpa = qkv.scaled_dot_product_attention


def _qkv(**shapes: tuple[int, ...]) -> tuple[Tensor, Tensor, Tensor]:
    q = torch.randn(*shapes.get("q", (2, 3, 4, 8)))
    k = torch.randn(*shapes.get("k", (2, 3, 6, 8)))
    v = torch.randn(*shapes.get("v", (2, 3, 6, 5)))
    return q, k, v


def test_rejects_not_4d() -> None:
    q, k, v = _qkv(q=(3, 4, 8))
    with pytest.raises(
        ValueError, match=r"query must be 4-D \[B, H, T, Dh\], got shape \(3, 4, 8\)"
    ):
        sdpa(q, k, v)


def test_rejects_not_floating() -> None:
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=r"key must be floating point, got dtype torch.int64"):
        sdpa(q, k.long(), v)


def test_rejects_dtype_mismatch() -> None:
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=r"share one dtype.*float32, torch.float32, torch.float64"):
        sdpa(q, k, v.double())


def test_rejects_device_mismatch() -> None:
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"one device, got cpu, meta, cpu"):
        sdpa(q, k.to("meta"), v)


def test_rejects_batch_mismatch() -> None:
    q, k, v = _qkv(k=(3, 3, 6, 8), v=(3, 3, 6, 5))
    with pytest.raises(ValueError, match=r"batch sizes differ: query B=2, key B=3, value B=3"):
        sdpa(q, k, v)


def test_rejects_head_mismatch() -> None:
    q, k, v = _qkv(k=(2, 1, 6, 8), v=(2, 1, 6, 5))
    with pytest.raises(ValueError, match=r"head counts differ: query H=3, key/value H=1"):
        sdpa(q, k, v)


def test_attention_rejects_heads_that_do_not_group() -> None:
    q, k, v = _qkv(q=(2, 4, 4, 8), k=(2, 3, 6, 8), v=(2, 3, 6, 5))
    with pytest.raises(ValueError, match=r"H=4 must be a multiple of key/value heads Hkv=3"):
        qkv.attention(q, k, v)


def test_rejects_query_key_width_mismatch() -> None:
    q, k, v = _qkv(k=(2, 3, 6, 7))
    with pytest.raises(ValueError, match=r"query and key widths differ: query Dh=8, key Dh=7"):
        sdpa(q, k, v)


def test_rejects_key_value_length_mismatch() -> None:
    q, k, v = _qkv(v=(2, 3, 5, 5))
    with pytest.raises(ValueError, match=r"key and value lengths differ: key S=6, value S=5"):
        sdpa(q, k, v)


def test_rejects_zero_sized_dim() -> None:
    q, k, v = _qkv(q=(2, 3, 0, 8))
    with pytest.raises(ValueError, match=r"query has a zero-sized dimension: shape \(2, 3, 0, 8\)"):
        sdpa(q, k, v)


@pytest.mark.parametrize("p", [-0.1, 1.5])
def test_rejects_dropout_outside_unit_interval(p: float) -> None:
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=rf"dropout_p must lie in \[0, 1\], got {p}"):
        sdpa(q, k, v, None, p)


def test_rejects_mask_not_bool() -> None:
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=r"mask must be bool \(True = blocked\), got torch.float32"):
        sdpa(q, k, v, torch.zeros(1, 1, 4, 6))


def test_rejects_mask_on_other_device() -> None:
    q, k, v = _qkv()
    mask = torch.zeros(1, 1, 4, 6, dtype=torch.bool, device="meta")
    with pytest.raises(ValueError, match=r"mask is on meta but query is on cpu"):
        sdpa(q, k, v, mask)


def test_rejects_mask_not_broadcastable() -> None:
    q, k, v = _qkv()
    mask = torch.zeros(2, 1, 4, 5, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"shape \(2, 1, 4, 5\) is not broadcastable to \[B, H"):
        sdpa(q, k, v, mask)


def test_rejects_bare_key_padding_mask() -> None:
    q, k, v = _qkv()  # B=2, T=4: broadcasting would fail, the message says why
    with pytest.raises(ValueError, match=r"looks like a key-padding mask.*qkv.masks.padding_mask"):
        sdpa(q, k, v, torch.zeros(2, 6, dtype=torch.bool))


def test_rejects_bare_key_padding_mask_when_batch_equals_query_length() -> None:
    q, k, v = _qkv(q=(4, 3, 4, 8), k=(4, 3, 6, 8), v=(4, 3, 6, 5))  # B == T: would broadcast
    with pytest.raises(ValueError, match=r"ambiguous when B == T == 4.*qkv.masks.padding_mask"):
        sdpa(q, k, v, torch.zeros(4, 6, dtype=torch.bool))


def test_accepts_unambiguous_short_masks() -> None:
    q, k, v = _qkv()
    tri = causal_mask(4, 6)[0, 0]  # [T, S] with B != T: unambiguous
    out2, _ = sdpa(q, k, v, tri)
    out4, _ = sdpa(q, k, v, tri[None, None])
    torch.testing.assert_close(out2, out4, atol=0, rtol=0)
    q1, k1, v1 = q[:1], k[:1], v[:1]  # B == 1: [1, S] is the same mask read either way
    row = torch.tensor([[False, False, True, False, True, False]])
    torch.testing.assert_close(
        sdpa(q1, k1, v1, row)[0], sdpa(q1, k1, v1, row[None, None])[0], atol=0, rtol=0
    )


# --- one signature, resolved in one place -----------------------------------------------------


def test_attention_plan_and_explain_backend_share_one_signature() -> None:
    want = inspect.signature(qkv.attention).parameters
    for fn in (qkv.explain_backend, qkv.plan):
        got = inspect.signature(fn).parameters
        assert got == want  # names, kinds, defaults and annotations
        assert {"block_q", "block_k", "bias", "plan"} <= set(got)
        with pytest.raises(TypeError):
            fn(*_inputs(torch.float32), masks=None)  # type: ignore[call-arg]
    assert inspect.signature(qkv.explain_backend).return_annotation in (str, "str")
    assert inspect.signature(qkv.plan).return_annotation in (qkv.Plan, "Plan")


def test_bias_is_a_deprecated_alias_of_attn_bias() -> None:
    q, k, v = _inputs(torch.float32)
    attn_bias = torch.randn(1, H, T, S)
    want, _ = qkv.attention(q, k, v, attn_bias=attn_bias, backend="reference")
    with pytest.warns(DeprecationWarning, match="use attn_bias="):
        got, _ = qkv.attention(q, k, v, bias=attn_bias, backend="reference")
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    with pytest.warns(DeprecationWarning, match="use attn_bias="):
        why = qkv.explain_backend(q, k, v, bias=attn_bias)
    assert why == qkv.explain_backend(q, k, v, attn_bias=attn_bias)
    for fn in (qkv.attention, qkv.explain_backend, qkv.plan):
        with pytest.raises(TypeError, match="both attn_bias and its deprecated alias bias"):
            fn(q, k, v, attn_bias=attn_bias, bias=attn_bias)


def test_explain_backend_checks_block_sizes_like_attention() -> None:
    q, k, v = _inputs(torch.float32)
    for fn in (qkv.attention, qkv.explain_backend, qkv.plan):
        with pytest.raises(ValueError, match="block_k must be a positive int, got 0"):
            fn(q, k, v, backend="blockwise", block_k=0)
        with pytest.raises(TypeError, match="block_q must be an int"):
            fn(q, k, v, backend="blockwise", block_q=2.0)  # type: ignore[arg-type]
