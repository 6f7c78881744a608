"""Attention heatmaps and the sinusoidal positional encoding, with matplotlib's Agg canvas, and
what ``qkv plot`` runs on a checkpoint (decode an input, then draw its attention as a PNG, as an
interactive HTML page, or both).

Figures are built as ``matplotlib.figure.Figure`` on a ``FigureCanvasAgg``, never through
``pyplot``: no global backend switch, no display needed, nothing left open. Matplotlib is
imported when the first figure is made (:func:`_agg_figure`), not with this module: it took
0.7 s of the 3.9 s ``qkv`` needed to start on a 2-core EPYC (Zen 1), and only ``qkv plot``
draws.

:func:`~qkv.apps.recording.attention_maps` records the per-head weights of one forward pass;
:func:`plot_attention` draws them as a grid, one row per (kind, layer) and one column per head,
with the tokens on the axes (rows of each heatmap are queries, columns keys) and one colour bar
for all of them; :mod:`qkv.apps.viz_html` writes the same maps as a page to explore.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch
from torch import Tensor

from qkv.apps.recording import (
    KINDS,
    AttentionMaps,
    attention_maps,
    checkpoint_attention,
    select_kinds,
)
from qkv.apps.viz_html import write_attention_page
from qkv.nn.positional import sinusoidal_table
from qkv.train.inference import load_trained

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "DEFAULT_PNG",
    "KINDS",
    "AttentionMaps",
    "attention_maps",
    "checkpoint_attention",
    "grid_shape",
    "plot_attention",
    "plot_checkpoint_positional",
    "plot_positional",
    "run_plot",
    "save_figure",
    "sinusoidal_table",
]

DEFAULT_PNG = "attn.png"
"""Where ``qkv plot`` writes its PNG when neither ``-o`` nor ``--html`` is given."""

# Figure space (inches) beside the grid for the colour bar, and above it for the title.
_COLORBAR_INCHES = 1.0
_TITLE_INCHES = 0.45


def _agg_figure(
    size: tuple[float, float], dpi: int, layout: Literal["constrained"] | None = None
) -> Figure:
    """A matplotlib ``Figure`` of ``size`` inches at ``dpi`` on an Agg canvas of its own,
    ``layout`` as matplotlib's ``Figure`` takes it; matplotlib is imported here, on first use
    (see the module docstring), not for a cycle."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, dpi=dpi, layout=layout)
    FigureCanvasAgg(fig)
    return fig


def grid_shape(maps: AttentionMaps, kinds: tuple[str, ...] | None = None) -> tuple[int, int]:
    """The (rows, columns) of :func:`plot_attention`'s grid: kinds x layers, heads.

    Raises:
        ValueError: an unknown kind, one the model does not have, or no kinds at all.
    """
    kinds = select_kinds(maps, kinds)
    rows = sum(len(maps.weights[k]) for k in kinds)
    return rows, max(w.shape[0] for k in kinds for w in maps.weights[k])


def plot_attention(
    maps: AttentionMaps,
    kinds: tuple[str, ...] | None = None,
    *,
    cell_inches: float | None = None,
    dpi: int = 100,
    title: str | None = None,
) -> Figure:
    """A grid of heatmaps: one row per (kind, layer), one column per head, one colour bar.

    Each heatmap's rows are the query tokens (axis title "query"), its columns the key tokens
    ("key"); every map uses the same scale, 0 white to 1 dark, shown once by the colour bar on
    the right. Matplotlib's constrained layout places the title above the panel titles and the
    tick labels between the panels, so nothing overlaps.

    Args:
        maps: from :func:`~qkv.apps.recording.attention_maps`.
        kinds: which kinds to draw, in order (default: all present).
        cell_inches: side of one heatmap (default grows with the number of tokens).
        dpi: resolution; the PNG is ``(columns * cell + 1) * dpi`` wide and
            ``(rows * cell + title) * dpi`` high (title: 0.45 inch when given, else 0).
        title: figure title.

    Returns:
        The figure; ``figure.axes`` holds the rows x columns heatmaps (row by row), then the
        colour bar.

    Raises:
        ValueError: an unknown kind, one the model does not have, or no kinds at all.
    """
    kinds = select_kinds(maps, kinds)
    rows = [(kind, i, w) for kind in kinds for i, w in enumerate(maps.weights[kind])]
    _, H = grid_shape(maps, kinds)
    longest = max(max(len(maps.queries[k]), len(maps.keys[k])) for k in kinds)
    cell = cell_inches if cell_inches is not None else max(1.8, 0.16 * longest + 0.9)
    size = (H * cell + _COLORBAR_INCHES, len(rows) * cell + (_TITLE_INCHES if title else 0.0))
    fig = _agg_figure(size, dpi, layout="constrained")
    axes = fig.subplots(len(rows), H, squeeze=False)
    font = max(4.0, min(8.0, 90.0 / max(1, longest)))
    image = None
    for r, (kind, layer, w) in enumerate(rows):
        q_tok, k_tok = maps.queries[kind], maps.keys[kind]
        for h in range(H):
            ax = axes[r][h]
            if h >= w.shape[0]:  # a kind with fewer heads than the widest row
                ax.set_axis_off()
                continue
            image = ax.imshow(w[h].float().numpy(), cmap="Blues", vmin=0.0, vmax=1.0, aspect="auto")
            ax.set_title(f"{kind} L{layer} H{h}", fontsize=font + 1)
            # tokens and title are the user's text, never mathtext ("$\\foo$" is no error)
            ax.set_xticks(range(len(k_tok)), k_tok, fontsize=font, rotation=90, parse_math=False)
            ax.set_yticks(range(len(q_tok)), q_tok, fontsize=font, parse_math=False)
            ax.tick_params(length=0, pad=1)
            ax.set_xlabel("key", fontsize=font)
            ax.set_ylabel("query", fontsize=font)
    assert image is not None  # every row has at least one head
    bar = fig.colorbar(image, ax=axes, fraction=0.9 / (H * cell + _COLORBAR_INCHES), aspect=40)
    bar.set_label("attention weight", fontsize=font + 1)
    bar.ax.tick_params(labelsize=font)
    if title:
        fig.suptitle(title, fontsize=10, parse_math=False)
    return fig


def plot_positional(table: Tensor, *, dpi: int = 100, title: str | None = None) -> Figure:
    """Heatmap of a positional-encoding table ``[L, D]`` (positions down, dimensions across)."""
    fig = _agg_figure((8, 5), dpi)
    ax = fig.subplots()
    image = ax.imshow(table.numpy(), cmap="RdBu", vmin=-1.0, vmax=1.0, aspect="auto")
    ax.set_xlabel("dimension")
    ax.set_ylabel("position")
    ax.set_title(
        title or f"sinusoidal positional encoding [L={table.shape[0]}, D={table.shape[1]}]",
        parse_math=False,
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
    """``qkv plot`` (arguments parsed by :mod:`qkv.apps.cli`): decode once, write the PNG
    (``-o``; :data:`DEFAULT_PNG` when neither ``-o`` nor ``--html`` is given) and / or the
    interactive page (``--html``), say where they are.

    Raises:
        ValueError: no ``input`` without ``--positional``; ``--html`` with ``--positional``;
            see :func:`~qkv.apps.recording.checkpoint_attention`.
    """
    torch.set_num_threads(args.threads)
    if args.positional:
        if args.html is not None:
            raise ValueError(
                f"--html writes the attention page of an INPUT; it does not go with --positional "
                f"(got --html {args.html})"
            )
        path = plot_checkpoint_positional(args.checkpoint, args.output or DEFAULT_PNG, args.length)
        print(f"positional encoding written to {path}")
        return 0
    if args.input is None:
        raise ValueError("qkv plot needs an INPUT to decode (or --positional)")
    kinds = None if args.kind is None else tuple(args.kind)
    maps, output = checkpoint_attention(args.checkpoint, args.input)
    title = f"{args.input!r} -> {output!r}"
    rows, cols = grid_shape(maps, kinds)  # checks the kinds before anything is written
    print(title)
    if args.output is not None or args.html is None:
        path = save_figure(plot_attention(maps, kinds, title=title), args.output or DEFAULT_PNG)
        print(
            f"attention grid ({rows} rows: kind x layer, {cols} columns: heads) written to {path}"
        )
    if args.html is not None:
        page = write_attention_page(maps, args.html, kinds, title)
        print(f"interactive attention page (group, head, zoom; hover a cell) written to {page}")
    return 0
