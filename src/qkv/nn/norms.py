"""The normalization layers a model can choose: LayerNorm or RMSNorm over the last dim."""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

__all__ = ["NORMS", "NormKind", "make_norm"]

NormKind = Literal["layer", "rms"]
NORMS: tuple[NormKind, ...] = ("layer", "rms")


def make_norm(
    kind: NormKind,
    d_model: int,
    eps: float,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> nn.Module:
    """``nn.LayerNorm`` (``"layer"``) or ``nn.RMSNorm`` (``"rms"``) over the last dim.

    Args:
        kind: which norm.
        d_model: D, the normalized width.
        eps: added to the variance (LayerNorm) or mean square (RMSNorm).
        device: parameter device.
        dtype: parameter dtype.

    Returns:
        The norm module, with a learned ``[D]`` scale (and a ``[D]`` shift for LayerNorm).

    Raises:
        ValueError: unknown kind.
    """
    if kind == "layer":
        return nn.LayerNorm(d_model, eps=eps, device=device, dtype=dtype)
    if kind == "rms":
        return nn.RMSNorm(d_model, eps=eps, device=device, dtype=dtype)
    raise ValueError(f"norm must be one of {NORMS}, got {kind!r}")
