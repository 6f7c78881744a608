"""Compare live outputs that must be equal: the worst difference and where it is.

The error of a comparison is the largest absolute difference over a sample's live outputs, in
float64; a non-finite value on either side makes it NaN, which fails any bound.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["Worst", "compare", "worst_of"]


@dataclass(frozen=True)
class Worst:
    """The worst difference of a comparison and where it is.

    Attributes:
        error: the largest absolute difference (NaN: a non-finite output).
        where: text, token and the two sides compared, for a person.
    """

    error: float
    where: str


def _nonfinite(x: Tensor) -> int | None:
    bad = ~torch.isfinite(x.reshape(x.shape[0], -1)).all(dim=-1)  # [L]
    return int(bad.nonzero()[0, 0]) if bool(bad.any()) else None


def compare(
    i: int, a: Tensor, b: Tensor, a_name: str, b_name: str, upto: int | None = None
) -> Worst:
    """The worst difference between text ``i``'s live outputs ``a`` and ``b`` ``[L, ...]``.

    Args:
        i: the text, for the message.
        a: live outputs of one run ``[L, ...]``.
        b: live outputs of the run that must agree ``[L, ...]``.
        a_name: what ``a`` is ("left-padded batch").
        b_name: what ``b`` is.
        upto: compare tokens ``0..upto`` only (None: all).

    Returns:
        The :class:`Worst` difference.

    Raises:
        ValueError: ``a`` and ``b`` of different shapes.
    """
    if upto is not None:
        a, b = a[: upto + 1], b[: upto + 1]
    if a.shape != b.shape:
        raise ValueError(
            f"text {i}: the {a_name} gives outputs {list(a.shape)}, the {b_name} {list(b.shape)}"
        )
    pair = f"{a_name} vs {b_name}"
    if a.shape[0] == 0:
        return Worst(0.0, f"text {i}: no token to compare ({pair})")
    for x, name in ((a, a_name), (b, b_name)):
        j = _nonfinite(x)
        if j is not None:
            return Worst(math.nan, f"text {i}, token {j}: non-finite output of the {name} ({pair})")
    diff = (a.double() - b.double()).abs().reshape(a.shape[0], -1).amax(dim=-1)  # [L]
    j = int(diff.argmax())
    if float(diff[j]) == 0:
        return Worst(0.0, f"bit-identical: {pair}")
    return Worst(float(diff[j]), f"text {i}, token {j}: {pair}")


def worst_of(worsts: Sequence[Worst]) -> Worst:
    """The largest error of ``worsts`` (NaN first)."""
    return max(worsts, key=lambda w: math.inf if math.isnan(w.error) else w.error)
