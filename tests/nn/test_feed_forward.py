"""FeedForward against a float64 recomputation of each activation's formula."""

import math

import pytest
import torch

from qkv.nn import FeedForward


def _gelu(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2.0)))


def _silu(x: torch.Tensor) -> torch.Tensor:
    return x / (1 + torch.exp(-x))


@pytest.mark.parametrize("activation", ["relu", "gelu", "swiglu"])
def test_matches_formula(activation: str) -> None:
    ffn = FeedForward(8, 20, activation, dropout=0.5).eval()  # type: ignore[arg-type]
    x = torch.randn(2, 5, 8)
    got = ffn(x)
    with torch.no_grad():
        x64 = x.double()
        h = x64 @ ffn.fc1.weight.double().T + ffn.fc1.bias.double()
        if activation == "relu":
            h = h.clamp(min=0)
        elif activation == "gelu":
            h = _gelu(h)
        else:
            assert ffn.gate is not None
            h = _silu(x64 @ ffn.gate.weight.double().T + ffn.gate.bias.double()) * h
        ref = h @ ffn.fc2.weight.double().T + ffn.fc2.bias.double()
    torch.testing.assert_close(got, ref.float(), atol=1e-5, rtol=1.3e-6)
    assert got.shape == x.shape
    assert (ffn.gate is not None) == (activation == "swiglu")


def test_dropout_only_in_training() -> None:
    ffn = FeedForward(8, 32, dropout=0.5)
    x = torch.randn(4, 8)
    ffn.train()
    assert not torch.equal(ffn(x), ffn(x))
    ffn.eval()
    assert torch.equal(ffn(x), ffn(x))


def test_errors() -> None:
    with pytest.raises(ValueError, match="activation"):
        FeedForward(4, 8, "tanh")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="positive"):
        FeedForward(4, 0)
