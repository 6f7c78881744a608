"""Hugging Face T5 (``T5ForConditionalGeneration``, ``T5Model``) -> :class:`qkv.Transformer`.

T5 is a pre-norm encoder–decoder without biases, with RMSNorm (its ``T5LayerNorm``), a final
norm on each stack, one unscaled embedding shared by both stacks and the head, and no position
added to the embeddings: each stack's first block holds a learned relative position bias
(bucketed distances, one-sided in the decoder) that every layer of the stack adds to its
self-attention scores (qkv's ``positional="relative"``, one table per stack). Its scores are not
scaled by ``1 / sqrt(d_kv)`` (qkv's ``attn_scale=1.0``); with its head tied to the embedding
(original T5) the decoder output is scaled by ``d_model ** -0.5`` before the head (qkv's
``output_scale``). T5 v1.1's ``gated-gelu`` feed-forward is qkv's ``"geglu_tanh"``. The decoder
starts from the pad token (``decoder_start_token_id``, qkv's ``bos_id == pad_id``).

Shapes: V vocabulary, D model width, N relative-position buckets, H heads.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from qkv.convert.hf_files import (
    Rule,
    check_against,
    check_layers,
    expand_rules,
    read_config,
    read_headers,
    read_tensors,
    to_qkv,
    weight_files,
)
from qkv.convert.hf_tokens import forced_token_ids, required_ids, token_id
from qkv.convert.hf_values import hf_bool, hf_float, hf_int, hf_str
from qkv.models.config import TransformerConfig
from qkv.models.registry import load_weights
from qkv.models.transformer import Transformer
from qkv.nn.feed_forward import Activation
from qkv.nn.meta import on_meta

__all__ = ["MODEL_TYPES", "config_from_hf", "load_t5", "rules"]

MODEL_TYPES: tuple[str, ...] = ("t5",)

_FEED_FORWARD: dict[str, Activation] = {
    "relu": "relu",
    "gelu": "gelu",
    "gated-gelu": "geglu_tanh",
    "gated-silu": "swiglu",
}
"""``feed_forward_proj`` -> qkv's activation (``gated-gelu`` means ``gelu_new``, tanh)."""

_ATTN = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "out_proj"}
_TIED = {
    "encoder.embed_tokens.weight": "the encoder's copy of the shared embedding",
    "decoder.embed_tokens.weight": "the decoder's copy of the shared embedding",
}


def _block_rules(stack: str, sublayers: list[tuple[str, str]], gated: bool) -> list[Rule]:
    """One stack's block rules: (HF attention module, qkv attention) per attention sublayer,
    each with its norm, then the feed-forward sublayer and its norm."""
    out: list[Rule] = []
    hf, ours = f"{stack}.block.{{}}.layer.", f"{stack}.layers.{{}}."
    for i, (hf_attn, our_attn) in enumerate(sublayers):
        for a, b in _ATTN.items():
            out.append(Rule(f"{hf}{i}.{hf_attn}.{a}.weight", (f"{ours}{our_attn}.{b}.weight",)))
        out.append(Rule(f"{hf}{i}.layer_norm.weight", (f"{ours}norm{i + 1}.weight",)))
    ff = f"{hf}{len(sublayers)}."
    inner = {"wi_0": "gate", "wi_1": "fc1", "wo": "fc2"} if gated else {"wi": "fc1", "wo": "fc2"}
    for a, b in inner.items():
        out.append(Rule(f"{ff}DenseReluDense.{a}.weight", (f"{ours}ffn.{b}.weight",)))
    out.append(Rule(f"{ff}layer_norm.weight", (f"{ours}norm{len(sublayers) + 1}.weight",)))
    return out


def _templates(c: TransformerConfig) -> tuple[list[Rule], list[Rule]]:
    """The encoder's and the decoder's block rules, ``{}`` not expanded."""
    gated = c.activation in ("geglu_tanh", "swiglu")
    enc = _block_rules("encoder", [("SelfAttention", "self_attn")], gated)
    dec = _block_rules(
        "decoder", [("SelfAttention", "self_attn"), ("EncDecAttention", "cross_attn")], gated
    )
    return enc, dec


def rules(c: TransformerConfig) -> list[Rule]:
    """Every rule but the shared embedding and the head, expanded over the layers."""
    enc, dec = _templates(c)
    out = expand_rules(enc, c.num_encoder_layers) + expand_rules(dec, c.num_decoder_layers)
    table = "block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    out += [
        Rule(f"encoder.{table}", ("positional.relative_attention_bias.weight",)),
        Rule(f"decoder.{table}", ("tgt_positional.relative_attention_bias.weight",)),
        Rule("encoder.final_layer_norm.weight", ("encoder.norm.weight",)),
        Rule("decoder.final_layer_norm.weight", ("decoder.norm.weight",)),
        Rule("shared.weight", ("tgt_embed.weight",)),
    ]
    return out


def config_from_hf(hf: Mapping[str, Any], *, source: str = "config.json") -> TransformerConfig:
    """A T5 ``config.json`` (parsed) as a :class:`TransformerConfig`.

    ``decoder_start_token_id`` (default ``pad_token_id``) becomes ``bos_id``; the head is
    scaled by ``d_model ** -0.5`` when ``scale_decoder_outputs`` says so (older configs:
    unless ``tie_word_embeddings`` is false), as ``transformers`` does.

    Every value is read with :mod:`qkv.convert.hf_values`: sizes are ints in
    ``[1, MAX_SIZE]``, flags ``true`` / ``false``, names strings.

    Raises:
        ValueError: a missing size, a value of the wrong type or beyond its bounds;
            ``num_heads * d_kv != d_model`` (qkv's heads split the model width); a
            ``feed_forward_proj`` qkv does not build; a missing token id; a value the config
            rejects. Each named with its key.
    """
    V = hf_int(hf, "vocab_size", source)
    D = hf_int(hf, "d_model", source)
    H = hf_int(hf, "num_heads", source)
    Dh = hf_int(hf, "d_kv", source)
    ffn = hf_int(hf, "d_ff", source)
    layers = hf_int(hf, "num_layers", source)
    decoder_layers = hf_int(hf, "num_decoder_layers", source, default=layers, nullable=True)
    assert V and D and H and Dh and ffn and layers and decoder_layers  # required / defaulted
    problems = []
    if H * Dh != D:
        problems.append(f"num_heads={H} * d_kv={Dh} != d_model={D} (qkv's heads split D)")
    proj = hf_str(hf, "feed_forward_proj", source, default="relu")
    if proj not in _FEED_FORWARD:
        problems.append(f"feed_forward_proj={proj!r} (known: {sorted(_FEED_FORWARD)})")
    if problems:
        raise ValueError(f"{source}: unsupported t5 options: " + "; ".join(problems))
    eps = hf_float(hf, "layer_norm_epsilon", source, default=1e-6)
    buckets = hf_int(hf, "relative_attention_num_buckets", source, default=32)
    distance = hf_int(hf, "relative_attention_max_distance", source, default=128)
    positions = hf_int(hf, "n_positions", source, default=512)
    assert buckets and distance and positions  # defaulted
    tied = hf_bool(hf, "tie_word_embeddings", source, default=True)
    scale = hf_bool(hf, "scale_decoder_outputs", source, default=tied)
    pad = token_id(hf, "pad_token_id", source)
    eos = token_id(hf, "eos_token_id", source)
    has_start = "decoder_start_token_id" in hf
    start = token_id(hf, "decoder_start_token_id", source) if has_start else pad
    pad, eos, start = required_ids(source, V, pad=pad, eos=eos, decoder_start=start)
    try:
        return TransformerConfig(
            V,
            V,
            d_model=D,
            num_heads=H,
            dim_feedforward=ffn,
            num_encoder_layers=layers,
            num_decoder_layers=decoder_layers,
            dropout=0.0,
            activation=_FEED_FORWARD[proj],
            norm_first=True,
            norm="rms",
            layer_norm_eps=eps,
            positional="relative",
            relative_buckets=buckets,
            relative_max_distance=distance,
            max_positions=positions,
            tie_embeddings=True,
            qkv_bias=False,
            out_bias=False,
            ffn_bias=False,
            attn_scale=1.0,
            pad_id=pad,
            bos_id=start,
            eos_id=eos,
            scale_embeddings=False,
            embed_norm=False,
            final_norm=True,
            share_positions=False,
            head_bias=False,
            output_scale=D**-0.5 if scale else 1.0,
        )
    except (TypeError, ValueError) as err:
        raise ValueError(f"{source}: {err}") from None


def load_t5(root: Path) -> Transformer:
    """Read a T5 ``save_pretrained`` directory into a :class:`Transformer`.

    A separate ``lm_head.weight`` is used when ``tie_word_embeddings`` is false (T5 v1.1 as
    first published); otherwise the head is the shared embedding, as ``transformers`` ties it.
    ``forced_bos_token_id`` / ``forced_eos_token_id`` are read as
    :func:`~qkv.convert.hf_tokens.forced_token_ids` reads them.

    Raises:
        ValueError: see :func:`config_from_hf`; a layer count beyond the layers the weights
            hold (checked before anything is built); unknown, missing or mis-shaped keys, named.
    """
    source = str(root / "config.json")
    hf = read_config(root)
    c = config_from_hf(hf, source=source)
    headers = read_headers(weight_files(root))
    for key, count, templates in zip(
        ("num_layers", "num_decoder_layers"),
        (c.num_encoder_layers, c.num_decoder_layers),
        _templates(c),
        strict=True,
    ):
        check_layers(source, key, count, headers, templates)  # before anything is built
    tied = hf_bool(hf, "tie_word_embeddings", source, default=True)
    untied = "lm_head.weight" in headers and not tied
    forced_bos, forced_eos = forced_token_ids(root, hf, source)
    c = replace(c, tie_embeddings=not untied, forced_bos_id=forced_bos, forced_eos_id=forced_eos)
    layer_rules = rules(c)
    if untied:
        layer_rules.append(Rule("lm_head.weight", ("lm_head.weight",)))
    with on_meta():
        shapes = {k: tuple(v.shape) for k, v in Transformer(c).state_dict().items()}
    ignored = dict(_TIED)
    if not untied:
        ignored["lm_head.weight"] = "the head is tied to the shared embedding"
    check_against(f"t5 checkpoint {str(root)!r}", headers, layer_rules, shapes, ignored)
    loaded = read_tensors(headers, [r.hf for r in layer_rules])
    state = to_qkv(layer_rules, {k: v.to(torch.float32) for k, v in loaded.items()})
    state["src_embed.weight"] = state["tgt_embed.weight"]
    if not untied:
        state["lm_head.weight"] = state["tgt_embed.weight"]
    model = Transformer(c)
    load_weights(model, state, str(root))
    return model
