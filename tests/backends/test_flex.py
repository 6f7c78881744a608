"""The flex backend (compiled ``flex_attention``) against the float64 reference, its limits, and
the switch without which ``auto`` never compiles.

Each distinct kind of rule compiles its block-mask builder and kernel once (seconds on CPU), so
the parity cases are few and share one grid.
"""

import pytest
import torch
from torch._dynamo.utils import counters

import qkv
from qkv.backends import flex
from qkv.backends.policy import compile_allowed, set_compile_allowed
from qkv.masks import Causal, Documents, MaskMod, Padding, SlidingWindow

B, H, HKV, T, S, DH = 2, 4, 2, 200, 256, 16


def _inputs(T_: int = T, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, T_, DH, generator=g)
    k = torch.randn(B, HKV, S, DH, generator=g)
    v = torch.randn(B, HKV, S, DH, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: object) -> torch.Tensor:
    out, _ = qkv.attention(q.double(), k.double(), v.double(), mask=mask, backend="reference")
    return out


def _check(out: torch.Tensor, ref: torch.Tensor) -> None:
    # flex computes in float32 over at most 256 keys with Dh=16: its rounding error is ~1e-7
    # relative (measured <= 1e-6 absolute here), so 1e-5 separates rounding from a wrong mask,
    # which moves outputs by O(0.1).
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_sliding_window_and_padding_match_the_reference_and_padding_never_leaks() -> None:
    q, k, v = _inputs()
    lengths = torch.tensor([180, 0])  # sample 1 is all padding: its rows are dead
    mask = SlidingWindow(48) | Padding(lengths)
    k[0, :, 200:], v[0, :, 190:] = float("nan"), float("inf")  # at padded positions only
    out, _ = qkv.attention(q, k, v, mask=mask, backend="flex")
    clean_k, clean_v = k.clone(), v.clone()
    clean_k[0, :, 200:], clean_v[0, :, 190:] = 0.0, 0.0
    _check(out, _reference(q, clean_k, clean_v, mask))
    assert torch.equal(out[1], torch.zeros_like(out[1]))  # fully masked rows: exactly 0
    # float16 / bfloat16 are computed in float32 (the same kernel) and cast back.
    out16, _ = qkv.attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask=mask, backend="flex")
    assert out16.dtype == torch.bfloat16
    ref16 = _reference(q.bfloat16(), clean_k.bfloat16(), clean_v.bfloat16(), mask)
    torch.testing.assert_close(out16.double(), ref16, atol=1e-2, rtol=1e-2)  # bf16 output


@pytest.mark.parametrize("make", [lambda: Causal(offset=20), lambda: Causal(align="top_left")])
def test_causal_alignment_and_gqa_match_the_reference(make: object) -> None:
    q, k, v = _inputs()  # T=200 queries over S=256 keys, 4 query heads on 2 key heads
    mask = make()  # type: ignore[operator]
    out, _ = qkv.attention(q, k, v, mask=mask, backend="flex")
    _check(out, _reference(q, k, v, mask))


def test_documents_and_mask_mod_match_the_reference() -> None:
    q, k, v = _inputs(T_=S)
    ids = torch.cat([torch.zeros(100), torch.ones(90), torch.full((66,), 2)]).long()
    docs = Documents(torch.stack([ids, ids.flip(0)]))

    def stripes(
        b: torch.Tensor, h: torch.Tensor, qi: torch.Tensor, ki: torch.Tensor
    ) -> torch.Tensor:
        return (qi - ki) % 3 != 1  # True = may attend (flex's sense)

    mask = docs | MaskMod(stripes)
    out, _ = qkv.attention(q, k, v, mask=mask, backend="flex")
    _check(out, _reference(q, k, v, mask))


def test_block_masks_broadcast_over_what_the_rule_does_not_depend_on() -> None:
    dev = torch.device("cpu")

    def per_head(
        b: torch.Tensor, h: torch.Tensor, qi: torch.Tensor, ki: torch.Tensor
    ) -> torch.Tensor:
        return (h == 0) | (ki <= qi)  # head 0 sees every key, the others are causal

    shapes = {
        "window": SlidingWindow(48),
        "padding": Padding(torch.tensor([180, 0])),
        "heads": MaskMod(per_head),
    }
    got = {
        name: tuple(flex.block_mask_for(rule, B, H, T, S, dev).kv_num_blocks.shape[:2])
        for name, rule in shapes.items()
    }
    # flex's CPU kernel is slower with a block mask repeated per head: only what varies is kept
    assert got == {"window": (1, 1), "padding": (B, 1), "heads": (1, H)}
    q, k, v = _inputs(T_=S)
    out, _ = qkv.attention(q, k, v, mask=shapes["heads"], backend="flex")
    ref = _reference(q, k, v, shapes["heads"])
    _check(out, ref)
    assert not torch.allclose(ref[:, 0], ref[:, 1])  # the heads do differ


def test_auto_never_compiles_without_the_switch() -> None:
    q, k, v = _inputs(T_=S)
    big = [torch.zeros(1, 1, 1024, DH)] * 3
    assert compile_allowed() is False
    for args in ((q, k, v), tuple(big)):
        assert qkv.plan(*args, mask=SlidingWindow(64)).backend != "flex"
    with qkv.allow_compile():
        assert compile_allowed()
        wide = SlidingWindow(640)  # too wide a band for the band reduction
        assert qkv.plan(*big, mask=wide).backend == "flex"
        # reductions to plain SDPA calls (the band too) still win, small grids stay fused
        assert qkv.plan(*big, mask=Causal()).backend == "fused"
        assert qkv.plan(*big, mask=SlidingWindow(64)).backend == "fused"
        assert qkv.plan(q, k, v, mask=wide).backend == "fused"
        with qkv.allow_compile(False):
            assert qkv.plan(*big, mask=wide).backend != "flex"
        # what flex cannot run is not given to it
        grad = [t.clone().requires_grad_() for t in big]
        assert qkv.plan(*grad, mask=wide).backend == "blockwise"
        bias = torch.zeros(1, 1, 1024, 1024)
        assert qkv.plan(*big, mask=wide, attn_bias=bias).backend != "flex"
    assert compile_allowed() is False


def test_explain_reports_the_measured_compile_time() -> None:
    q, k, v = _inputs()
    mask = SlidingWindow(48) | Padding(torch.tensor([180, 0]))
    qkv.attention(q, k, v, mask=mask, backend="flex")
    sig = ("cpu", torch.float32, True, T, S)
    seconds = flex.compile_seconds()[sig]
    assert seconds > 0
    assert f"took {seconds:.2f} s" in qkv.explain_backend(q, k, v, mask=mask, backend="flex")


def test_flex_refuses_what_it_cannot_do() -> None:
    q, k, v = _inputs()
    mask = SlidingWindow(48)
    with pytest.raises(ValueError, match="cannot return weights"):
        qkv.attention(q, k, v, mask=mask, backend="flex", need_weights=True)
    with pytest.raises(ValueError, match="attn_bias"):
        qkv.attention(q, k, v, mask=mask, backend="flex", attn_bias=torch.zeros(T, S))
    with pytest.raises(ValueError, match="dropout"):
        qkv.attention(q, k, v, mask=mask, backend="flex", dropout_p=0.1, training=True)
    with pytest.raises(ValueError, match=r"no backward on CPU.*blockwise"):
        qkv.attention(q.requires_grad_(), k, v, mask=mask, backend="flex")
    with torch.no_grad():  # inference on inputs that require grad is fine
        out, _ = qkv.attention(q, k, v, mask=mask, backend="flex")
    assert not out.requires_grad
    with pytest.raises(TypeError, match="allowed must be a bool"):
        set_compile_allowed(1)  # type: ignore[arg-type]


def test_a_new_window_reuses_the_kernel_and_a_full_kernel_cache_falls_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    q, k, v = _inputs()
    with torch.no_grad():
        qkv.attention(q, k, v, mask=SlidingWindow(64), backend="flex")
        graphs = counters["stats"]["unique_graphs"]
        out, _ = qkv.attention(q, k, v, mask=SlidingWindow(96), backend="flex")
    assert counters["stats"]["unique_graphs"] == graphs  # window is a tensor, not a constant
    _check(out, _reference(q, k, v, SlidingWindow(96)))
    # Past the kernel limit torch would run flex eagerly (every score materialized); qkv stops.
    monkeypatch.setitem(flex._state, "exhausted", False)
    with qkv.use_policy(flex_max_kernels=1):
        q2, k2, v2 = (x[:, :, :136] for x in (q, k, v))  # a new grid: it would need a new kernel
        with torch.no_grad(), pytest.warns(UserWarning, match="runs on blockwise"):
            out, _ = qkv.attention(q2, k2, v2, mask=SlidingWindow(96), backend="flex")
        _check(out, _reference(q2, k2, v2, SlidingWindow(96)))
        with torch.no_grad(), qkv.allow_compile():
            assert qkv.plan(q, k, v, mask=SlidingWindow(96)).backend != "flex"
            with pytest.raises(ValueError, match="compiled its 1 kernels"):
                qkv.attention(q, k, v, mask=SlidingWindow(96), backend="flex")
