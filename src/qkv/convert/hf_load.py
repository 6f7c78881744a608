"""``load_hf``: a Hugging Face ``save_pretrained`` directory as qkv's own model.

``bert`` becomes :class:`qkv.models.bert.BertEncoder` (:mod:`qkv.convert.hf_bert`); ``llama``,
``qwen2``, ``mistral`` (:mod:`qkv.convert.hf_llama`) and ``gpt2`` (:mod:`qkv.convert.hf_gpt2`)
become :class:`qkv.DecoderOnlyLM`; ``bart``, ``marian`` (:mod:`qkv.convert.hf_seq2seq`) and
``t5`` (:mod:`qkv.convert.hf_t5`) become :class:`qkv.Transformer`. The config is read and
checked first, then the weight headers against the shapes it implies; tensors are allocated only
when everything fits.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import torch
from torch import nn

import qkv.convert.hf_gpt2 as hf_gpt2
import qkv.convert.hf_llama as hf_llama
import qkv.convert.hf_seq2seq as hf_seq2seq
import qkv.convert.hf_t5 as hf_t5
from qkv.convert.hf_bert import load_bert
from qkv.convert.hf_files import (
    check_against,
    check_layers,
    expand_rules,
    read_config,
    read_headers,
    read_tensors,
    to_qkv,
    weight_files,
)
from qkv.functional import BACKENDS, Backend
from qkv.models.decoder_only import DecoderOnlyLM
from qkv.models.registry import load_weights
from qkv.nn.meta import on_meta
from qkv.nn.multihead import MultiHeadAttention

__all__ = ["DECODERS", "load_hf"]

DECODERS: dict[str, ModuleType] = {t: m for m in (hf_llama, hf_gpt2) for t in m.MODEL_TYPES}
"""HF ``model_type`` -> the module that converts it to a :class:`DecoderOnlyLM`."""


def _load_decoder(root: Path, kind: str) -> DecoderOnlyLM:
    spec = DECODERS[kind]
    source = str(root / "config.json")
    config = spec.config_from_hf(read_config(root), source=source)
    headers = read_headers(weight_files(root))
    original = {k.removeprefix(spec.PREFIX): k for k in headers}
    # layers before anything is built (see check_layers)
    check_layers(source, spec.LAYERS_KEY, config.num_layers, original, spec.rules(config))
    rules = expand_rules(spec.rules(config), config.num_layers)
    ignored = dict(spec.IGNORED)
    if config.tie_embeddings:
        ignored["lm_head.weight"] = "the head is tied to the token embedding"
    with on_meta():
        shapes = {k: tuple(v.shape) for k, v in DecoderOnlyLM(config).state_dict().items()}
    check_against(
        f"{kind} checkpoint {str(root)!r} (keys named without the {spec.PREFIX!r} prefix)",
        {k: headers[o] for k, o in original.items()},
        rules,
        shapes,
        ignored,
    )
    loaded = read_tensors(headers, [original[r.hf] for r in rules])
    state = to_qkv(rules, {k: loaded[o] for k, o in original.items() if o in loaded})
    state = {k: v.to(torch.float32) for k, v in state.items()}
    if config.tie_embeddings:
        state["lm_head.weight"] = state["embed.weight"]
    model = DecoderOnlyLM(config)
    load_weights(model, state, str(root))
    return model


def load_hf(
    path: str | Path,
    *,
    backend: Backend = "auto",
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> nn.Module:
    """Load a Hugging Face ``save_pretrained`` directory into qkv's own model, in eval mode.

    Args:
        path: a directory with ``config.json`` and ``model.safetensors`` (or shards
            ``model-0000x-of-0000y.safetensors`` with ``model.safetensors.index.json``).
        backend: the attention backend of every layer.
        device: where the parameters go.
        dtype: parameter dtype (checkpoint tensors are cast to it).

    Returns:
        A :class:`~qkv.models.bert.BertEncoder` (``bert``), a :class:`~qkv.DecoderOnlyLM`
        (``llama``, ``qwen2``, ``mistral``, ``gpt2``) or a :class:`~qkv.Transformer` (``bart``,
        ``marian``: :mod:`qkv.convert.hf_seq2seq`; ``t5``: :mod:`qkv.convert.hf_t5`); a
        decoder's ``forward(ids, padding_mask)`` gives the logits of ``*ForCausalLM``
        (``padding_mask`` True = padding).

    Raises:
        FileNotFoundError: no such directory, no ``config.json``, no safetensors weights (a
            pickle is never read).
        ValueError: an unknown ``model_type``, an unsupported option, and unknown, missing or
            mis-shaped keys, each named; an unknown backend.
    """
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"checkpoint directory {str(root)!r} does not exist")
    kind = read_config(root).get("model_type")
    if kind == "bert":
        return load_bert(root, backend=backend, device=device, dtype=dtype)
    known = ["bert", *DECODERS, *hf_seq2seq.MODEL_TYPES, *hf_t5.MODEL_TYPES]
    if kind not in known:
        raise ValueError(
            f"{root / 'config.json'}: model_type={kind!r} is not supported; known: {sorted(known)}"
        )
    model: nn.Module
    if kind in hf_seq2seq.MODEL_TYPES:
        model = hf_seq2seq.load_seq2seq(root, kind)
    elif kind in hf_t5.MODEL_TYPES:
        model = hf_t5.load_t5(root)
    else:
        model = _load_decoder(root, kind)
        if kind in hf_gpt2.MODEL_TYPES:
            hf_gpt2.keep_conv1d_layout(model)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    for m in model.modules():
        if isinstance(m, MultiHeadAttention):
            m.backend = backend
    return model.to(device=device, dtype=dtype).eval()
