"""``qkv plot --html``: the self-contained page, checked in a real headless browser.

Debian's ``chromium`` loads the page from ``file://`` with the view named in the URL hash, then a
script the test appends switches head and kind through the page's own ``<select>`` elements and
hovers a cell; ``--dump-dom`` returns the DOM, whose ``data-weight`` values are compared with the
weights the model recorded (exactly, in float32). The page is written from the same maps the test
compares with: a second decode (``qkv plot``) may run with another thread count, and so differ in
the last bits. ``tests/apps/test_viz.py`` runs ``qkv plot --html`` itself.
"""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from qkv.apps.recording import AttentionMaps, checkpoint_attention
from qkv.apps.viz_html import attention_page, page_data, write_attention_page

FIXTURES = Path(__file__).parents[1] / "fixtures" / "qkv_0_1"
REVERSE, TEXT = FIXTURES / "reverse", FIXTURES / "text"
CHROMIUM = shutil.which("chromium")

needs_chromium = pytest.mark.skipif(
    CHROMIUM is None,
    reason="Debian's chromium is not installed (apt-get install chromium; .ci/run installs it)",
)

# Appended to the page: the reader's actions, then everything they saw as JSON in <pre id=probe>.
PROBE = """
<script>
const grab = () => {
  const g = document.getElementById("grid");
  return {
    kind: g.dataset.kind, layer: Number(g.dataset.layer), head: Number(g.dataset.head),
    cells: [...g.querySelectorAll("td.cell")].map((td) =>
      [Number(td.dataset.t), Number(td.dataset.s), td.dataset.query, td.dataset.key,
       td.dataset.weight]),
  };
};
const pick = (id, value) => {
  const select = document.getElementById(id);
  select.value = String(value);
  select.dispatchEvent(new Event("change"));
};
const probe = { kinds: [...document.getElementById("kind").options].map((o) => o.text) };
probe.opened = grab();
pick("head", 0);
probe.head0 = grab();
pick("kind", 0);
probe.kind0 = grab();
probe.hash = location.hash;
const cell = document.querySelector('td.cell[data-t="2"][data-s="1"]');
cell.dispatchEvent(new MouseEvent("mouseover", { bubbles: true }));
const out = document.getElementById("readout");
probe.hover = { ...out.dataset, text: out.textContent };
const pre = document.createElement("pre");
pre.id = "probe";
pre.textContent = JSON.stringify(probe);
document.body.append(pre);
</script>
"""


def _browse(page: Path, tmp_path: Path, view: str) -> dict[str, Any]:
    """Open ``page`` with the probe appended at ``#view`` in headless chromium; the probe's JSON."""
    probed = tmp_path / f"probed-{page.name}"
    probed.write_text(page.read_text(encoding="utf-8") + PROBE, encoding="utf-8")
    assert CHROMIUM is not None
    dom = subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--disable-gpu",
            "--no-sandbox",
            "--no-first-run",
            f"--user-data-dir={tmp_path / 'profile'}",
            "--dump-dom",
            f"{probed.as_uri()}#{view}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    found = re.search(r'<pre id="probe">(.*?)</pre>', dom, re.S)
    assert found is not None, f"the page's script did not run; DOM: {dom[:2000]}"
    probe: dict[str, Any] = json.loads(html.unescape(found.group(1)))
    return probe


def _assert_view(
    seen: dict[str, Any], maps: AttentionMaps, kind: str, layer: int, head: int
) -> None:
    """Every cell the page drew is the model's weight, at its query and key token."""
    assert (seen["kind"], seen["layer"], seen["head"]) == (kind, layer, head)
    expected = maps.weights[kind][layer][head]  # [T, S]
    queries, keys = maps.queries[kind], maps.keys[kind]
    T, S = expected.shape
    assert len(seen["cells"]) == T * S == len(queries) * len(keys)
    for t, s, query, key, weight in seen["cells"]:
        assert (query, key) == (queries[t], keys[s])
        drawn = torch.tensor(float(weight), dtype=torch.float32)
        assert drawn == expected[t, s], (kind, layer, head, t, s)


@pytest.fixture(scope="module")
def reverse_maps() -> AttentionMaps:
    return checkpoint_attention(REVERSE, "abcdefg")[0]


@needs_chromium
def test_browser_switches_head_and_kind_and_hovers(
    reverse_maps: AttentionMaps, tmp_path: Path
) -> None:
    page = write_attention_page(reverse_maps, tmp_path / "attn.html", title="'abcdefg' -> ...")
    # The two heads differ, so a page that drew the wrong head would fail below.
    assert not torch.equal(reverse_maps.weights["cross"][1][0], reverse_maps.weights["cross"][1][1])
    seen = _browse(page, tmp_path, "kind=cross&layer=1&head=1")
    assert seen["kinds"] == ["encoder self", "decoder self", "cross"]
    _assert_view(seen["opened"], reverse_maps, "cross", 1, 1)  # the view the URL names
    _assert_view(seen["head0"], reverse_maps, "cross", 1, 0)  # the head <select>
    _assert_view(seen["kind0"], reverse_maps, "encoder self", 1, 0)  # the kind <select>
    assert seen["hash"] == "#kind=encoder%20self&layer=1&head=0"  # a link to this view
    hover = seen["hover"]
    query, key = reverse_maps.queries["encoder self"][2], reverse_maps.keys["encoder self"][1]
    expected = reverse_maps.weights["encoder self"][1][0][2, 1]
    assert (hover["query"], hover["key"]) == (query, key) == ("c", "b")
    assert torch.tensor(float(hover["weight"]), dtype=torch.float32) == expected
    assert hover["text"] == f'query 2 "c" -> key 1 "b": weight {float(expected):.4f}'


@needs_chromium
def test_browser_decoder_only_page_has_self_attention_only(tmp_path: Path) -> None:
    maps, _ = checkpoint_attention(TEXT, "the cat")
    page = write_attention_page(maps, tmp_path / "text.html")
    seen = _browse(page, tmp_path, "layer=1&head=1")
    assert seen["kinds"] == ["decoder self"]
    _assert_view(seen["opened"], maps, "decoder self", 1, 1)
    _assert_view(seen["head0"], maps, "decoder self", 1, 0)


def test_page_is_self_contained_and_round_trips_float32(reverse_maps: AttentionMaps) -> None:
    text = attention_page(reverse_maps, title="'abcdefg' -> 'gfedcba'")
    assert not re.search(r"https?://|\bsrc=|<link|@import|fetch\(|XMLHttpRequest", text)
    data = json.loads(page_data(reverse_maps))
    assert [k["name"] for k in data["kinds"]] == list(reverse_maps.weights)
    for kind in data["kinds"]:
        name = kind["name"]
        assert (kind["queries"], kind["keys"]) == (
            reverse_maps.queries[name],
            reverse_maps.keys[name],
        )
        for got, want in zip(kind["layers"], reverse_maps.weights[name], strict=True):
            torch.testing.assert_close(torch.tensor(got, dtype=torch.float32), want, rtol=0, atol=0)


def test_tokens_cannot_break_out_of_the_script_element() -> None:
    weights = {"decoder self": [torch.full((1, 2, 2), 0.5)]}
    tokens = ["</script><b>", "&amp;"]
    maps = AttentionMaps(weights, {"decoder self": tokens}, {"decoder self": tokens})
    text = attention_page(maps, title="<i>title</i>")
    data = text.split('id="qkv-data">', 1)[1].split("</script>", 1)[0]
    assert "<" not in data and ">" not in data and "&" not in data
    assert json.loads(data)["kinds"][0]["queries"] == tokens


def test_page_refuses_kinds_the_model_lacks(reverse_maps: AttentionMaps) -> None:
    with pytest.raises(ValueError, match=r"kind 'self' not available; this model has"):
        page_data(reverse_maps, ("self",))
    with pytest.raises(ValueError, match=r"kinds must name at least one attention kind"):
        page_data(reverse_maps, ())
