"""Modules built on the meta device for their shapes: no values filled, no compiler imported,
and the position tables the same wherever a model is built."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from qkv.models import DecoderOnlyConfig, DecoderOnlyLM, Transformer, TransformerConfig
from qkv.nn.meta import on_meta
from qkv.nn.positional import RotaryEmbedding, SinusoidalPositionalEncoding


def test_models_built_on_meta_import_no_compiler() -> None:
    """``normal_`` and the float64 ``arange`` of the position tables run through Python
    reference ops on the meta device, and those import dynamo (~1.5 s) on first use."""
    code = (
        "import sys, torch\n"
        "from qkv.nn.meta import on_meta\n"
        "from qkv.models import DecoderOnlyConfig, DecoderOnlyLM, Transformer, TransformerConfig\n"
        "with on_meta():\n"
        "    models = [DecoderOnlyLM(DecoderOnlyConfig(97, d_model=32, num_heads=4, num_layers=1,"
        " dim_feedforward=64, positional=p)) for p in ('rotary', 'sinusoidal', 'learned')]\n"
        "    models.append(Transformer(TransformerConfig(20, 20, d_model=32, num_heads=4,"
        " num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=64)))\n"
        "    models.append(torch.nn.Embedding(10, 4))\n"
        "print({t.device.type for m in models for t in [*m.parameters(), *m.buffers()]})\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert proc.stdout.split() == ["{'meta'}", "False"]


def test_only_normal_on_meta_is_skipped() -> None:
    torch.manual_seed(0)
    with on_meta():
        meta = torch.empty(3, 4).normal_()  # nothing to fill
        cpu = torch.empty(3, 4, device="cpu")
        torch.nn.init.normal_(cpu)
        meta2 = torch.nn.init.normal_(tensor=torch.empty(2))
    assert meta.is_meta and meta.shape == (3, 4) and meta2.is_meta
    torch.manual_seed(0)
    assert torch.equal(cpu, torch.empty(3, 4).normal_())  # a CPU tensor is filled as always
    assert torch._C._len_torch_function_stack() == 0  # both modes gone after the block


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_position_tables_are_the_same_wherever_they_are_built(device: str) -> None:
    want_sin = SinusoidalPositionalEncoding(16, 40).table  # [L, D]
    want_rot = RotaryEmbedding(8, 40)
    with torch.device(device):
        sin = SinusoidalPositionalEncoding(16, 40).table  # [L, D]
        rot = RotaryEmbedding(8, 40)
    assert sin.device.type == rot.cos.device.type == rot.sin.device.type == device
    if device == "cpu":
        assert torch.equal(sin, want_sin)
        assert torch.equal(rot.cos, want_rot.cos) and torch.equal(rot.sin, want_rot.sin)
    # float64 on the CPU, then float32: the reference formula's values
    pos = torch.arange(40, dtype=torch.float64)[:, None]  # [L, 1]
    inv = 10000.0 ** (-torch.arange(0, 16, 2, dtype=torch.float64) / 16)  # [D/2]
    torch.testing.assert_close(want_sin[:, 0::2], torch.sin(pos * inv).float(), rtol=0, atol=0)


def test_a_checkpoints_skeleton_is_built_on_meta_with_shapes_only() -> None:
    cfg = TransformerConfig(20, 20, d_model=32, num_heads=4, num_encoder_layers=1,
                            num_decoder_layers=1, dim_feedforward=64)  # fmt: skip
    with on_meta():
        skeleton = Transformer(cfg)
    real = Transformer(cfg)
    assert {k: v.shape for k, v in skeleton.state_dict().items()} == {
        k: v.shape for k, v in real.state_dict().items()
    }
    lm_cfg = DecoderOnlyConfig(97, d_model=32, num_heads=4, num_layers=1, dim_feedforward=64)
    with on_meta():
        lm = DecoderOnlyLM(lm_cfg)
    assert all(p.is_meta for p in lm.parameters())
