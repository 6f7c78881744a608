"""What judging one attention call reads and returns: the model's :class:`Padding` (which
queries and keys are real tokens), the :class:`Verdict` (one finding), and the bound a leaked
weight is held to.

Shapes: B batch, T queries, S keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from qkv.doctor.findings import Severity

__all__ = ["LEAK_WEIGHT", "Padding", "Verdict", "last_real_query"]

LEAK_WEIGHT = 1e-3
"""A blocked or padding key with a larger weight than this is a finding (the issue's bound)."""


@dataclass(frozen=True)
class Padding:
    """Which queries and keys of one call are real tokens (from the model's attention mask).

    Attributes:
        live_queries: ``[B, T]`` bool, True = a real token.
        live_keys: ``[B, S]`` bool, True = a real token (keys past the model's mask, such as
            empty cache slots, are marked real: nothing is claimed about them).
    """

    live_queries: Tensor
    live_keys: Tensor


@dataclass(frozen=True)
class Verdict:
    """One finding of one call, before it is given a place."""

    kind: str
    severity: Severity
    message: str
    evidence: dict[str, Any]


def last_real_query(pad: Padding) -> Tensor:
    """``[B]`` the index of each sample's last real query (0 for a sample with none)."""
    T = pad.live_queries.shape[1]
    idx = torch.arange(1, T + 1, device=pad.live_queries.device)
    return (pad.live_queries * idx).argmax(-1)  # [B]
