"""`qkv shapes --model`: the traced shapes are those of a real forward pass."""

import pytest
import torch

from qkv.apps.cli import main
from qkv.apps.shapes import trace_model_shapes


def test_trace_model_shapes_records_layers_and_masks() -> None:
    rows = {name: (dict(inputs), out) for name, inputs, out in trace_model_shapes(2, 5, 3, 4, 8)}
    assert rows["ids"][1] == (2, 3, 20)
    assert rows["src_embed"][1] == (2, 5, 32)
    enc_in, enc_out = rows["encoder.layers.1"]
    assert enc_in == {"src": (2, 5, 32), "src_mask": (2, 1, 1, 5)} and enc_out == (2, 5, 32)
    cross_in, _ = rows["decoder.layers.0.cross_attn"]
    assert cross_in["key"] == (2, 5, 32) and cross_in["attn_mask"] == (2, 1, 1, 5)
    assert rows["decoder.layers.0.self_attn"][0]["causal"] == (1, 1, 3, 3)
    assert rows["lm_head"][1] == (2, 3, 20)
    with pytest.raises(ValueError, match="positive"):
        trace_model_shapes(0)


def test_cli(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["shapes", "--model", "--layers", "1", "--T", "4"]) == 0
    out = capsys.readouterr().out
    assert "decoder.layers.0.cross_attn" in out and "[2, 4, 32]" in out


def test_trace_leaves_the_global_rng_alone() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    trace_model_shapes()
    torch.testing.assert_close(torch.rand(3), expected, atol=0, rtol=0)
