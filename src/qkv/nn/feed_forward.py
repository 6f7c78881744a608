"""Position-wise feed-forward network: expand to ``dim_feedforward``, activate, project back.

Shapes: B batch, T length, D model width, F ``dim_feedforward``.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.dropout import Dropout

Activation = Literal["relu", "gelu", "gelu_tanh", "silu", "swiglu", "geglu_tanh"]
ACTIVATIONS: tuple[str, ...] = ("relu", "gelu", "gelu_tanh", "silu", "swiglu", "geglu_tanh")
GATED: tuple[str, ...] = ("swiglu", "geglu_tanh")
"""The activations with a gate projection (``gate``), multiplied into ``fc1``'s output."""

__all__ = ["ACTIVATIONS", "GATED", "Activation", "FeedForward"]


class FeedForward(nn.Module):
    """``fc2(dropout(act(fc1(x))))``; SwiGLU uses ``fc2(dropout(silu(gate(x)) * fc1(x)))``, and
    ``"geglu_tanh"`` the same with the tanh-approximate GELU in place of SiLU.

    Args:
        d_model: D.
        dim_feedforward: F, the inner width.
        activation: ``"relu"`` (the original Transformer), ``"gelu"`` (exact erf form, as in
            BERT and ``nn.Transformer(activation="gelu")``), ``"gelu_tanh"`` (the tanh
            approximation, GPT-2's ``gelu_new``), ``"silu"`` (``x * sigmoid(x)``, Marian's
            ``swish``), ``"swiglu"`` (LLaMA) or ``"geglu_tanh"`` (T5 v1.1's ``gated-gelu``,
            whose GELU is ``gelu_new``).
        dropout: dropout on the inner activation (``nn.TransformerEncoderLayer`` puts one here).
        bias: biases on the linear layers.
        device: parameter device.
        dtype: parameter dtype.

    Raises:
        ValueError: unknown activation or non-positive widths.
    """

    def __init__(
        self,
        d_model: int,
        dim_feedforward: int,
        activation: Activation = "relu",
        dropout: float = 0.0,
        *,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        if d_model < 1 or dim_feedforward < 1:
            raise ValueError(
                f"d_model and dim_feedforward must be positive, got {d_model}, {dim_feedforward}"
            )
        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        self.activation = activation
        self.fc1 = nn.Linear(d_model, dim_feedforward, bias=bias, **factory)
        self.gate = (
            nn.Linear(d_model, dim_feedforward, bias=bias, **factory)
            if activation in GATED
            else None
        )
        self.fc2 = nn.Linear(dim_feedforward, d_model, bias=bias, **factory)
        self.dropout = Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        """Args: x ``[B, T, D]``. Returns: ``[B, T, D]``."""
        h = self.fc1(x)  # [B, T, F]
        if self.gate is not None and self.activation == "geglu_tanh":
            h = F.gelu(self.gate(x), approximate="tanh") * h  # [B, T, F]
        elif self.gate is not None:
            h = F.silu(self.gate(x)) * h  # [B, T, F]
        elif self.activation == "gelu":
            h = F.gelu(h)  # [B, T, F]
        elif self.activation == "gelu_tanh":
            h = F.gelu(h, approximate="tanh")  # [B, T, F]
        elif self.activation == "silu":
            h = F.silu(h)  # [B, T, F]
        else:
            h = F.relu(h)  # [B, T, F]
        return self.fc2(self.dropout(h))  # [B, T, D]
