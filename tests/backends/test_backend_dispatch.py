"""auto picks a backend from facts about the call and says why; forced backends never switch."""

import pytest
import torch

import qkv
from qkv.backends import blockwise, dispatch, flex, reductions
from qkv.masks import Causal, Documents, MaskMod, Padding, SlidingWindow


def _qkv(
    T: int, S: int, dtype: torch.dtype = torch.float32, grad: bool = False
) -> tuple[torch.Tensor, ...]:
    # Expanded views: explain_backend computes nothing, so big lengths cost no memory here.
    one = torch.zeros(1, 1, 1, 1, dtype=dtype, requires_grad=grad)
    return one.expand(1, 8, T, 64), one.expand(1, 8, S, 64), one.expand(1, 8, S, 64)


def test_weights_need_reference() -> None:
    why = qkv.explain_backend(*_qkv(8, 8), mask=Causal(), need_weights=True)
    assert why.startswith("reference:") and "weights" in why


def test_dense_goes_fused_and_sdpa_causal_only_when_square() -> None:
    assert qkv.explain_backend(*_qkv(64, 64)).startswith("fused:")
    assert "SDPA's own causal kernel" in qkv.explain_backend(*_qkv(64, 64), is_causal=True)
    # Bottom-right with T=4 < S=64: only rows 0-2 have a causal edge; row 3 sees every key.
    small = qkv.explain_backend(*_qkv(4, 64), is_causal=True)
    assert small.startswith("fused:") and "2 SDPA call(s)" in small and "[3, 63]" in small
    forced = qkv.explain_backend(*_qkv(4, 64), mask=torch.ones(4, 64).tril(60) == 0, is_causal=True)
    assert forced.startswith("fused:") and "bottom-right causal mask is materialized" in forced


def test_large_structured_masks_go_blockwise_with_the_skipped_fraction() -> None:
    # With a gradient (training) a sliding window is not cut into bands, and the sentence says so.
    why = qkv.explain_backend(*_qkv(4096, 4096, grad=True), mask=SlidingWindow(1024))
    assert why.startswith("blockwise:") and "fully masked" in why
    assert "band SDPA calls only when no gradient is needed" in why
    why = qkv.explain_backend(*_qkv(16384, 16384, grad=True), mask=SlidingWindow(256))
    assert why.startswith("blockwise:") and "materializing" in why
    with torch.no_grad():
        assert "no gradient" not in qkv.explain_backend(
            *_qkv(16384, 16384, grad=True),
            mask=SlidingWindow(256) | MaskMod(lambda b, h, q, k: q >= k),
        )
    why = qkv.explain_backend(*_qkv(2048, 2048), mask=MaskMod(lambda b, h, q, k: q >= k))
    assert why.startswith("blockwise:") and "mask_mod" in why


def test_dense_structured_mask_is_materialized_for_fused_and_says_so() -> None:
    holes = (torch.arange(2048) % 2 == 0)[None]  # [1, S]: every other key, not the last, padding
    why = qkv.explain_backend(*_qkv(2048, 2048), mask=Padding(holes))
    assert why.startswith("fused:") and "materialized" in why
    half = qkv.explain_backend(*_qkv(64, 64, torch.float16), mask=SlidingWindow(8))
    assert "upcast to float32" in half and "materialized" in half
    reduced = qkv.explain_backend(*_qkv(64, 64, torch.float16), mask=Causal())
    assert "upcast to float32" in reduced and "is_causal kernel" in reduced


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


def test_explanation_counts_the_calls_own_blocks() -> None:
    window = SlidingWindow(1024)
    xs = _qkv(4096, 4096, grad=True)  # a gradient: no band reduction
    default = qkv.explain_backend(*xs, mask=window)
    assert "of 128 tiles" in default  # 16 x 8 tiles of 256 x 512
    small = qkv.explain_backend(*xs, mask=window, block_q=512, block_k=512)
    # 8 x 8 tiles of 512: query block i sees key blocks i-2 .. i, so 8 + 7 + 6 are computed.
    assert "43 of 64 tiles (67%)" in small


def test_blockwise_runs_the_plan_dispatch_made(monkeypatch: pytest.MonkeyPatch) -> None:
    """auto plans the tiles once: blockwise takes the dispatcher's plan instead of replanning."""
    calls: list[int] = []
    real = blockwise.plan_tiles

    def counting(*args: object, **kwargs: object) -> blockwise.TilePlan:
        calls.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(blockwise, "plan_tiles", counting)
    monkeypatch.setattr(dispatch, "plan_tiles", counting)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 1024, 8, generator=g) for _ in range(3))
    q.requires_grad_()  # a gradient: no band reduction, blockwise
    kw: dict[str, object] = {"mask": SlidingWindow(256), "block_q": 128, "block_k": 128}
    assert qkv.explain_backend(q, k, v, **kw).startswith("blockwise:")  # type: ignore[arg-type]
    calls.clear()
    out, _ = qkv.attention(q, k, v, **kw)  # type: ignore[arg-type]
    assert len(calls) == 1
    want, _ = qkv.attention(q, k, v, backend="reference", **kw)  # type: ignore[arg-type]
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1.3e-6)
    calls.clear()
    qkv.attention(q, k, v, backend="blockwise", **kw)  # type: ignore[arg-type]
    assert len(calls) == 1  # a forced blockwise call plans in the backend, once


def test_a_plan_for_another_mask_is_refused() -> None:
    q, k, v = (torch.randn(1, 1, 8, 4) for _ in range(3))
    mask = Causal()
    plan = blockwise.plan_tiles(mask, 1, 1, 8, 8, 4, 4, q.device)
    with pytest.raises(ValueError, match="plan was made for"):
        blockwise.blockwise_attention(q, k, v, Causal(), None, 0.5, 0.0, False, plan=plan)
    with pytest.raises(ValueError, match="block_q=2 but the tile plan was made with block_q=4"):
        blockwise.blockwise_attention(q, k, v, mask, None, 0.5, 0.0, False, block_q=2, plan=plan)


def test_sliding_window_without_gradient_is_cut_into_bands() -> None:
    why = qkv.explain_backend(*_qkv(4096, 4096), mask=SlidingWindow(256))
    # 32 blocks of 128 queries; a full block sees 128 + 255 keys, the first only its 128.
    assert why.startswith("fused: SlidingWindow(window=256")
    assert "32 SDPA call(s) on 9% of the query-key pairs" in why
    assert "sliding window → 32 band SDPA call(s) of up to 128 query rows over 128-383 keys" in why
    with torch.no_grad():  # no_grad counts as no gradient, whatever requires_grad says
        assert "band SDPA" in qkv.explain_backend(
            *_qkv(4096, 4096, grad=True), mask=SlidingWindow(256)
        )
    # Decoding one token with a window: one maskless call over the window's keys.
    one = qkv.explain_backend(*_qkv(1, 4096), mask=SlidingWindow(256))
    assert "1 band SDPA call(s) of up to 128 query rows over 256 keys" in one
    assert "own mask" not in one
    # A band over more than BAND_MAX_SHARE of the pairs (52% here) is left to the other steps.
    wide = qkv.explain_backend(*_qkv(1024, 1024), mask=SlidingWindow(640))
    assert wide.startswith("blockwise:") and "band" not in wide


def test_the_band_comes_before_flex_also_when_compiling_is_allowed() -> None:
    """The band's SDPA calls were measured faster than compiled flex_attention (forward)."""
    with flex.allow_compile():
        why = qkv.explain_backend(*_qkv(4096, 4096), mask=SlidingWindow(256))
        assert why.startswith("fused:") and "band SDPA call(s)" in why
        # a window too wide for a band is still flex's
        wide = qkv.explain_backend(*_qkv(1024, 1024), mask=SlidingWindow(640))
        assert wide.startswith("flex:")


def test_small_cpu_training_calls_take_blockwise_not_the_recomputing_backward() -> None:
    """Where fused would replace SDPA's CPU backward by its exact recomputation, auto runs
    blockwise (exact too, faster); above the exact backward's size bound, with dropout, or
    without a gradient, fused stays."""
    for extra in ({}, {"is_causal": True}):
        why = qkv.explain_backend(*_qkv(128, 128, grad=True), **extra)  # type: ignore[arg-type]
        assert why.startswith("blockwise:") and "needs a gradient on CPU" in why
        assert qkv.explain_backend(*_qkv(128, 128), **extra).startswith("fused:")  # type: ignore[arg-type]
    assert qkv.explain_backend(*_qkv(32, 32, grad=True)).startswith("fused:")  # too small to pay
    # 4 * 8 * 2048^2 * 4 bytes = 512 MB > the bound: SDPA's own backward, fused stays.
    assert qkv.explain_backend(*_qkv(2048, 2048, grad=True)).startswith("fused:")
    q, k, v = _qkv(128, 128, grad=True)
    assert qkv.explain_backend(q, k, v, dropout_p=0.1, training=True).startswith("fused:")


def test_allow_sdpa_backward_trains_through_sdpa_itself() -> None:
    """Inside the opt-in, small CPU training calls (whole, or a reduction's pieces) keep SDPA's
    own backward: output and gradients equal to plain SDPA's, bit for bit; after the block,
    the exact default is back."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 128, 32, requires_grad=True) for _ in range(3))
    d_out = torch.randn(2, 4, 128, 32)
    with qkv.allow_sdpa_backward():
        why = qkv.explain_backend(q, k, v, is_causal=True)
        assert why.startswith("fused:") and "SDPA's own CPU backward" in why
        out, _ = qkv.attention(q, k, v, is_causal=True)
        ids = torch.arange(128).div(64, rounding_mode="floor").expand(2, 128)  # 2 documents
        why = qkv.explain_backend(q, k, v, mask=Documents(ids, ids))
        assert "one SDPA call per document" in why and "SDPA's own CPU backward" in why
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
    assert qkv.explain_backend(q, k, v, is_causal=True).startswith("blockwise:")


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
        _check_training_against_float64(q, k, v, "fused:", mask=mask)
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
    assert qkv.explain_backend(*leaves, **call).startswith(backend)  # type: ignore[arg-type]
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
    _check_training_against_float64(q, k, v, "blockwise:", is_causal=True)
