"""One self-contained interactive attention page (what ``qkv plot --html FILE`` writes).

The page holds its CSS, its plain JavaScript and the weights (JSON) inline: it opens from disk
(``file://``) with no server and no network. The reader picks the kind (encoder self, decoder
self, cross; a decoder-only model has decoder self only), the layer and the head; one heatmap is
drawn as a table, rows queries and columns keys, one colour scale 0-1 for every map. Hovering a
cell shows its query token, key token and weight. The selection lives in the URL hash
(``#kind=cross&layer=1&head=0``): a link opens the same view, and the page follows a changed hash.

Every cell carries ``data-query``, ``data-key`` and ``data-weight``; the weight is the float32
value the model produced, written as the shortest decimal that reads back to the same float32.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from torch import Tensor

from qkv.apps.recording import AttentionMaps, select_kinds

__all__ = ["attention_page", "page_data", "write_attention_page"]


def _float32_json(weights: Tensor) -> str:
    """``[H, T, S]`` -> a JSON array of the shortest decimals that round-trip in float32."""
    array = weights.detach().float().cpu().numpy()  # [H, T, S]
    heads = (
        "[" + ",".join("[" + ",".join(str(v) for v in row) + "]" for row in head) + "]"
        for head in array.astype(np.float32)
    )
    return "[" + ",".join(heads) + "]"


def page_data(maps: AttentionMaps, kinds: tuple[str, ...] | None = None, title: str = "") -> str:
    """The page's data as one JSON object (safe inside a ``<script>`` element).

    Args:
        maps: from :func:`qkv.apps.recording.attention_maps`.
        kinds: which kinds to include, in order (default: all the model has).
        title: shown above the controls.

    Returns:
        ``{"title": ..., "kinds": [{"name", "queries", "keys", "layers": [[H][T][S] floats]}]}``
        with ``<``, ``>`` and ``&`` escaped, so a token such as ``</script>`` cannot end the
        element.

    Raises:
        ValueError: an unknown kind, one the model does not have, or no kinds at all.
    """
    kinds = select_kinds(maps, kinds)
    parts = []
    for kind in kinds:
        head = json.dumps(
            {"name": kind, "queries": maps.queries[kind], "keys": maps.keys[kind]},
            ensure_ascii=False,
        )
        layers = ",".join(_float32_json(w) for w in maps.weights[kind])  # each [H, T, S]
        parts.append(f'{head[:-1]},"layers":[{layers}]}}')
    text = f'{{"title":{json.dumps(title, ensure_ascii=False)},"kinds":[{",".join(parts)}]}}'
    return text.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")


_CSS = """
body { font: 14px system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.1em; font-weight: 600; }
#controls label { margin-right: 1.2em; }
#readout { margin: 0.8em 0; min-height: 1.4em; font-family: ui-monospace, monospace; }
#view { display: flex; align-items: flex-start; gap: 1.5em; }
table.grid { border-collapse: collapse; }
table.grid td.cell { width: 22px; height: 22px; border: 1px solid #eee; padding: 0; }
table.grid td.cell.hot { outline: 2px solid #d62728; }
table.grid th { font-weight: normal; font-family: ui-monospace, monospace; font-size: 12px; }
table.grid th.key { writing-mode: vertical-rl; transform: rotate(180deg); padding: 2px 0; }
table.grid th.query { text-align: right; padding-right: 4px; }
table.grid th.on { color: #d62728; font-weight: bold; }
.axis { font-size: 12px; color: #555; }
#legend { display: flex; flex-direction: column; align-items: center; font-size: 12px; }
#legend .bar { width: 16px; height: 180px; border: 1px solid #ccc;
  background: linear-gradient(to top, rgb(255,255,255), rgb(8,48,107)); }
"""

# Plain JavaScript, no framework. Colour: white (0) to dark blue (1), the PNG's scale.
_JS = """
"use strict";
const DATA = JSON.parse(document.getElementById("qkv-data").textContent);
const $ = (id) => document.getElementById(id);

function colour(w) {
  const t = Math.min(1, Math.max(0, w));
  const mix = (a, b) => Math.round(a + (b - a) * t);
  return `rgb(${mix(255, 8)}, ${mix(255, 48)}, ${mix(255, 107)})`;
}

function readHash() {
  const p = new URLSearchParams(location.hash.slice(1));
  const kinds = DATA.kinds.map((k) => k.name);
  const kind = Math.max(0, kinds.indexOf(p.get("kind") || kinds[0]));
  const clamp = (text, n) => {
    const v = parseInt(text || "0", 10);
    return Number.isInteger(v) && v >= 0 && v < n ? v : 0;
  };
  const layer = clamp(p.get("layer"), DATA.kinds[kind].layers.length);
  const head = clamp(p.get("head"), DATA.kinds[kind].layers[layer].length);
  return { kind, layer, head };
}

function fill(select, labels, chosen) {
  select.replaceChildren(...labels.map((label, i) => new Option(label, String(i))));
  select.value = String(chosen);
}

function show(sel) {
  const kind = DATA.kinds[sel.kind];
  const w = kind.layers[sel.layer][sel.head];  // [T][S]
  fill($("kind"), DATA.kinds.map((k) => k.name), sel.kind);
  fill($("layer"), kind.layers.map((_, i) => `L${i}`), sel.layer);
  fill($("head"), kind.layers[sel.layer].map((_, i) => `H${i}`), sel.head);
  const table = $("grid");
  table.dataset.kind = kind.name;
  table.dataset.layer = String(sel.layer);
  table.dataset.head = String(sel.head);
  const top = document.createElement("tr");
  top.append(document.createElement("th"));
  kind.keys.forEach((tok, s) => {
    const th = document.createElement("th");
    th.className = "key";
    th.dataset.s = String(s);
    th.textContent = tok;
    top.append(th);
  });
  const rows = [top];
  kind.queries.forEach((tok, t) => {
    const tr = document.createElement("tr");
    const th = document.createElement("th");
    th.className = "query";
    th.dataset.t = String(t);
    th.textContent = tok;
    tr.append(th);
    w[t].forEach((weight, s) => {
      const td = document.createElement("td");
      td.className = "cell";
      td.dataset.t = String(t);
      td.dataset.s = String(s);
      td.dataset.query = tok;
      td.dataset.key = kind.keys[s];
      td.dataset.weight = String(weight);
      td.style.background = colour(weight);
      td.title = `${tok} -> ${kind.keys[s]}: ${weight.toFixed(4)}`;
      tr.append(td);
    });
    rows.push(tr);
  });
  table.replaceChildren(...rows);
  $("readout").textContent = "hover a cell";
}

function hover(event) {
  const td = event.target.closest("td.cell");
  document.querySelectorAll(".hot, .on").forEach((e) => e.classList.remove("hot", "on"));
  if (!td) return;
  td.classList.add("hot");
  const t = td.dataset.t, s = td.dataset.s;
  document.querySelector(`th.query[data-t="${t}"]`).classList.add("on");
  document.querySelector(`th.key[data-s="${s}"]`).classList.add("on");
  const out = $("readout");
  out.dataset.query = td.dataset.query;
  out.dataset.key = td.dataset.key;
  out.dataset.weight = td.dataset.weight;
  out.textContent =
    `query ${t} ${JSON.stringify(td.dataset.query)} -> key ${s} ` +
    `${JSON.stringify(td.dataset.key)}: weight ${Number(td.dataset.weight).toFixed(4)}`;
}

function choose() {
  const kind = DATA.kinds[Number($("kind").value)];
  const layer = Math.min(Number($("layer").value), kind.layers.length - 1);
  const head = Math.min(Number($("head").value), kind.layers[layer].length - 1);
  location.hash = `kind=${encodeURIComponent(kind.name)}&layer=${layer}&head=${head}`;
  show(readHash());  // now, not only when the (asynchronous) hashchange event arrives
}

$("title").textContent = DATA.title;
["kind", "layer", "head"].forEach((id) => $(id).addEventListener("change", choose));
$("grid").addEventListener("mouseover", hover);
window.addEventListener("hashchange", () => show(readHash()));
show(readHash());
"""

_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>qkv attention</title>
<style>{css}</style>
</head>
<body>
<h1 id="title"></h1>
<div id="controls">
<label>kind <select id="kind"></select></label>
<label>layer <select id="layer"></select></label>
<label>head <select id="head"></select></label>
</div>
<div id="readout"></div>
<div id="view">
<div><div class="axis">rows: query, columns: key</div><table class="grid" id="grid"></table></div>
<div id="legend">1<div class="bar"></div>0<div class="axis">attention weight</div></div>
</div>
<script type="application/json" id="qkv-data">{data}</script>
<script>{js}</script>
</body>
</html>
"""


def attention_page(
    maps: AttentionMaps, kinds: tuple[str, ...] | None = None, title: str = ""
) -> str:
    """The whole HTML page: CSS, JavaScript and data inline, nothing fetched.

    Args:
        maps: from :func:`qkv.apps.recording.attention_maps`.
        kinds: which kinds the reader can pick (default: all the model has).
        title: the page's heading.

    Returns:
        The page's text.

    Raises:
        ValueError: as :func:`page_data`.
    """
    return _PAGE.format(css=_CSS, js=_JS, data=page_data(maps, kinds, title))


def write_attention_page(
    maps: AttentionMaps, path: str | Path, kinds: tuple[str, ...] | None = None, title: str = ""
) -> Path:
    """Write :func:`attention_page` to ``path`` (UTF-8), creating its folder.

    Returns:
        The path written.

    Raises:
        ValueError: as :func:`page_data`.
    """
    path = Path(path)
    text = attention_page(maps, kinds, title)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path
