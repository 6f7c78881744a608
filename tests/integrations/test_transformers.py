"""``attn_implementation="qkv"`` against transformers' own ``"sdpa"`` and ``"eager"``.

All offline: the real all-MiniLM-L6-v2 from its package, tiny random Llama / GPT-2 models saved
with ``save_pretrained`` into a temp dir and reloaded.
"""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

from pathlib import Path

import pytest
import torch
import transformers as tr
from torch import Tensor

import qkv
from qkv.apps.embed import default_model_dir
from qkv.integrations.transformers import make_attention_forward, register

register()
F32 = {"atol": 1e-5, "rtol": 1.3e-6}
LLAMA = {
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,  # GQA
    "max_position_embeddings": 64,
    "initializer_range": 0.2,
}
GPT2 = {"vocab_size": 96, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64}


def _saved(tmp: Path, model: tr.PreTrainedModel) -> Path:
    model.save_pretrained(tmp)
    return tmp


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    return _saved(tmp_path_factory.mktemp("llama"), tr.LlamaForCausalLM(tr.LlamaConfig(**LLAMA)))


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    cfg = tr.GPT2Config(**GPT2, initializer_range=0.2, bos_token_id=0, eos_token_id=0)
    return _saved(tmp_path_factory.mktemp("gpt2"), tr.GPT2LMHeadModel(cfg))


def _load(cls: type, d: Path, impl: str) -> tr.PreTrainedModel:
    return cls.from_pretrained(d, attn_implementation=impl).eval()


def _left_padded(B: int = 3, T: int = 7, V: int = 96) -> tuple[Tensor, Tensor]:
    ids = torch.randint(1, V, (B, T))
    am = torch.ones(B, T, dtype=torch.long)
    am[1, :3] = 0
    am[2, :1] = 0
    return ids, am


def test_register_adds_both_attention_and_mask() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    assert "qkv" in AttentionInterface._global_mapping
    assert "qkv" in AttentionMaskInterface._global_mapping


def test_register_refuses_builtin_names_and_bad_backends() -> None:
    with pytest.raises(ValueError, match="sdpa"):
        register("sdpa")
    with pytest.raises(ValueError, match="backend"):
        register("qkv2", backend="nope")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="name"):
        register("")


def test_minilm_padded_batch_matches_sdpa_and_eager() -> None:
    d = default_model_dir()
    tok = tr.AutoTokenizer.from_pretrained(d)
    batch = tok(
        ["hello world", "a longer sentence with several more tokens"],
        padding=True,
        return_tensors="pt",
    )
    real = batch["attention_mask"].bool()
    out = {}
    for impl in ("qkv", "sdpa", "eager"):
        with torch.no_grad():
            out[impl] = _load(tr.BertModel, d, impl)(**batch).last_hidden_state  # [B, T, D]
    for ref in ("sdpa", "eager"):
        torch.testing.assert_close(out["qkv"][real], out[ref][real], **F32)


def test_llama_gqa_left_padding_matches(llama_dir: Path) -> None:
    ids, am = _left_padded()
    out = {}
    for impl in ("qkv", "sdpa", "eager"):
        with torch.no_grad():
            out[impl] = _load(tr.LlamaForCausalLM, llama_dir, impl)(ids, attention_mask=am).logits
    real = am.bool()
    for ref in ("sdpa", "eager"):
        torch.testing.assert_close(out["qkv"][real], out[ref][real], **F32)


def test_set_attn_implementation_switches_an_existing_model(llama_dir: Path) -> None:
    ids, _ = _left_padded()
    model = _load(tr.LlamaForCausalLM, llama_dir, "eager")
    with torch.no_grad():
        ref = model(ids).logits
        model.set_attn_implementation("qkv")
        got = model(ids).logits
    assert model.config._attn_implementation == "qkv"
    torch.testing.assert_close(got, ref, **F32)


def test_gpt2_logits_and_gradients_match(gpt2_dir: Path) -> None:
    ids, am = _left_padded()
    real = am.bool()
    grads, logits = {}, {}
    for impl in ("qkv", "sdpa", "eager"):
        model = _load(tr.GPT2LMHeadModel, gpt2_dir, impl)
        out = model(ids, attention_mask=am).logits  # [B, T, V]
        out[real].square().mean().backward()
        logits[impl] = out.detach()
        grads[impl] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    for ref in ("sdpa", "eager"):
        torch.testing.assert_close(logits["qkv"][real], logits[ref][real], **F32)
        assert grads["qkv"].keys() == grads[ref].keys()
        for name in grads[ref]:
            torch.testing.assert_close(grads["qkv"][name], grads[ref][name], **F32, msg=name)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_generate_gives_identical_greedy_tokens(
    cache: str, kind: str, llama_dir: Path, gpt2_dir: Path
) -> None:
    cls, d = (tr.LlamaForCausalLM, llama_dir) if kind == "llama" else (tr.GPT2LMHeadModel, gpt2_dir)
    ids = torch.randint(1, 96, (1, 6))
    tokens = {}
    for impl in ("qkv", "sdpa"):
        model = _load(cls, d, impl)
        kw: dict = {"max_new_tokens": 9, "do_sample": False}
        if cache == "static":
            kw["cache"] = tr.StaticCache(config=model.config, max_cache_len=15)  # prefill T=6, S=15
        tokens[impl] = model.generate(ids, **kw)
    assert torch.equal(tokens["qkv"], tokens["sdpa"])


def test_static_cache_prefill_is_top_left_causal(llama_dir: Path) -> None:
    """The measured case: T=6 queries, S=15 keys, no mask. Bottom-right would attend to the
    empty slots; the result must equal the same prompt without a cache."""
    ids = torch.randint(1, 96, (1, 6))
    model = _load(tr.LlamaForCausalLM, llama_dir, "qkv")
    with torch.no_grad():
        ref = model(ids, use_cache=False).logits
        cache = tr.StaticCache(config=model.config, max_cache_len=15)
        got = model(ids, cache=cache, use_cache=True).logits
    torch.testing.assert_close(got, ref, **F32)


def test_weights_only_with_output_attentions(llama_dir: Path) -> None:
    ids, am = _left_padded()
    model = _load(tr.LlamaForCausalLM, llama_dir, "qkv")
    eager = _load(tr.LlamaForCausalLM, llama_dir, "eager")
    with torch.no_grad():
        assert model(ids, attention_mask=am).attentions is None
        got = model(ids, attention_mask=am, output_attentions=True).attentions
        ref = eager(ids, attention_mask=am, output_attentions=True).attentions
    real = am.bool()[:, None, :, None]  # real query rows [B, 1, T, 1]
    for g, r in zip(got, ref, strict=True):
        torch.testing.assert_close(g * real, r * real, **F32)


def _call(**kw: object) -> tuple[Tensor, Tensor | None]:
    q = torch.randn(2, 4, 5, 8)
    k = torch.randn(2, 2, 5, 8)
    forward = make_attention_forward()
    return forward(torch.nn.Module(), q, k, k.clone(), None, **kw)


@pytest.mark.parametrize("name", ["softcap", "s_aux"])
def test_unsupported_arguments_raise(name: str) -> None:
    with pytest.raises(ValueError, match=name):
        _call(**{name: 1.0})


def _t5(seed: int) -> tr.T5ForConditionalGeneration:
    torch.manual_seed(seed)
    cfg = tr.T5Config(
        vocab_size=96, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=2,
        num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=16,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    return tr.T5ForConditionalGeneration(cfg).eval()


def test_t5_position_bias_is_a_score_bias(tmp_path: Path) -> None:
    d = _saved(tmp_path, _t5(0))
    ref = _load(tr.T5ForConditionalGeneration, d, "eager")
    ours = _load(tr.T5ForConditionalGeneration, d, "qkv")
    src, am = _left_padded(3, 9)
    src = src.flip(1)  # padding on the right, as a T5 source has it
    am = am.flip(1)
    tgt = torch.randint(1, 96, (3, 6))
    tgt[:, 0] = 0  # the decoder starts from the pad token
    with torch.no_grad():
        want = ref(input_ids=src, attention_mask=am, decoder_input_ids=tgt).logits
        got = ours(input_ids=src, attention_mask=am, decoder_input_ids=tgt).logits
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        kw = {"attention_mask": am, "max_new_tokens": 10, "do_sample": False}
        assert torch.equal(ours.generate(src, **kw), ref.generate(src, **kw))
        beams = {**kw, "num_beams": 3}
        assert torch.equal(ours.generate(src, **beams), ref.generate(src, **beams))


def test_unknown_argument_raises_and_unused_none_is_fine() -> None:
    with pytest.raises(TypeError, match="frobnicate"):
        _call(frobnicate=True)
    out, weights = _call(softcap=None, position_ids=torch.arange(5))
    assert out.shape == (2, 5, 4, 8) and weights is None


def test_sliding_window_without_a_mask_raises() -> None:
    with pytest.raises(ValueError, match="sliding_window"):
        _call(sliding_window=2)


def test_gqa_scaling_and_dropout_reach_qkv_attention() -> None:
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    allowed = torch.rand(2, 1, 5, 5) > 0.3  # HF sense: True = attend
    forward = make_attention_forward()
    torch.manual_seed(3)
    got, _ = forward(torch.nn.Module(), q, k, v, allowed, dropout=0.25, scaling=0.3)
    torch.manual_seed(3)
    ref, _ = qkv.attention(q, k, v, mask=~allowed, scale=0.3, dropout_p=0.25, training=True)
    torch.testing.assert_close(got, ref.transpose(1, 2), rtol=0, atol=0)


def test_fully_padded_sequence_is_finite_and_documented() -> None:
    """A row with no real token: eager averages the padding (garbage), qkv's attention output is
    0 there, as documented; the real rows are unchanged."""
    d = default_model_dir()
    tok = tr.AutoTokenizer.from_pretrained(d)
    batch = tok(["hello world", "another sentence"], padding=True, return_tensors="pt")
    am = batch["attention_mask"].clone()
    am[1] = 0  # fully padded
    zero_forward = make_attention_forward()

    def zeros_for_row_1(module, query, key, value, mask, **kw):  # type: ignore[no-untyped-def]
        out, w = zero_forward(module, query, key, value, mask, **kw)
        out = out.clone()
        out[1] = 0.0
        return out, w

    tr.AttentionInterface.register("qkv_zero_row", zeros_for_row_1)
    tr.masking_utils.AttentionMaskInterface.register("qkv_zero_row", tr.masking_utils.sdpa_mask)
    out = {}
    for impl in ("qkv", "eager", "qkv_zero_row"):
        with torch.no_grad():
            out[impl] = _load(tr.BertModel, d, impl)(
                input_ids=batch["input_ids"], attention_mask=am
            ).last_hidden_state
    assert out["qkv"].isfinite().all()
    torch.testing.assert_close(out["qkv"], out["qkv_zero_row"], rtol=0, atol=0)
    assert (out["eager"][1] - out["qkv"][1]).abs().max() > 0.1  # eager: mean over padding
    torch.testing.assert_close(out["qkv"][0], out["eager"][0], **F32)
