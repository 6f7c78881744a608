"""Models for the examination tests: plain PyTorch language models with one seeded bug each, and
tiny ``transformers`` models built from configs (no download).

``TinyLM`` is a correct causal LM (positions shifted for left padding, padding and causal masks,
every query sees at least itself) unless one bug is switched on:

* ``off_by_one``: the causal mask lets token t see token t + 1;
* ``unshifted_positions``: positions ``0..T-1`` whatever the padding;
* ``dropped_mask``: the padding mask is never applied (causal only);
* ``broadcast_mask``: the padding of sample 0 is applied to every sample;
* ``nan_rows``: an additive -inf mask without the "a query sees itself" guard, so fully padded
  query rows are NaN (their outputs are unused, their gradients are not).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import pytest
import torch
import torch.nn.functional as F
import transformers as tr
from torch import Tensor, nn

BUGS = ("off_by_one", "unshifted_positions", "dropped_mask", "broadcast_mask", "nan_rows")
V = 100  # every tiny model's vocabulary


class TinyLM(nn.Module):
    """One attention layer with learned absolute positions; ``causal=False`` is an encoder."""

    def __init__(self, bug: str | None = None, causal: bool = True, d: int = 16) -> None:
        super().__init__()
        assert bug is None or bug in BUGS
        self.bug, self.causal = bug, causal
        self.embed = nn.Embedding(V, d)
        self.pos = nn.Embedding(32, d)
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, V)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        B, T = input_ids.shape
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        pos = (mask.cumsum(-1) - 1).clamp(min=0)  # [B, T]
        if self.bug == "unshifted_positions":
            pos = torch.arange(T).expand(B, T)
        x = self.embed(input_ids) + self.pos(pos)  # [B, T, D]
        q, k, v = self.qkv(x).view(B, T, 3, 2, -1).permute(2, 0, 3, 1, 4)  # 3 x [B, 2, T, Dh]
        allowed = torch.ones(T, T, dtype=torch.bool)
        if self.causal:
            allowed = torch.ones(T, T).tril(1 if self.bug == "off_by_one" else 0).bool()
        pad = mask.bool()[:, None, None, :]  # [B, 1, 1, T]
        if self.bug == "broadcast_mask":
            pad = mask.bool()[:1, None, None, :]  # [1, 1, 1, T]
        if self.bug != "dropped_mask":
            allowed = allowed & pad  # [B, 1, T, T]
        if self.bug == "nan_rows":
            bias = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
            h = torch.softmax(q @ k.transpose(-1, -2) / 8**0.5 + bias, -1) @ v  # [B, 2, T, Dh]
        else:
            allowed = allowed | torch.eye(T, dtype=torch.bool)  # a padded query sees itself
            h = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)  # [B, 2, T, Dh]
        x = self.norm(x + self.out(h.transpose(1, 2).reshape(B, T, -1)))  # [B, T, D]
        return self.head(x)  # [B, T, V]


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    """Tiny models run on one thread: an examination makes ~40 calls of a few small ops each,
    and two threads on a shared 2-core machine measured 2-7 s per examination against 0.1 s."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_lm() -> type[TinyLM]:
    return TinyLM


@pytest.fixture(scope="session")
def batch() -> tuple[Tensor, Tensor]:
    """Three texts of 9, 6 and 4 tokens, right-padded (the examination re-pads them)."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(4, V, (3, 9), generator=g)
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, 6:] = 0
    mask[2, 4:] = 0
    return ids.masked_fill(mask == 0, 0), mask


def _seeded(build):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    return build().eval()


HF_CONFIGS = {
    "llama": lambda: tr.LlamaForCausalLM(
        tr.LlamaConfig(
            vocab_size=V,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        )
    ),
    "gpt2": lambda: tr.GPT2LMHeadModel(
        tr.GPT2Config(
            vocab_size=V,
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=64,
            bos_token_id=1,
            eos_token_id=2,
        )
    ),
    "bert": lambda: tr.BertModel(
        tr.BertConfig(
            vocab_size=V,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            max_position_embeddings=64,
        )
    ),
    "bart": lambda: tr.BartForConditionalGeneration(
        tr.BartConfig(
            vocab_size=V,
            d_model=32,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            max_position_embeddings=64,
        )
    ),
    "t5": lambda: tr.T5ForConditionalGeneration(
        tr.T5Config(vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)
    ),
}


@pytest.fixture(scope="session")
def hf_model():  # type: ignore[no-untyped-def]
    """``hf_model(name)``: a fresh tiny transformers model (seeded, eval mode)."""
    return lambda name: _seeded(HF_CONFIGS[name])


def _heads(query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
    n = query.shape[1] // key.shape[1]  # grouped-query attention: repeat the key/value heads
    return key.repeat_interleave(n, 1), value.repeat_interleave(n, 1)


def ignores_mask(module, query, key, value, attention_mask, scaling=None, **kwargs):  # type: ignore[no-untyped-def]
    """A custom transformers attention that never reads ``attention_mask`` (causal only)."""
    key, value = _heads(query, key, value)
    T, S = query.shape[2], key.shape[2]
    causal = bool(getattr(module, "is_causal", True)) and T == S and T > 1
    out = F.scaled_dot_product_attention(query, key, value, is_causal=causal, scale=scaling)
    return out.transpose(1, 2).contiguous(), None  # [B, T, H, Dh]


def top_left_causal(module, query, key, value, attention_mask, scaling=None, **kwargs):  # type: ignore[no-untyped-def]
    """A custom attention written for prefill: ``is_causal=True`` for every call of several
    queries, so a cached chunk (T < S) is aligned top-left and sees the first keys only."""
    key, value = _heads(query, key, value)
    if query.shape[2] > 1:
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)
    else:
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, scale=scaling
        )
    return out.transpose(1, 2).contiguous(), None  # [B, T, H, Dh]


@pytest.fixture(scope="session")
def registered() -> tuple[str, str]:
    """Register the two seeded attention functions (with transformers' own SDPA mask)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    for name, fn in (("ignores_mask", ignores_mask), ("top_left_causal", top_left_causal)):
        AttentionInterface.register(name, fn)
        AttentionMaskInterface.register(name, sdpa_mask)
    return "ignores_mask", "top_left_causal"
