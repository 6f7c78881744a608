"""Record the attention of one example: run a checkpoint's model once with every
:class:`~qkv.nn.multihead.MultiHeadAttention` keeping its weights, and label the axes with tokens.

What :mod:`qkv.apps.viz` (the PNG) and :mod:`qkv.apps.viz_html` (the interactive page) draw.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from qkv.nn.multihead import MultiHeadAttention
from qkv.train.inference import generate_text, load_trained

__all__ = ["KINDS", "AttentionMaps", "attention_maps", "checkpoint_attention", "select_kinds"]

KINDS = ("encoder self", "decoder self", "cross")


@dataclass(frozen=True)
class AttentionMaps:
    """Per-layer attention weights of one example.

    Attributes:
        weights: kind -> one ``[H, T, S]`` tensor per layer.
        queries: kind -> the query tokens (rows).
        keys: kind -> the key tokens (columns).
    """

    weights: dict[str, list[Tensor]]
    queries: dict[str, list[str]]
    keys: dict[str, list[str]]


def _attn(module: nn.Module, name: str) -> MultiHeadAttention:
    attn = getattr(module, name)
    assert isinstance(attn, MultiHeadAttention)
    return attn


def _recorded(attn: MultiHeadAttention) -> Tensor:
    if attn.last_weights is None:
        raise RuntimeError("a MultiHeadAttention recorded no weights during the forward pass")
    return attn.last_weights[0]  # [H, T, S]


@torch.no_grad()
def attention_maps(
    model: nn.Module, src: Tensor | None, tgt: Tensor, tokens: dict[str, list[str]]
) -> AttentionMaps:
    """Record every attention of one forward pass.

    Args:
        model: a ``Transformer`` (``src`` given) or a ``DecoderOnlyLM`` (``src=None``).
        src: source ids ``[1, S]`` (encoder-decoder) or None.
        tgt: decoder input ids ``[1, T]`` (``<bos>`` + output), or the LM's ids.
        tokens: ``{"src": [...], "tgt": [...]}`` labels for the axes.

    Returns:
        The maps; for a decoder-only model only ``"decoder self"``.
    """
    modules = [m for m in model.modules() if isinstance(m, MultiHeadAttention)]
    before = [m.record_weights for m in modules]
    was_training = model.training
    model.eval()
    try:
        for m in modules:
            m.record_weights, m.last_weights = True, None
        if src is not None:
            model(src, tgt)  # [1, T, V]
            enc = list(model.get_submodule("encoder.layers").children())
            dec = list(model.get_submodule("decoder.layers").children())
            weights = {
                "encoder self": [_recorded(_attn(layer, "self_attn")) for layer in enc],
                "decoder self": [_recorded(_attn(layer, "self_attn")) for layer in dec],
                "cross": [_recorded(_attn(layer, "cross_attn")) for layer in dec],
            }
        else:
            model(tgt)  # [1, T, V]
            layers = list(model.get_submodule("blocks.layers").children())
            weights = {"decoder self": [_recorded(_attn(layer, "self_attn")) for layer in layers]}
    finally:
        for m, flag in zip(modules, before, strict=True):
            m.record_weights = flag
        model.train(was_training)
    src_tok, tgt_tok = tokens.get("src", []), tokens["tgt"]
    queries = {"encoder self": src_tok, "decoder self": tgt_tok, "cross": tgt_tok}
    keys = {"encoder self": src_tok, "decoder self": tgt_tok, "cross": src_tok}
    return AttentionMaps(
        weights=weights,
        queries={k: queries[k] for k in weights},
        keys={k: keys[k] for k in weights},
    )


def checkpoint_attention(checkpoint: str | Path, text: str) -> tuple[AttentionMaps, str]:
    """Greedy-decode ``text`` with the checkpoint, then record the attention of the forward pass
    that reproduces the decoded output (teacher-forced on it).

    Returns:
        The maps and the decoded output.

    Raises:
        ValueError / CheckpointError: as :func:`qkv.train.inference.generate_text` and
            :func:`qkv.train.inference.load_trained`.
    """
    model, task, _ = load_trained(checkpoint)
    gen = generate_text(model, task, text)
    src, tgt = task.teacher_forced_ids(text, gen.ids)
    tokens = {"tgt": [task.vocab.token(i) for i in tgt]}
    if src is not None:
        tokens["src"] = [task.vocab.token(i) for i in src]
    src_ids = None if src is None else torch.tensor([src])  # [1, S]
    maps = attention_maps(model, src_ids, torch.tensor([tgt]), tokens)  # tgt: [1, T]
    return maps, gen.text


def select_kinds(maps: AttentionMaps, kinds: tuple[str, ...] | None) -> tuple[str, ...]:
    """The kinds to draw, checked: ``kinds`` as given, or every kind the model has.

    Raises:
        ValueError: an unknown kind, one the model does not have, or no kinds at all.
    """
    kinds = tuple(maps.weights) if kinds is None else kinds
    if not kinds:
        raise ValueError("kinds must name at least one attention kind, got ()")
    for kind in kinds:
        if kind not in maps.weights:
            raise ValueError(f"kind {kind!r} not available; this model has {tuple(maps.weights)}")
    return kinds
