"""What ``qkv plot`` runs: decode an input with a checkpoint, then draw its attention."""

from __future__ import annotations

from pathlib import Path

import torch

from qkv.apps.viz import (
    AttentionMaps,
    attention_maps,
    plot_attention,
    plot_positional,
    save_figure,
    sinusoidal_table,
)
from qkv.train.inference import generate_text, load_trained
from qkv.train.tasks import BOS_ID, TextTask

__all__ = ["checkpoint_attention", "plot_checkpoint", "plot_checkpoint_positional"]


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
    vocab = task.vocab
    if isinstance(task, TextTask):
        ids = vocab.encode(text) + [i for i in gen.ids if i >= 3]
        labels = [vocab.token(i) for i in ids]
        maps = attention_maps(model, None, torch.tensor([ids]), {"tgt": labels})
    else:
        src = vocab.encode(text)
        tgt = [BOS_ID] + [i for i in gen.ids if i >= 3]  # <bos> + output, without <eos>
        tokens = {"src": [vocab.token(i) for i in src], "tgt": [vocab.token(i) for i in tgt]}
        maps = attention_maps(model, torch.tensor([src]), torch.tensor([tgt]), tokens)
    return maps, gen.text


def plot_checkpoint(
    checkpoint: str | Path, text: str, out: str | Path, kinds: tuple[str, ...] | None = None
) -> tuple[Path, str, tuple[int, int]]:
    """Write the attention grid (rows: kind x layer, columns: heads) of ``text`` to ``out``.

    Returns:
        The PNG path, the decoded output, and the grid's (rows, columns).
    """
    maps, output = checkpoint_attention(checkpoint, text)
    fig = plot_attention(maps, kinds, title=f"{text!r} -> {output!r}")
    shown = tuple(maps.weights) if kinds is None else kinds
    rows = sum(len(maps.weights[k]) for k in shown)
    cols = max(w.shape[0] for k in shown for w in maps.weights[k])
    return save_figure(fig, out), output, (rows, cols)


def plot_checkpoint_positional(
    checkpoint: str | Path, out: str | Path, length: int | None = None
) -> Path:
    """Write the sinusoidal positional-encoding table of the checkpoint's width to ``out``.

    Args:
        checkpoint: the checkpoint directory.
        out: the PNG path.
        length: positions to draw (default: the model's ``max_len``).

    Raises:
        ValueError: the checkpoint's model does not use sinusoidal positions.
    """
    _, _, ckpt = load_trained(checkpoint)
    cfg = ckpt.model_config
    if cfg.get("positional") != "sinusoidal":
        raise ValueError(
            f"--positional plots the sinusoidal encoding; this model uses "
            f"positional={cfg.get('positional')!r}"
        )
    positions = cfg["max_positions"] if "max_positions" in cfg else cfg["max_len"]  # 0.1: max_len
    table = sinusoidal_table(length or int(positions), int(cfg["d_model"]))  # [L, D]
    return save_figure(plot_positional(table), out)
