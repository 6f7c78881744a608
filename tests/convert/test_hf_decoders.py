"""load_hf / save_hf against transformers: tiny random Llama, Qwen2, GPT-2 saved with
save_pretrained, several seeds and shapes, GQA and MHA, tied and untied heads."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import json
from pathlib import Path

import pytest
import torch
import transformers as tr
from safetensors.torch import load_file, save_file

from qkv.convert import load_hf, save_hf
from qkv.models import DecoderOnlyConfig, DecoderOnlyLM

TOL = {"atol": 1e-4, "rtol": 0.0}  # the bound on logits
V = 96


def _llama(seed: int, kv: int, tied: bool, theta: float = 10000.0) -> tr.PreTrainedModel:
    torch.manual_seed(seed)
    cfg = tr.LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv,
        max_position_embeddings=80,
        initializer_range=0.2,
        tie_word_embeddings=tied,
        rope_theta=theta,
    )
    return tr.LlamaForCausalLM(cfg).eval()


def _qwen2(seed: int) -> tr.PreTrainedModel:
    torch.manual_seed(seed)
    cfg = tr.Qwen2Config(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=80,
        initializer_range=0.2,
    )
    model = tr.Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # zero-initialised biases would not test the mapping
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.normal_(0, 0.2)
    return model


def _gpt2(seed: int, tied: bool = True) -> tr.PreTrainedModel:
    torch.manual_seed(seed)
    cfg = tr.GPT2Config(
        vocab_size=V,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=80,
        initializer_range=0.2,
        tie_word_embeddings=tied,
    )
    model = tr.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.normal_(0, 0.2)
    return model


CASES = {
    "llama-gqa-untied-s0": lambda: _llama(0, 2, False),
    "llama-mha-tied-s1": lambda: _llama(1, 4, True, theta=500.0),
    "llama-mqa-untied-s2": lambda: _llama(2, 1, False),
    "qwen2-gqa-s3": lambda: _qwen2(3),
    "gpt2-tied-s4": lambda: _gpt2(4),
    "gpt2-untied-s5": lambda: _gpt2(5, tied=False),
}


def _saved(model: tr.PreTrainedModel, tmp: Path, **kw: object) -> Path:
    model.save_pretrained(tmp, **kw)
    return tmp


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("shape", [(1, 5), (3, 17)])
def test_logits_match_transformers(case: str, shape: tuple[int, int], tmp_path: Path) -> None:
    ref = CASES[case]()
    ours = load_hf(_saved(ref, tmp_path))
    assert isinstance(ours, DecoderOnlyLM)
    ids = torch.randint(0, V, shape)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), ref(ids).logits, **TOL)


def test_sharded_checkpoint_loads(tmp_path: Path) -> None:
    ref = _llama(0, 2, False)
    root = _saved(ref, tmp_path, max_shard_size="20KB")
    assert (root / "model.safetensors.index.json").is_file()
    ids = torch.randint(0, V, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(load_hf(root)(ids), ref(ids).logits, **TOL)


def _greedy_qkv(model: DecoderOnlyLM, ids: torch.Tensor, pad: torch.Tensor, n: int) -> torch.Tensor:
    cache = model.new_cache(ids.shape[1] + n)
    logits = model(ids, pad, kv_cache=cache)[:, -1]  # [B, V]
    out = []
    for _ in range(n):
        nxt = logits.argmax(-1, keepdim=True)  # [B, 1]
        out.append(nxt)
        logits = model(nxt, torch.zeros_like(nxt, dtype=torch.bool), kv_cache=cache)[:, -1]
    return torch.cat(out, dim=1)  # [B, n]


def _greedy_hf(
    model: tr.PreTrainedModel, ids: torch.Tensor, am: torch.Tensor, n: int
) -> torch.Tensor:
    """transformers' forward with its cache, positions counted from each row's first real token
    (``position_ids`` from the attention mask, as its ``generate`` does and as qkv does)."""
    pos = (am.cumsum(1) - 1).clamp(min=0)  # [B, T]
    out = model(ids, attention_mask=am, position_ids=pos, use_cache=True)
    cache, logits, toks = out.past_key_values, out.logits[:, -1], []
    for _ in range(n):
        nxt = logits.argmax(-1, keepdim=True)  # [B, 1]
        toks.append(nxt)
        am = torch.cat([am, torch.ones_like(nxt)], dim=1)  # [B, S]
        pos = am.sum(1, keepdim=True) - 1  # [B, 1]
        out = model(nxt, attention_mask=am, position_ids=pos, past_key_values=cache, use_cache=True)
        cache, logits = out.past_key_values, out.logits[:, -1]
    return torch.cat(toks, dim=1)  # [B, n]


@pytest.mark.parametrize("case", ["llama-gqa-untied-s0", "qwen2-gqa-s3", "gpt2-tied-s4"])
def test_greedy_32_tokens_left_padded_with_kv_cache(case: str, tmp_path: Path) -> None:
    ref = CASES[case]()
    ours = load_hf(_saved(ref, tmp_path))
    ids = torch.randint(1, V, (3, 8))
    am = torch.ones_like(ids)
    am[1, :3] = 0
    am[2, :5] = 0
    with torch.no_grad():
        assert torch.equal(_greedy_qkv(ours, ids, am == 0, 32), _greedy_hf(ref, ids, am, 32))


def test_gpt2_greedy_32_tokens_with_kv_cache(tmp_path: Path) -> None:
    ref = _gpt2(4)
    ours = load_hf(_saved(ref, tmp_path))
    ids = torch.randint(1, V, (2, 6))
    with torch.no_grad():
        got = _greedy_qkv(ours, ids, torch.zeros_like(ids, dtype=torch.bool), 32)
        want = ref.generate(
            ids, max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0
        )[:, 6:]
    assert torch.equal(got, want)


@pytest.mark.parametrize("tied", [True, False])
def test_gpt2_linear_weights_keep_the_conv1d_layout(tied: bool, tmp_path: Path) -> None:
    """The Linear weights of a loaded GPT-2 are stored as its Conv1D stores them ([in, out]
    contiguous), the tied head as the embedding's rows; a float64 load keeps the layout."""
    ref = _gpt2(4, tied=tied)
    ours = load_hf(_saved(ref, tmp_path / "hf"))
    assert isinstance(ours, DecoderOnlyLM)
    linears = [m for m in ours.modules() if isinstance(m, torch.nn.Linear)]
    for m in linears:
        N = m.weight.shape[0]
        if m.weight is ours.lm_head.weight and tied:
            assert m.weight.is_contiguous()  # the embedding's rows
        else:
            assert m.weight.stride() == (1, N), m
    conv = ref.transformer.h[0].mlp.c_fc.weight  # [in, out]
    fc1 = dict(ours.named_parameters())["blocks.layers.0.ffn.fc1.weight"]  # [out, in]
    assert torch.equal(fc1.t(), conv)
    wide = load_hf(_saved(ref, tmp_path / "hf64"), dtype=torch.float64)
    assert dict(wide.named_parameters())["blocks.layers.0.ffn.fc1.weight"].stride() == (
        1,
        conv.shape[1],
    )
    ids = torch.randint(1, V, (2, 7))
    with torch.no_grad():  # the same values: the logits of transformers
        torch.testing.assert_close(ours(ids), ref(ids).logits, **TOL)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("kv", [1, 4])
def test_save_hf_loads_in_transformers_with_same_logits(
    tied: bool, kv: int, tmp_path: Path
) -> None:
    torch.manual_seed(kv)
    cfg = DecoderOnlyConfig(
        V,
        num_layers=2,
        d_model=32,
        num_heads=4,
        num_kv_heads=kv,
        dim_feedforward=48,
        activation="swiglu",
        norm="rms",
        positional="rotary",
        qkv_bias=False,
        out_bias=False,
        ffn_bias=False,
        tie_embeddings=tied,
        rope_theta=1000.0,
        max_positions=64,
        dropout=0.0,
    )
    ours = DecoderOnlyLM(cfg).eval()
    ref = tr.LlamaForCausalLM.from_pretrained(save_hf(ours, tmp_path)).eval()
    ids = torch.randint(0, V, (2, 11))
    with torch.no_grad():
        torch.testing.assert_close(ref(ids).logits, ours(ids), **TOL)
    again = load_hf(tmp_path)  # and back
    torch.testing.assert_close(again.state_dict(), ours.state_dict(), rtol=0, atol=0)


def test_save_hf_names_what_llama_cannot_express(tmp_path: Path) -> None:
    ours = DecoderOnlyLM(DecoderOnlyConfig(V, num_layers=1, d_model=16, num_heads=2))
    with pytest.raises(ValueError, match=r"activation='gelu'.*norm='layer'"):
        save_hf(ours, tmp_path)
    llama_like = {"activation": "swiglu", "norm": "rms", "qkv_bias": False, "out_bias": False}
    inter = DecoderOnlyConfig(
        V, num_layers=1, d_model=16, num_heads=2, rope_layout="interleaved", **llama_like
    )
    with pytest.raises(ValueError, match=r"rope_layout='interleaved' \(Llama needs 'half_split'"):
        save_hf(DecoderOnlyLM(inter), tmp_path)
    assert not (tmp_path / "config.json").exists()
    with pytest.raises(TypeError, match="DecoderOnlyLM"):
        save_hf(torch.nn.Linear(2, 2), tmp_path)  # type: ignore[arg-type]


def _rewrite(root: Path, *, config: dict | None = None, tensors: dict | None = None) -> Path:
    if config is not None:
        (root / "config.json").write_text(json.dumps(config))
    if tensors is not None:
        save_file(tensors, str(root / "model.safetensors"))
    return root


def test_bad_checkpoints_are_named(tmp_path: Path) -> None:
    root = _saved(_llama(0, 2, False), tmp_path)
    cfg = json.loads((root / "config.json").read_text())
    weights = load_file(root / "model.safetensors")
    # (t5 was the unknown type here until issue 25 made it a known one)
    with pytest.raises(ValueError, match=r"model_type='falcon' is not supported"):
        load_hf(_rewrite(root, config={**cfg, "model_type": "falcon"}))
    with pytest.raises(ValueError, match=r"model_type='gptj' is not supported"):
        load_hf(_rewrite(root, config={**cfg, "model_type": "gptj"}))  # interleaved, partial RoPE
    assert load_hf(_rewrite(root, config=cfg)).config.rope_layout == "half_split"
    scaled = {**cfg, "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}
    with pytest.raises(ValueError, match=r"rope_type='linear'"):
        load_hf(_rewrite(root, config=scaled))
    with pytest.raises(ValueError, match=r"sliding_window=16"):
        load_hf(_rewrite(root, config={**cfg, "model_type": "mistral", "sliding_window": 16}))
    _rewrite(root, config=cfg)
    broken = dict(weights)
    broken["model.layers.0.extra.weight"] = torch.zeros(2)
    del broken["model.layers.1.mlp.up_proj.weight"]
    broken["model.norm.weight"] = torch.zeros(31)
    with pytest.raises(ValueError) as err:
        load_hf(_rewrite(root, tensors=broken))
    msg = str(err.value)
    assert "unknown key(s): layers.0.extra.weight" in msg
    assert "missing key(s): layers.1.mlp.up_proj.weight" in msg
    assert "norm.weight has shape [31], expected [32]" in msg


def test_pickle_is_refused_never_opened(tmp_path: Path) -> None:
    root = _saved(_llama(0, 2, False), tmp_path)
    (root / "model.safetensors").unlink()
    (root / "pytorch_model.bin").write_bytes(b"not opened")
    with pytest.raises(FileNotFoundError, match="unpickling can run arbitrary code"):
        load_hf(root)
