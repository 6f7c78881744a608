"""Left-padded batches in DecoderOnlyLM.generate against transformers' generate: tiny random
Llama and GPT-2 saved with save_pretrained, the issue's prompts of different lengths."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

from pathlib import Path

import pytest
import torch
import transformers as tr

from qkv.convert import load_hf
from qkv.models import DecoderOnlyConfig, DecoderOnlyLM

V, NEW = 128, 12
PROMPTS = [[1, 15, 30, 44, 51], [0, 0, 1, 7, 9]]  # the reproduction (pad id 0)
PAD = [[False] * 5, [True, True, False, False, False]]


def _llama() -> tr.PreTrainedModel:
    torch.manual_seed(0)
    cfg = tr.LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        initializer_range=0.2, bos_token_id=1, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    return tr.LlamaForCausalLM(cfg).eval()


def _gpt2() -> tr.PreTrainedModel:
    torch.manual_seed(1)
    cfg = tr.GPT2Config(
        vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64, initializer_range=0.2,
        bos_token_id=1, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    model = tr.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.normal_(0, 0.2)
    return model


MODELS = {"llama": _llama, "gpt2": _gpt2}
STOP = {"llama": 123, "gpt2": 102}  # a token one row's beam search produces, as eos


def _pair(kind: str, root: Path) -> tuple[tr.PreTrainedModel, DecoderOnlyLM]:
    ref = MODELS[kind]()
    ref.save_pretrained(root)
    model = load_hf(root)
    assert isinstance(model, DecoderOnlyLM)
    return ref, model


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_left_padded_greedy_equals_transformers(kind: str, tmp_path: Path) -> None:
    ref, model = _pair(kind, tmp_path)
    assert model.config.pad_id == 0  # load_hf keeps the checkpoint's pad id
    ids, pad = torch.tensor(PROMPTS), torch.tensor(PAD)
    with torch.no_grad():
        expected = ref.generate(
            ids, attention_mask=(~pad).long(), max_new_tokens=NEW, do_sample=False
        )
    got = model.generate(ids, NEW, padding_mask=pad, greedy=True)
    assert got.tolist() == expected.tolist()
    alone = model.generate(torch.tensor([PROMPTS[1][2:]]), NEW, greedy=True)
    assert alone[0].tolist() == got[1, 2:].tolist()  # a padded row decodes as if alone


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_left_padded_beam_search_equals_transformers(kind: str, tmp_path: Path) -> None:
    ref, model = _pair(kind, tmp_path)
    ids, pad = torch.tensor(PROMPTS), torch.tensor(PAD)
    for eos in (None, STOP[kind]):
        with torch.no_grad():
            want = ref.generate(
                ids, attention_mask=(~pad).long(), max_new_tokens=NEW, do_sample=False,
                num_beams=3, eos_token_id=eos,
            ).tolist()  # fmt: skip
        got = model.generate(ids, NEW, padding_mask=pad, beam_size=3, eos_id=eos).tolist()
        for g, w in zip(got, want, strict=True):
            end = g.index(eos, 5) + 1 if eos in g[5:] else len(g)
            assert g[:end] == w[:end], (eos, got, want)
            # after the stop qkv pads with pad_id; transformers fills with
            # `pad_token_id or eos_token_id`: eos when the pad id is 0
            assert set(g[end:]) <= {0} and set(w[end:]) <= {eos}, (eos, got, want)
        if eos is not None:  # one row stops, the other runs to the end
            assert sorted(eos in row[5:] for row in got) == [False, True], got
    with pytest.raises(ValueError, match="beam_size=3 takes padding_mask, eos_id and"):
        model.generate(ids, 2, padding_mask=pad, beam_size=3, top_k=5)


@pytest.mark.parametrize("positional", ["rotary", "learned", "sinusoidal", "alibi"])
def test_padded_forward_logits_equal_the_unpadded_row(positional: str) -> None:
    torch.manual_seed(0)
    cfg = DecoderOnlyConfig(
        40, num_layers=2, d_model=32, num_heads=4, dim_feedforward=48, dropout=0.0,
        positional=positional, max_positions=32, pad_id=0,
    )  # fmt: skip
    model = DecoderOnlyLM(cfg).eval()
    row = torch.tensor([[5, 9, 3, 7]])
    padded = torch.tensor([[0, 0, 0, 5, 9, 3, 7]])
    with torch.no_grad():
        ref = model(row)  # [1, 4, V]
        got = model(padded)[:, 3:]  # [1, 4, V]
        cache = model.new_cache()
        model(padded[:, :5], kv_cache=cache)
        steps = [model(padded[:, t : t + 1], kv_cache=cache) for t in (5, 6)]  # 2 x [1, 1, V]
        step = torch.cat(steps, dim=1)  # [1, 2, V]
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1.3e-6)
    torch.testing.assert_close(step, ref[:, 2:], atol=1e-5, rtol=1.3e-6)


def test_padding_that_cannot_be_decoded_is_refused(tmp_path: Path) -> None:
    _, model = _pair("llama", tmp_path)
    ids = torch.tensor(PROMPTS)
    with pytest.raises(ValueError, match=r"pad_id=0 \(first at row 1, column 0\).*padding_mask="):
        model.generate(ids, 2, greedy=True)
    right = torch.tensor([[False] * 5, [False, False, False, True, True]])
    with pytest.raises(ValueError, match=r"row 1, column 3.*must be left-padded"):
        model.generate(ids, 2, padding_mask=right, greedy=True)
    every = torch.tensor([[False] * 5, [True] * 5])
    with pytest.raises(ValueError, match="every token of row 1"):
        model.generate(ids, 2, padding_mask=every, greedy=True)
    with pytest.raises(TypeError, match="padding_mask must be a bool tensor"):
        model.generate(ids, 2, padding_mask=torch.tensor(PAD).long(), greedy=True)
    # token 0 as a real token: an all-False mask says so
    real = model.generate(ids, 2, padding_mask=torch.zeros(2, 5, dtype=torch.bool), greedy=True)
    assert real.shape == (2, 7)
