"""Attention heatmaps and the sinusoidal positional encoding, with matplotlib's Agg canvas, and
what ``qkv plot`` runs on a checkpoint (decode an input, then draw its attention).

Figures are built as ``matplotlib.figure.Figure`` on a ``FigureCanvasAgg``, never through
``pyplot``: no global backend switch, no display needed, nothing left open.

:func:`attention_maps` runs one forward pass with ``record_weights = True`` on every
:class:`~qkv.nn.multihead.MultiHeadAttention` of a model and collects the per-head weights;
:func:`plot_attention` draws them as a grid, one row per (kind, layer) and one column per head,
with the tokens on the axes: rows of each heatmap are queries, columns keys.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from torch import Tensor, nn

from qkv.nn.multihead import MultiHeadAttention
from qkv.nn.positional import sinusoidal_table
from qkv.train.inference import generate_text, load_trained

__all__ = [
    "KINDS",
    "AttentionMaps",
    "attention_maps",
    "checkpoint_attention",
    "plot_attention",
    "plot_checkpoint",
    "plot_checkpoint_positional",
    "plot_positional",
    "run_plot",
    "save_figure",
    "sinusoidal_table",
]

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
            layers = list(model.get_submodule("layers").children())
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


def plot_attention(
    maps: AttentionMaps,
    kinds: tuple[str, ...] | None = None,
    *,
    cell_inches: float | None = None,
    dpi: int = 100,
    title: str | None = None,
) -> Figure:
    """A grid of heatmaps: one row per (kind, layer), one column per head.

    Args:
        maps: from :func:`attention_maps`.
        kinds: which kinds to draw, in order (default: all present).
        cell_inches: side of one heatmap (default grows with the number of tokens).
        dpi: resolution; the PNG is ``columns * cell * dpi`` wide, ``rows * cell * dpi`` high.
        title: figure title.

    Returns:
        The figure; ``figure.axes`` holds exactly rows x columns heatmaps (no colour bar: every
        map uses the same scale, 0 white to 1 dark).

    Raises:
        ValueError: an unknown kind or one the model does not have.
    """
    kinds = tuple(maps.weights) if kinds is None else kinds
    for kind in kinds:
        if kind not in maps.weights:
            raise ValueError(f"kind {kind!r} not available; this model has {tuple(maps.weights)}")
    rows = [(kind, i, w) for kind in kinds for i, w in enumerate(maps.weights[kind])]
    H = max(w.shape[0] for _, _, w in rows)
    longest = max(max(len(maps.queries[k]), len(maps.keys[k])) for k in kinds)
    cell = cell_inches if cell_inches is not None else max(1.8, 0.16 * longest + 0.9)
    fig = Figure(figsize=(H * cell, len(rows) * cell), dpi=dpi)
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(rows), H, squeeze=False)
    font = max(4.0, min(8.0, 90.0 / max(1, longest)))
    for r, (kind, layer, w) in enumerate(rows):
        q_tok, k_tok = maps.queries[kind], maps.keys[kind]
        for h in range(H):
            ax = axes[r][h]
            ax.imshow(w[h].float().numpy(), cmap="Blues", vmin=0.0, vmax=1.0, aspect="auto")
            ax.set_title(f"{kind} L{layer} H{h}", fontsize=font + 1)
            ax.set_xticks(range(len(k_tok)), k_tok, fontsize=font, rotation=90)
            ax.set_yticks(range(len(q_tok)), q_tok, fontsize=font)
            ax.tick_params(length=0, pad=1)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def plot_positional(table: Tensor, *, dpi: int = 100, title: str | None = None) -> Figure:
    """Heatmap of a positional-encoding table ``[L, D]`` (positions down, dimensions across)."""
    fig = Figure(figsize=(8, 5), dpi=dpi)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    image = ax.imshow(table.numpy(), cmap="RdBu", vmin=-1.0, vmax=1.0, aspect="auto")
    ax.set_xlabel("dimension")
    ax.set_ylabel("position")
    ax.set_title(
        title or f"sinusoidal positional encoding [L={table.shape[0]}, D={table.shape[1]}]"
    )
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    return fig


def save_figure(fig: Figure, path: str | Path) -> Path:
    """Write ``fig`` as PNG (size exactly ``figsize * dpi``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=fig.dpi)
    return path


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
        length: positions to draw (default: the model's ``max_positions``).

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


def run_plot(args: argparse.Namespace) -> int:
    """``qkv plot`` (arguments parsed by :mod:`qkv.apps.cli`): write the PNG, say where it is.

    Raises:
        ValueError: no ``input`` without ``--positional``; see :func:`plot_checkpoint`.
    """
    torch.set_num_threads(args.threads)
    if args.positional:
        path = plot_checkpoint_positional(args.checkpoint, args.output, args.length)
        print(f"positional encoding written to {path}")
        return 0
    if args.input is None:
        raise ValueError("qkv plot needs an INPUT to decode (or --positional)")
    kinds = None if args.kind is None else tuple(args.kind)
    path, output, (rows, cols) = plot_checkpoint(args.checkpoint, args.input, args.output, kinds)
    print(f"{args.input!r} -> {output!r}")
    print(f"attention grid ({rows} rows: kind x layer, {cols} columns: heads) written to {path}")
    return 0
