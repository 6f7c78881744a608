"""Structured masks: materialize() matches the qkv.masks builders; tile() matches materialize()."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from qkv.masks import (
    EMPTY,
    FULL,
    AnyOf,
    Causal,
    Dense,
    Documents,
    MaskMod,
    Padding,
    SlidingWindow,
    StructuredMask,
    Tile,
    causal_mask,
    combine,
    padding_mask,
    sliding_window_mask,
)

CPU = torch.device("cpu")


def _docs(B: int, L: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    starts = torch.rand(B, L, generator=g) < 0.2
    return starts.cumsum(dim=1)  # [B, L], non-decreasing ids


def _masks(B: int, H: int, T: int, S: int, seed: int) -> list[StructuredMask]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, S + 1, (B,), generator=g)
    ids = _docs(B, max(T, S), seed)

    def stripes(
        b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor
    ) -> torch.Tensor:
        return ((q + kv + h) % 3 != 0) & (kv <= q + b)

    return [
        Causal(),
        Causal(align="top_left"),
        Causal(offset=-2),
        SlidingWindow(3),
        SlidingWindow(2, align="top_left"),
        Padding(lengths),
        Documents(ids[:, :T], ids[:, :S]),
        MaskMod(stripes),
        Causal() | Padding(lengths),
        Documents(ids[:, :T], ids[:, :S]) | SlidingWindow(4),
        Dense(torch.rand(B, 1, T, S, generator=g) < 0.5),
    ]


def test_materialize_matches_builders() -> None:
    T, S = 5, 9
    torch.testing.assert_close(
        Causal(align="top_left").materialize(1, 1, T, S), causal_mask(T, S, align="top_left")
    )
    torch.testing.assert_close(
        Causal().materialize(1, 1, T, S), causal_mask(T, S, align="bottom_right")
    )
    torch.testing.assert_close(
        Causal(offset=2).materialize(1, 1, T, S), causal_mask(T, S, offset=2)
    )
    torch.testing.assert_close(
        SlidingWindow(3).materialize(1, 1, T, S),
        sliding_window_mask(T, S, window=3, align="bottom_right"),
    )
    lengths = torch.tensor([9, 0, 4])
    both = Causal() | Padding(lengths)
    expected = combine(padding_mask(lengths, S), causal_mask(T, S, align="bottom_right"))
    assert expected is not None
    torch.testing.assert_close(
        both.materialize(3, 2, T, S).expand(3, 2, T, S), expected.expand(3, 2, T, S)
    )


def test_documents_and_mask_mod_materialize() -> None:
    ids = torch.tensor([[0, 0, 1, 1, 1, 2]])
    blocked = Documents(ids).materialize(1, 1, 6, 6)
    expected = ids[:, :, None] != ids[:, None, :]  # [1, 6, 6]
    torch.testing.assert_close(blocked, expected[:, None])

    def causal_keep(
        b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor
    ) -> torch.Tensor:
        return q >= kv

    torch.testing.assert_close(
        MaskMod(causal_keep).materialize(1, 1, 4, 4), causal_mask(4, align="top_left")
    )


@given(
    T=st.integers(1, 12),
    S=st.integers(1, 12),
    bq=st.integers(1, 7),
    bk=st.integers(1, 7),
    seed=st.integers(0, 1000),
)
def test_tiles_agree_with_materialized(T: int, S: int, bq: int, bk: int, seed: int) -> None:
    """EMPTY means every entry blocked, FULL none, a tensor equals the materialized slice."""
    B, H = 2, 3
    for m in _masks(B, H, T, S, seed):
        full = m.materialize(B, H, T, S).expand(B, H, T, S)
        for q0 in range(0, T, bq):
            for k0 in range(0, S, bk):
                q1, k1 = min(q0 + bq, T), min(k0 + bk, S)
                want = full[:, :, q0:q1, k0:k1]
                got = m.tile(Tile(B, H, T, S, q0, q1, k0, k1, CPU))
                if got is EMPTY:
                    assert bool(want.all()), m
                elif got is FULL:
                    assert not bool(want.any()), m
                else:
                    assert isinstance(got, torch.Tensor)
                    torch.testing.assert_close(got.expand_as(want), want)


def test_causal_tiles_are_skipped_by_index_arithmetic() -> None:
    m = Causal()
    assert m.tile(Tile(1, 1, 64, 64, 0, 16, 16, 32, CPU)) is EMPTY
    assert m.tile(Tile(1, 1, 64, 64, 16, 32, 0, 16, CPU)) is FULL
    assert isinstance(m.tile(Tile(1, 1, 64, 64, 0, 16, 0, 16, CPU)), torch.Tensor)


def test_tile_is_a_small_frozen_value() -> None:
    t = Tile.whole(2, 3, 5, 7, CPU)
    assert t.bounds == (0, 5, 0, 7) and (t.B, t.H, t.T, t.S) == (2, 3, 5, 7)
    assert torch.equal(Tile(1, 1, 8, 8, 2, 5, 3, 4, CPU).q_index(), torch.tensor([2, 3, 4]))
    assert torch.equal(Tile(1, 1, 8, 8, 2, 5, 3, 4, CPU).k_index(), torch.tensor([3]))
    with pytest.raises(AttributeError):
        t.q0 = 1  # type: ignore[misc]


def test_padding_lengths_and_is_pad_are_one_mask() -> None:
    """The same padding has one spelling with two forms, tile by tile too."""
    lengths = torch.tensor([5, 0, 3])
    is_pad = torch.arange(6)[None, :] >= lengths[:, None]  # [B, S]
    by_lengths, by_is_pad = Padding(lengths), Padding(is_pad)
    assert torch.equal(by_lengths.materialize(3, 2, 4, 6), by_is_pad.materialize(3, 2, 4, 6))
    for k0, k1 in ((0, 2), (3, 5), (5, 6)):
        a = by_lengths.tile(Tile(3, 2, 4, 6, 0, 4, k0, k1, CPU))
        b = by_is_pad.tile(Tile(3, 2, 4, 6, 0, 4, k0, k1, CPU))
        if isinstance(a, torch.Tensor):
            assert isinstance(b, torch.Tensor) and torch.equal(a, b)
        else:
            assert a is b
    left_pad = torch.tensor([[True, False, False], [False, False, False]])  # no lengths form
    expected = left_pad[:, None, None, :]  # [B, 1, 1, S]
    assert torch.equal(Padding(left_pad).materialize(2, 1, 3, 3), expected)
    with pytest.raises(ValueError, match="is_pad has S=3, expected S=4"):
        Padding(left_pad).validate(2, 1, 3, 4, CPU)
    with pytest.raises(ValueError, match="is_pad has B=2, expected B=1"):
        Padding(left_pad).validate(1, 1, 3, 3, CPU)


def test_materialize_returns_the_rules_broadcast_shape() -> None:
    B, H, T, S = 3, 4, 5, 6
    lengths = torch.tensor([6, 2, 0])
    ids = torch.zeros(B, T, dtype=torch.long)
    shapes = {
        Padding(lengths): (B, 1, 1, S),
        Padding(torch.tensor([6, 6, 6])): (B, 1, 1, S),  # FULL: still [B, 1, 1, S]
        Causal(): (1, 1, T, S),
        Causal(offset=100): (1, 1, T, S),  # FULL
        SlidingWindow(2): (1, 1, T, S),
        Documents(ids, torch.zeros(B, S, dtype=torch.long)): (B, 1, T, S),
        Causal() | Padding(lengths): (B, 1, T, S),
        Dense(torch.rand(1, 1, 1, S) < 0.5): (1, 1, T, S),
    }
    for rule, shape in shapes.items():
        assert tuple(rule.materialize(B, H, T, S).shape) == shape, rule


def test_rules_join_bool_tensors_with_or() -> None:
    T, S = 4, 6
    dense = torch.rand(1, 1, T, S) < 0.3
    want = causal_mask(T, S) | dense
    for rule in (Causal() | dense, dense | Causal()):
        assert isinstance(rule, AnyOf)
        assert torch.equal(rule.materialize(1, 1, T, S), want)


def test_union_is_a_deprecated_alias_of_any_of() -> None:
    with pytest.warns(DeprecationWarning, match="AnyOf"):
        from qkv.masks import Union
    assert Union is AnyOf
    assert isinstance(Causal() | SlidingWindow(2), Union)


def test_errors_name_the_argument() -> None:
    with pytest.raises(ValueError, match="window must be a positive int, got 0"):
        SlidingWindow(0)
    with pytest.raises(TypeError, match="window must be an int"):
        SlidingWindow(2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="align"):
        Causal(align="middle")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="lengths"):
        Padding(torch.tensor([1.0]))
    with pytest.raises(ValueError, match="B=2"):
        Padding(torch.tensor([1, 2])).validate(3, 1, 4, 4, CPU)
    with pytest.raises(ValueError, match="S=4"):
        Padding(torch.tensor([5])).validate(1, 1, 4, 4, CPU)
    with pytest.raises(ValueError, match="q_ids"):
        Documents(torch.zeros(1, 3, dtype=torch.long)).validate(1, 1, 4, 4, CPU)
    with pytest.raises(TypeError, match="bool"):
        MaskMod(lambda b, h, q, kv: q - kv).materialize(1, 1, 3, 3)
    with pytest.raises(TypeError, match="callable"):
        MaskMod(3)  # type: ignore[arg-type]
