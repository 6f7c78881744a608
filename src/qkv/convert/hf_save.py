"""``save_hf``: a qkv :class:`~qkv.DecoderOnlyLM` whose options fit Llama (or a
:class:`~qkv.Transformer` that fits BART), as a Hugging Face directory that
``transformers.LlamaForCausalLM`` (``BartForConditionalGeneration``) loads with the same logits."""

from __future__ import annotations

from pathlib import Path

import qkv.convert.hf_llama as hf_llama
from qkv.convert.hf_files import expand_rules, from_qkv, write_dir
from qkv.convert.hf_seq2seq import save_bart
from qkv.models.decoder_only import DecoderOnlyLM
from qkv.models.transformer import Transformer

__all__ = ["save_hf"]


def save_hf(model: DecoderOnlyLM | Transformer, path: str | Path) -> Path:
    """Write ``model`` as ``config.json`` + ``model.safetensors`` in Llama's (BART's) format.

    Args:
        model: a decoder-only model with SwiGLU, RMSNorm pre-norm blocks, rotary positions
            (half-split layout) and one bias setting for all four attention projections; or an
            encoder–decoder with BART's options (see :func:`qkv.convert.hf_seq2seq.save_bart`).
        path: the directory (created if needed; existing files of these names are replaced).

    Returns:
        The directory.

    Raises:
        TypeError: ``model`` is neither a :class:`DecoderOnlyLM` nor a :class:`Transformer`.
        ValueError: each option Llama (BART) cannot express, named.
    """
    if isinstance(model, Transformer):
        return save_bart(model, path)
    if not isinstance(model, DecoderOnlyLM):
        raise TypeError(
            f"model must be a qkv DecoderOnlyLM or Transformer, got {type(model).__name__}"
        )
    c = model.config
    hf_config = hf_llama.config_to_hf(c)
    rules = expand_rules(hf_llama.rules(c), c.num_layers)
    body = from_qkv(rules, model.state_dict())
    tensors = {k if k == "lm_head.weight" else hf_llama.PREFIX + k: v for k, v in body.items()}
    return write_dir(Path(path), hf_config, tensors)
