"""``qkv plot --html``: the self-contained page, checked in a real headless browser.

Debian's ``chromium`` loads the page from ``file://`` with the view named in the URL hash, driven
through :class:`qkv.doctor.view_browser.Browser`; a probe switches head and kind through the page's
own ``<select>`` elements, hovers every cell of each map it is shown with real mouse events, and
returns what the readout said. Those weights are compared with the weights the model recorded
(exactly, in float32: maps this small carry their float32 values). The page is written from the
same maps the test compares with: a second decode (``qkv plot``) may run with another thread
count, and so differ in the last bits. ``tests/apps/test_viz.py`` runs ``qkv plot --html`` itself.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from qkv.apps.recording import AttentionMaps, checkpoint_attention
from qkv.apps.viz_html import attention_page, head_maps, write_attention_page
from qkv.doctor.view_browser import Browser, chromium

FIXTURES = Path(__file__).parents[1] / "fixtures" / "qkv_0_1"
REVERSE, TEXT = FIXTURES / "reverse", FIXTURES / "text"

needs_chromium = pytest.mark.skipif(
    chromium() is None,
    reason="Debian's chromium is not installed (apt-get install chromium; .ci/run installs it)",
)

# Run in the page after its first paint: the reader's actions, and everything they saw.
PROBE = """(async () => {
  await qkvView.ready;
  const canvas = document.getElementById("map-canvas");
  const grab = () => {
    const st = qkvView.state(), cells = [];
    for (let t = 0; t < st.rows; t++) {
      for (let s = 0; s < st.cols; s++) {
        const c = qkvView.cellCenter(t, s);
        canvas.dispatchEvent(new MouseEvent("mousemove", { clientX: c.x, clientY: c.y,
          bubbles: true }));
        const d = document.getElementById("readout").dataset;
        cells.push([Number(d.t), Number(d.s), d.query, d.key, d.weight, d.exact]);
      }
    }
    return { title: st.title, cells, text: document.getElementById("readout").textContent };
  };
  const pick = async (id, value) => {
    const select = document.getElementById(id);
    select.value = String(value);
    select.dispatchEvent(new Event("change"));
    await qkvView.idle();
  };
  const options = (id) => [...document.getElementById(id).options].map((o) => o.text);
  const probe = { groups: options("group"), heads: options("map") };
  probe.opened = grab();
  await pick("map", document.getElementById("map").options[0].value);
  probe.head0 = grab();
  await pick("group", 0);
  probe.group0 = grab();
  probe.hash = location.hash;
  return probe;
})()"""


def _browse(page: Path, view: str) -> dict[str, Any]:
    """Open ``page`` at ``#view`` in headless chromium; what the probe saw."""
    with Browser(width=1000, height=800) as browser:
        session = browser.open(f"{page.as_uri()}#{view}")
        probe: dict[str, Any] = browser.evaluate(PROBE, session)
    return probe


def _index(maps: AttentionMaps, kind: str, layer: int, head: int) -> int:
    """The page's map number of (kind, layer, head)."""
    titles = [m.title for m in head_maps(maps)]
    return titles.index(f"{kind} · layer {layer} · head {head}")


def _assert_view(
    seen: dict[str, Any], maps: AttentionMaps, kind: str, layer: int, head: int
) -> None:
    """Every cell the page showed is the model's weight, at its query and key token."""
    assert seen["title"] == f"{kind} · layer {layer} · head {head}"
    expected = maps.weights[kind][layer][head]  # [T, S]
    queries, keys = maps.queries[kind], maps.keys[kind]
    T, S = expected.shape
    assert len(seen["cells"]) == T * S == len(queries) * len(keys)
    assert {(t, s) for t, s, *_ in seen["cells"]} == {(t, s) for t in range(T) for s in range(S)}
    for t, s, query, key, weight, exact in seen["cells"]:
        assert (query, key, exact) == (queries[t], keys[s], "1")
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
    seen = _browse(page, f"map={_index(reverse_maps, 'cross', 1, 1)}")
    assert seen["groups"] == [
        f"{kind} · layer {layer}" for kind in reverse_maps.weights for layer in range(2)
    ]
    assert seen["heads"] == ["head 0", "head 1"]
    _assert_view(seen["opened"], reverse_maps, "cross", 1, 1)  # the view the URL names
    _assert_view(seen["head0"], reverse_maps, "cross", 1, 0)  # the head <select>
    _assert_view(seen["group0"], reverse_maps, "encoder self", 0, 0)  # the group <select>
    assert seen["hash"] == "#map=0&scale=linear"  # a link to this view
    query, key = reverse_maps.queries["encoder self"][-1], reverse_maps.keys["encoder self"][-1]
    last = seen["group0"]["cells"][-1]
    assert seen["group0"]["text"] == f"query {last[0]} {json.dumps(query)} -> key {last[1]} " + (
        f"{json.dumps(key)}: weight {last[4]}"
    )


@needs_chromium
def test_browser_decoder_only_page_has_self_attention_only(tmp_path: Path) -> None:
    maps, _ = checkpoint_attention(TEXT, "the cat")
    page = write_attention_page(maps, tmp_path / "text.html")
    seen = _browse(page, f"map={_index(maps, 'decoder self', 1, 1)}")
    assert seen["groups"] == ["decoder self · layer 0", "decoder self · layer 1"]
    _assert_view(seen["opened"], maps, "decoder self", 1, 1)
    _assert_view(seen["head0"], maps, "decoder self", 1, 0)


def test_page_is_self_contained_and_holds_every_head(reverse_maps: AttentionMaps) -> None:
    text = attention_page(reverse_maps, title="'abcdefg' -> 'gfedcba'")
    assert not re.search(r"https?://|\bsrc=|<link|@import|fetch\(|XMLHttpRequest", text)
    data = json.loads(text.split('id="qkv-data">', 1)[1].split("</script>", 1)[0])
    want = [
        (f"{kind} · layer {layer}", head, maps.shape[1:])
        for kind, layers in reverse_maps.weights.items()
        for layer, maps in enumerate(layers)
        for head in range(maps.shape[0])
    ]
    got = [(m["group"], int(m["title"].rsplit(" ", 1)[1]), (m["T"], m["S"])) for m in data["maps"]]
    assert got == want
    assert all(m["exactBytes"] == 4 * m["T"] * m["S"] for m in data["maps"])


def test_tokens_cannot_break_out_of_the_script_element() -> None:
    weights = {"decoder self": [torch.full((1, 2, 2), 0.5)]}
    tokens = ["</script><b>", "&amp;"]
    maps = AttentionMaps(weights, {"decoder self": tokens}, {"decoder self": tokens})
    text = attention_page(maps, title="<i>title</i>")
    data = text.split('id="qkv-data">', 1)[1].split("</script>", 1)[0]
    assert "<" not in data and ">" not in data and "&" not in data
    assert json.loads(data)["labels"] == [tokens]


def test_page_refuses_kinds_the_model_lacks(reverse_maps: AttentionMaps) -> None:
    with pytest.raises(ValueError, match=r"kind 'self' not available; this model has"):
        head_maps(reverse_maps, ("self",))
    with pytest.raises(ValueError, match=r"kinds must name at least one attention kind"):
        head_maps(reverse_maps, ())
