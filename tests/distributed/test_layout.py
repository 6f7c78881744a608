"""Layouts: every position on exactly one rank, shard/unshard without a process group."""

from __future__ import annotations

import pytest
import torch

from qkv import distributed as cp


@pytest.mark.parametrize("layout", cp.LAYOUTS)
@pytest.mark.parametrize(("n", "world"), [(37, 2), (37, 3), (5, 3), (2, 4), (64, 4), (0, 2)])
def test_every_position_is_on_exactly_one_rank(layout: cp.Layout, n: int, world: int) -> None:
    held = [
        p for r in range(world) for a, b in cp.segments(n, world, r, layout) for p in range(a, b)
    ]
    assert sorted(held) == list(range(n))
    sizes = [sum(b - a for a, b in cp.segments(n, world, r, layout)) for r in range(world)]
    assert max(sizes) - min(sizes) <= (1 if layout == "contiguous" else 2)


def test_zigzag_pairs_an_early_piece_with_a_late_one() -> None:
    assert cp.segments(16, 2, 0, "zigzag") == [(0, 4), (12, 16)]
    assert cp.segments(16, 2, 1, "zigzag") == [(4, 8), (8, 12)]
    assert cp.segments(10, 2, 0, "contiguous") == [(0, 5)]
    # Uneven: torch.tensor_split's pieces (the first ones one longer).
    assert cp.segments(7, 2, 0, "contiguous") == [(0, 4)]
    assert cp.segments(7, 2, 1, "zigzag") == [(2, 4), (4, 6)]


def test_local_positions_are_the_shard_of_the_positions() -> None:
    for layout in cp.LAYOUTS:
        for r in range(3):
            pos = cp.local_positions(29, 3, r, layout)
            segs = cp.segments(29, 3, r, layout)
            assert pos.tolist() == [p for a, b in segs for p in range(a, b)]


def test_without_a_process_group_shard_and_unshard_are_identity() -> None:
    x = torch.randn(2, 3, 11, 4)
    assert torch.equal(cp.shard(x, 2, layout="zigzag"), x)
    assert torch.equal(cp.unshard(x, -2), x)
    assert cp.group_rank(None) == (0, 1)


def test_bad_arguments_are_clear_errors() -> None:
    x = torch.randn(2, 5)
    with pytest.raises(ValueError, match="layout must be one of"):
        cp.shard(x, 1, layout="striped")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dim=2 is out of range"):
        cp.shard(x, 2)
    with pytest.raises(TypeError, match="dim must be an int"):
        cp.shard(x, 1.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"x must be a torch\.Tensor"):
        cp.shard([1, 2], 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"rank must be in \[0, world=2\)"):
        cp.segments(10, 2, 2)
    with pytest.raises(ValueError, match=r"torch\.distributed is not initialized"):
        cp.group_rank(object())  # type: ignore[arg-type]
