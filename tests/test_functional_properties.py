"""Property tests of scaled_dot_product_attention over shapes and random masks."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor

import qkv

LENGTHS = st.sampled_from([1, 2, 17, 127, 129])


@st.composite
def problems(draw: st.DrawFn) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Random float64 Q, K, V and a random mask (some dead rows, some dead key columns)."""
    B = draw(st.integers(1, 2))
    H = draw(st.integers(1, 2))
    T = draw(LENGTHS)
    S = draw(LENGTHS)
    Dh = draw(st.sampled_from([1, 4, 8]))
    Dv = draw(st.sampled_from([1, 3]))
    density = draw(st.sampled_from([0.0, 0.3, 0.7, 0.95, 1.0]))
    layout = draw(st.sampled_from(["full", "per_batch", "per_query"]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    q = torch.randn(B, H, T, Dh, generator=gen, dtype=torch.float64)
    k = torch.randn(B, H, S, Dh, generator=gen, dtype=torch.float64)
    v = torch.randn(B, H, S, Dv, generator=gen, dtype=torch.float64)
    shape = {"full": (B, H, T, S), "per_batch": (B, 1, 1, S), "per_query": (1, 1, T, S)}[layout]
    mask = torch.rand(shape, generator=gen) < density
    if draw(st.booleans()):
        mask = mask.expand(B, H, T, S).clone()
        mask[..., int(torch.randint(T, (1,), generator=gen)), :] = True  # a dead row
        mask[..., int(torch.randint(S, (1,), generator=gen))] = True  # a dead key column
    return q, k, v, mask


@given(problems())
def test_weights_are_a_distribution_over_allowed_keys(
    p: tuple[Tensor, Tensor, Tensor, Tensor],
) -> None:
    q, k, v, mask = p
    out, weights = qkv.scaled_dot_product_attention(q, k, v, mask)
    full = mask.expand_as(weights)
    alive = ~full.all(dim=-1)  # [B, H, T]
    sums = weights.sum(dim=-1)
    torch.testing.assert_close(sums[alive], torch.ones_like(sums[alive]))
    assert bool((weights[~alive] == 0).all()) and bool((out[~alive] == 0).all())
    assert bool((weights[full] == 0).all())
    assert bool((weights >= 0).all())


@given(problems(), st.sampled_from([1e10, -1e10, 1e300]))
def test_blocked_keys_do_not_change_the_output(
    p: tuple[Tensor, Tensor, Tensor, Tensor], huge: float
) -> None:
    q, k, v, mask = p
    out, weights = qkv.scaled_dot_product_attention(q, k, v, mask)
    never_seen = mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2]).all(dim=2)  # [B,H,S]
    v2, k2 = v.clone(), k.clone()
    v2[never_seen] = huge
    k2[never_seen] = huge
    out2, weights2 = qkv.scaled_dot_product_attention(q, k2, v2, mask)
    torch.testing.assert_close(weights2, weights, atol=0, rtol=0)
    torch.testing.assert_close(out2, out, atol=0, rtol=0)
    # Per query: one query row alone ignores every key blocked for that row.
    t = q.shape[2] // 2
    row_mask = mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])[:, :, t : t + 1]
    seen_not = row_mask[:, :, 0]  # [B, H, S]
    v3, k3 = v.clone(), k.clone()
    v3[seen_not] = huge
    k3[seen_not] = huge
    row = qkv.scaled_dot_product_attention(q[:, :, t : t + 1], k, v, row_mask)
    row3 = qkv.scaled_dot_product_attention(q[:, :, t : t + 1], k3, v3, row_mask)
    torch.testing.assert_close(row3, row, atol=0, rtol=0)


@given(problems())
def test_backward_is_finite_with_dead_rows(p: tuple[Tensor, Tensor, Tensor, Tensor]) -> None:
    q, k, v, mask = (x.requires_grad_() if x.is_floating_point() else x for x in p)
    out, weights = qkv.scaled_dot_product_attention(q, k, v, mask)
    (out.square().sum() + weights.sum()).backward()
    for g in (q.grad, k.grad, v.grad):
        assert g is not None and bool(torch.isfinite(g).all())
    dead = mask.expand_as(weights).all(dim=-1)  # [B, H, T]
    assert q.grad is not None and bool((q.grad[dead] == 0).all())
