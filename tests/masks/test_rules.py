"""Structured masks: materialize() matches the qkv.masks builders; tile() matches materialize()."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qkv.masks import (
    EMPTY,
    FULL,
    Causal,
    Dense,
    Documents,
    MaskMod,
    Padding,
    SlidingWindow,
    StructuredMask,
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


@settings(max_examples=40, deadline=None)
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
                got = m.tile(B, H, T, S, q0, q1, k0, k1, CPU)
                if got is EMPTY:
                    assert bool(want.all()), m
                elif got is FULL:
                    assert not bool(want.any()), m
                else:
                    assert isinstance(got, torch.Tensor)
                    torch.testing.assert_close(got.expand_as(want), want)


def test_causal_tiles_are_skipped_by_index_arithmetic() -> None:
    m = Causal()
    assert m.tile(1, 1, 64, 64, 0, 16, 16, 32, CPU) is EMPTY
    assert m.tile(1, 1, 64, 64, 16, 32, 0, 16, CPU) is FULL
    assert isinstance(m.tile(1, 1, 64, 64, 0, 16, 0, 16, CPU), torch.Tensor)


def test_errors_name_the_argument() -> None:
    with pytest.raises(ValueError, match="window"):
        SlidingWindow(0)
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
