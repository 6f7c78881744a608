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
    expand_rules,
    read_config,
    read_headers,
    read_tensors,
    require_keys,
    to_qkv,
    weight_files,
)
from qkv.convert.hf_tokens import forced_token_ids, token_id
from qkv.models.config import TransformerConfig
from qkv.models.registry import load_weights
from qkv.models.transformer import Transformer
from qkv.nn.feed_forward import Activation

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


def rules(c: TransformerConfig) -> list[Rule]:
    """Every rule but the shared embedding and the head, expanded over the layers."""
    gated = c.activation in ("geglu_tanh", "swiglu")
    enc = _block_rules("encoder", [("SelfAttention", "self_attn")], gated)
    dec = _block_rules(
        "decoder", [("SelfAttention", "self_attn"), ("EncDecAttention", "cross_attn")], gated
    )
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

    Raises:
        ValueError: a missing size; ``num_heads * d_kv != d_model`` (qkv's heads split the model
            width); a ``feed_forward_proj`` qkv does not build; a missing token id; a value the
            config rejects. Each named.
    """
    require_keys(hf, ("vocab_size", "d_model", "d_kv", "d_ff", "num_layers", "num_heads"), source)
    problems = []
    D, H, Dh = hf["d_model"], hf["num_heads"], hf["d_kv"]
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in (D, H, Dh)) or H * Dh != D:
        problems.append(f"num_heads={H!r} * d_kv={Dh!r} != d_model={D!r} (qkv's heads split D)")
    proj = hf.get("feed_forward_proj", "relu")
    if proj not in _FEED_FORWARD:
        problems.append(f"feed_forward_proj={proj!r} (known: {sorted(_FEED_FORWARD)})")
    if problems:
        raise ValueError(f"{source}: unsupported t5 options: " + "; ".join(problems))
    V = hf["vocab_size"]
    pad = token_id(hf, "pad_token_id", source)
    eos = token_id(hf, "eos_token_id", source)
    has_start = "decoder_start_token_id" in hf
    start = token_id(hf, "decoder_start_token_id", source) if has_start else pad
    missing = [k for k, v in (("pad", pad), ("eos", eos), ("decoder_start", start)) if v is None]
    if missing:
        raise ValueError(
            f"{source}: needs {', '.join(m + '_token_id' for m in missing)} in [0, {V})"
        )
    assert pad is not None and eos is not None and start is not None
    scale = hf.get("scale_decoder_outputs", hf.get("tie_word_embeddings", True) is not False)
    try:
        return TransformerConfig(
            V,
            V,
            d_model=D,
            num_heads=H,
            dim_feedforward=hf["d_ff"],
            num_encoder_layers=hf["num_layers"],
            num_decoder_layers=hf.get("num_decoder_layers") or hf["num_layers"],
            dropout=0.0,
            activation=_FEED_FORWARD[proj],
            norm_first=True,
            norm="rms",
            layer_norm_eps=hf.get("layer_norm_epsilon", 1e-6),
            positional="relative",
            relative_buckets=hf.get("relative_attention_num_buckets", 32),
            relative_max_distance=hf.get("relative_attention_max_distance", 128),
            max_positions=hf.get("n_positions", 512),
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
        ValueError: see :func:`config_from_hf`; unknown, missing or mis-shaped keys, named.
    """
    source = str(root / "config.json")
    hf = read_config(root)
    c = config_from_hf(hf, source=source)
    headers = read_headers(weight_files(root))
    untied = "lm_head.weight" in headers and hf.get("tie_word_embeddings") is False
    forced_bos, forced_eos = forced_token_ids(root, hf, source)
    c = replace(c, tie_embeddings=not untied, forced_bos_id=forced_bos, forced_eos_id=forced_eos)
    layer_rules = rules(c)
    if untied:
        layer_rules.append(Rule("lm_head.weight", ("lm_head.weight",)))
    with torch.device("meta"):
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
