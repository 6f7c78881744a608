"""One alignment default and one offset rule for every causal / sliding-window spelling.

Bottom-right is the default everywhere (the last query sees the last key), checked against
``torch.nn.attention.bias.causal_lower_right``; ``offset`` with an explicit ``align`` is refused
by every spelling; every builder is its rule's ``materialize``.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor
from torch.nn.attention.bias import causal_lower_right, causal_upper_left

import qkv
from qkv.masks import (
    Causal,
    Padding,
    SlidingWindow,
    causal_mask,
    padding_mask,
    sliding_window_mask,
)
from reference_f64 import attention_f64

SHAPES = [(3, 7), (5, 5), (7, 3)]  # T < S, T == S, T > S


def _lower_right(T: int, S: int) -> Tensor:
    return ~causal_lower_right(T, S)._materialize()  # [T, S], torch: True = may attend


@pytest.mark.filterwarnings("ignore:Lower right causal bias will produce NaNs")  # T > S rows
@pytest.mark.parametrize(("T", "S"), SHAPES)
def test_every_causal_spelling_defaults_to_bottom_right(T: int, S: int) -> None:
    want = _lower_right(T, S)  # [T, S]
    spellings = {
        "causal_mask": causal_mask(T, S),
        "sliding_window_mask": sliding_window_mask(T, S, window=T + S),  # wider than the grid
        "Causal": Causal().materialize(1, 1, T, S),
        "SlidingWindow": SlidingWindow(None).materialize(1, 1, T, S),
        "SlidingWindow(wide)": SlidingWindow(T + S).materialize(1, 1, T, S),
    }
    for name, mask in spellings.items():
        assert mask.shape == (1, 1, T, S), name
        assert torch.equal(mask[0, 0], want), name


@pytest.mark.filterwarnings("ignore:Lower right causal bias will produce NaNs")
@pytest.mark.parametrize(("T", "S"), SHAPES)
def test_top_left_and_offset_spell_the_same_masks(T: int, S: int) -> None:
    top_left = ~causal_upper_left(T, S)._materialize()  # [T, S]
    assert torch.equal(causal_mask(T, S, align="top_left")[0, 0], top_left)
    assert torch.equal(causal_mask(T, S, offset=0)[0, 0], top_left)
    assert torch.equal(Causal(align="top_left").materialize(1, 1, T, S)[0, 0], top_left)
    assert torch.equal(causal_mask(T, S, offset=S - T)[0, 0], _lower_right(T, S))
    window = sliding_window_mask(T, S, window=2, align="top_left")[0, 0]
    i, j = torch.arange(T)[:, None], torch.arange(S)[None, :]
    assert torch.equal(window, ~((j <= i) & (j > i - 2)))


@pytest.mark.parametrize(("T", "S"), SHAPES)
@pytest.mark.parametrize("backend", ["reference", "fused", "blockwise"])
def test_attention_is_causal_is_the_default_causal_mask(T: int, S: int, backend: str) -> None:
    g = torch.Generator().manual_seed(T * 10 + S)
    q = torch.randn(2, 3, T, 8, generator=g)
    k = torch.randn(2, 3, S, 8, generator=g)
    v = torch.randn(2, 3, S, 4, generator=g)
    want, _ = attention_f64(q, k, v, causal_mask(T, S))
    for kwargs in ({"is_causal": True}, {"mask": causal_mask(T, S)}, {"mask": Causal()}):
        out, _ = qkv.attention(q, k, v, backend=backend, **kwargs)  # type: ignore[arg-type]
        torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1.3e-6)


def test_offset_with_an_explicit_align_is_refused_everywhere() -> None:
    for align in ("bottom_right", "top_left"):
        spellings = (
            lambda a=align: causal_mask(3, 5, offset=1, align=a),  # type: ignore[misc]
            lambda a=align: sliding_window_mask(3, 5, window=2, offset=1, align=a),  # type: ignore[misc]
            lambda a=align: Causal(offset=1, align=a),  # type: ignore[misc]
            lambda a=align: SlidingWindow(2, offset=1, align=a),  # type: ignore[misc]
        )
        for spell in spellings:
            with pytest.raises(ValueError, match="either offset or align, not both"):
                spell()
    for bad in (1.5, True, "2"):
        with pytest.raises(TypeError, match="offset must be an int"):
            Causal(offset=bad)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="offset must be an int"):
            causal_mask(3, offset=bad)  # type: ignore[arg-type]


def test_every_builder_is_its_rules_materialize() -> None:
    T, S = 4, 6
    for kw in ({}, {"align": "top_left"}, {"align": "bottom_right"}, {"offset": 3}):
        assert torch.equal(causal_mask(T, S, **kw), Causal(**kw).materialize(1, 1, T, S))  # type: ignore[arg-type]
        for w in (1, 2, 5):
            assert torch.equal(
                sliding_window_mask(T, S, window=w, **kw),  # type: ignore[arg-type]
                SlidingWindow(w, **kw).materialize(1, 1, T, S),  # type: ignore[arg-type]
            )
    lengths = torch.tensor([6, 0, 3])
    is_pad = torch.tensor([[True, False, False, False, False, True]])
    assert torch.equal(padding_mask(lengths, S), Padding(lengths).materialize(3, 1, 1, S))
    assert torch.equal(padding_mask(is_pad), Padding(is_pad).materialize(1, 1, 1, S))
    assert padding_mask(lengths, S).shape == (3, 1, 1, S)
    assert causal_mask(T, S).shape == (1, 1, T, S)
