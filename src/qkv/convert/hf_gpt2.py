"""Hugging Face GPT-2 -> :class:`qkv.DecoderOnlyLM`.

GPT-2 stores its linear layers as ``Conv1D``: weights ``[in, out]``, the transpose of
``nn.Linear``'s, and the query/key/value projections fused into one ``c_attn`` of width ``3D``;
both are undone here. Learned absolute positions, LayerNorm pre-norm blocks, the tanh GELU
(``gelu_new``), biases everywhere, a head tied to the token embedding.

The loaded ``nn.Linear`` weights keep ``Conv1D``'s memory layout (:func:`keep_conv1d_layout`):
``[out, in]`` values stored column-major, so ``x @ W.t()`` reads a contiguous ``[in, out]``,
which MKL multiplies few rows by faster (eager decoding of GPT-2 small at B=8, 2 threads:
0.76x the time).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from qkv.convert.hf_files import Rule, decoder_config
from qkv.convert.hf_tokens import token_id
from qkv.convert.hf_values import hf_bool, hf_float, hf_int, hf_str
from qkv.models.config import DecoderOnlyConfig
from qkv.nn.feed_forward import Activation

__all__ = [
    "IGNORED",
    "LAYERS_KEY",
    "MODEL_TYPES",
    "PREFIX",
    "config_from_hf",
    "keep_conv1d_layout",
    "rules",
]

MODEL_TYPES: tuple[str, ...] = ("gpt2",)
PREFIX = "transformer."
LAYERS_KEY = "n_layer"
"""The config key of the layer count (checked against the layers the weights hold)."""
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
            the layer index, cross-attention, another activation), a missing size, a value of
            the wrong type or beyond its bounds, or a value the config rejects; each named
            with its key.
    """
    V = hf_int(hf, "vocab_size", source)
    D = hf_int(hf, "n_embd", source)
    H = hf_int(hf, "n_head", source)
    layers = hf_int(hf, LAYERS_KEY, source)
    assert D is not None  # required
    inner = hf_int(hf, "n_inner", source, default=None, nullable=True)
    act = hf_str(hf, "activation_function", source, default="gelu_new")
    problems = []
    if act not in _ACTIVATIONS:
        problems.append(f"activation_function={act!r} (known: {sorted(_ACTIVATIONS)})")
    if not hf_bool(hf, "scale_attn_weights", source, default=True):
        problems.append("scale_attn_weights=false")
    if hf_bool(hf, "scale_attn_by_inverse_layer_idx", source, default=False):
        problems.append("scale_attn_by_inverse_layer_idx=true")
    if hf_bool(hf, "add_cross_attention", source, default=False):
        problems.append("add_cross_attention=true")
    return decoder_config(
        hf,
        source,
        problems,
        vocab_size=V,
        num_layers=layers,
        d_model=D,
        num_heads=H,
        dim_feedforward=4 * D if inner is None else inner,
        activation=_ACTIVATIONS.get(act, "gelu"),
        norm="layer",
        layer_norm_eps=hf_float(hf, "layer_norm_epsilon", source, default=1e-5),
        positional="learned",
        max_positions=hf_int(hf, "n_positions", source, default=1024),
        tie_embeddings=hf_bool(hf, "tie_word_embeddings", source, default=True),
        pad_id=token_id(hf, "pad_token_id", source),
    )


def rules(c: DecoderOnlyConfig) -> list[Rule]:
    """The key rules of a GPT-2 checkpoint for ``c`` (HF keys with ``PREFIX`` removed)."""
    out = list(_RULES)
    if not c.tie_embeddings:
        out.append(Rule("lm_head.weight", ("lm_head.weight",)))
    return out


def keep_conv1d_layout(model: nn.Module) -> None:
    """Store every ``nn.Linear`` weight of ``model`` column-major, as GPT-2's ``Conv1D`` stores
    it (the same ``[out, in]`` values, strides ``(1, out)``), in place. A weight shared with an
    ``nn.Embedding`` (the tied head) keeps its rows contiguous: the embedding reads rows.
    """
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for m in model.modules():
        if isinstance(m, nn.Linear) and id(m.weight) not in embedded:
            m.weight.data = m.weight.data.t().contiguous().t()  # [out, in], strides (1, out)
