"""Hugging Face BART and Marian (MarianMT) <-> :class:`qkv.Transformer`.

Both are post-norm encoder–decoders with biases everywhere, one token embedding shared by the
encoder, the decoder and the head, no final norm on either stack, and a ``final_logits_bias``
(qkv's ``head_bias``). They differ in positions and embeddings:

* BART learns one position table per stack, stored with 2 unused leading rows (its positions
  are offset by 2), and normalises the embeddings (``layernorm_embedding``, qkv's
  ``embed_norm``); its embeddings are unscaled.
* Marian's positions are fixed sinusoids with the sines in the first half of each vector and the
  cosines in the second (not interleaved as qkv's ``"sinusoidal"``); they are not saved, so they
  are computed here as ``transformers`` computes them and loaded as a fixed ``"learned"`` table
  shared by both stacks. Its decoder starts from the pad token (qkv's ``bos_id == pad_id``).

``decoder_start_token_id`` becomes qkv's ``bos_id``, the token :meth:`Transformer.generate`
starts from (BART's is its ``eos_token_id``); ``forced_bos_token_id`` / ``forced_eos_token_id``
(BART's default config forces its eos at the last step) become ``forced_bos_id`` /
``forced_eos_id``, read as ``transformers`` reads them
(:func:`~qkv.convert.hf_tokens.forced_token_ids`).
Shapes: V vocabulary, D model width, L positions.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from qkv.convert.hf_files import (
    Header,
    Rule,
    check_against,
    check_layers,
    expand_rules,
    from_qkv,
    read_config,
    read_headers,
    read_tensors,
    to_qkv,
    weight_files,
    write_dir,
)
from qkv.convert.hf_tokens import forced_token_ids, required_ids, token_id
from qkv.convert.hf_values import hf_bool, hf_int, hf_str
from qkv.models.config import TransformerConfig
from qkv.models.registry import load_weights
from qkv.models.transformer import Transformer
from qkv.nn.feed_forward import Activation
from qkv.nn.meta import on_meta

__all__ = [
    "MARIAN_TABLE",
    "MODEL_TYPES",
    "PREFIX",
    "config_from_hf",
    "config_to_hf",
    "load_seq2seq",
    "marian_positions",
    "save_bart",
]

MODEL_TYPES: tuple[str, ...] = ("bart", "marian")
PREFIX = "model."
BART_POSITION_OFFSET = 2
"""BART's position ``p`` is row ``p + 2`` of its tables (rows 0 and 1 are never read)."""
MARIAN_TABLE = 2**27
"""The most elements (positions x width) of Marian's sinusoid table, which is computed (in
float64), not read: 512 MiB in float32; a released Marian is 512 x 512."""

_ACTIVATIONS: dict[str, Activation] = {
    "gelu": "gelu",
    "relu": "relu",
    "swish": "silu",
    "silu": "silu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
}
_ATTN = ("q_proj", "k_proj", "v_proj", "out_proj")
_TIED = {
    "encoder.embed_tokens.weight": "the encoder's copy of the shared embedding",
    "decoder.embed_tokens.weight": "the decoder's copy of the shared embedding",
}


def _layer_rules(stack: str, sublayers: list[tuple[str, str, str]]) -> list[Rule]:
    """Rules of one stack's layers: (HF attention, qkv attention, the norm after it) triples,
    then the feed-forward block and its norm."""
    out: list[Rule] = []
    L = f"{stack}.layers.{{}}."
    for hf_attn, ours, norm in sublayers:
        for proj in _ATTN:
            for p in ("weight", "bias"):
                out.append(Rule(f"{L}{hf_attn}.{proj}.{p}", (f"{L}{ours}.{proj}.{p}",)))
        for p in ("weight", "bias"):
            out.append(Rule(f"{L}{hf_attn}_layer_norm.{p}", (f"{L}{norm}.{p}",)))
    last = f"norm{len(sublayers) + 1}"
    for p in ("weight", "bias"):
        out += [
            Rule(f"{L}fc1.{p}", (f"{L}ffn.fc1.{p}",)),
            Rule(f"{L}fc2.{p}", (f"{L}ffn.fc2.{p}",)),
            Rule(f"{L}final_layer_norm.{p}", (f"{L}{last}.{p}",)),
        ]
    return out


def _templates() -> tuple[list[Rule], list[Rule]]:
    """The encoder's and the decoder's layer rules, ``{}`` not expanded."""
    enc = _layer_rules("encoder", [("self_attn", "self_attn", "norm1")])
    dec = _layer_rules(
        "decoder", [("self_attn", "self_attn", "norm1"), ("encoder_attn", "cross_attn", "norm2")]
    )
    return enc, dec


def rules(c: TransformerConfig) -> list[Rule]:
    """The key rules (HF keys without ``PREFIX``) of the layers and embedding norms, expanded;
    the shared embedding, the positions and the head are mapped by hand (see the module)."""
    enc, dec = _templates()
    out = expand_rules(enc, c.num_encoder_layers) + expand_rules(dec, c.num_decoder_layers)
    if c.embed_norm:
        for stack, ours in (("encoder", "src_embed_norm"), ("decoder", "tgt_embed_norm")):
            for p in ("weight", "bias"):
                out.append(Rule(f"{stack}.layernorm_embedding.{p}", (f"{ours}.{p}",)))
    return out


def config_from_hf(hf: Mapping[str, Any], *, source: str = "config.json") -> TransformerConfig:
    """A BART or Marian ``config.json`` (parsed) as a :class:`TransformerConfig`.

    Every value is read with :mod:`qkv.convert.hf_values`: sizes are ints in
    ``[1, MAX_SIZE]``, flags ``true`` / ``false``, names strings.

    Raises:
        ValueError: an option qkv does not build (encoder and decoder of different widths or
            head counts, heads that do not divide ``d_model``, pre-norm layers, separate source
            and target vocabularies, an unknown activation), a missing size, a value of the
            wrong type or beyond its bounds (Marian: a sinusoid table over
            :data:`MARIAN_TABLE` elements), or a value the config rejects; each named with its
            key.
    """
    kind = hf.get("model_type")
    V = hf_int(hf, "vocab_size", source)
    D = hf_int(hf, "d_model", source)
    assert D is not None  # required
    heads = hf_int(hf, "encoder_attention_heads", source)
    ffn = hf_int(hf, "encoder_ffn_dim", source, default=4 * D)
    sizes = {
        "encoder_attention_heads": heads,
        "decoder_attention_heads": hf_int(hf, "decoder_attention_heads", source, default=heads),
        "encoder_ffn_dim": ffn,
        "decoder_ffn_dim": hf_int(hf, "decoder_ffn_dim", source, default=ffn),
    }
    encoder_layers = hf_int(hf, "encoder_layers", source)
    decoder_layers = hf_int(hf, "decoder_layers", source)
    positions = hf_int(hf, "max_position_embeddings", source, default=1024)
    # required or defaulted, so ints
    assert V and heads and ffn and encoder_layers and decoder_layers and positions
    problems = []
    for a, b in (
        ("encoder_attention_heads", "decoder_attention_heads"),
        ("encoder_ffn_dim", "decoder_ffn_dim"),
    ):
        if sizes[a] != sizes[b]:
            problems.append(f"{a}={sizes[a]} != {b}={sizes[b]} (qkv's stacks share them)")
    if D % heads:
        problems.append(
            f"d_model={D} is not divisible by encoder_attention_heads={heads} (qkv's heads "
            "split the width)"
        )
    act = hf_str(hf, "activation_function", source, default="gelu")
    if act not in _ACTIVATIONS:
        problems.append(f"activation_function={act!r} (known: {sorted(_ACTIVATIONS)})")
    for flag in ("normalize_before", "add_final_layer_norm"):
        if hf_bool(hf, flag, source, default=False):
            problems.append(f"{flag}=true (pre-norm, mBART-style, is not mapped)")
    if kind == "marian":
        if positions * D > MARIAN_TABLE:
            raise ValueError(
                f"{source}: max_position_embeddings={positions} * d_model={D} is more than "
                f"{MARIAN_TABLE}, the largest sinusoid table qkv computes"
            )
        if not hf_bool(hf, "share_encoder_decoder_embeddings", source, default=True):
            problems.append("share_encoder_decoder_embeddings=false")
        target_vocab = hf_int(hf, "decoder_vocab_size", source, default=V, nullable=True)
        if target_vocab != V:
            problems.append(f"decoder_vocab_size={target_vocab} != vocab_size={V}")
    if problems:
        raise ValueError(f"{source}: unsupported {kind} options: " + "; ".join(problems))
    pad = token_id(hf, "pad_token_id", source)
    eos = token_id(hf, "eos_token_id", source)
    start = token_id(hf, "decoder_start_token_id", source)
    pad, eos, start = required_ids(source, V, pad=pad, eos=eos, decoder_start=start)
    try:
        return TransformerConfig(
            V,
            V,
            d_model=D,
            num_heads=heads,
            dim_feedforward=ffn,
            num_encoder_layers=encoder_layers,
            num_decoder_layers=decoder_layers,
            dropout=0.0,
            activation=_ACTIVATIONS[act],
            norm_first=False,
            norm="layer",
            layer_norm_eps=1e-5,
            positional="learned",
            max_positions=positions,
            tie_embeddings=hf_bool(hf, "tie_word_embeddings", source, default=True),
            pad_id=pad,
            bos_id=start,
            eos_id=eos,
            scale_embeddings=hf_bool(hf, "scale_embedding", source, default=False),
            embed_norm=kind == "bart",
            final_norm=False,
            share_positions=kind != "bart",
            head_bias=True,
        )
    except (TypeError, ValueError) as err:
        raise ValueError(f"{source}: {err}") from None


def marian_positions(max_positions: int, d_model: int) -> Tensor:
    """Marian's sinusoids: angle ``p / 10000^(2(j // 2) / D)``, the sines of the even ``j`` in
    the first half of each vector, the cosines of the odd ``j`` in the second.

    Returns:
        float32 ``[L, D]``, computed in float64 as ``transformers`` does.
    """
    pos = torch.arange(max_positions, dtype=torch.float64)[:, None]  # [L, 1]
    j = torch.arange(d_model, dtype=torch.float64)  # [D]
    angles = pos / torch.pow(10000.0, 2 * torch.div(j, 2, rounding_mode="floor") / d_model)
    half = (d_model + 1) // 2
    table = torch.empty(max_positions, d_model, dtype=torch.float64)  # [L, D]
    table[:, :half] = torch.sin(angles[:, 0::2])
    table[:, half:] = torch.cos(angles[:, 1::2])
    return table.to(torch.float32)


def _check_special(
    kind: str, c: TransformerConfig, headers: Mapping[str, Header], source: str
) -> dict[str, tuple[int, ...]]:
    """The shapes the hand-mapped keys must have; raises naming each that differs."""
    V, D, L = c.tgt_vocab_size, c.d_model, c.max_positions
    want: dict[str, tuple[int, ...]] = {"shared.weight": (V, D), "final_logits_bias": (1, V)}
    if kind == "bart":
        for stack in ("encoder", "decoder"):
            want[f"{stack}.embed_positions.weight"] = (L + BART_POSITION_OFFSET, D)
    if not c.tie_embeddings:
        want["lm_head.weight"] = (V, D)
    bad = [
        f"{k} has shape {list(headers[k].shape)}, expected {list(s)}"
        for k, s in want.items()
        if k in headers and headers[k].shape != s
    ]
    missing = [k for k in want if k not in headers and k != "final_logits_bias"]
    if bad or missing:
        raise ValueError(
            f"{kind} checkpoint {source!r} does not fit its config: "
            + "; ".join(bad + [f"missing {k}" for k in missing])
        )
    return want


def load_seq2seq(root: Path, kind: str) -> Transformer:
    """Read a BART or Marian ``save_pretrained`` directory into a :class:`Transformer`.

    Raises:
        ValueError: see :func:`config_from_hf`; a layer count beyond the layers the weights
            hold (checked before anything is built); unknown, missing or mis-shaped keys, named.
    """
    source = str(root / "config.json")
    hf = read_config(root)
    forced_bos, forced_eos = forced_token_ids(root, hf, source)
    c = replace(
        config_from_hf(hf, source=source), forced_bos_id=forced_bos, forced_eos_id=forced_eos
    )
    raw = read_headers(weight_files(root))
    # BartForConditionalGeneration / MarianMTModel prefix the body with "model."; the bare
    # BartModel / MarianModel do not; the head and its bias have no prefix
    headers = {k.removeprefix(PREFIX): h for k, h in raw.items()}
    original = {k.removeprefix(PREFIX): k for k in raw}
    for key, count, templates in zip(
        ("encoder_layers", "decoder_layers"),
        (c.num_encoder_layers, c.num_decoder_layers),
        _templates(),
        strict=True,
    ):
        check_layers(source, key, count, headers, templates)  # before anything is built
    layer_rules = rules(c)
    special = _check_special(kind, c, headers, str(root))
    with on_meta():
        shapes = {k: tuple(v.shape) for k, v in Transformer(c).state_dict().items()}
    ignored = {**_TIED, "embed_positions.weight": "Marian's fixed sinusoids, recomputed"}
    if c.tie_embeddings:
        ignored["lm_head.weight"] = "the head is tied to the shared embedding"
    check_against(
        f"{kind} checkpoint {str(root)!r} (keys named without the {PREFIX!r} prefix)",
        {k: h for k, h in headers.items() if k not in special},
        layer_rules,
        shapes,
        ignored,
    )
    wanted = [r.hf for r in layer_rules] + [k for k in special if k in headers]
    loaded = read_tensors(raw, [original[k] for k in wanted])
    t = {k: loaded[original[k]].to(torch.float32) for k in wanted}
    state = to_qkv(layer_rules, t)
    state["src_embed.weight"] = t["shared.weight"]
    state["tgt_embed.weight"] = t["shared.weight"]
    state["lm_head.weight"] = t["lm_head.weight"] if not c.tie_embeddings else t["shared.weight"]
    state["lm_head.bias"] = t.get("final_logits_bias", torch.zeros(1, c.tgt_vocab_size))[0]
    if kind == "bart":
        cut = BART_POSITION_OFFSET
        state["positional.embedding.weight"] = t["encoder.embed_positions.weight"][cut:]
        state["tgt_positional.embedding.weight"] = t["decoder.embed_positions.weight"][cut:]
    else:
        state["positional.embedding.weight"] = marian_positions(c.max_positions, c.d_model)
    model = Transformer(c)
    load_weights(model, state, str(root))
    return model


def config_to_hf(c: TransformerConfig) -> dict[str, Any]:
    """A :class:`TransformerConfig` that fits BART as a ``BartConfig`` dict.

    Raises:
        ValueError: each option BART cannot express, named with its value.
    """
    wanted: dict[str, object] = {
        "norm_first": False,
        "norm": "layer",
        "positional": "learned",
        "embed_norm": True,
        "final_norm": False,
        "share_positions": False,
        "head_bias": True,
        "qkv_bias": True,
        "out_bias": True,
        "ffn_bias": True,
        "num_kv_heads": None,
        "layer_norm_eps": 1e-5,
        "src_vocab_size": c.tgt_vocab_size,
    }
    bad = [
        f"{k}={getattr(c, k)!r} (BART needs {v!r})" for k, v in wanted.items() if getattr(c, k) != v
    ]
    acts = {v: k for k, v in _ACTIVATIONS.items() if k != "swish"}
    if c.activation not in acts:
        bad.append(f"activation={c.activation!r}")
    if bad:
        raise ValueError("this Transformer does not fit BART: " + "; ".join(bad))
    return {
        "architectures": ["BartForConditionalGeneration"],
        "model_type": "bart",
        "vocab_size": c.tgt_vocab_size,
        "d_model": c.d_model,
        "encoder_layers": c.num_encoder_layers,
        "decoder_layers": c.num_decoder_layers,
        "encoder_attention_heads": c.num_heads,
        "decoder_attention_heads": c.num_heads,
        "encoder_ffn_dim": c.dim_feedforward,
        "decoder_ffn_dim": c.dim_feedforward,
        "activation_function": acts[c.activation],
        "max_position_embeddings": c.max_positions,
        "scale_embedding": c.scale_embeddings,
        "tie_word_embeddings": c.tie_embeddings,
        "pad_token_id": c.pad_id,
        "eos_token_id": c.eos_id,
        "decoder_start_token_id": c.bos_id,
        "forced_bos_token_id": c.forced_bos_id,
        "forced_eos_token_id": c.forced_eos_id,
        "dropout": 0.0,
        "attention_dropout": 0.0,
        "activation_dropout": 0.0,
        "dtype": "float32",
    }


def save_bart(model: Transformer, path: str | Path) -> Path:
    """Write ``model`` as a ``BartForConditionalGeneration`` directory.

    The source and target embeddings must be equal (BART shares one); the two unused leading
    rows of each position table are written as zeros.

    Raises:
        ValueError: an option BART cannot express, or different source and target embeddings.
    """
    c = model.config
    hf_config = config_to_hf(c)
    sd = model.state_dict()
    if not torch.equal(sd["src_embed.weight"], sd["tgt_embed.weight"]):
        raise ValueError("BART shares one embedding: src_embed and tgt_embed must be equal")
    body = from_qkv(rules(c), sd)
    pad_rows = torch.zeros(BART_POSITION_OFFSET, c.d_model)  # [2, D]
    body["shared.weight"] = sd["tgt_embed.weight"]
    for stack, ours in (("encoder", "positional"), ("decoder", "tgt_positional")):
        table = sd[f"{ours}.embedding.weight"].detach()  # [L, D]
        body[f"{stack}.embed_positions.weight"] = torch.cat([pad_rows, table])  # [L + 2, D]
    tensors = {PREFIX + k: v.detach().contiguous() for k, v in body.items()}
    tensors["final_logits_bias"] = sd["lm_head.bias"].detach()[None].contiguous()  # [1, V]
    if not c.tie_embeddings:
        tensors["lm_head.weight"] = sd["lm_head.weight"].detach().contiguous()
    return write_dir(Path(path), hf_config, tensors)
