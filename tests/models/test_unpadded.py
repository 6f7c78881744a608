"""The unpadded kernel against the ordinary layers: float64, the real tokens, every padding."""

from __future__ import annotations

import pytest
import torch

from qkv.models.unpadded import encode_unpadded, runs_unpadded
from qkv.nn.layers import EncoderLayer
from qkv.nn.stacks import Encoder

PADDINGS = [
    [[0, 0, 0, 0, 0], [0, 0, 0, 0, 0]],  # none
    [[0, 0, 0, 1, 1], [0, 1, 1, 1, 1]],  # suffixes of two lengths
    [[1, 1, 0, 0, 0], [0, 0, 1, 0, 0]],  # left padding, a hole
    [[1, 1, 1, 1, 1], [0, 0, 0, 1, 1]],  # a sample without any token
]


def _layers(norm_first: bool, num_kv_heads: int | None = None) -> list[EncoderLayer]:
    torch.manual_seed(0)
    kw = {"norm_first": norm_first, "num_kv_heads": num_kv_heads, "dtype": torch.float64}
    return [EncoderLayer(16, 4, 24, dropout=0.0, activation="gelu", **kw) for _ in range(2)]


def _expected(layers: list[EncoderLayer], x: torch.Tensor, is_pad: torch.Tensor) -> torch.Tensor:
    return Encoder(layers)(x, is_pad[:, None, None, :])  # [B, T, D]


@pytest.mark.parametrize("padding", PADDINGS)
@pytest.mark.parametrize(("norm_first", "kv_heads"), [(False, None), (True, 2)])
def test_real_tokens_are_the_encoders_in_float64(
    padding: list, norm_first: bool, kv_heads: int | None
) -> None:
    layers = _layers(norm_first, kv_heads)
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    is_pad = torch.tensor(padding, dtype=torch.bool)
    got = encode_unpadded(layers, x, is_pad)  # [B, T, D]
    real = ~is_pad
    torch.testing.assert_close(got[real], _expected(layers, x, is_pad)[real])  # float64 default
    assert not bool(got[is_pad].any()), "padding positions are zeros"


@pytest.mark.parametrize("backend", ["reference", "fused", "blockwise"])
def test_every_backend_gives_the_reference(backend: str) -> None:
    layers = _layers(norm_first=False)
    for layer in layers:
        layer.self_attn.backend = backend  # type: ignore[assignment]
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    is_pad = torch.tensor(PADDINGS[1], dtype=torch.bool)
    got = encode_unpadded(layers, x, is_pad)
    for layer in layers:
        layer.self_attn.backend = "reference"
    torch.testing.assert_close(got[~is_pad], _expected(layers, x, is_pad)[~is_pad])


def test_weight_changes_are_seen() -> None:
    """Nothing is cached: an in-place update and load_state_dict both show in the next call."""
    layers = _layers(norm_first=False)
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    is_pad = torch.tensor(PADDINGS[1], dtype=torch.bool)
    before = encode_unpadded(layers, x, is_pad)
    with torch.no_grad():
        layers[0].self_attn.k_proj.weight.mul_(2.0)  # in place: same tensor, same data_ptr
    after = encode_unpadded(layers, x, is_pad)
    assert not torch.allclose(before[~is_pad], after[~is_pad])
    torch.testing.assert_close(after[~is_pad], _expected(layers, x, is_pad)[~is_pad])
    other = _layers(norm_first=False)
    with torch.no_grad():
        other[1].ffn.fc1.weight.add_(0.5)
    for mine, theirs in zip(layers, other, strict=True):
        mine.load_state_dict(theirs.state_dict())
    expected = encode_unpadded(other, x, is_pad)
    torch.testing.assert_close(encode_unpadded(layers, x, is_pad), expected)


def test_layers_whose_calls_are_observed_are_not_run_unpadded() -> None:
    layer = _layers(norm_first=False)[0]
    assert runs_unpadded(layer)
    layer.self_attn.record_weights = True
    assert not runs_unpadded(layer)
    layer.self_attn.record_weights = False
    handle = layer.register_forward_hook(lambda *_: None)
    assert not runs_unpadded(layer)
    handle.remove()
    layer.self_attn.register_forward_pre_hook(lambda *_: None)
    assert not runs_unpadded(layer)
