"""qkv's dropout: the distribution, scaling, gradients and fall-backs of ``F.dropout``."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qkv.nn
from qkv.dropout import Dropout, dropout


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keeps_each_element_with_probability_1_minus_p(p: float) -> None:
    torch.manual_seed(0)
    n = 200_000
    out = dropout(torch.ones(n), p)  # [n]
    kept = (out != 0).double().mean().item()
    sigma = math.sqrt(p * (1 - p) / n)  # binomial standard deviation of the kept fraction
    assert abs(kept - (1 - p)) < 5 * sigma
    # and F.dropout's scale on what is kept
    assert torch.equal(out.unique().sort().values, torch.tensor([0.0, 1.0 / (1.0 - p)]))


def test_kept_values_are_scaled_inputs_and_gradients_match_the_mask() -> None:
    torch.manual_seed(1)
    x = torch.randn(4, 8, 16, dtype=torch.float64, requires_grad=True)
    out = dropout(x, 0.25)  # [4, 8, 16]
    keep = out != 0
    torch.testing.assert_close(out[keep], x[keep] * (1 / 0.75), rtol=0, atol=0)
    g = torch.randn_like(out)
    out.backward(g)
    assert x.grad is not None
    torch.testing.assert_close(x.grad, g * keep * (1 / 0.75), rtol=0, atol=0)


def test_same_seed_same_mask_and_low_precision_kept() -> None:
    x = torch.randn(64, 64, dtype=torch.bfloat16)
    torch.manual_seed(3)
    a = dropout(x, 0.3)
    torch.manual_seed(3)
    b = dropout(x, 0.3)
    assert a.dtype == torch.bfloat16 and torch.equal(a, b)
    assert 0.55 < (a != 0).float().mean().item() < 0.85


def test_identity_and_edge_probabilities() -> None:
    x = torch.randn(5, 7)
    assert dropout(x, 0.5, training=False) is x
    assert dropout(x, 0.0) is x
    assert torch.equal(dropout(x, 1.0), torch.zeros_like(x))


@pytest.mark.parametrize("p", [-0.1, 1.5, float("nan")])
def test_probability_outside_unit_interval_raises(p: float) -> None:
    with pytest.raises(ValueError, match=r"p must lie in \[0, 1\]"):
        dropout(torch.ones(3), p)


def test_module_is_an_nn_dropout_and_follows_train_eval() -> None:
    m = Dropout(0.5)
    assert isinstance(m, nn.Dropout) and qkv.nn.Dropout is Dropout
    x = torch.randn(32, 32)
    m.eval()
    assert torch.equal(m(x), x)
    m.train()
    torch.manual_seed(4)
    y = m(x)
    torch.manual_seed(4)
    assert torch.equal(y, dropout(x, 0.5))
    m.p = 0.0  # BERT's loader sets p after construction
    assert torch.equal(m(x), x)


def test_inplace_defers_to_nn_dropout() -> None:
    x = torch.randn(16, 16)
    torch.manual_seed(5)
    want = F.dropout(x.clone(), 0.5, training=True, inplace=True)
    torch.manual_seed(5)
    got = x.clone()
    Dropout(0.5, inplace=True)(got)
    assert torch.equal(got, want)


def test_models_use_it() -> None:
    layer = qkv.nn.EncoderLayer(16, 2, 32, dropout=0.1)
    kinds = {type(m) for m in layer.modules() if isinstance(m, nn.Dropout)}
    assert kinds == {Dropout}
