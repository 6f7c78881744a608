"""The context-parallel plan: what each pair of ranks sends, and how work is balanced.

The plan needs no process group: every rank computes the same one, so these tests make each
rank's plan in one process. That the exchanges it plans give exact results is
tests/distributed/test_context_parallel.py's job (real processes).
"""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv import distributed as cp
from qkv.masks import Causal, Documents, Padding, SlidingWindow, StructuredMask


def plans(
    rule: StructuredMask | None, n: int, world: int, layout: cp.Layout
) -> list[cp.ContextPlan]:
    return [
        cp.plan_context(
            rule, batch=1, heads=2, kv_heads=2, length=n, world=world, rank=r, layout=layout
        )
        for r in range(world)
    ]


def brute_needs(
    rule: StructuredMask | None, n: int, world: int, layout: cp.Layout
) -> list[list[set[int]]]:
    """needs[i][j]: the keys of rank j some query of rank i sees, from the whole mask."""
    blocked = (
        torch.zeros(1, 1, n, n, dtype=torch.bool) if rule is None else rule.materialize(1, 2, n, n)
    )
    seen = ~blocked.expand(1, 2, n, n).any(dim=1)[0]  # [n, n]: any head
    owner = {
        p: r for r in range(world) for a, b in cp.segments(n, world, r, layout) for p in range(a, b)
    }
    out: list[list[set[int]]] = [[set() for _ in range(world)] for _ in range(world)]
    for qpos, kpos in seen.nonzero().tolist():
        out[owner[qpos]][owner[kpos]].add(kpos)
    return out


RULES = {
    "none": None,
    "causal": Causal(),
    "window": SlidingWindow(9),
    "padding": Padding(torch.tensor([23])),
    "documents": Documents(torch.tensor([[0] * 11 + [1] * 20 + [2] * 9])),
}


@pytest.mark.parametrize("layout", cp.LAYOUTS)
@pytest.mark.parametrize("name", list(RULES))
def test_each_pair_gets_the_keys_it_sees_and_no_range_wider_than_them(
    layout: cp.Layout, name: str
) -> None:
    rule, n, world = RULES[name], 40, 3
    truth = brute_needs(rule, n, world, layout)
    for p in plans(rule, n, world, layout):
        for j in range(world):
            got = {k for a, b in p.needs[p.rank][j] for k in range(a, b)}
            want = truth[p.rank][j]
            assert want <= got, (p.rank, j)
            # Each range starts and ends at a seen key (a range covers any holes between).
            for a, b in p.needs[p.rank][j]:
                assert a in want and b - 1 in want


def test_a_sliding_window_sends_only_its_halo() -> None:
    n, w = 16384, 4096
    ps = plans(SlidingWindow(w), n, 2, "contiguous")
    assert ps[0].keys_sent() == w - 1  # the last w - 1 keys of rank 0 reach rank 1's first query
    assert ps[1].keys_sent() == 0  # nothing after a query is ever seen
    ring = sum(p.ring_keys_sent() for p in ps)
    assert ring >= 4 * sum(p.keys_sent() for p in ps)


def test_documents_that_no_two_ranks_share_send_nothing() -> None:
    ids = torch.tensor([[0] * 20 + [1] * 20])
    assert all(p.keys_sent() == 0 for p in plans(Documents(ids) | Causal(), 40, 2, "contiguous"))


@pytest.mark.parametrize("world", [2, 3, 4])
def test_zigzag_balances_causal_work_within_ten_percent(world: int) -> None:
    work = [p.pairs_computed() for p in plans(Causal(), 8192, world, "zigzag")]
    assert max(work) / min(work) - 1 <= 0.10
    contiguous = [p.pairs_computed() for p in plans(Causal(), 8192, world, "contiguous")]
    assert max(contiguous) / min(contiguous) - 1 > 0.5  # what zigzag is for


def test_single_process_equals_attention_and_low_precision_is_computed_in_float32() -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 33, 8) for _ in range(3))
    rule = Padding(torch.tensor([20, 0])) | Causal()  # sample 1: every key blocked
    out = cp.context_parallel_attention(q, k, v, mask=rule)
    ref, _ = qkv.attention(q.double(), k.double(), v.double(), mask=rule)
    torch.testing.assert_close(out, ref.float(), atol=2e-6, rtol=0)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    qb, kb, vb = (t.bfloat16().requires_grad_() for t in (q, k, v))
    outb = cp.context_parallel_attention(qb, kb, vb, mask=rule)
    assert outb.dtype == torch.bfloat16
    refb, _ = qkv.attention(
        qb.detach().float(), kb.detach().float(), vb.detach().float(), mask=rule
    )
    # Equal to float32 arithmetic rounded once to bfloat16 (one bfloat16 step: 2**-7).
    torch.testing.assert_close(outb.float(), refb, atol=1e-6, rtol=2**-7)
    grads = torch.autograd.grad(outb.float().sum(), (qb, kb, vb))
    assert all(torch.isfinite(g).all() for g in grads)


def test_is_causal_and_gqa() -> None:
    torch.manual_seed(0)
    q = torch.randn(1, 6, 17, 4, dtype=torch.float64)
    k, v = (torch.randn(1, 2, 17, 4, dtype=torch.float64) for _ in range(2))
    out = cp.context_parallel_attention(q, k, v, is_causal=True, scale=0.3)
    ref, _ = qkv.attention(q, k, v, is_causal=True, scale=0.3)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)


def test_cross_attention_keys_of_another_length() -> None:
    torch.manual_seed(0)
    q = torch.randn(2, 2, 7, 4, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 12, 4, dtype=torch.float64) for _ in range(2))
    rule = Padding(torch.tensor([12, 5])) | Causal()  # bottom-right: query 6 sees all 12 keys
    out = cp.context_parallel_attention(q, k, v, mask=rule)
    ref, _ = qkv.attention(q, k, v, mask=rule)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)


def test_bad_calls_are_clear_errors() -> None:
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(TypeError, match="mask must be a qkv mask rule in global coordinates"):
        cp.context_parallel_attention(q, q, q, mask=torch.ones(8, 8, dtype=torch.bool))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must share the batch size"):
        cp.context_parallel_attention(q, q[:, :, :5], q[:, :, :6])
    with pytest.raises(ValueError, match="4-D"):
        cp.context_parallel_attention(q[0], q, q)
    other = cp.plan_context(None, batch=1, heads=4, kv_heads=4, length=8, world=1, rank=0)
    with pytest.raises(ValueError, match="plan was made for"):
        cp.context_parallel_attention(q, q, q, plan=other)
    short = cp.plan_context(None, batch=1, heads=2, kv_heads=2, length=9, world=1, rank=0)
    with pytest.raises(ValueError, match="T_local=8 and S_local=8"):
        cp.context_parallel_attention(q, q, q, plan=short)
    with pytest.raises(ValueError, match="Padding lengths must lie in"):
        cp.context_parallel_attention(q, q, q, mask=Padding(torch.tensor([9])))
