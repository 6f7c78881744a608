"""Mask reductions to plain SDPA calls: exact against the float64 reference, and planned.

Assertions read the plan's pieces (``qkv.plan(...).pieces``, a :class:`Reduction`), not the
sentences :func:`qkv.explain_backend` makes of them."""

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

import qkv
from qkv.backends import reads
from qkv.backends.pieces import Piece, Reduction, reduce_mask
from qkv.backends.plan import Plan
from qkv.backends.reductions import reduced_attention
from qkv.masks import Causal, Documents, MaskMod, Padding, SlidingWindow, StructuredMask

TOL64 = {"atol": 1e-10, "rtol": 1e-8}


def _inputs(B: int, H: int, Hkv: int, T: int, S: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(B, H, T, 16, generator=g, dtype=torch.float64).requires_grad_(),
        torch.randn(B, Hkv, S, 16, generator=g, dtype=torch.float64).requires_grad_(),
        torch.randn(B, Hkv, S, 8, generator=g, dtype=torch.float64).requires_grad_(),
    ]


def _out_and_grads(backend: str, xs: list[torch.Tensor], **kw: object) -> list[torch.Tensor]:
    out, _ = qkv.attention(*xs, backend=backend, **kw)  # type: ignore[arg-type]
    d_out = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)
    bias = kw.get("attn_bias")
    wrt = [*xs, *([bias] if isinstance(bias, torch.Tensor) else [])]
    return [out, *torch.autograd.grad(out, wrt, d_out)]


def _check(xs: list[torch.Tensor], **kw: object) -> Reduction:
    """auto and fused agree with the reference in float64; returns auto's pieces."""
    want = _out_and_grads("reference", xs, **kw)
    for backend in ("auto", "fused"):
        got = _out_and_grads(backend, xs, **kw)
        for g, w in zip(got, want, strict=True):
            assert torch.isfinite(g).all()
            torch.testing.assert_close(g, w, **TOL64)
    p = qkv.plan(*xs, **kw)  # type: ignore[arg-type]
    assert p.backend == "fused" and p.reasons[0].rule == "reduced" and p.pieces is not None
    return p.pieces


def _kinds(red: Reduction) -> list[str]:
    return [p.kind for g in red.groups for p in g.pieces]


def _masked(red: Reduction) -> list[tuple[int, int]]:
    """The shapes of the pieces that keep the rule's own mask."""
    return [(p.q1 - p.q0, p.k1 - p.k0) for g in red.groups for p in g.pieces if p.kind == "masked"]


def _dead_rows(red: Reduction) -> int:
    return sum(
        len(g.batch) * (p.q1 - p.q0) for g in red.groups for p in g.pieces if p.kind == "dead"
    )


def _docs(lengths: list[int]) -> torch.Tensor:
    """Document ids ``[1, sum(lengths)]`` of documents of these lengths, packed."""
    return torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]


def test_causal_rule_becomes_sdpa_is_causal() -> None:
    xs = _inputs(1, 4, 2, 12, 12)
    red = _check(xs, mask=Causal())
    assert _kinds(red) == ["causal"] and red.calls == 1
    top_left = _check(_inputs(1, 2, 2, 5, 9), mask=Causal(align="top_left"))
    assert "causal" in _kinds(top_left)
    # Bottom-right with T > S: the first T - S rows see no key and are 0.
    wide = _check(_inputs(1, 2, 2, 9, 5), mask=Causal())
    assert _kinds(wide) == ["dead", "causal"] and _dead_rows(wide) == 4


def test_kv_cache_chunk_needs_no_full_mask() -> None:
    # T=3 queries after 6 cached keys: only the first two rows have a causal edge.
    xs = _inputs(1, 2, 1, 3, 9)
    red = _check(xs, is_causal=True)
    assert red.calls == 2 and _masked(red) == [(2, 8)]
    one = _check(_inputs(1, 2, 1, 1, 9), is_causal=True)  # decoding: row 0 sees every key
    assert one.calls == 1 and one.pairs == 9


def test_padding_cuts_keys_to_the_longest_live_length() -> None:
    xs = _inputs(3, 2, 2, 6, 10)
    assert _check(xs, mask=Padding(torch.tensor([7, 4, 0]))).longest == 7
    red = reduce_mask(Padding(torch.tensor([7, 4, 0])), 3, 2, 6, 10)
    # Suffix padding: one maskless call per live length (7 and 4); the empty sample is zeros.
    assert red is not None and red.calls == 2
    assert {p.kind for g in red.groups for p in g.pieces} == {"open", "dead"}


def test_padding_as_is_pad_with_and_without_holes() -> None:
    suffix = torch.tensor([[False] * 5 + [True] * 3, [False] * 6 + [True] * 2])
    assert _check(_inputs(2, 2, 2, 4, 8), mask=Padding(suffix)).longest == 6
    holes = torch.tensor([[False, True] * 3 + [True, True], [True] * 8])
    red = _check(_inputs(2, 2, 2, 4, 8), mask=Padding(holes))
    assert red.longest == 5 and _masked(red) == [(4, 5)]


def test_causal_with_padding_groups_samples_by_length() -> None:
    lengths = torch.tensor([9, 3, 9, 0])
    red = _check(_inputs(4, 2, 1, 9, 9), mask=Causal() | Padding(lengths))
    assert "causal" in _kinds(red) and len(red.groups) == 3
    # One is_causal call per live length: the rows past a sample's last live key (which see
    # every live key) stay in that call, as SDPA's top-left flag has them (the empty sample: 0).
    assert red.calls == 2
    red = reduce_mask(Causal() | Padding(lengths), 4, 2, 9, 9)
    assert red is not None
    tall = [p for g in red.groups for p in g.pieces if p.kind == "causal" and p.k1 == 3]
    assert tall == [Piece(0, 9, 0, 3, "causal")] and tall[0].pairs == 6 + 6 * 3


def test_documents_one_call_each_and_causal_inside() -> None:
    ids = _docs([3, 5, 1, 4])
    red = _check(_inputs(1, 2, 2, 13, 13), mask=Documents(ids))
    assert red.documents and red.calls == 4 and _kinds(red) == ["open"] * 4
    red = _check(_inputs(1, 2, 2, 13, 13), mask=Documents(ids) | Causal())
    assert red.documents and _kinds(red) == ["causal", "causal", "open", "causal"]  # 1 key: open
    padded = Documents(ids) | Causal() | Padding(torch.tensor([10]))
    red = _check(_inputs(1, 2, 2, 13, 13), mask=padded)
    assert red.documents and red.longest == 10


def test_cross_documents_and_missing_documents() -> None:
    q_ids = torch.tensor([[0, 0, 1, 1, 1, 5]])  # document 5 has no keys: its row is 0
    kv_ids = torch.tensor([[0, 1, 1, 1, 2, 2, 2]])
    red = _check(_inputs(1, 2, 1, 6, 7), mask=Documents(q_ids, kv_ids))
    assert red.documents and red.calls == 2 and _dead_rows(red) == 1


def test_bias_is_cut_with_the_pieces() -> None:
    xs = _inputs(2, 2, 2, 7, 7)
    bias = torch.randn(2, 1, 7, 7, dtype=torch.float64, requires_grad=True)
    mask = Documents(torch.tensor([[0, 0, 0, 1, 1, 1, 1], [0, 1, 1, 1, 1, 2, 2]])) | Causal()
    want = _out_and_grads("reference", xs, mask=mask, attn_bias=bias)
    got = _out_and_grads("fused", xs, mask=mask, attn_bias=bias)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **TOL64)


def test_document_runs_are_read_in_one_pass() -> None:
    runs = reads.runs(torch.tensor([4, 4, 7, 7, 7, 2]))
    assert runs == [(4, 0, 2), (7, 2, 5), (2, 5, 6)]
    assert reads.runs(torch.tensor([], dtype=torch.long)) == []


def test_not_reducible_parts_and_unsorted_documents_are_left_alone() -> None:
    assert reduce_mask(SlidingWindow(3), 1, 1, 8, 8) is None
    assert reduce_mask(MaskMod(lambda b, h, q, k: q >= k), 1, 1, 8, 8) is None
    assert reduce_mask(Documents(torch.tensor([[0, 1, 0, 1]])), 1, 1, 4, 4) is None
    assert qkv.plan(*_inputs(1, 1, 1, 8, 8), mask=SlidingWindow(3)).pieces is None


def test_a_reduction_for_another_grid_is_refused() -> None:
    red = reduce_mask(Causal(), 1, 1, 4, 4)
    assert red is not None
    q, k, v = (torch.randn(1, 1, 5, 4) for _ in range(3))
    with pytest.raises(ValueError, match="reduction was made for grid"):
        reduced_attention(q, k, v, red, None, scale=0.5, dropout_p=0.0, training=False)


@given(
    B=st.integers(1, 3),
    T=st.integers(1, 12),
    S=st.integers(1, 12),
    groups=st.sampled_from([1, 2]),
    causal=st.sampled_from([None, "bottom_right", "top_left", -2, 3]),
    padding=st.booleans(),
    docs=st.booleans(),
    data=st.data(),
)
def test_any_combination_matches_the_reference(
    B: int,
    T: int,
    S: int,
    groups: int,
    causal: str | int | None,
    padding: bool,
    docs: bool,
    data: st.DataObject,
) -> None:
    assume(causal is not None or padding or docs)  # no mask at all is not a combination
    parts: list[StructuredMask] = []
    if causal in ("bottom_right", "top_left"):
        parts.append(Causal(align=causal))  # type: ignore[arg-type]
    elif isinstance(causal, int):
        parts.append(Causal(offset=causal))
    if padding:
        lengths = data.draw(st.lists(st.integers(0, S), min_size=B, max_size=B))
        parts.append(Padding(torch.tensor(lengths)))
    if docs:

        def ids(n: int) -> torch.Tensor:
            steps = data.draw(st.lists(st.integers(0, 1), min_size=B * n, max_size=B * n))
            return torch.tensor(steps).reshape(B, n).cumsum(dim=1)  # sorted ids [B, n]

        parts.append(Documents(ids(T), ids(S)))
    mask = parts[0] if len(parts) == 1 else parts[0] | parts[1]
    for p in parts[2:]:
        mask = mask | p
    xs = _inputs(B, 2 * groups, 2, T, S)
    want = _out_and_grads("reference", xs, mask=mask)
    got = _out_and_grads("fused", xs, mask=mask)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **TOL64)


@pytest.mark.parametrize("is_causal", [False, True])
def test_padding_tensor_from_a_model_is_reduced_as_padding(is_causal: bool) -> None:
    # What BertEncoder / qkv.Transformer build: padding_mask(is_pad), [B, 1, 1, S].
    from qkv.masks import padding_mask

    lengths = torch.tensor([9, 4, 9, 0, 6])
    is_pad = torch.arange(9)[None] >= lengths[:, None]  # [B, S], suffix padding
    xs = _inputs(5, 4, 2, 9, 9, seed=3)
    red = _check(xs, mask=padding_mask(is_pad), is_causal=is_causal)
    assert qkv.plan(*xs, mask=padding_mask(is_pad), is_causal=is_causal).reasons[0].facts == {
        "from_tensor": True
    }
    assert len(red.groups) == 4 and _dead_rows(red) == 9
    # Holes (left and middle padding) keep the rule's own mask on the cut keys, still exact.
    holes = is_pad | torch.arange(9)[None].eq(8)  # no sample sees key 8: cut to 8 keys
    holes[0, 2] = True
    holes[2, 0] = True
    cut = _check(xs, mask=padding_mask(holes), is_causal=is_causal)
    assert cut.longest == 8 and _masked(cut)
    # Nothing to cut (a sample live up to key S - 1): without is_causal SDPA takes it as it is.
    holes[0, 8] = False
    uncut = qkv.plan(*xs, mask=padding_mask(holes), is_causal=is_causal)
    assert (uncut.pieces is not None) == is_causal  # causal still cuts the upper triangle
    assert (uncut.reasons[0].rule == "tensor-mask") != is_causal
    # One row broadcast over the batch.
    one = padding_mask(is_pad[:1] | torch.arange(9)[None].eq(8))  # [1, 1, 1, S]
    assert _check(xs, mask=one, is_causal=is_causal).longest == 8


def test_other_tensor_shapes_are_not_read_as_padding() -> None:
    xs = _inputs(2, 2, 2, 6, 6, seed=4)
    rows = torch.rand(2, 1, 6, 6, generator=torch.Generator().manual_seed(0)) < 0.3
    p = qkv.plan(*xs, mask=rows)
    assert p.pieces is None and p.reasons[0].rule == "tensor-mask"


def test_sliding_window_tensor_is_classified_and_runs_blockwise() -> None:
    # T * S = 1024 * 1024 reaches Policy.blockwise_min_pairs: auto classifies the tensor's tiles.
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 1, 1024, 8, generator=g, dtype=torch.float64) for _ in range(3))
    band = SlidingWindow(128).materialize(1, 1, 1024, 1024)  # [1, 1, T, S]
    p = qkv.plan(q, k, v, mask=band)
    assert p.backend == "blockwise" and p.reasons[0].rule == "tensor-tiles-skipped"
    assert p.reasons[0].value is not None and p.reasons[0].value >= 0.25
    want, _ = qkv.attention(q, k, v, mask=band, backend="reference")
    got, _ = qkv.attention(q, k, v, mask=band)
    torch.testing.assert_close(got, want, **TOL64)
    dense = torch.rand(1, 1, 1024, 1024, generator=g) < 0.5  # no tile fully masked
    assert qkv.plan(q, k, v, mask=dense).reasons[0].rule == "tensor-mask"


TOL32 = {"atol": 1e-5, "rtol": 1.3e-6}


def _band(xs: list[torch.Tensor], mask: StructuredMask, **kw: object) -> Plan:
    """Forward without a gradient: auto runs the band reduction, exact against the float64
    reference of the same inputs; returns auto's plan."""
    with torch.no_grad():
        why = qkv.plan(*xs, mask=mask, **kw)  # type: ignore[arg-type]
        got, _ = qkv.attention(*xs, mask=mask, **kw)  # type: ignore[arg-type]
        want, _ = qkv.attention(*(x.double() for x in xs), mask=mask, backend="reference", **kw)  # type: ignore[arg-type]
    assert why.pieces is not None and why.pieces.band, why
    assert got.dtype == xs[0].dtype and torch.isfinite(got).all()
    tol = TOL64 if got.dtype == torch.float64 else TOL32
    torch.testing.assert_close(got.double(), want, **tol)
    return why


def _f32(B: int, H: int, Hkv: int, T: int, S: int, seed: int = 0) -> list[torch.Tensor]:
    return [x.detach().float() for x in _inputs(B, H, Hkv, T, S, seed)]


@pytest.mark.parametrize(
    ("T", "S", "rule"),
    [
        (512, 512, SlidingWindow(64)),
        (300, 700, SlidingWindow(50)),  # bottom-right, T < S: a KV-cache chunk
        (700, 300, SlidingWindow(50)),  # bottom-right, T > S: the first 400 rows are 0
        (700, 300, SlidingWindow(50, align="top_left")),  # rows past S + 49 are 0
        (400, 500, SlidingWindow(40, offset=-30)),  # the first 30 rows see no key
        (400, 500, SlidingWindow(40, offset=90)),
        (512, 512, SlidingWindow(1)),  # each query sees only its own position
        (512, 512, SlidingWindow(64) | Causal(align="top_left")),
        (300, 700, SlidingWindow(50) | Causal(offset=380)),  # causal cuts the band's top
        (512, 512, SlidingWindow(64) | SlidingWindow(32, offset=8)),
    ],
)
def test_band_matches_the_reference(T: int, S: int, rule: StructuredMask) -> None:
    why = _band(_f32(1, 4, 2, T, S), rule)  # GQA: 4 query heads on 2 key heads
    assert why.pieces is not None and why.pieces.band_block == 128
    assert all(p.q1 - p.q0 <= 128 for g in why.pieces.groups for p in g.pieces if p.kind != "dead")
    _band(_inputs(1, 2, 2, T, S, seed=1), rule)  # float64: to the reference's own precision


def test_band_with_padding_cuts_each_sample_to_its_live_keys() -> None:
    lengths = torch.tensor([512, 200, 0, 333])  # a sample with no key is 0
    why = _band(_f32(4, 2, 1, 512, 512), SlidingWindow(64) | Padding(lengths))
    assert why.pieces is not None and why.pieces.longest == 512 and _dead_rows(why.pieces) > 0
    is_pad = torch.arange(512)[None] >= lengths[:, None]  # [B, S], as a model builds it
    _band(_f32(4, 2, 1, 512, 512), SlidingWindow(64) | Padding(is_pad) | Causal())
    holes = is_pad.clone()
    holes[0, 100:110] = True  # a hole inside the band: its pieces keep the whole rule's mask
    holes[3, 0] = True
    why = _band(_f32(4, 2, 1, 512, 512), SlidingWindow(64) | Padding(holes))
    red = reduce_mask(SlidingWindow(64) | Padding(holes), 4, 2, 512, 512, band=True)
    assert red is not None and red.piece_mask is None
    plain = reduce_mask(SlidingWindow(64) | Padding(lengths), 4, 2, 512, 512, band=True)
    assert plain is not None and repr(plain.piece_mask).startswith("SlidingWindow")


def test_band_pieces_ask_the_window_once_per_pattern_and_carry_the_bias(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked: list[tuple[int, int, int, int]] = []
    tile = SlidingWindow.tile

    def spy(self: SlidingWindow, t: object) -> object:
        asked.append((t.q0, t.q1, t.k0, t.k1))  # type: ignore[attr-defined]
        return tile(self, t)  # type: ignore[arg-type]

    monkeypatch.setattr(SlidingWindow, "tile", spy)
    xs = _f32(2, 2, 1, 1024, 1024)
    bias = torch.randn(2, 1, 1024, 1024)
    rule = SlidingWindow(64) | Padding(torch.tensor([1024, 700]))
    _band(xs, rule)
    red = reduce_mask(rule, 2, 2, 1024, 1024, band=True)
    assert red is not None
    masked = [p for g in red.groups for p in g.pieces if p.kind == "masked"]
    bands = [t for t in asked if t != (0, 1024, 0, 1024)]  # the reference's whole mask
    # 14 band pieces (8 + 6; the rest of sample 1 is dead) and 3 patterns: the first block
    # (cut at key 0), the interior blocks (one shared diagonal offset), and sample 1's block at
    # its live length 700, whose last rows see no key: that one is asked again by the path
    # that zeroes dead rows
    assert len(masked) == 14
    assert bands == [(0, 128, 0, 128), (128, 256, 65, 256), *[(640, 768, 577, 700)] * 2]
    asked.clear()
    with torch.no_grad():
        got, _ = qkv.attention(*xs, mask=rule, attn_bias=bias)
        want, _ = qkv.attention(
            *(x.double() for x in xs), mask=rule, attn_bias=bias.double(), backend="reference"
        )
    torch.testing.assert_close(got.double(), want, **TOL32)


def test_band_inside_documents() -> None:
    ids = _docs([200, 37, 275])  # [1, 512]
    why = _band(_f32(1, 2, 2, 512, 512), SlidingWindow(64) | Documents(ids))
    assert why.pieces is not None and why.pieces.documents and why.pieces.band


def test_band_in_low_precision_is_computed_in_float32() -> None:
    q, k, v = (x.to(torch.bfloat16) for x in _f32(1, 4, 4, 512, 512))
    rule = SlidingWindow(64)
    with torch.no_grad():
        why = qkv.plan(q, k, v, mask=rule)
        got, _ = qkv.attention(q, k, v, mask=rule)
        want, _ = qkv.attention(q.double(), k.double(), v.double(), mask=rule, backend="reference")
        # A naive bfloat16 formula, every step in bfloat16.
        scores = (q @ k.transpose(-2, -1)) * 0.25  # [B, H, T, S]
        scores = scores.masked_fill(rule.materialize(1, 4, 512, 512), float("-inf"))
        naive = scores.softmax(dim=-1) @ v  # [B, H, T, Dv]
    assert why.pieces is not None and why.pieces.band and got.dtype == torch.bfloat16
    assert [r.rule for r in why.reasons] == ["reduced", "upcast"]
    err = (got.double() - want).abs().max()
    assert err <= 2 * (naive.double() - want).abs().max()


def test_window_wider_than_the_grid_is_causal() -> None:
    # window >= S (bottom-right, T == S): the window never binds; SDPA's is_causal runs it.
    red = _check(_inputs(1, 2, 2, 12, 12), mask=SlidingWindow(12))
    assert _kinds(red) == ["causal"] and not red.band
    red = reduce_mask(SlidingWindow(300), 1, 2, 300, 300, band=True)
    assert red is not None and red.calls == 1  # reduced as causal, not cut into bands
    red = reduce_mask(SlidingWindow(299), 1, 2, 300, 300, band=True)
    assert red is None  # binds once (last row, key 0): a band as wide as the grid


def test_band_needs_to_be_allowed_and_to_pay() -> None:
    assert reduce_mask(SlidingWindow(64), 1, 2, 512, 512) is None  # band=False by default
    assert reduce_mask(SlidingWindow(64), 1, 2, 512, 512, band=True) is not None
    assert reduce_mask(SlidingWindow(512), 1, 2, 1024, 1024, band=True) is not None  # 47%
    assert reduce_mask(SlidingWindow(640), 1, 2, 1024, 1024, band=True) is None  # 52%
    # A gradient: auto does not cut the window into bands (fwd+bwd measured slower).
    xs = _inputs(1, 2, 2, 512, 512)
    assert qkv.plan(*xs, mask=SlidingWindow(64)).pieces is None


@given(
    B=st.integers(1, 3),
    T=st.integers(1, 14),
    S=st.integers(1, 14),
    window=st.integers(1, 6),
    where=st.sampled_from(["bottom_right", "top_left", -3, 4]),
    causal=st.booleans(),
    padding=st.booleans(),
    docs=st.booleans(),
    data=st.data(),
)
def test_any_band_matches_the_reference(
    B: int,
    T: int,
    S: int,
    window: int,
    where: str | int,
    causal: bool,
    padding: bool,
    docs: bool,
    data: st.DataObject,
) -> None:
    # Blocks of 4 rows and no share limit, so tiny grids are cut into many bands.
    with qkv.use_policy(band_block=4, band_max_share=1.0):
        w = (
            SlidingWindow(window, align=where)  # type: ignore[arg-type]
            if isinstance(where, str)
            else SlidingWindow(window, offset=where)
        )
        mask: StructuredMask = w
        if causal:
            mask = mask | Causal()
        if padding:
            lengths = data.draw(st.lists(st.integers(0, S), min_size=B, max_size=B))
            mask = mask | Padding(torch.tensor(lengths))
        if docs:

            def ids(n: int) -> torch.Tensor:
                steps = data.draw(st.lists(st.integers(0, 1), min_size=B * n, max_size=B * n))
                return torch.tensor(steps).reshape(B, n).cumsum(dim=1)  # sorted ids [B, n]

            mask = mask | Documents(ids(T), ids(S))
        xs = [x.detach() for x in _inputs(B, 4, 2, T, S)]
        red = reduce_mask(mask, B, 4, T, S, band=True)
        assume(red is not None)  # no band cut for this mask: nothing to compare
        assert red is not None
        got = reduced_attention(*xs, red, None, scale=0.25, dropout_p=0.0, training=False)
        want, _ = qkv.attention(*xs, mask=mask, backend="reference", scale=0.25)
        torch.testing.assert_close(got, want, **TOL64)


def test_band_cuts_the_bias_with_the_pieces() -> None:
    xs = _inputs(2, 2, 2, 300, 300, seed=2)
    bias = torch.randn(
        2, 1, 300, 300, generator=torch.Generator().manual_seed(1), dtype=xs[0].dtype
    )
    _band([x.detach() for x in xs], SlidingWindow(32) | Causal(), attn_bias=bias)
