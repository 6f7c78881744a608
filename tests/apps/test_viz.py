"""``qkv plot``'s PNG: one shared colour bar, query / key axis titles, nothing overlapping.

The checkpoints are the qkv 0.1 fixtures (2 + 2 layers, 2 heads; a decoder-only text model):
loading them takes milliseconds, so no training here.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib.image as mpimg
import pytest
import torch
from matplotlib.figure import Figure
from matplotlib.transforms import Bbox

from qkv.apps.cli import main
from qkv.apps.recording import AttentionMaps, checkpoint_attention
from qkv.apps.viz import DEFAULT_PNG, grid_shape, plot_attention, plot_positional, save_figure

FIXTURES = Path(__file__).parents[1] / "fixtures" / "qkv_0_1"
REVERSE, TEXT = FIXTURES / "reverse", FIXTURES / "text"


@pytest.fixture(scope="module")
def reverse_maps() -> AttentionMaps:
    return checkpoint_attention(REVERSE, "abcdefg")[0]


@pytest.fixture(scope="module")
def text_maps() -> AttentionMaps:
    return checkpoint_attention(TEXT, "the cat")[0]


def _boxes(fig: Figure) -> list[tuple[str, Bbox]]:
    """Every piece of text drawn (suptitle, panel titles, axis titles, tick labels), in pixels."""
    renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
    fig.draw_without_rendering()
    found = []
    if fig._suptitle is not None:  # matplotlib keeps no public handle on the Text
        found.append(("suptitle", fig._suptitle.get_window_extent(renderer)))
    for i, ax in enumerate(fig.axes):
        texts = [ax.title, ax.xaxis.label, ax.yaxis.label]
        texts += ax.get_xticklabels() + ax.get_yticklabels()
        found += [(f"axes {i}", t.get_window_extent(renderer)) for t in texts if t.get_text()]
    return found


def _overlaps(fig: Figure) -> list[str]:
    boxes = _boxes(fig)
    return [
        f"{a} {box_a} overlaps {b} {box_b}"
        for i, (a, box_a) in enumerate(boxes)
        for b, box_b in boxes[i + 1 :]
        if a != b and box_a.overlaps(box_b)
    ]


@pytest.mark.parametrize("title", ["'abcdefg' -> 'gfedcba'", None])
def test_grid_has_axis_titles_one_colour_bar_and_no_overlap(
    reverse_maps: AttentionMaps, title: str | None
) -> None:
    fig = plot_attention(reverse_maps, title=title)
    rows, cols = grid_shape(reverse_maps)
    assert (rows, cols) == (3 * 2, 2)  # 3 kinds x 2 layers, 2 heads
    *panels, bar = fig.axes
    assert len(panels) == rows * cols
    assert bar.get_label() == "<colorbar>" and bar.get_ylabel() == "attention weight"
    for ax in panels:
        assert ax.get_xlabel() == "key" and ax.get_ylabel() == "query"
        (image,) = ax.get_images()
        assert image.get_clim() == (0.0, 1.0)  # every map on the colour bar's scale
    assert bar.get_ylim() == (0.0, 1.0)
    assert _overlaps(fig) == []


def test_title_sits_above_the_first_row_of_panel_titles(reverse_maps: AttentionMaps) -> None:
    fig = plot_attention(reverse_maps, title="'abcdefg' -> 'gfedcba'")
    renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
    fig.draw_without_rendering()
    assert fig._suptitle is not None
    title = fig._suptitle.get_window_extent(renderer)
    first_row = [ax.title.get_window_extent(renderer) for ax in fig.axes[:2]]
    assert all(title.y0 > box.y1 for box in first_row)  # pixels grow upwards


def test_decoder_only_grid_and_long_inputs_do_not_overlap(text_maps: AttentionMaps) -> None:
    fig = plot_attention(text_maps, title="a decoder-only model")
    rows, cols = grid_shape(text_maps)
    assert len(fig.axes) == rows * cols + 1 and set(text_maps.weights) == {"decoder self"}
    assert _overlaps(fig) == []


def test_cli_writes_the_png_of_the_figure_size(tmp_path: Path, reverse_maps: AttentionMaps) -> None:
    png = tmp_path / "attn.png"
    assert main(["plot", str(REVERSE), "abcdefg", "-o", str(png), "--kind", "cross"]) == 0
    fig = plot_attention(reverse_maps, ("cross",), title="x")
    width, height = fig.get_size_inches() * fig.dpi
    assert mpimg.imread(png).shape[:2] == (round(height), round(width))


def test_cli_default_png_only_without_html(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["plot", str(REVERSE), "abc", "--html", "page.html"]) == 0
    assert (tmp_path / "page.html").is_file() and not (tmp_path / DEFAULT_PNG).exists()
    assert main(["plot", str(REVERSE), "abc"]) == 0
    assert (tmp_path / DEFAULT_PNG).is_file()
    assert main(["plot", str(REVERSE), "abc", "--html", "p2.html", "-o", "both.png"]) == 0
    assert (tmp_path / "p2.html").is_file() and (tmp_path / "both.png").is_file()
    out = capsys.readouterr().out
    assert "interactive attention page" in out and "attention grid" in out


def test_cli_refuses_html_with_positional_and_unknown_kinds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    page = tmp_path / "page.html"
    assert main(["plot", str(REVERSE), "--positional", "--html", str(page)]) == 2
    assert "--html" in capsys.readouterr().err and not page.exists()
    assert main(["plot", str(TEXT), "the", "--kind", "cross", "--html", str(page)]) == 2
    err = capsys.readouterr().err
    assert "'cross' not available" in err and "decoder self" in err and not page.exists()


def test_plot_attention_refuses_no_kinds(reverse_maps: AttentionMaps) -> None:
    with pytest.raises(ValueError, match=r"kinds must name at least one attention kind, got \(\)"):
        plot_attention(reverse_maps, ())


def test_user_text_is_text_not_mathtext(tmp_path: Path, reverse_maps: AttentionMaps) -> None:
    """Issue 27: ``qkv plot DIR '$\\foo$ abc'`` exited 2 with matplotlib's ParseException: the
    input (title and token labels) was parsed as mathtext. Now it is drawn as written."""
    odd = ["$\\foo$", "$", "a_b^c", "$x$"]
    tokens = {k: [odd[i % len(odd)] for i in range(len(v))] for k, v in reverse_maps.keys.items()}
    queries = {
        k: [odd[i % len(odd)] for i in range(len(v))] for k, v in reverse_maps.queries.items()
    }
    maps = AttentionMaps(reverse_maps.weights, queries, tokens)
    fig = plot_attention(maps, ("cross",), title="'$\\foo$ abc' -> '$'")
    save_figure(fig, tmp_path / "odd.png")
    assert fig.axes[0].get_xticklabels()[0].get_text() == "$\\foo$"
    fig = plot_positional(torch.zeros(4, 6), title="$\\foo$ positions")
    save_figure(fig, tmp_path / "pos.png")
    assert fig.axes[0].get_title() == "$\\foo$ positions"
