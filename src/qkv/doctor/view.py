"""One self-contained page to explore attention maps of any length: a canvas, not a table.

:func:`attention_html` writes every map into one HTML file (script, style and data inline: it opens
from ``file://`` with no server and no network). The page draws one map at a time on a
``<canvas>``: the whole ``[T, S]`` map fitted to the view, an overview with the visible part
framed, zoom (wheel, drag to pan, shift-drag for a zoom box, double-click to fit) down to single
cells with their query and key tokens on the axes, and a readout of the hovered cell: query token,
key token, weight. Pickers choose the group and the map (``[`` and ``]`` step through them); the
selection, colour scale and zoom live in the URL hash (``#map=3&scale=log&zoom=0,0,64,64``), so a
link opens the same view.

How a map travels (:mod:`qkv.doctor.view_encode`): one byte per cell, an 8-bit logarithmic code
(zero, NaN and inf each have their own), written as a grayscale PNG that the browser decodes
natively, 7 bits to a character of text. Only the map on screen is decoded. A 2048 x 2048 map
takes at most 4.8 MB, whatever its weights; a map longer than ``max_side`` on either axis is
pooled by block max first, and the page says so. The hovered weight is the exact float32 value
for maps of at most ``exact_cells`` cells, otherwise the code's value, within the relative error
the page states (3.7 % at most).

Colour scales: linear 0-1 (the PNG plot's scale), linear from 0 to the map's largest weight, and
logarithmic from the map's floor to its largest weight (the default when a map has more than 256
keys). NaN is magenta, inf orange, an exact zero white; zoomed out, each pixel shows the max of
the cells under it, so a single large weight never drops out of view.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from qkv._checks import check_nonnegative_int, check_positive_int
from qkv.doctor.view_encode import (
    CODE_BELOW,
    CODE_INF,
    CODE_NAN,
    CODE_ZERO,
    ILLEGAL,
    STEPS,
    block_max,
    pack7,
    png_gray8,
    quantize,
)
from qkv.doctor.view_page import CSS, JS, PAGE

__all__ = ["HeadMap", "attention_html", "save_attention_html"]

MAX_SIDE = 2048
"""A map longer than this on either axis is pooled (block max) to fit it."""

EXACT_CELLS = 65536
"""Maps of at most this many cells carry their float32 weights too (5.3 bytes a cell)."""

LOG_KEYS = 256
"""The page opens on the log colour scale when some map has more keys than this."""


@dataclass(frozen=True)
class HeadMap:
    """One attention map to show: the weights of one head for one sample.

    Attributes:
        title: the map's name in the picker, e.g.
            ``"model.layers.3.self_attn · call 1 · sample 0 · head 5"`` (a leading ``group · `` is
            left out in the picker, which lists the maps of one group).
        weights: ``[T, S]`` attention weights (rows queries, columns keys), any float dtype, read as
            float32: each ``>= 0``, ``+inf`` or NaN (NaN and inf are drawn in their own colours).
        query_labels: ``T`` labels (tokens) of the rows, or None for their indices.
        key_labels: ``S`` labels of the columns, or None for their indices.
        group: the group the map belongs to in the first picker (e.g. a module path).

    Raises:
        TypeError: ``weights`` not a floating-point tensor, a label not a string.
        ValueError: ``weights`` not 2-D or empty, labels of the wrong length.
    """

    title: str
    weights: Tensor
    query_labels: Sequence[str] | None = None
    key_labels: Sequence[str] | None = None
    group: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.weights, Tensor) or not self.weights.is_floating_point():
            raise TypeError(
                f"HeadMap {self.title!r}: weights must be a floating-point torch.Tensor, "
                f"got {type(self.weights).__name__}"
                + (f" of {self.weights.dtype}" if isinstance(self.weights, Tensor) else "")
            )
        if self.weights.dim() != 2 or self.weights.numel() == 0:
            raise ValueError(
                f"HeadMap {self.title!r}: weights must be a non-empty [T, S] matrix, "
                f"got shape {tuple(self.weights.shape)}"
            )
        for name, labels, n in (
            ("query_labels", self.query_labels, self.weights.shape[0]),
            ("key_labels", self.key_labels, self.weights.shape[1]),
        ):
            if labels is None:
                continue
            if isinstance(labels, str) or len(labels) != n:
                got = "a str" if isinstance(labels, str) else f"{len(labels)} labels"
                raise ValueError(f"HeadMap {self.title!r}: {name} must be {n} labels, got {got}")
            bad = next((x for x in labels if not isinstance(x, str)), None)
            if bad is not None:
                raise TypeError(
                    f"HeadMap {self.title!r}: {name} must be strings, got {type(bad).__name__}"
                )


def _labels_index(labels: Sequence[str] | None, table: list[list[str]], seen: dict) -> int:
    """The index of ``labels`` in ``table`` (added once), or -1 for None (indices)."""
    if labels is None:
        return -1
    key = tuple(labels)
    if key not in seen:
        seen[key] = len(table)
        table.append(list(labels))
    return int(seen[key])


def _stats(w: Tensor, rows: int = 1024) -> dict:
    """NaN, +inf and zero counts, the largest finite weight (None if none) and whether any weight
    is negative (with the smallest), in blocks of ``rows`` rows: no ``[T, S]`` temporaries."""
    nan = inf = zero = 0
    top, low = -math.inf, math.inf
    for block in w.split(rows):  # [rows, S]
        nan += int(torch.count_nonzero(torch.isnan(block)))
        inf += int(torch.count_nonzero(torch.isposinf(block)))
        zero += int(torch.count_nonzero(block == 0))
        finite = torch.nan_to_num(block, nan=0.0, posinf=0.0, neginf=-math.inf)  # [rows, S]
        top, low = max(top, float(finite.max())), min(low, float(finite.min()))
    found = nan + inf < w.numel()
    return {
        "nan": nan,
        "inf": inf,
        "zero": zero,
        "max": top if found else None,
        "negative": low < 0,
        "min": low,
    }


def _encode(i: int, head: HeadMap, max_side: int, exact_cells: int) -> tuple[dict, list[str]]:
    """One map's description for the page and its ``<script>`` payloads."""
    w = head.weights.detach().to(device="cpu", dtype=torch.float32)  # [T, S]
    T, S = w.shape
    stats = _stats(w)
    if stats.pop("negative"):
        raise ValueError(
            f"maps[{i}] ({head.title!r}): attention weights must be >= 0 (or NaN / +inf), got "
            f"min {stats.pop('min'):.6g}"
        )
    pooled, bt, bs = block_max(w, max_side, max_side)  # [R, C]
    codes = quantize(pooled)
    png = png_gray8(codes.codes)
    payloads = [f'<script type="text/plain" id="qkv-png-{i}">{pack7(png)}</script>']
    exact = bt == 1 and bs == 1 and exact_cells >= T * S
    raw = w.numpy().astype("<f4").tobytes() if exact else b""
    if exact:
        payloads.append(f'<script type="text/plain" id="qkv-f32-{i}">{pack7(raw)}</script>')
    meta = {
        "title": head.title,
        "group": head.group,
        "T": T,
        "S": S,
        "rows": int(pooled.shape[0]),
        "cols": int(pooled.shape[1]),
        "bt": bt,
        "bs": bs,
        "lo": codes.lo,
        "hi": codes.hi,
        "error": codes.error,
        "pngBytes": len(png),
        "exactBytes": len(raw),
        "max": stats["max"],
        "nan": stats["nan"],
        "inf": stats["inf"],
        "zero": stats["zero"],
    }
    return meta, payloads


def _json(value: object) -> str:
    """JSON safe inside a ``<script>`` element: ``<``, ``>`` and ``&`` escaped."""
    text = json.dumps(value, ensure_ascii=False, allow_nan=False)
    return text.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")


def attention_html(
    maps: Sequence[HeadMap],
    title: str = "",
    *,
    max_side: int = MAX_SIDE,
    exact_cells: int = EXACT_CELLS,
) -> str:
    """The whole page for ``maps``: HTML, CSS, JavaScript and data, nothing fetched.

    Args:
        maps: the maps, in picker order (the page opens on the first, or the one the URL names).
        title: the page's heading.
        max_side: a map longer than this on either axis is pooled by block max to at most
            ``max_side x max_side`` cells (a 2048 x 2048 map takes at most 4.8 MB of page).
        exact_cells: maps of at most this many cells (and not pooled) also carry their exact
            float32 weights for the hover readout; 0 for none.

    Returns:
        The page's text.

    Raises:
        TypeError: an element of ``maps`` not a :class:`HeadMap`, ``title`` not a str.
        ValueError: no maps, a negative weight, ``max_side`` < 1 or ``exact_cells`` < 0.
    """
    maps = list(maps)
    if not maps:
        raise ValueError("maps must hold at least one HeadMap, got none")
    bad = next((m for m in maps if not isinstance(m, HeadMap)), None)
    if bad is not None:
        raise TypeError(f"maps must hold HeadMap objects, got {type(bad).__name__}")
    if not isinstance(title, str):
        raise TypeError(f"title must be a str, got {type(title).__name__}")
    check_positive_int("max_side", max_side)
    check_nonnegative_int("exact_cells", exact_cells)
    labels: list[list[str]] = []
    seen: dict = {}
    described, payloads = [], []
    for i, head in enumerate(maps):
        meta, parts = _encode(i, head, max_side, exact_cells)
        meta["q"] = _labels_index(head.query_labels, labels, seen)
        meta["k"] = _labels_index(head.key_labels, labels, seen)
        described.append(meta)
        payloads.extend(parts)
    data = {
        "title": title,
        "scale": "log" if any(m["S"] > LOG_KEYS for m in described) else "linear",
        "codes": {
            "zero": CODE_ZERO,
            "below": CODE_BELOW,
            "first": CODE_BELOW + 1,
            "last": CODE_BELOW + 1 + STEPS,
            "inf": CODE_INF,
            "nan": CODE_NAN,
        },
        "illegal": list(ILLEGAL),
        "labels": labels,
        "maps": described,
    }
    return PAGE.format(css=CSS, js=JS, data=_json(data), payloads="\n".join(payloads))


def save_attention_html(
    path: str | os.PathLike[str],
    maps: Sequence[HeadMap],
    title: str = "",
    *,
    max_side: int = MAX_SIDE,
    exact_cells: int = EXACT_CELLS,
) -> Path:
    """Write :func:`attention_html` to ``path`` (UTF-8), creating its folder.

    Returns:
        The path written.

    Raises:
        TypeError, ValueError: as :func:`attention_html`.
    """
    text = attention_html(maps, title, max_side=max_side, exact_cells=exact_cells)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path
