"""Hugging Face GPT-2 -> :class:`qkv.DecoderOnlyLM`.

GPT-2 stores its linear layers as ``Conv1D``: weights ``[in, out]``, the transpose of
``nn.Linear``'s, and the query/key/value projections fused into one ``c_attn`` of width ``3D``;
both are undone here. Learned absolute positions, LayerNorm pre-norm blocks, the tanh GELU
(``gelu_new``), biases everywhere, a head tied to the token embedding.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from qkv.convert.hf_files import Rule, decoder_config, require_keys
from qkv.convert.hf_tokens import token_id
from qkv.models.config import DecoderOnlyConfig
from qkv.nn.feed_forward import Activation

__all__ = ["IGNORED", "MODEL_TYPES", "PREFIX", "config_from_hf", "rules"]

MODEL_TYPES: tuple[str, ...] = ("gpt2",)
PREFIX = "transformer."
IGNORED: dict[str, str] = {
    "attn.bias": "the causal-mask buffer of older GPT-2 checkpoints, rebuilt by qkv",
    "attn.masked_bias": "the mask fill value buffer of older GPT-2 checkpoints",
}
_ACTIVATIONS: dict[str, Activation] = {
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu": "gelu",
    "relu": "relu",
}
_L = "blocks.layers.{}."
_RULES = [
    Rule("wte.weight", ("embed.weight",)),
    Rule("wpe.weight", ("positional.embedding.weight",)),
    Rule("ln_f.weight", ("blocks.norm.weight",)),
    Rule("ln_f.bias", ("blocks.norm.bias",)),
    Rule("h.{}.ln_1.weight", (_L + "norm1.weight",)),
    Rule("h.{}.ln_1.bias", (_L + "norm1.bias",)),
    Rule("h.{}.ln_2.weight", (_L + "norm2.weight",)),
    Rule("h.{}.ln_2.bias", (_L + "norm2.bias",)),
    Rule(
        "h.{}.attn.c_attn.weight",
        tuple(_L + f"self_attn.{p}_proj.weight" for p in "qkv"),
        "split_t",
    ),
    Rule("h.{}.attn.c_attn.bias", tuple(_L + f"self_attn.{p}_proj.bias" for p in "qkv"), "split_t"),
    Rule("h.{}.attn.c_proj.weight", (_L + "self_attn.out_proj.weight",), "t"),
    Rule("h.{}.attn.c_proj.bias", (_L + "self_attn.out_proj.bias",)),
    Rule("h.{}.mlp.c_fc.weight", (_L + "ffn.fc1.weight",), "t"),
    Rule("h.{}.mlp.c_fc.bias", (_L + "ffn.fc1.bias",)),
    Rule("h.{}.mlp.c_proj.weight", (_L + "ffn.fc2.weight",), "t"),
    Rule("h.{}.mlp.c_proj.bias", (_L + "ffn.fc2.bias",)),
]


def config_from_hf(hf: Mapping[str, Any], *, source: str = "config.json") -> DecoderOnlyConfig:
    """A GPT-2 ``config.json`` (parsed) as a :class:`DecoderOnlyConfig`.

    Raises:
        ValueError: an option qkv does not build (scores not scaled by ``1/sqrt(Dh)``, scaling by
            the layer index, cross-attention, another activation), a missing size, or a value the
            config rejects; each named.
    """
    require_keys(hf, ("vocab_size", "n_embd", "n_layer", "n_head"), source)
    act = hf.get("activation_function", "gelu_new")
    problems = []
    if act not in _ACTIVATIONS:
        problems.append(f"activation_function={act!r} (known: {sorted(_ACTIVATIONS)})")
    if not hf.get("scale_attn_weights", True):
        problems.append("scale_attn_weights=false")
    if hf.get("scale_attn_by_inverse_layer_idx", False):
        problems.append("scale_attn_by_inverse_layer_idx=true")
    if hf.get("add_cross_attention", False):
        problems.append("add_cross_attention=true")
    D = hf["n_embd"]
    return decoder_config(
        hf,
        source,
        problems,
        num_layers=hf["n_layer"],
        d_model=D,
        num_heads=hf["n_head"],
        dim_feedforward=hf.get("n_inner") or 4 * D,
        activation=_ACTIVATIONS.get(act, "gelu"),
        norm="layer",
        layer_norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        positional="learned",
        max_positions=hf.get("n_positions", 1024),
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        pad_id=token_id(hf, "pad_token_id", source),
    )


def rules(c: DecoderOnlyConfig) -> list[Rule]:
    """The key rules of a GPT-2 checkpoint for ``c`` (HF keys with ``PREFIX`` removed)."""
    out = list(_RULES)
    if not c.tie_embeddings:
        out.append(Rule("lm_head.weight", ("lm_head.weight",)))
    return out
