"""Tiny real ``transformers`` models for the doctor's tests, built from configs (no download).

Each is small enough to run a batch in milliseconds; ``build(name, implementation)`` gives a
seeded model in eval mode, ``batch(name, side)`` a padded batch in the model's conventions.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers
from transformers import (
    BartConfig,
    BertConfig,
    GPT2Config,
    LlamaConfig,
    T5Config,
)

VOCAB = 64
PAD = 0
LENGTHS = (7, 4)
NAMES = ("llama", "gpt2", "bert", "bart", "t5")
CAUSAL = ("llama", "gpt2")
SEQ2SEQ = ("bart", "t5")


def _config(name: str) -> Any:
    if name == "llama":
        return LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            pad_token_id=PAD,
        )
    if name == "gpt2":
        return GPT2Config(
            vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, pad_token_id=PAD
        )
    if name == "bert":
        return BertConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            max_position_embeddings=64,
            pad_token_id=PAD,
        )
    if name == "bart":
        return BartConfig(
            vocab_size=VOCAB,
            d_model=32,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            max_position_embeddings=64,
            pad_token_id=PAD,
            bos_token_id=1,
            eos_token_id=2,
            decoder_start_token_id=2,
            forced_eos_token_id=None,
        )
    if name == "t5":
        return T5Config(
            vocab_size=VOCAB,
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_decoder_layers=2,
            num_heads=4,
            pad_token_id=PAD,
            decoder_start_token_id=PAD,
            eos_token_id=1,
        )
    raise ValueError(name)


_CLASSES = {
    "llama": transformers.LlamaForCausalLM,
    "gpt2": transformers.GPT2LMHeadModel,
    "bert": transformers.BertModel,
    "bart": transformers.BartForConditionalGeneration,
    "t5": transformers.T5ForConditionalGeneration,
}


def build(name: str, implementation: str = "sdpa", dtype: torch.dtype = torch.float32) -> Any:
    """A seeded tiny model of family ``name`` with ``attn_implementation=implementation``."""
    torch.manual_seed(0)
    config = _config(name)
    config._attn_implementation = implementation
    model = _CLASSES[name](config).eval()
    return model.to(dtype)


def batch(side: str = "right", lengths: tuple[int, ...] = LENGTHS) -> dict[str, torch.Tensor]:
    """``input_ids`` and ``attention_mask`` (1 = token) padded on ``side``."""
    g = torch.Generator().manual_seed(1)
    L = max(lengths)
    ids = torch.full((len(lengths), L), PAD, dtype=torch.long)
    mask = torch.zeros(len(lengths), L, dtype=torch.long)
    for i, n in enumerate(lengths):
        tokens = torch.randint(3, VOCAB, (n,), generator=g)
        cols = slice(L - n, L) if side == "left" else slice(0, n)
        ids[i, cols], mask[i, cols] = tokens, 1
    return {"input_ids": ids, "attention_mask": mask}


def run(model: Any, name: str, side: str, cached_step: bool = True) -> Any:
    """A forward of the padded batch, then (causal LMs and seq2seq) one cached step."""
    inputs = batch(side)
    with torch.no_grad():
        if name in SEQ2SEQ:
            dec = torch.tensor([[PAD if name == "t5" else 2, 5, 6]] * len(LENGTHS))
            out = model(**inputs, decoder_input_ids=dec, use_cache=True)
            if cached_step:
                model(
                    **inputs,
                    decoder_input_ids=dec[:, -1:],
                    past_key_values=out.past_key_values,
                    use_cache=True,
                )
            return out.logits
        if name in CAUSAL:
            out = model(**inputs, use_cache=True)
            if cached_step:
                step_mask = torch.cat(
                    [inputs["attention_mask"], torch.ones(len(LENGTHS), 1, dtype=torch.long)], 1
                )
                model(
                    input_ids=torch.full((len(LENGTHS), 1), 9),
                    attention_mask=step_mask,
                    past_key_values=out.past_key_values,
                    use_cache=True,
                )
            return out.logits
        return model(**inputs).last_hidden_state
