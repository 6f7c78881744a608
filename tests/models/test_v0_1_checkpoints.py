"""Checkpoints written by qkv 0.1 load and decode exactly as they did under 0.1.

``tests/fixtures/qkv_0_1`` holds a reverse-task Transformer and a ``--text`` DecoderOnlyLM written
by ``qkv train`` at 0.1, and what ``make_expected.py`` computed from them with the 0.1 code.
This test runs the functions of that same script with today's code: the same arithmetic on the
same weights, so the decodes must be equal and the logits equal up to float32 rounding. The
DecoderOnlyLM's 0.1 state-dict keys (``layers.N.*``, ``norm.*``) are mapped on load.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest
import torch
from safetensors.torch import load_file

from qkv.models import DecoderOnlyLM, Transformer
from qkv.models.decoder_only import upgrade_state_dict
from qkv.train import generate_text, load_trained
from qkv.train.checkpoint import load_checkpoint

FIXTURES = Path(__file__).parents[1] / "fixtures" / "qkv_0_1"


def _make_expected() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_expected", FIXTURES / "make_expected.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ME = _make_expected()
EXPECTED = json.loads((FIXTURES / "expected.json").read_text())
LOGITS = load_file(str(FIXTURES / "expected.safetensors"))


def test_the_text_checkpoint_has_0_1_keys() -> None:
    keys = set(load_checkpoint(FIXTURES / "text").weights)
    assert any(k.startswith("layers.0.") for k in keys) and "norm.weight" in keys
    assert not any(k.startswith("blocks.") for k in keys)


def test_reverse_transformer_decodes_as_in_0_1() -> None:
    model, task, _ = load_trained(FIXTURES / "reverse")
    assert isinstance(model, Transformer) and not model.training
    for s in ME.REVERSE_INPUTS:
        assert generate_text(model, task, s).text == EXPECTED["reverse_greedy"][s]
        assert generate_text(model, task, s, beam_size=3).text == EXPECTED["reverse_beam3"][s]
    torch.testing.assert_close(
        ME.reverse_logits(model, task), LOGITS["reverse"], atol=1e-5, rtol=1.3e-6
    )


def test_text_model_decodes_as_in_0_1() -> None:
    model, task, _ = load_trained(FIXTURES / "text")
    assert isinstance(model, DecoderOnlyLM) and not model.training
    for p in ME.TEXT_PROMPTS:
        got = generate_text(model, task, p, max_new_tokens=8).text
        assert got == EXPECTED["text_greedy"][p]
    torch.testing.assert_close(ME.text_logits(model), LOGITS["text"], atol=1e-5, rtol=1.3e-6)


@pytest.mark.parametrize("via", ["load_state_dict", "upgrade_state_dict"])
def test_0_1_keys_load_without_load_trained(via: str) -> None:
    ckpt = load_checkpoint(FIXTURES / "text")
    reference, _, _ = load_trained(FIXTURES / "text")
    model = DecoderOnlyLM(reference.config).eval()
    weights = ckpt.weights if via == "load_state_dict" else upgrade_state_dict(ckpt.weights)
    if via == "upgrade_state_dict":
        assert set(weights) == set(model.state_dict())
    model.load_state_dict(weights)  # strict: every 0.1 key found its new name
    ids = torch.tensor([[3, 4, 5, 6]])
    torch.testing.assert_close(model(ids), reference(ids), atol=0.0, rtol=0.0)
