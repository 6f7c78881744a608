"""``save_hf``: a qkv :class:`~qkv.DecoderOnlyLM` whose options fit Llama, as a Hugging Face
directory that ``transformers.LlamaForCausalLM.from_pretrained`` loads with the same logits."""

from __future__ import annotations

from pathlib import Path

import qkv.convert.hf_llama as hf_llama
from qkv.convert.hf_files import expand_rules, from_qkv, write_dir
from qkv.models.decoder_only import DecoderOnlyLM

__all__ = ["save_hf"]


def save_hf(model: DecoderOnlyLM, path: str | Path) -> Path:
    """Write ``model`` as ``config.json`` + ``model.safetensors`` in Llama's format.

    Args:
        model: a decoder-only model with SwiGLU, RMSNorm pre-norm blocks, rotary positions
            (half-split layout) and one bias setting for all four attention projections.
        path: the directory (created if needed; existing files of these names are replaced).

    Returns:
        The directory.

    Raises:
        TypeError: ``model`` is not a :class:`DecoderOnlyLM`.
        ValueError: each option Llama cannot express, named.
    """
    if not isinstance(model, DecoderOnlyLM):
        raise TypeError(f"model must be a qkv DecoderOnlyLM, got {type(model).__name__}")
    c = model.config
    hf_config = hf_llama.config_to_hf(c)
    rules = expand_rules(hf_llama.rules(c), c.num_layers)
    body = from_qkv(rules, model.state_dict())
    tensors = {k if k == "lm_head.weight" else hf_llama.PREFIX + k: v for k, v in body.items()}
    return write_dir(Path(path), hf_config, tensors)
