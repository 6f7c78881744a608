"""auto picks a backend from facts about the call and records why; forced backends never switch.

The tests read plans (``qkv.plan``) and their reasons as records: the rule applied, the
quantity measured, the threshold and the policy field. The sentences are tested once, in
``test_explain_renders_the_records``.
"""

import dataclasses

import pytest
import torch

import qkv
from qkv.backends import blockwise, explain, reductions
from qkv.backends import plan as planning
from qkv.backends.plan import Plan, Reason
from qkv.backends.tiles import plan_tiles
from qkv.masks import Causal, Documents, MaskMod, Padding, SlidingWindow


def _qkv(
    T: int, S: int, dtype: torch.dtype = torch.float32, grad: bool = False
) -> tuple[torch.Tensor, ...]:
    # Expanded views: planning computes nothing, so big lengths cost no memory here.
    one = torch.zeros(1, 1, 1, 1, dtype=dtype, requires_grad=grad)
    return one.expand(1, 8, T, 64), one.expand(1, 8, S, 64), one.expand(1, 8, S, 64)


def _rules(p: Plan) -> list[str]:
    return [r.rule for r in p.reasons]


def _why(p: Plan) -> Reason:
    """The reason the backend was chosen."""
    return p.reasons[0]


def _measured(r: Reason, field: str) -> None:
    """The record names a real policy field whose value is the threshold it compared with."""
    assert r.policy_field == field
    assert r.threshold == getattr(qkv.backends.policy.current_policy(), field)
    assert r.quantity is not None and r.value is not None


def test_weights_need_reference() -> None:
    p = qkv.plan(*_qkv(8, 8), mask=Causal(), need_weights=True)
    assert p.backend == "reference" and _rules(p) == ["need-weights"]


def test_dense_goes_fused_and_sdpa_causal_only_when_square() -> None:
    p = qkv.plan(*_qkv(64, 64))
    assert (p.backend, _rules(p)) == ("fused", ["no-structured-mask"])
    assert _rules(qkv.plan(*_qkv(64, 64), is_causal=True))[0] == "sdpa-is-causal"
    # Bottom-right with T=4 < S=64: only rows 0-2 have a causal edge; row 3 sees every key.
    small = qkv.plan(*_qkv(4, 64), is_causal=True)
    assert small.backend == "fused" and small.pieces is not None and small.pieces.calls == 2
    masked = [p for g in small.pieces.groups for p in g.pieces if p.kind == "masked"]
    assert [(p.q1 - p.q0, p.k1 - p.k0) for p in masked] == [(3, 63)]
    forced = qkv.plan(*_qkv(4, 64), mask=torch.ones(4, 64).tril(60) == 0, is_causal=True)
    assert forced.backend == "fused" and "causal-materialized" in _rules(forced)
    note = forced.reasons[_rules(forced).index("causal-materialized")]
    assert note.facts == {"T": 4, "S": 64}


def test_large_structured_masks_go_blockwise_with_the_skipped_fraction() -> None:
    # With a gradient (training) a sliding window is not cut into bands, and a record says so.
    p = qkv.plan(*_qkv(4096, 4096, grad=True), mask=SlidingWindow(1024))
    assert p.backend == "blockwise" and _rules(p) == ["tiles-skipped", "no-band-with-gradient"]
    _measured(_why(p), "blockwise_min_skip")
    assert _why(p).value is not None and _why(p).value >= 0.25
    p = qkv.plan(*_qkv(16384, 16384, grad=True), mask=SlidingWindow(256))
    assert p.backend == "blockwise" and _why(p).rule == "mask-too-large"
    _measured(_why(p), "materialize_limit_bytes")
    assert _why(p).value == 5 * 16384 * 16384
    with torch.no_grad():
        p = qkv.plan(
            *_qkv(16384, 16384, grad=True),
            mask=SlidingWindow(256) | MaskMod(lambda b, h, q, k: q >= k),
        )
        assert "no-band-with-gradient" not in _rules(p)
    p = qkv.plan(*_qkv(2048, 2048), mask=MaskMod(lambda b, h, q, k: q >= k))
    assert p.backend == "blockwise" and _rules(p) == ["assumed-sparse"]
    assert p.tiles is None  # a mask_mod is cut into tiles as blockwise runs


def test_dense_structured_mask_is_materialized_for_fused_and_says_so() -> None:
    holes = (torch.arange(2048) % 2 == 0)[None]  # [1, S]: every other key, not the last, padding
    p = qkv.plan(*_qkv(2048, 2048), mask=Padding(holes))
    assert p.backend == "fused" and _why(p).rule == "few-tiles-skipped"
    assert _why(p).value == 0.0 and "mask-materialized" in _rules(p)
    half = qkv.plan(*_qkv(64, 64, torch.float16), mask=SlidingWindow(8))
    assert _why(half).rule == "too-small" and {"upcast", "mask-materialized"} <= set(_rules(half))
    _measured(_why(half), "blockwise_min_pairs")
    reduced = qkv.plan(*_qkv(64, 64, torch.float16), mask=Causal())
    assert _rules(reduced) == ["reduced", "upcast"]
    assert reduced.reasons[1].facts == {"dtype": torch.float16}
    assert reduced.pieces is not None
    assert [p.kind for g in reduced.pieces.groups for p in g.pieces] == ["causal"]


def test_forced_backend_that_cannot_serve_raises_and_explains() -> None:
    q, k, v = (torch.randn(1, 2, 4, 8) for _ in range(3))
    for backend in ("fused", "blockwise"):
        why = qkv.explain_backend(q, k, v, need_weights=True, backend=backend)  # type: ignore[arg-type]
        assert why.startswith("no backend:") and "cannot return weights" in why
        with pytest.raises(ValueError, match="cannot return weights"):
            qkv.attention(q, k, v, need_weights=True, backend=backend)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="backend must be one of"):
        qkv.attention(q, k, v, backend="flash")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="block_q"):
        qkv.attention(q, k, v, backend="blockwise", block_q=0)


def test_structured_mask_that_does_not_fit_is_refused() -> None:
    q, k, v = (torch.randn(2, 2, 4, 8) for _ in range(3))
    with pytest.raises(ValueError, match="Padding lengths"):
        qkv.attention(q, k, v, mask=Padding(torch.tensor([4])))


@pytest.mark.parametrize("backend", ["fused", "blockwise"])
def test_multihead_passes_its_backend(backend: str) -> None:
    mha = qkv.MultiHeadAttention(16, 4, num_kv_heads=2, backend=backend)  # type: ignore[arg-type]
    assert mha.backend == backend
    x = torch.randn(2, 5, 16)
    with pytest.raises(ValueError, match="weights"):
        mha(x, need_weights=True)  # only the reference backend returns weights
    out, weights = mha(x, need_weights=False, is_causal=True)
    assert weights is None
    mha.backend = "reference"
    ref, _ = mha(x, need_weights=False, is_causal=True)
    torch.testing.assert_close(out, ref)


def test_the_tiles_are_the_calls_own_blocks() -> None:
    window = SlidingWindow(1024)
    xs = _qkv(4096, 4096, grad=True)  # a gradient: no band reduction
    default = qkv.plan(*xs, mask=window)
    assert default.tiles is not None and default.tiles.total == 128  # 16 x 8 of 256 x 512
    assert default.tiles.blocks == (256, 512)
    small = qkv.plan(*xs, mask=window, block_q=512, block_k=512)
    # 8 x 8 tiles of 512: query block i sees key blocks i-2 .. i, so 8 + 7 + 6 are computed.
    assert small.tiles is not None and (small.tiles.computed, small.tiles.total) == (21, 64)
    assert _why(small).facts["skipped"] == 43 and _why(small).value == 43 / 64


def test_attention_runs_the_plan_without_planning_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prepared plan is run as it is: its tiles are not cut again; auto plans once a call."""
    calls: list[int] = []

    def counting(*args: object, **kwargs: object) -> object:
        calls.append(1)
        return plan_tiles(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(blockwise, "plan_tiles", counting)
    monkeypatch.setattr(planning, "plan_tiles", counting)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 1024, 8, generator=g) for _ in range(3))
    q.requires_grad_()  # a gradient: no band reduction, blockwise
    kw: dict[str, object] = {"mask": SlidingWindow(256), "block_q": 128, "block_k": 128}
    p = qkv.plan(q, k, v, **kw)  # type: ignore[arg-type]
    assert p.backend == "blockwise" and p.tiles is not None and len(calls) == 1
    calls.clear()
    out, _ = qkv.attention(q, k, v, plan=p, **kw)  # type: ignore[arg-type]
    assert calls == []
    want, _ = qkv.attention(q, k, v, backend="reference", **kw)  # type: ignore[arg-type]
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1.3e-6)
    again, _ = qkv.attention(q, k, v, **kw)  # type: ignore[arg-type]
    assert len(calls) == 1 and torch.equal(again, out)
    calls.clear()
    qkv.attention(q, k, v, backend="blockwise", **kw)  # type: ignore[arg-type]
    assert len(calls) == 1  # a forced blockwise call cuts its tiles in the backend, once


def test_a_plan_runs_only_the_call_it_was_made_for() -> None:
    q, k, v = (torch.randn(2, 2, 16, 8) for _ in range(3))
    lengths = torch.tensor([16, 9])
    mask = Causal() | Padding(lengths)
    p = qkv.plan(q, k, v, mask=mask)
    out, _ = qkv.attention(q, k, v, mask=mask, plan=p)
    torch.testing.assert_close(out, qkv.attention(q, k, v, mask=mask)[0], atol=0, rtol=0)
    assert qkv.plan(q, k, v, mask=mask, plan=p) is p
    with pytest.raises(ValueError, match=r"query: planned \(2, 2, 16, 8\), got \(2, 2, 15, 8\)"):
        qkv.attention(q[:, :, 1:], k, v, mask=mask, plan=p)
    with pytest.raises(ValueError, match="mask: planned"):
        qkv.attention(q, k, v, mask=Causal() | Padding(lengths), plan=p)  # an equal, new rule
    with pytest.raises(ValueError, match="dtype"):
        qkv.attention(q.double(), k.double(), v.double(), mask=mask, plan=p)
    with pytest.raises(ValueError, match="is_causal"):
        qkv.attention(q, k, v, mask=mask, is_causal=True, plan=p)
    with pytest.raises(TypeError, match="plan must be a Plan"):
        qkv.attention(q, k, v, mask=mask, plan="fused")  # type: ignore[arg-type]
    # A tensor mask is the same mask while its memory, shape and version are.
    pad = torch.zeros(2, 1, 1, 16, dtype=torch.bool)
    p = qkv.plan(q, k, v, mask=pad)
    qkv.attention(q, k, v, mask=pad.view(2, 1, 1, 16), plan=p)  # a view of the same memory
    pad[1, 0, 0, 9:] = True  # changed in place: another mask
    with pytest.raises(ValueError, match="mask: planned"):
        qkv.attention(q, k, v, mask=pad, plan=p)


def test_a_plan_for_another_mask_is_refused_by_blockwise() -> None:
    q, k, v = (torch.randn(1, 1, 8, 4) for _ in range(3))
    mask = Causal()
    tiles = plan_tiles(mask, 1, 1, 8, 8, 4, 4, q.device)
    with pytest.raises(ValueError, match="plan was made for"):
        blockwise.blockwise_attention(q, k, v, Causal(), None, 0.5, 0.0, False, tiles=tiles)
    with pytest.raises(ValueError, match="block_q=2 but the tile plan was made with block_q=4"):
        blockwise.blockwise_attention(q, k, v, mask, None, 0.5, 0.0, False, block_q=2, tiles=tiles)


def _band_plan(p: Plan, calls: int, widths: tuple[int, int]) -> None:
    assert p.backend == "fused" and _why(p).rule == "reduced" and p.pieces is not None
    assert p.pieces.band and p.pieces.band_block == 128 and p.pieces.calls == calls
    _measured(_why(p), "band_max_share")
    live = [x for g in p.pieces.groups for x in g.pieces if x.kind != "dead"]
    assert (min(x.k1 - x.k0 for x in live), max(x.k1 - x.k0 for x in live)) == widths


def test_sliding_window_without_gradient_is_cut_into_bands() -> None:
    p = qkv.plan(*_qkv(4096, 4096), mask=SlidingWindow(256))
    # 32 blocks of 128 queries; a full block sees 128 + 255 keys, the first only its 128.
    _band_plan(p, 32, (128, 383))
    assert _why(p).value is not None and round(_why(p).value, 2) == 0.09
    with torch.no_grad():  # no_grad counts as no gradient, whatever requires_grad says
        _band_plan(qkv.plan(*_qkv(4096, 4096, grad=True), mask=SlidingWindow(256)), 32, (128, 383))
    # Decoding one token with a window: one maskless call over the window's keys.
    one = qkv.plan(*_qkv(1, 4096), mask=SlidingWindow(256))
    _band_plan(one, 1, (256, 256))
    assert one.pieces is not None and {x.kind for x in one.pieces.groups[0].pieces} == {"open"}
    # A band over more than band_max_share of the pairs (52% here) is left to the other steps.
    wide = qkv.plan(*_qkv(1024, 1024), mask=SlidingWindow(640))
    assert wide.backend == "blockwise" and wide.pieces is None
    with qkv.use_policy(band_max_share=0.05):  # the policy decides: 9% is now too much
        assert qkv.plan(*_qkv(4096, 4096), mask=SlidingWindow(256)).backend == "blockwise"


def test_the_band_comes_before_flex_also_when_compiling_is_allowed() -> None:
    """The band's SDPA calls were measured faster than compiled flex_attention (forward)."""
    with qkv.allow_compile():
        _band_plan(qkv.plan(*_qkv(4096, 4096), mask=SlidingWindow(256)), 32, (128, 383))
        # a window too wide for a band is still flex's
        wide = qkv.plan(*_qkv(1024, 1024), mask=SlidingWindow(640))
        assert wide.backend == "flex" and _rules(wide) == ["compile-allowed", "compile-cost"]
        assert _why(wide).policy_field == "allow_compile"


def test_small_cpu_training_calls_take_blockwise_not_the_recomputing_backward() -> None:
    """Where fused would replace SDPA's CPU backward by its exact recomputation, auto runs
    blockwise (exact too, faster); above the exact backward's size bound, with dropout, or
    without a gradient, fused stays."""
    for extra in ({}, {"is_causal": True}):
        p = qkv.plan(*_qkv(128, 128, grad=True), **extra)  # type: ignore[arg-type]
        assert p.backend == "blockwise" and _rules(p) == ["exact-gradient"]
        _measured(_why(p), "exact_grad_blockwise_min_pairs")
        assert qkv.plan(*_qkv(128, 128), **extra).backend == "fused"  # type: ignore[arg-type]
    assert qkv.plan(*_qkv(32, 32, grad=True)).backend == "fused"  # too small to pay
    # 4 * 8 * 2048^2 * 4 bytes = 512 MB > the bound: SDPA's own backward, fused stays.
    assert qkv.plan(*_qkv(2048, 2048, grad=True)).backend == "fused"
    with qkv.use_policy(exact_backward_max_bytes=2**30):
        assert qkv.plan(*_qkv(2048, 2048, grad=True)).backend == "blockwise"
    q, k, v = _qkv(128, 128, grad=True)
    assert qkv.plan(q, k, v, dropout_p=0.1, training=True).backend == "fused"


def test_allow_sdpa_backward_trains_through_sdpa_itself() -> None:
    """Inside the opt-in, small CPU training calls (whole, or a reduction's pieces) keep SDPA's
    own backward: output and gradients equal to plain SDPA's, bit for bit; after the block,
    the exact default is back."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 128, 32, requires_grad=True) for _ in range(3))
    d_out = torch.randn(2, 4, 128, 32)
    with qkv.allow_sdpa_backward():
        p = qkv.plan(q, k, v, is_causal=True)
        assert p.backend == "fused" and _rules(p)[-1] == "sdpa-backward"
        assert p.reasons[-1].policy_field == "allow_sdpa_backward"
        out, _ = qkv.attention(q, k, v, is_causal=True)
        ids = torch.arange(128).div(64, rounding_mode="floor").expand(2, 128)  # 2 documents
        p = qkv.plan(q, k, v, mask=Documents(ids, ids))
        assert p.pieces is not None and p.pieces.documents and p.pieces.calls == 2
        assert _rules(p) == ["reduced", "sdpa-backward"]
        pieces, _ = qkv.attention(q, k, v, mask=Documents(ids, ids))
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.equal(out, want)
    for got, exp in zip(
        torch.autograd.grad(out, (q, k, v), d_out),
        torch.autograd.grad(want, (q, k, v), d_out),
        strict=True,
    ):
        assert torch.equal(got, exp)
    halves = [
        torch.nn.functional.scaled_dot_product_attention(*(x[:, :, s] for x in (q, k, v)))
        for s in (slice(0, 64), slice(64, 128))
    ]
    want_docs = torch.cat(halves, dim=2)  # [2, 4, 128, 32]
    for got, exp in zip(
        torch.autograd.grad(pieces, (q, k, v), d_out),
        torch.autograd.grad(want_docs, (q, k, v), d_out),
        strict=True,
    ):
        assert torch.equal(got, exp)
    assert qkv.plan(q, k, v, is_causal=True).backend == "blockwise"


def test_reduction_pieces_train_on_blockwise_and_match_the_float64_reference(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A reduction keeps its pieces; each piece small enough for fused's recomputing backward
    runs on blockwise instead, gradients exact against float64."""
    calls = []

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(args[3])
        return blockwise.blockwise_attention(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(reductions, "blockwise_attention", spy)
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 192, 32, dtype=torch.float64) for _ in range(3))
    ids = torch.arange(192).div(96, rounding_mode="floor").expand(2, 192)  # [2, 192]: 2 docs
    lengths = torch.tensor([192, 150])
    for mask in (Documents(ids, ids) | Causal(), Padding(lengths), Causal() | Padding(lengths)):
        calls.clear()
        _check_training_against_float64(q, k, v, "fused", mask=mask)
        assert calls, "the pieces should have run on blockwise"
    with torch.no_grad():
        calls.clear()
        qkv.attention(q.float(), k.float(), v.float(), mask=Documents(ids, ids))
        assert not calls  # no gradient: SDPA


def _check_training_against_float64(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str, **call: object
) -> None:
    """auto in float32 picks ``backend`` and its output and gradients match the float64
    reference to float32 rounding (measured at most 6.4e-7, relative on the gradients)."""
    leaves = [x.float().requires_grad_() for x in (q, k, v)]
    assert qkv.plan(*leaves, **call).backend == backend  # type: ignore[arg-type]
    out, _ = qkv.attention(*leaves, **call)  # type: ignore[arg-type]
    grads = torch.autograd.grad(out.square().sum(), leaves)
    ref_leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ref, _ = qkv.attention(*ref_leaves, backend="reference", **call)  # type: ignore[arg-type]
    ref_grads = torch.autograd.grad(ref.square().sum(), ref_leaves)
    assert (out.double() - ref).abs().max() < 5e-6
    for g, r in zip(grads, ref_grads, strict=True):
        assert (g.double() - r).abs().max() < 5e-6 * max(1.0, float(r.abs().max()))


def test_blockwise_for_training_matches_the_float64_reference() -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 96, 32, dtype=torch.float64) for _ in range(3))
    _check_training_against_float64(q, k, v, "blockwise", is_causal=True)


def test_explain_renders_the_records() -> None:
    """explain_backend is the plan's reasons in words: one sentence per record."""
    xs = _qkv(4096, 4096, grad=True)
    window = SlidingWindow(1024)
    p = qkv.plan(*xs, mask=window)
    why = qkv.explain_backend(*xs, mask=window)
    assert why == qkv.explain_backend(*xs, mask=window, plan=p)
    assert why.startswith("blockwise: SlidingWindow(window=1024")
    assert f"{_why(p).facts['skipped']} of 128 tiles ({_why(p).value:.0%}) fully masked" in why
    assert why.endswith("no gradient is needed (fwd+bwd through the bands was measured slower)")
    band = qkv.explain_backend(*_qkv(4096, 4096), mask=SlidingWindow(256))
    assert "32 SDPA call(s) on 9% of the query-key pairs" in band
    assert "sliding window → 32 band SDPA call(s) of up to 128 query rows over 128-383 keys" in band
    assert qkv.explain_backend(*_qkv(64, 64)) == "fused: no structured mask; SDPA runs it unchanged"
    every = set(planning.Rule.__args__)  # type: ignore[attr-defined]
    assert set(explain._SENTENCES) == every  # every rule has its sentence


def test_every_reason_names_a_policy_field() -> None:
    fields = {f.name for f in dataclasses.fields(qkv.Policy)}
    plans = [
        qkv.plan(*_qkv(4096, 4096, grad=True), mask=SlidingWindow(1024)),
        qkv.plan(*_qkv(16384, 16384, grad=True), mask=SlidingWindow(256)),
        qkv.plan(*_qkv(4096, 4096), mask=SlidingWindow(256)),
        qkv.plan(*_qkv(128, 128, grad=True)),
        qkv.plan(*_qkv(64, 64), mask=SlidingWindow(8)),
    ]
    for p in plans:
        for r in p.reasons:
            assert (r.threshold is None) == (r.policy_field is None) or r.rule == "sdpa-backward"
            assert r.policy_field is None or r.policy_field in fields
