"""The page :mod:`qkv.doctor.view` writes: its HTML, CSS and plain JavaScript (no framework).

The script reads the maps' description (``<script id="qkv-data">``), and decodes one map at a time
from its ``<script id="qkv-png-I">`` text (:func:`qkv.doctor.view_encode.pack7` of an 8-bit PNG):
the bytes go to the browser's own PNG decoder (``createImageBitmap``), the codes come back through
a canvas. Zoomed out, the map is drawn from its block maxima (a power of 2 per axis, built when
first needed, a few kept), each block at least one pixel wide and tall, so no weight drops out of
the view. Cells are square, except that the short side of an elongated map (the one query of a
decoding step) is stretched to at least 24 pixels. ``window.qkvView`` is the page's API for
probes (tests, ``benchmarks/view.py``): ``ready``, ``select(i)``, ``idle()`` (the promise of the
latest switch, however it was asked for), ``cellCenter(t, s)``, ``zoomTo(t0, s0, t1, s1)``,
``pixel(x, y)``, ``state()``, ``timings``.
"""

from __future__ import annotations

from qkv.doctor.view_control_js import CONTROL_JS
from qkv.doctor.view_draw_js import DRAW_JS

__all__ = ["CSS", "JS", "PAGE"]

CSS = """
body { font: 14px system-ui, sans-serif; margin: 1.2em; color: #222; }
h1 { font-size: 1.1em; font-weight: 600; margin: 0 0 0.5em; }
#controls { display: flex; flex-wrap: wrap; gap: 0.4em 1.2em; align-items: center; }
#controls select { max-width: 32em; }
#info { margin: 0.6em 0 0.2em; font-size: 12px; color: #555; }
#info span { margin-right: 1.2em; }
#readout { margin: 0.4em 0; min-height: 1.4em; font-family: ui-monospace, monospace;
  white-space: nowrap; overflow: hidden; text-overflow: ellipsis; }
#view { display: flex; align-items: flex-start; gap: 1.2em; }
#map-canvas { cursor: crosshair; touch-action: none; }
#side { display: flex; flex-direction: column; gap: 0.6em; font-size: 12px; color: #555; }
#overview { border: 1px solid #ccc; cursor: pointer; align-self: flex-start; }
#legend { display: flex; gap: 0.6em; align-items: stretch; }
#legend-ticks { display: flex; flex-direction: column; justify-content: space-between; }
.swatch { display: inline-block; width: 12px; height: 12px; border: 1px solid #999;
  vertical-align: middle; margin-right: 0.4em; }
.help { max-width: 16em; line-height: 1.5; }
"""

JS = DRAW_JS + CONTROL_JS
"""The page's script: drawing first, then the controls that call it."""

PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>qkv attention</title>
<style>{css}</style>
</head>
<body>
<h1 id="title"></h1>
<div id="controls">
<label id="group-label">group <select id="group"></select></label>
<label>map <select id="map"></select></label>
<span><button id="prev" title="previous map ([)">&#9664;</button>
<button id="next" title="next map (])">&#9654;</button></span>
<label>colour <select id="scale"><option value="linear">linear 0–1</option>
<option value="max">linear 0–max</option><option value="log">log</option></select></label>
<span><button id="fit" title="the whole map (0, double-click)">fit</button>
<button id="zoom-in" title="zoom in (+)">+</button>
<button id="zoom-out" title="zoom out (-)">&minus;</button></span>
</div>
<div id="info"><span id="dims"></span><span id="pooling"></span><span id="quant"></span></div>
<div id="readout">hover a cell</div>
<div id="view">
<canvas id="map-canvas"></canvas>
<div id="side">
<canvas id="overview" width="1" height="1"></canvas>
<div>overview: click or drag to move the view</div>
<div id="zoom-note" class="help"></div>
<div id="legend"><canvas id="legend-bar" width="16" height="160"></canvas>
<div id="legend-ticks"></div></div>
<div><span class="swatch" style="background: #fff"></span>0 (blocked)</div>
<div id="legend-below"><span class="swatch" style="background: rgb(245, 247, 249)"></span>
positive, below the log floor</div>
<div><span class="swatch" style="background: rgb(255, 0, 255)"></span>NaN</div>
<div><span class="swatch" style="background: rgb(255, 140, 0)"></span>inf</div>
<div class="help">wheel: zoom &middot; drag: pan &middot; shift+drag: zoom box &middot;
double-click: fit &middot; [ and ]: previous / next map</div>
</div>
</div>
<script type="application/json" id="qkv-data">{data}</script>
{payloads}
<script>{js}</script>
</body>
</html>
"""
