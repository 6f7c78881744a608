"""One query row per head (a compiled decoding step): :mod:`qkv.backends.one_query` against a
float64 recomputation, with qkv's guarantees for blocked keys and dead rows; and when the fused
backend takes that path."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor

import qkv
from qkv.backends import fused, one_query
from qkv.backends.reference import reference_attention

B, H, S, Dh, Dv = 3, 6, 11, 8, 5


def _inputs(Hkv: int, seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, 1, Dh, generator=g)  # [B, H, 1, Dh]
    k = torch.randn(B, Hkv, S, Dh, generator=g)  # [B, Hkv, S, Dh]
    v = torch.randn(B, Hkv, S, Dv, generator=g)  # [B, Hkv, S, Dv]
    return q, k, v


def _masks() -> dict[str, Tensor | None]:
    g = torch.Generator().manual_seed(1)
    pad = torch.zeros(B, 1, 1, S, dtype=torch.bool)  # [B, 1, 1, S]
    pad[1, ..., :4] = True
    pad[2] = True  # a row with every key blocked
    per_head = torch.rand(B, H, 1, S, generator=g) < 0.4  # [B, H, 1, S]
    per_head[0, 2] = True
    return {
        "none": None,
        "padding": pad,
        "per-head": per_head,
        "keys only": torch.arange(S) >= S - 3,  # [S]
        "shared heads": torch.rand(1, H, 1, S, generator=g) < 0.5,  # [1, H, 1, S]
    }


def _want(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, bias: Tensor | None) -> Tensor:
    """The reference backend in float64 (keys and values of blocked positions zeroed there)."""
    d = torch.float64
    b = None if bias is None else bias.to(d)
    out, _ = reference_attention(q.to(d), k.to(d), v.to(d), mask, b, 0.3, 0.0, False)
    return out  # [B, H, 1, Dv]


@pytest.mark.parametrize("Hkv", [H, 2, 1])
@pytest.mark.parametrize("name", sorted(_masks()))
def test_matches_float64_reference(Hkv: int, name: str) -> None:
    q, k, v = _inputs(Hkv)
    mask = _masks()[name]
    got = one_query.one_query_attention(q, k, v, mask, None, 0.3, torch.float32)
    torch.testing.assert_close(got.double(), _want(q, k, v, mask, None), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bias_shape", [(B, H, 1, S), (1, H, 1, S), (1, 1, 1, S)])
def test_score_bias(bias_shape: tuple[int, ...]) -> None:
    q, k, v = _inputs(2)
    bias = torch.randn(bias_shape, generator=torch.Generator().manual_seed(3))
    mask = _masks()["padding"]
    got = one_query.one_query_attention(q, k, v, mask, bias, 0.3, torch.float32)
    torch.testing.assert_close(got.double(), _want(q, k, v, mask, bias), rtol=1e-5, atol=1e-6)


def test_blocked_nonfinite_keys_and_values_never_reach_the_output() -> None:
    q, k, v = _inputs(2)
    mask = _masks()["padding"]
    assert mask is not None
    clean = one_query.one_query_attention(q, k, v, mask, None, 0.3, torch.float32)
    blocked = mask[:, 0, 0]  # [B, S]
    k[blocked[:, None, :, None].expand_as(k)] = float("nan")
    v[blocked[:, None, :, None].expand_as(v)] = float("inf")
    got = one_query.one_query_attention(q, k, v, mask, None, 0.3, torch.float32)
    assert torch.equal(got, clean)
    assert torch.equal(got[2], torch.zeros_like(got[2]))  # every key blocked: 0


def test_float64_stays_float64() -> None:
    q, k, v = (x.double() for x in _inputs(3))
    got = one_query.one_query_attention(q, k, v, None, None, 0.3, torch.float64)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, _want(q, k, v, None, None), rtol=1e-12, atol=1e-12)


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """Record the query shape of each call of the one-query path the fused backend makes."""
    seen: list[tuple[int, ...]] = []
    real = fused.one_query_attention

    def spy(query: Tensor, *args: object) -> Tensor:
        seen.append(tuple(query.shape))
        return real(query, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(fused, "one_query_attention", spy)
    return seen


def _compiled(fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """``fn`` under dynamo with its eager backend: traced as torch.compile traces (so
    ``is_compiling()`` holds), run without inductor's code generation."""
    torch._dynamo.reset()
    return torch.compile(fn, backend="eager", fullgraph=True)


@pytest.mark.parametrize("name", ["padding", "per-head", "none"])
def test_compiled_decoding_step_takes_it(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    seen = _spy(monkeypatch)
    q, k, v = _inputs(2)
    mask = _masks()[name]

    def step(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return qkv.attention(q, k, v, mask=mask, scale=0.3, need_weights=False)[0]

    with torch.no_grad():
        got = _compiled(step)(q, k, v)
    assert seen == [(B, H, 1, Dh)]
    torch.testing.assert_close(got.double(), _want(q, k, v, mask, None), rtol=1e-5, atol=1e-6)


def test_top_left_causal_lone_query_sees_only_the_first_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SDPA's own causal flag serves T == S == 1; the one-query path joins the mask itself."""
    seen = _spy(monkeypatch)
    q, k, v = _inputs(H)
    k, v = k[:, :, :1], v[:, :, :1]  # S = 1

    def step(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return fused.fused_attention(
            q, k, v, None, None, is_causal=True, scale=0.3, dropout_p=0.0, training=False,
            causal_align="top_left",
        )  # fmt: skip

    with torch.no_grad():
        got = _compiled(step)(q, k, v)
    assert seen == [(B, H, 1, Dh)]
    torch.testing.assert_close(got.double(), _want(q, k, v, None, None), rtol=1e-5, atol=1e-6)


def test_not_taken_eagerly_for_longer_queries_or_with_a_gradient(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen = _spy(monkeypatch)
    q, k, v = _inputs(2)
    with torch.no_grad():
        qkv.attention(q, k, v, need_weights=False)  # eager: SDPA
    longer = torch.cat([q, q], dim=2)  # [B, H, 2, Dh]

    def step(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return qkv.attention(q, k, v, need_weights=False)[0]

    with torch.no_grad():
        _compiled(step)(longer, k, v)
    _compiled(step)(q.requires_grad_(), k, v).sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()

    def dropped(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return fused.fused_attention(
            q, k, v, None, None, is_causal=False, scale=0.3, dropout_p=0.5, training=True
        )

    with torch.no_grad():
        _compiled(dropped)(q, k, v)
    assert seen == []
