"""Hugging Face Llama (and the Llama-shaped Qwen2, Mistral) <-> :class:`qkv.DecoderOnlyLM`.

The three differ, for qkv, only in biases (Qwen2: on q/k/v, not on the output projection) and in
Mistral's sliding window, refused here when it is shorter than the positions (qkv's decoder
attends to every earlier token). The rest maps one to one: RMSNorm pre-norm blocks, SwiGLU
(``gate_proj`` -> ``ffn.gate``, ``up_proj`` -> ``ffn.fc1``, ``down_proj`` -> ``ffn.fc2``), rotary
positions in HF's half-split layout, grouped-query attention, tied or untied head.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from qkv.convert.hf_files import Rule, decoder_config
from qkv.convert.hf_tokens import token_id
from qkv.convert.hf_values import hf_bool, hf_dict, hf_float, hf_int, hf_str
from qkv.models.config import DecoderOnlyConfig

__all__ = [
    "IGNORED",
    "LAYERS_KEY",
    "MAX_POSITIONS",
    "MODEL_TYPES",
    "PREFIX",
    "config_from_hf",
    "config_to_hf",
    "rules",
]

MODEL_TYPES: tuple[str, ...] = ("llama", "qwen2", "mistral")
PREFIX = "model."
"""The prefix ``*ForCausalLM`` puts on the body's keys (``lm_head`` has none)."""
LAYERS_KEY = "num_hidden_layers"
"""The config key of the layer count (checked against the layers the weights hold)."""

IGNORED: dict[str, str] = {
    "rotary_emb.inv_freq": "RoPE frequencies, recomputed from rope_theta",
}

_BODY = [
    Rule("embed_tokens.weight", ("embed.weight",)),
    Rule("norm.weight", ("blocks.norm.weight",)),
    Rule("layers.{}.input_layernorm.weight", ("blocks.layers.{}.norm1.weight",)),
    Rule("layers.{}.post_attention_layernorm.weight", ("blocks.layers.{}.norm2.weight",)),
    Rule("layers.{}.mlp.gate_proj.weight", ("blocks.layers.{}.ffn.gate.weight",)),
    Rule("layers.{}.mlp.up_proj.weight", ("blocks.layers.{}.ffn.fc1.weight",)),
    Rule("layers.{}.mlp.down_proj.weight", ("blocks.layers.{}.ffn.fc2.weight",)),
]
_PROJ = {"q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj", "o_proj": "out_proj"}


MAX_POSITIONS = 2**21
"""The most positions a rotary model may give: qkv builds the cos/sin tables of every position
when it loads (2 x 2**21 x head_dim floats, 2 GiB at head_dim 128)."""


def _rope_theta(hf: Mapping[str, Any], source: str) -> float:
    params = hf_dict(hf, "rope_parameters", source)
    scaling = hf_dict(hf, "rope_scaling", source)
    rope_type: object = "default"
    for key, given in (("rope_parameters", params), ("rope_scaling", scaling)):
        kind = given.get("rope_type", given.get("type"))
        if kind is not None and not isinstance(kind, str):
            raise ValueError(f"{source}: {key}.rope_type must be a string, got {kind!r}")
        if kind not in (None, "default"):
            rope_type = kind
    if rope_type != "default":
        raise ValueError(f"{source}: RoPE scaling rope_type={rope_type!r} is not supported")
    if "rope_theta" in params:
        return hf_float(params, "rope_theta", f"{source}: rope_parameters", default=10000.0)
    return hf_float(hf, "rope_theta", source, default=10000.0)


def config_from_hf(hf: Mapping[str, Any], *, source: str = "config.json") -> DecoderOnlyConfig:
    """A Llama / Qwen2 / Mistral ``config.json`` (parsed) as a :class:`DecoderOnlyConfig`.

    Raises:
        ValueError: an option qkv does not build (RoPE scaling, a sliding window shorter than the
            positions, an activation other than SiLU, a head width other than
            ``hidden_size / num_attention_heads``, Llama's ``pretraining_tp`` > 1), a missing
            size, a value of the wrong type or beyond its bounds, or a value the config
            rejects; each named with its key.
    """
    kind = hf.get("model_type")
    V = hf_int(hf, "vocab_size", source)
    D = hf_int(hf, "hidden_size", source)
    H = hf_int(hf, "num_attention_heads", source)
    layers = hf_int(hf, LAYERS_KEY, source)
    ffn = hf_int(hf, "intermediate_size", source)
    kv = hf_int(hf, "num_key_value_heads", source, default=H, nullable=True)
    positions = hf_int(hf, "max_position_embeddings", source, default=2048, high=MAX_POSITIONS)
    assert D is not None and H is not None and positions is not None  # required / defaulted
    problems = []
    act = hf_str(hf, "hidden_act", source, default="silu")
    if act != "silu":
        problems.append(f"hidden_act={act!r} (only 'silu', SwiGLU, is built)")
    head_dim = hf_int(hf, "head_dim", source, default=None, nullable=True)
    if head_dim is not None and head_dim * H != D:
        problems.append(f"head_dim={head_dim} != hidden_size / num_attention_heads = {D / H:g}")
    tp = hf_int(hf, "pretraining_tp", source, default=1, nullable=True)
    if tp != 1:
        problems.append(f"pretraining_tp={tp}")
    window = hf_int(hf, "sliding_window", source, default=None, nullable=True)
    uses_window = hf_bool(hf, "use_sliding_window", source, default=kind == "mistral")
    if uses_window and window is not None and window < positions:
        problems.append(f"sliding_window={window} (qkv's decoder attends to every earlier token)")
    attention_bias = hf_bool(hf, "attention_bias", source, default=False)
    qkv_bias = kind == "qwen2" or attention_bias
    return decoder_config(
        hf,
        source,
        problems,
        vocab_size=V,
        num_layers=layers,
        d_model=D,
        num_heads=H,
        num_kv_heads=kv,
        dim_feedforward=ffn,
        activation="swiglu",
        norm="rms",
        layer_norm_eps=hf_float(hf, "rms_norm_eps", source, default=1e-6),
        positional="rotary",
        rope_theta=_rope_theta(hf, source),
        rope_layout="half_split",  # HF's rotate_half; Meta's interleaved weights come permuted
        max_positions=positions,
        tie_embeddings=hf_bool(hf, "tie_word_embeddings", source, default=False),
        qkv_bias=qkv_bias,
        out_bias=kind != "qwen2" and attention_bias,
        ffn_bias=hf_bool(hf, "mlp_bias", source, default=False),
        pad_id=token_id(hf, "pad_token_id", source),
    )


def config_to_hf(c: DecoderOnlyConfig) -> dict[str, Any]:
    """A :class:`DecoderOnlyConfig` whose options fit Llama as a ``LlamaConfig`` dict.

    Raises:
        ValueError: each option that Llama cannot express, named with its value.
    """
    wanted = {
        "activation": "swiglu",
        "norm": "rms",
        "norm_first": True,
        "positional": "rotary",
        "rope_layout": "half_split",
        "qkv_bias": c.out_bias,  # Llama has one attention_bias for all four projections
    }
    bad = [
        f"{k}={getattr(c, k)!r} (Llama needs {v!r})"
        for k, v in wanted.items()
        if getattr(c, k) != v
    ]
    if bad:
        raise ValueError("this DecoderOnlyLM does not fit Llama: " + "; ".join(bad))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": c.vocab_size,
        "hidden_size": c.d_model,
        "intermediate_size": c.dim_feedforward,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads or c.num_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": c.max_positions,
        "rms_norm_eps": c.layer_norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
        "attention_bias": c.qkv_bias,
        "mlp_bias": c.ffn_bias,
        "tie_word_embeddings": c.tie_embeddings,
        "bos_token_id": None,
        "eos_token_id": c.eos_id,
        "pad_token_id": c.pad_id,
        "dtype": "float32",
    }


def rules(c: DecoderOnlyConfig) -> list[Rule]:
    """The key rules of a Llama-shaped checkpoint for ``c`` (HF keys with ``PREFIX`` removed)."""
    out = list(_BODY)
    for hf, ours in _PROJ.items():
        out.append(
            Rule(
                f"layers.{{}}.self_attn.{hf}.weight",
                (f"blocks.layers.{{}}.self_attn.{ours}.weight",),
            )
        )
        if c.out_bias if hf == "o_proj" else c.qkv_bias:
            out.append(
                Rule(
                    f"layers.{{}}.self_attn.{hf}.bias",
                    (f"blocks.layers.{{}}.self_attn.{ours}.bias",),
                )
            )
    if c.ffn_bias:
        for hf, ours in (("gate_proj", "gate"), ("up_proj", "fc1"), ("down_proj", "fc2")):
            out.append(Rule(f"layers.{{}}.mlp.{hf}.bias", (f"blocks.layers.{{}}.ffn.{ours}.bias",)))
    if not c.tie_embeddings:
        out.append(Rule("lm_head.weight", ("lm_head.weight",)))
    return out
