"""Dropout in training: unbiased on average for every backend; blockwise's backward is exact."""

import pytest
import torch

import qkv
from qkv.backends.blockwise import blockwise_attention
from qkv.masks import Causal


@pytest.mark.parametrize("backend", ["reference", "fused", "blockwise"])
def test_dropout_is_unbiased_and_drops_about_p(backend: str) -> None:
    N, T, S, p = 4000, 3, 5, 0.4
    q = torch.randn(1, 1, T, 4).expand(N, 1, T, 4)
    k = torch.randn(1, 1, S, 4).expand(N, 1, S, 4)
    v = torch.eye(S)[None, None].expand(N, 1, S, S)  # output row = the (dropped) weights
    mask = Causal(align="top_left")
    want, _ = qkv.attention(q[:1], k[:1], v[:1], mask=mask, backend="reference")
    out, _ = qkv.attention(
        q, k, v, mask=mask, dropout_p=p, training=True, backend=backend, block_q=2, block_k=2
    )  # type: ignore[arg-type]
    kept = want[0, 0] > 0  # [T, S] weights that can be nonzero
    zero_frac = (out[:, 0][:, kept] == 0).double().mean()
    assert abs(float(zero_frac) - p) < 0.02
    mean = out.mean(dim=0)  # [1, T, S]
    stderr = out.std(dim=0) / N**0.5  # [1, T, S]
    assert bool(((mean - want[0]).abs() <= 5 * stderr + 1e-7).all())
    # Without training, dropout_p is ignored.
    eval_out, _ = qkv.attention(q[:1], k[:1], v[:1], mask=mask, dropout_p=p, backend=backend)  # type: ignore[arg-type]
    torch.testing.assert_close(eval_out, want)


def test_blockwise_dropout_backward_matches_finite_differences() -> None:
    q, k, v = (torch.randn(1, 2, n, 3, dtype=torch.float64, requires_grad=True) for n in (5, 6, 6))

    def f(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return blockwise_attention(
            q, k, v, Causal(), None, 0.5, 0.3, True, block_q=2, block_k=4, dropout_seed=7
        )

    assert torch.autograd.gradcheck(f, (q, k, v))
