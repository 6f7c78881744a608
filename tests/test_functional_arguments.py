"""Every mask path validated, and the argument gaps of issue 10 items 6 and 14.

Each bad argument gives a ValueError / TypeError that names the argument, the value it got and
what was expected, on every backend; nothing is silently cropped or reinterpreted.
"""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv.masks import Causal, Dense, MaskMod, SlidingWindow

BACKENDS = ("auto", "reference", "fused", "blockwise")
B, H, T, S, DH = 2, 2, 3, 5, 4


def _qkv() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.randn(B, H, T, DH), torch.randn(B, H, S, DH), torch.randn(B, H, S, DH)


@pytest.mark.parametrize("backend", BACKENDS)
def test_too_large_dense_mask_is_refused_not_cropped(backend: str) -> None:
    big = torch.zeros(1, 1, T + 4, S + 4, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"Dense mask \[1, 1, 7, 9\] of shape .* not broadcast"):
        qkv.attention(*_qkv(), mask=Causal() | Dense(big), backend=backend)  # type: ignore[arg-type]


@pytest.mark.parametrize("backend", BACKENDS)
def test_dense_mask_with_wrong_batch_is_a_clear_error(backend: str) -> None:
    wrong_b = torch.zeros(B + 1, 1, T, S, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"\[B, H, T, S\] = \[2, 2, 3, 5\]"):
        qkv.attention(*_qkv(), mask=Dense(wrong_b), backend=backend)  # type: ignore[arg-type]


def test_multihead_attention_refuses_an_attn_mask_larger_than_the_grid() -> None:
    """``attn_mask`` next to a rule becomes a Dense part; it used to be cropped to [T, S]."""
    mha = qkv.MultiHeadAttention(8, 2)
    x = torch.randn(2, 4, 8)
    too_big = torch.zeros(6, 6, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"Dense mask \[1, 1, 6, 6\] .* not broadcastable"):
        mha(x, attn_mask=too_big, mask=Causal(), need_weights=False)


def test_padding_mask_as_1_b_s_is_refused_like_b_s() -> None:
    q, k, v = torch.randn(3, 1, 3, 4), torch.randn(3, 1, 5, 4), torch.randn(3, 1, 5, 4)
    is_pad = torch.zeros(1, 3, 5, dtype=torch.bool)  # [1, B, S] with B == T == 3
    with pytest.raises(ValueError, match=r"3-D mask \(1, 3, 5\) is ambiguous when B == T == 3"):
        qkv.attention(q, k, v, mask=is_pad)
    q2 = torch.randn(3, 1, 2, 4)  # T=2 != B: [1, B, S] looks like padding
    with pytest.raises(ValueError, match="looks like a key-padding mask"):
        qkv.attention(q2, k, v, mask=is_pad)


@pytest.mark.parametrize(
    ("scale", "error"),
    [
        (True, TypeError),
        (False, TypeError),
        (0, ValueError),
        (0.0, ValueError),
        (-1.0, ValueError),
        (float("inf"), ValueError),
        (float("nan"), ValueError),
        ("0.5", TypeError),
    ],
)
def test_scale_must_be_a_finite_positive_float(scale: object, error: type[Exception]) -> None:
    with pytest.raises(error, match="scale must be"):
        qkv.attention(*_qkv(), scale=scale)  # type: ignore[arg-type]


def test_an_int_scale_is_the_float() -> None:
    a, _ = qkv.attention(*_qkv(), scale=2)
    torch.manual_seed(0)
    b, _ = qkv.attention(*_qkv(), scale=2.0)
    torch.testing.assert_close(a, b)


def test_sliding_window_refuses_a_bool() -> None:
    with pytest.raises(TypeError, match=r"window must be an int, got True"):
        SlidingWindow(True)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"num_heads": True}, TypeError, "num_heads must be an int, got True"),
        ({"kdim": 0}, ValueError, "kdim must be a positive int, got 0"),
        ({"kdim": -1}, ValueError, "kdim must be a positive int, got -1"),
        ({"vdim": 2.5}, TypeError, r"vdim must be an int, got 2.5"),
        ({"num_kv_heads": False}, TypeError, "num_kv_heads must be an int, got False"),
    ],
)
def test_multihead_attention_sizes_are_checked(
    kwargs: dict[str, object], error: type[Exception], message: str
) -> None:
    args: dict[str, object] = {"embed_dim": 8, "num_heads": 2, **kwargs}
    with pytest.raises(error, match=message):
        qkv.MultiHeadAttention(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize("backend", BACKENDS)
def test_mask_mod_returning_a_fixed_shape_is_a_clear_error(backend: str) -> None:
    fixed = torch.ones(7, 7, dtype=torch.bool)

    def wrong(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return fixed  # ignores the indices

    with pytest.raises(ValueError, match=r"mask_mod wrong returned shape \(7, 7\)"):
        qkv.attention(*_qkv(), mask=MaskMod(wrong), backend=backend)  # type: ignore[arg-type]


def test_huge_block_sizes_are_clamped_to_the_grid() -> None:
    """block_q=10**9 used to size a 10**9-row workspace; the result equals the reference."""
    q, k, v = (x.double() for x in _qkv())
    got, _ = qkv.attention(
        q, k, v, is_causal=True, backend="blockwise", block_q=10**9, block_k=10**9
    )
    want, _ = qkv.attention(q, k, v, is_causal=True, backend="reference")
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("backend", ["fused", "blockwise"])
def test_weightless_module_defaults_to_no_weights(backend: str) -> None:
    mha = qkv.MultiHeadAttention(8, 2, backend=backend).double()  # type: ignore[arg-type]
    x = torch.randn(2, 4, 8, dtype=torch.float64)
    out, weights = mha(x)  # its own defaults work
    assert weights is None
    mha.backend = "reference"
    want, _ = mha(x)
    torch.testing.assert_close(out, want)
    mha.backend = backend  # type: ignore[assignment]
    with pytest.raises(ValueError, match="call it with need_weights=False"):
        mha(x, need_weights=True)


def test_reference_module_still_returns_weights_by_default() -> None:
    mha = qkv.MultiHeadAttention(8, 2, backend="reference")
    ref = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    _, weights = mha(torch.randn(2, 4, 8))
    _, ref_weights = ref(*(torch.randn(2, 4, 8),) * 3)
    assert weights is not None and ref_weights is not None
    assert weights.shape == ref_weights.shape == (2, 4, 4)
