"""Hugging Face BERT checkpoints -> :class:`qkv.models.bert.BertEncoder`.

A checkpoint directory holds ``config.json`` (sizes), ``model.safetensors`` or its shards
(weights, read by :mod:`qkv.convert.hf_files`) and, for :mod:`qkv.apps.embed` only,
``tokenizer.json``. Weights are read with ``safetensors`` only: a pickle
(``pytorch_model.bin``) can run arbitrary code when loaded, so it is
refused, never opened.

Every checkpoint key is accounted for by :data:`KEY_MAP` (``{}`` stands for the layer index), by
:data:`IGNORED_PREFIXES` (heads this encoder does not have, listed with their reason) or by the
``embeddings.position_ids`` buffer (checked to be ``0..P-1``, then dropped). Anything else, any
model key the checkpoint lacks, and any tensor whose shape differs from what ``config.json``
implies is an error that names the keys. Keys may carry the ``bert.`` prefix that task models
(``BertForMaskedLM``, ``BertForPreTraining``, ...) put on the encoder, or not.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from qkv.convert.hf_files import (
    INDEX_FILE,
    listing,
    read_config,
    read_headers,
    read_tensors,
    require_keys,
    weight_files,
)
from qkv.convert.hf_values import hf_float, hf_int
from qkv.models.bert import BertConfig, BertEncoder
from qkv.nn.meta import on_meta

__all__ = [
    "IGNORED_PREFIXES",
    "KEY_MAP",
    "REQUIRED_FILES",
    "WEIGHT_FILES",
    "bert_config_from_hf",
    "check_checkpoint_dir",
    "convert_bert_state_dict",
    "load_bert",
    "read_bert_checkpoint",
]

REQUIRED_FILES: tuple[str, ...] = ("config.json", "model.safetensors", "tokenizer.json")
"""What ``qkv embed`` needs (weights and tokenizer)."""
WEIGHT_FILES: tuple[str, ...] = ("config.json", "model.safetensors")
"""What loading the weights needs (``model.safetensors`` may be sharded, with its index)."""

KEY_MAP: dict[str, str] = {
    "embeddings.word_embeddings.weight": "embeddings.word_embeddings.weight",
    "embeddings.position_embeddings.weight": "embeddings.position_embeddings.weight",
    "embeddings.token_type_embeddings.weight": "embeddings.token_type_embeddings.weight",
    "embeddings.LayerNorm.weight": "embeddings.norm.weight",
    "embeddings.LayerNorm.bias": "embeddings.norm.bias",
    "encoder.layer.{}.attention.self.query.weight": "encoder.layers.{}.self_attn.q_proj.weight",
    "encoder.layer.{}.attention.self.query.bias": "encoder.layers.{}.self_attn.q_proj.bias",
    "encoder.layer.{}.attention.self.key.weight": "encoder.layers.{}.self_attn.k_proj.weight",
    "encoder.layer.{}.attention.self.key.bias": "encoder.layers.{}.self_attn.k_proj.bias",
    "encoder.layer.{}.attention.self.value.weight": "encoder.layers.{}.self_attn.v_proj.weight",
    "encoder.layer.{}.attention.self.value.bias": "encoder.layers.{}.self_attn.v_proj.bias",
    "encoder.layer.{}.attention.output.dense.weight": "encoder.layers.{}.self_attn.out_proj.weight",
    "encoder.layer.{}.attention.output.dense.bias": "encoder.layers.{}.self_attn.out_proj.bias",
    "encoder.layer.{}.attention.output.LayerNorm.weight": "encoder.layers.{}.norm1.weight",
    "encoder.layer.{}.attention.output.LayerNorm.bias": "encoder.layers.{}.norm1.bias",
    "encoder.layer.{}.intermediate.dense.weight": "encoder.layers.{}.ffn.fc1.weight",
    "encoder.layer.{}.intermediate.dense.bias": "encoder.layers.{}.ffn.fc1.bias",
    "encoder.layer.{}.output.dense.weight": "encoder.layers.{}.ffn.fc2.weight",
    "encoder.layer.{}.output.dense.bias": "encoder.layers.{}.ffn.fc2.bias",
    "encoder.layer.{}.output.LayerNorm.weight": "encoder.layers.{}.norm2.weight",
    "encoder.layer.{}.output.LayerNorm.bias": "encoder.layers.{}.norm2.bias",
}
"""Hugging Face key (``{}`` = layer index) -> :class:`BertEncoder` state-dict key."""

IGNORED_PREFIXES: dict[str, str] = {
    "pooler.": "BertModel's pooler, tanh(dense(h[CLS])), feeds the next-sentence and "
    "classification heads; sentence embeddings mean-pool the last hidden states instead",
    "cls.predictions.": "masked-language-model head (predicts vocabulary tokens), "
    "used in pre-training only",
    "cls.seq_relationship.": "next-sentence-prediction head, used in pre-training only",
}
"""Checkpoint key prefixes that are skipped (and reported), with the reason."""

_POSITION_IDS = "embeddings.position_ids"
_FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")  # safetensors' names of floating dtypes
_TASK_PREFIX = "bert."
_LEGACY_NORM = re.compile(r"LayerNorm\.(gamma|beta)$")  # TF-era names for weight / bias
_PATTERNS = [
    (re.compile("^" + re.escape(hf).replace(r"\{\}", r"(\d+)") + "$"), ours)
    for hf, ours in KEY_MAP.items()
]


def check_checkpoint_dir(path: str | Path, files: tuple[str, ...] = REQUIRED_FILES) -> Path:
    """Check that ``path`` is a directory holding ``files`` (default :data:`REQUIRED_FILES`);
    ``model.safetensors`` may be shards listed in ``model.safetensors.index.json``.

    Returns:
        The directory as a ``Path``.

    Raises:
        FileNotFoundError: the directory or one of the files is missing (the message says which,
            and why a ``pytorch_model.bin`` found instead is not read).
    """
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"checkpoint directory {str(root)!r} does not exist")
    sharded = (root / INDEX_FILE).is_file()
    missing = [
        name
        for name in files
        if not (root / name).is_file() and not (name == "model.safetensors" and sharded)
    ]
    if missing:
        hint = ""
        pickle = any(root.glob("*.bin")) or any(root.glob("*.pt"))
        if "model.safetensors" in missing and pickle:
            hint = (
                "; a pickle checkpoint (*.bin / *.pt) is there, but qkv reads safetensors "
                "only, since unpickling can run arbitrary code"
            )
        raise FileNotFoundError(
            f"checkpoint directory {str(root)!r} lacks {', '.join(missing)} "
            f"(it needs {', '.join(files)}){hint}"
        )
    return root


def bert_config_from_hf(hf: Mapping[str, Any], *, source: str = "config.json") -> BertConfig:
    """Read a Hugging Face BERT ``config.json`` (as a dict) into a :class:`BertConfig`.

    Args:
        hf: the parsed JSON.
        source: where it came from, for error messages.

    Raises:
        ValueError: not a plain BERT encoder (``model_type`` other than ``"bert"``, relative
            positions, a decoder, cross-attention), a required size missing, or a size that
            :class:`BertConfig` rejects.
    """
    model_type = hf.get("model_type", "bert")
    if model_type != "bert":
        raise ValueError(
            f"{source}: model_type must be 'bert', got {model_type!r} (e.g. RoBERTa offsets its "
            "positions by the pad id, so its numbers would silently differ)"
        )
    position_type = hf.get("position_embedding_type", "absolute")
    if position_type != "absolute":
        raise ValueError(
            f"{source}: position_embedding_type must be 'absolute', got {position_type!r}"
        )
    for flag in ("is_decoder", "add_cross_attention"):
        if hf.get(flag, False):
            raise ValueError(f"{source}: {flag}=true is not a bidirectional encoder")
    required = (
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "intermediate_size",
    )
    require_keys(hf, required, source)
    for name in required:  # each named, and bounded before any shape is built from it
        hf_int(hf, name, source)
    for name in ("max_position_embeddings", "type_vocab_size"):
        hf_int(hf, name, source, default=None, nullable=True)
    hf_int(hf, "pad_token_id", source, default=None, low=0, nullable=True)
    if hf.get("layer_norm_eps") is not None:
        hf_float(hf, "layer_norm_eps", source, default=1e-12)
    optional = (
        "hidden_act",
        "hidden_dropout_prob",
        "attention_probs_dropout_prob",
        "max_position_embeddings",
        "type_vocab_size",
        "layer_norm_eps",
        "pad_token_id",
    )
    fields = {name: hf[name] for name in (*required, *optional) if hf.get(name) is not None}
    try:
        return BertConfig(**fields)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{source}: {err}") from None


def _hf_name(ours: str) -> str:
    """The checkpoint key that maps onto qkv key ``ours`` (for naming missing keys)."""
    layer = re.match(r"^encoder\.layers\.(\d+)\.(.*)$", ours)
    template = f"encoder.layers.{{}}.{layer[2]}" if layer else ours
    hf = next(h for h, o in KEY_MAP.items() if o == template)
    return hf.format(layer[1]) if layer else hf


def _map_key(key: str) -> tuple[str, int | None] | None:
    for pattern, ours in _PATTERNS:
        m = pattern.match(key)
        if m:
            return (ours.format(m.group(1)), int(m.group(1))) if m.groups() else (ours, None)
    return None


def convert_bert_state_dict(
    tensors: Mapping[str, Tensor], config: BertConfig
) -> tuple[dict[str, Tensor], dict[str, str]]:
    """Rename a Hugging Face BERT state dict to :class:`BertEncoder` keys and check it.

    Args:
        tensors: checkpoint key -> tensor (keys with or without the ``bert.`` prefix).
        config: the sizes the tensors must have.

    Returns:
        ``(state_dict, ignored)``: tensors under qkv keys, ready for ``load_state_dict`` with
        ``strict=True``, and each skipped checkpoint key with the reason it is not needed.

    Raises:
        ValueError: unknown keys (including layers beyond ``num_hidden_layers``), missing keys,
            layers ``num_hidden_layers`` names that the checkpoint lacks, tensors whose shape
            differs from the one ``config`` implies, two keys that name the same weight (with
            and without ``bert.``), a ``position_ids`` buffer that is not ``0..P-1``. One
            message lists every problem, naming the keys.
        TypeError: a weight that is not floating point.
    """
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    not_float = {k: str(v.dtype) for k, v in tensors.items() if not v.is_floating_point()}
    sources, ignored = _check_shapes(shapes, not_float, config)
    _check_position_ids(tensors, config)
    return {ours: tensors[key] for ours, key in sources.items()}, ignored


def _expected_shapes(config: BertConfig) -> dict[str, tuple[int, ...]]:
    """qkv key (``{}`` = layer index) -> shape.

    Taken from a one-layer encoder on the meta device (nothing allocated, however large the
    widths): building all ``num_hidden_layers`` layers, even on meta, takes seconds per
    thousand, so that a config.json claiming 20,000 layers took 30 s to refuse.
    """
    with on_meta():
        one = BertEncoder(dataclasses.replace(config, num_hidden_layers=1))
    out: dict[str, tuple[int, ...]] = {}
    for k, v in one.state_dict().items():
        out[re.sub(r"^encoder\.layers\.0\.", "encoder.layers.{}.", k)] = tuple(v.shape)
    return out


def _check_shapes(
    shapes: Mapping[str, tuple[int, ...]], not_float: Mapping[str, str], config: BertConfig
) -> tuple[dict[str, str], dict[str, str]]:
    """Check checkpoint keys and shapes against ``config`` (see :func:`convert_bert_state_dict`).

    Args:
        shapes: checkpoint key -> shape (of the tensors, or read from the headers).
        not_float: checkpoint key -> dtype, for the keys that are not floating point.
        config: the sizes the checkpoint must have.

    Returns:
        ``(sources, ignored)``: qkv key -> the checkpoint key holding it, and each skipped
        checkpoint key with its reason.
    """
    templates = _expected_shapes(config)
    N = config.num_hidden_layers
    source_of: dict[str, str] = {}
    found_in_layer: dict[int, int] = {}
    ignored: dict[str, str] = {}
    unknown: list[str] = []
    extra_layers: set[int] = set()
    misshaped: list[str] = []
    problems: list[str] = []
    for key in sorted(shapes):
        name = key[len(_TASK_PREFIX) :] if key.startswith(_TASK_PREFIX) else key
        name = _LEGACY_NORM.sub(
            lambda m: "LayerNorm." + {"gamma": "weight", "beta": "bias"}[m[1]], name
        )
        reason = next((r for p, r in IGNORED_PREFIXES.items() if name.startswith(p)), None)
        if reason is not None:
            ignored[key] = reason
            continue
        if name == _POSITION_IDS:
            ignored[key] = "a buffer holding the positions 0..P-1, recomputed in forward"
            continue
        mapped = _map_key(name)
        if mapped is None:
            unknown.append(key)
            continue
        ours, layer = mapped
        if layer is not None and layer >= N:
            extra_layers.add(layer)
            unknown.append(key)
            continue
        if ours in source_of:
            problems.append(f"{source_of[ours]} and {key} both hold {ours}")
            continue
        if key in not_float:
            raise TypeError(f"checkpoint tensor {key} must be floating point, got {not_float[key]}")
        want = templates[re.sub(r"^encoder\.layers\.\d+\.", "encoder.layers.{}.", ours)]
        if shapes[key] != want:
            misshaped.append(f"{key} has shape {list(shapes[key])}, expected {list(want)}")
        source_of[ours] = key
        if layer is not None:
            found_in_layer[layer] = found_in_layer.get(layer, 0) + 1
    held = 1 + max(found_in_layer, default=-1)  # layers 0 .. held-1 have at least one key
    if held < N:
        problems.append(
            f"config.json's num_hidden_layers={N} but the checkpoint holds "
            f"{held} layer(s) (encoder.layer.0 .. encoder.layer.{held - 1}): "
            f"{N - held} layer(s) missing"
        )
    missing = [
        k.format(i) if "{}" in k else k
        for k in templates
        for i in (range(held) if "{}" in k else (0,))
        if (k.format(i) if "{}" in k else k) not in source_of
    ]
    if unknown:
        note = ""
        if extra_layers:
            note = (
                f" (layers {sorted(extra_layers)} lie beyond config.json's num_hidden_layers={N})"
            )
        problems.insert(0, f"{len(unknown)} unknown key(s){note}: {listing(unknown)}")
    if missing:
        named = sorted(_hf_name(k) for k in missing)
        problems.append(f"{len(missing)} missing key(s): {listing(named)}")
    if misshaped:
        problems.append(
            f"{len(misshaped)} key(s) of another shape than config.json implies (check its "
            f"hidden_size, intermediate_size, vocab_size, max_position_embeddings, "
            f"type_vocab_size): {listing(misshaped)}"
        )
    if problems:
        raise ValueError("BERT checkpoint does not fit its config: " + "; ".join(problems))
    return {ours: source_of[ours] for ours in sorted(source_of)}, ignored


def _check_position_ids(tensors: Mapping[str, Tensor], config: BertConfig) -> None:
    """The ``position_ids`` buffer, where there is one, must be ``0..P-1``."""
    P = config.max_position_embeddings
    for key in (_POSITION_IDS, _TASK_PREFIX + _POSITION_IDS):
        value = tensors.get(key)
        if value is not None and (
            value.numel() != P or not torch.equal(value.reshape(-1).long(), torch.arange(P))
        ):
            raise ValueError(
                "BERT checkpoint does not fit its config: "
                f"{key} is not the positions 0..{P - 1} (shape {list(value.shape)})"
            )


def read_bert_checkpoint(
    path: str | Path,
) -> tuple[BertConfig, dict[str, Tensor], dict[str, str]]:
    """Read and check a checkpoint directory without building a model.

    Returns:
        ``(config, state_dict, ignored)`` as :func:`convert_bert_state_dict`.

    Raises:
        FileNotFoundError: as :func:`check_checkpoint_dir`.
        ValueError: unreadable ``config.json`` or ``model.safetensors``, or the problems listed
            by :func:`bert_config_from_hf` and :func:`convert_bert_state_dict`.
        TypeError: a weight that is not floating point.
    """
    root = check_checkpoint_dir(path, WEIGHT_FILES)
    config = bert_config_from_hf(read_config(root), source=str(root / "config.json"))
    headers = read_headers(weight_files(root))
    # Keys and shapes from the headers first: nothing is read or built before they fit.
    sources, ignored = _check_shapes(
        {k: h.shape for k, h in headers.items()},
        {k: h.dtype for k, h in headers.items() if h.dtype not in _FLOAT_DTYPES},
        config,
    )
    positions = [k for k in headers if k.removeprefix(_TASK_PREFIX) == _POSITION_IDS]
    tensors = read_tensors(headers, [*sources.values(), *positions])
    _check_position_ids(tensors, config)
    return config, {ours: tensors[key] for ours, key in sources.items()}, ignored


def load_bert(
    path: str | Path,
    *,
    backend: str = "auto",
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> BertEncoder:
    """Load a Hugging Face BERT checkpoint directory into a :class:`BertEncoder` in eval mode.

    Args:
        path: directory with ``config.json`` and ``model.safetensors`` (or its shards).
        backend: attention backend of every layer (one of ``qkv.BACKENDS``).
        device: where the parameters go.
        dtype: parameter dtype (checkpoint tensors are cast to it).

    Returns:
        The encoder; ``model(input_ids, attention_mask)`` equals ``BertModel``'s
        ``last_hidden_state``.

    Raises:
        FileNotFoundError / ValueError / TypeError: as :func:`read_bert_checkpoint`, plus an
            unknown backend.
    """
    config, state_dict, _ = read_bert_checkpoint(path)
    model = BertEncoder(config, backend=backend, device=device, dtype=dtype)
    model.load_state_dict(state_dict, strict=True)
    return model.eval()
