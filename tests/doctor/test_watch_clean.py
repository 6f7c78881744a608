"""No false alarms: clean models give no error and no warning, and run bit-identically.

Tiny real ``transformers`` models (Llama, GPT-2, BERT, BART, T5) under ``sdpa`` and ``eager``,
left and right padding, float32 and bfloat16, a prefill and one cached step; ``nn.Transformer``
(inference fast path and training path); qkv's own models.
"""

from __future__ import annotations

import warnings

import hf_models as hm
import pytest
import torch
import transformers

import qkv
from qkv import doctor
from qkv.integrations.transformers import register

warnings.filterwarnings("ignore", message=".*past_key_values.*")


def _assert_clean(report: doctor.Report) -> None:
    assert report.ok, str(report)
    assert report.unread == [], report.unread
    assert all(f.severity == "hint" for f in report.findings)


@pytest.mark.parametrize("name", hm.NAMES)
@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_hf_models_are_clean(name: str, implementation: str, dtype: torch.dtype) -> None:
    model = hm.build(name, implementation, dtype)
    for side in ("left", "right"):
        unwatched = hm.run(model, name, side)
        with doctor.watch(model) as report:
            watched = hm.run(model, name, side)
        assert torch.equal(unwatched, watched)
        # every layer's attention was seen, prefill and cached step
        layers = {"llama": 2, "gpt2": 2, "bert": 2, "bart": 2 * 3, "t5": 2 * 3}[name]
        steps = 1 if name == "bert" else 2
        assert report.calls == layers * steps
        _assert_clean(report)


def test_hf_padding_is_read_and_used() -> None:
    """The clean verdict is earned: the same Llama with its mask dropped is caught."""
    model = hm.build("llama", "sdpa")
    inputs = hm.batch("left")
    with torch.no_grad(), doctor.watch(model) as report:
        model(input_ids=inputs["input_ids"])  # no attention_mask: nothing to compare with
    assert report.ok and report.calls == 2
    with torch.no_grad(), doctor.watch(model) as report:
        model(**inputs)
    assert report.ok


@pytest.mark.parametrize("grad", [False, True], ids=["fast_path", "python_path"])
def test_nn_transformer_is_clean_and_bit_identical(grad: bool) -> None:
    m = torch.nn.Transformer(16, 2, 2, 2, 32, batch_first=True, dropout=0.0).eval()
    src, tgt = torch.randn(2, 7, 16), torch.randn(2, 5, 16)
    kpm = torch.zeros(2, 7, dtype=torch.bool)
    kpm[1, 4:] = True
    causal = m.generate_square_subsequent_mask(5)
    kwargs = dict(src_key_padding_mask=kpm, memory_key_padding_mask=kpm, tgt_mask=causal)
    with torch.set_grad_enabled(grad):
        unwatched = m(src, tgt, **kwargs)
        with doctor.watch(m) as report:
            watched = m(src, tgt, **kwargs)
    assert torch.equal(unwatched, watched)  # the fast path still runs inside the watch
    assert report.calls == 6
    _assert_clean(report)


def test_qkv_models_are_clean() -> None:
    lm = qkv.DecoderOnlyLM(
        qkv.DecoderOnlyConfig(
            vocab_size=50,
            d_model=16,
            num_heads=2,
            num_layers=2,
            dim_feedforward=32,
            max_positions=32,
        )
    ).eval()
    ids = torch.randint(0, 50, (2, 6))
    padding = torch.zeros(2, 6, dtype=torch.bool)
    padding[1, 4:] = True
    with torch.no_grad():
        unwatched = lm(ids, padding_mask=padding)
        with doctor.watch(lm) as report:
            watched = lm(ids, padding_mask=padding)
    assert torch.equal(unwatched, watched)
    assert report.calls == 2
    _assert_clean(report)


def test_a_sliding_window_is_not_mistaken_for_a_broadcast_mask() -> None:
    """Mistral's window blocks a prefix of keys, as left padding does: no leak, no finding."""
    config = transformers.MistralConfig(
        vocab_size=hm.VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=4,
        pad_token_id=hm.PAD,
    )
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(config).eval()
    inputs = hm.batch("left")
    unwatched = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    with doctor.watch(model) as report:
        watched = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    assert torch.equal(unwatched, watched) and report.calls == 6
    _assert_clean(report)


@pytest.mark.parametrize("name", hm.NAMES)
def test_hf_models_under_qkvs_own_implementation_are_clean(name: str) -> None:
    """attn_implementation="qkv": the call is judged as qkv.attention computed it."""
    register()
    model = hm.build(name, "qkv")
    unwatched = hm.run(model, name, "left")
    with doctor.watch(model) as report:
        watched = hm.run(model, name, "left")
    assert torch.equal(unwatched, watched) and report.calls > 0
    _assert_clean(report)
