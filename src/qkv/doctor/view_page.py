"""The page :mod:`qkv.doctor.view` writes: its HTML, CSS and plain JavaScript (no framework).

The script reads the maps' description (``<script id="qkv-data">``), and decodes one map at a time
from its ``<script id="qkv-png-I">`` text (:func:`qkv.doctor.view_encode.pack7` of an 8-bit PNG):
the bytes go to the browser's own PNG decoder (``createImageBitmap``), the codes come back through
a canvas, and a pyramid of 2 x 2 block maxima lets every zoom level draw each cell at least one
pixel wide, so no weight drops out of a zoomed-out view. ``window.qkvView`` is the page's API for
probes (tests, ``benchmarks/view.py``): ``ready``, ``select(i)``, ``idle()`` (the promise of the
latest switch, however it was asked for), ``cellCenter(t, s)``, ``zoomTo(t0, s0, t1, s1)``,
``pixel(x, y)``, ``state()``, ``timings``.
"""

from __future__ import annotations

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

JS = r"""
"use strict";
const META = JSON.parse(document.getElementById("qkv-data").textContent);
const CODE = META.codes;  // zero, below, first, last, inf, nan
const $ = (id) => document.getElementById(id);
const LIGHT = [255, 255, 255], DARK = [8, 48, 107];  // the PNG plot's scale, white to dark blue
const NAN_RGB = [255, 0, 255], INF_RGB = [255, 140, 0];
const MAX_CELL = 64;  // the most CSS pixels one cell may take when zoomed in
const OVERVIEW = 200;  // the overview's longer side, CSS pixels
const MARGIN = { left: 124, top: 100, right: 8, bottom: 8 };
const state = { index: -1, scale: META.scale, head: null, view: null, hover: null, token: 0 };
const timings = { firstPaint: null, lastSwitch: null, lastDecode: null };
const canvas = $("map-canvas"), ctx = canvas.getContext("2d");
const ovCanvas = $("overview"), ovCtx = ovCanvas.getContext("2d");
let plot = { x: MARGIN.left, y: MARGIN.top, w: 400, h: 400 };
let drag = null;

// ---- decoding: text -> bytes -> PNG -> codes, one map at a time -----------------------------
function unpack7(text, n) {
  const out = new Uint8Array(n), bad = META.illegal;
  let acc = 0, bits = 0, o = 0;
  const put = (g) => {
    acc = (acc << 7) | g;
    bits += 7;
    if (bits >= 8) {
      bits -= 8;
      if (o < n) out[o++] = (acc >> bits) & 255;
      acc &= (1 << bits) - 1;
    }
  };
  for (let i = 0; i < text.length; i++) {
    const c = text.charCodeAt(i);
    if (c < 128) { put(c); continue; }
    const x = c - 256, j = x >> 7;
    if (j === 3) put(bad[x & 127]);
    else { put(bad[j]); put(x & 127); }
  }
  return out;
}

function pyramid(codes, rows, cols) {
  const levels = [{ f: 1, rows, cols, codes }];
  let cur = levels[0];
  while (Math.max(cur.rows, cur.cols) > 32) {  // 2 x 2 block maxima (codes grow with weights)
    const r2 = Math.ceil(cur.rows / 2), c2 = Math.ceil(cur.cols / 2);
    const out = new Uint8Array(r2 * c2);
    for (let r = 0; r < cur.rows; r++) {
      const base = (r >> 1) * c2, row = r * cur.cols;
      for (let c = 0; c < cur.cols; c++) {
        const v = cur.codes[row + c], j = base + (c >> 1);
        if (v > out[j]) out[j] = v;
      }
    }
    cur = { f: cur.f * 2, rows: r2, cols: c2, codes: out };
    levels.push(cur);
  }
  return levels;
}

async function decodeHead(i) {
  const m = META.maps[i];
  const png = unpack7($(`qkv-png-${i}`).textContent, m.pngBytes);
  const bitmap = await createImageBitmap(new Blob([png], { type: "image/png" }),
    { colorSpaceConversion: "none", premultiplyAlpha: "none" });
  const scratch = document.createElement("canvas");
  scratch.width = m.cols;
  scratch.height = m.rows;
  const sctx = scratch.getContext("2d", { willReadFrequently: true });
  sctx.drawImage(bitmap, 0, 0);
  bitmap.close();
  const rgba = sctx.getImageData(0, 0, m.cols, m.rows).data;
  const codes = new Uint8Array(m.rows * m.cols);
  for (let k = 0; k < codes.length; k++) codes[k] = rgba[4 * k];
  const exact = m.exactBytes ? new DataView(unpack7($(`qkv-f32-${i}`).textContent,
    m.exactBytes).buffer) : null;
  return { i, m, rows: m.rows, cols: m.cols, codes, exact, levels: pyramid(codes, m.rows, m.cols) };
}

// ---- colour ------------------------------------------------------------------------------------
function codeValue(m, c) {
  if (c === CODE.zero) return 0;
  if (c === CODE.nan) return NaN;
  if (c === CODE.inf) return Infinity;
  if (c === CODE.below) return m.lo;  // an upper bound
  if (m.hi === m.lo || c === CODE.last) return m.hi;
  if (c === CODE.first) return m.lo;
  return m.lo * Math.pow(m.hi / m.lo, (c - CODE.first) / (CODE.last - CODE.first));
}

function position(m, c, scale) {  // 0 (white) .. 1 (dark blue)
  if (c === CODE.zero) return 0;
  if (scale === "log") {
    if (c === CODE.below || m.hi === m.lo) return c === CODE.below ? 0.04 : 1;
    return 0.1 + 0.9 * (c - CODE.first) / (CODE.last - CODE.first);
  }
  const v = c === CODE.below ? 0 : codeValue(m, c);
  return scale === "max" ? (m.hi > 0 ? Math.min(1, v / m.hi) : 0) : Math.min(1, v);
}

const ramp = (t) => LIGHT.map((a, k) => Math.round(a + (DARK[k] - a) * t));

function palette(m, scale) {
  const lut = new Uint32Array(256), bytes = new Uint8Array(lut.buffer);
  for (let c = 0; c < 256; c++) {
    const rgb = c === CODE.nan ? NAN_RGB : c === CODE.inf ? INF_RGB : ramp(position(m, c, scale));
    bytes.set([rgb[0], rgb[1], rgb[2], 255], 4 * c);
  }
  return lut;
}

function colour(head, scale) {
  const lut = palette(head.m, scale);
  for (const lv of head.levels) {
    if (!lv.canvas) {
      lv.canvas = document.createElement("canvas");
      lv.canvas.width = lv.cols;
      lv.canvas.height = lv.rows;
    }
    const img = new ImageData(lv.cols, lv.rows), px = new Uint32Array(img.data.buffer);
    for (let k = 0; k < lv.codes.length; k++) px[k] = lut[lv.codes[k]];
    lv.canvas.getContext("2d").putImageData(img, 0, 0);
  }
  head.scale = scale;
}

// ---- the view: x, y (top-left, in map cells) and k (CSS pixels per cell) --------------------
function layout() {
  const below = canvas.getBoundingClientRect().top + MARGIN.top + MARGIN.bottom + 12;
  const side = Math.max(320, Math.min(window.innerWidth - 420, window.innerHeight - below, 1100));
  plot = { x: MARGIN.left, y: MARGIN.top, w: side, h: side };
  const w = MARGIN.left + side + MARGIN.right, h = MARGIN.top + side + MARGIN.bottom;
  const dpr = window.devicePixelRatio || 1;
  canvas.style.width = `${w}px`;
  canvas.style.height = `${h}px`;
  canvas.width = Math.round(w * dpr);
  canvas.height = Math.round(h * dpr);
}

const fitK = (h) => Math.min(plot.w / h.cols, plot.h / h.rows);

function clampView(v) {
  const h = state.head, k0 = fitK(h);
  v.k = Math.min(Math.max(v.k, k0), Math.max(k0, MAX_CELL));
  v.x = Math.min(Math.max(v.x, 0), Math.max(0, h.cols - plot.w / v.k));
  v.y = Math.min(Math.max(v.y, 0), Math.max(0, h.rows - plot.h / v.k));
  return v;
}

function levelFor(k) {  // the finest level whose cells are at least one pixel wide
  const levels = state.head.levels;
  let i = 0;
  while (i + 1 < levels.length && levels[i].f * k < 1) i++;
  return levels[i];
}

function zoomCells(r0, c0, r1, c1) {  // show map cells [r0, r1) x [c0, c1)
  const k = Math.min(plot.w / Math.max(1, c1 - c0), plot.h / Math.max(1, r1 - r0));
  state.view = clampView({ x: c0, y: r0, k });
}

function zoomAt(px, py, factor) {
  const v = state.view, cx = v.x + (px - plot.x) / v.k, cy = v.y + (py - plot.y) / v.k;
  const k = v.k * factor;
  state.view = clampView({ x: cx - (px - plot.x) / k, y: cy - (py - plot.y) / k, k });
  redraw(true);
}

// ---- labels ----------------------------------------------------------------------------------
function label(m, axis, i) {
  const list = axis === "q" ? m.q : m.k;
  return list < 0 ? String(i) : META.labels[list][i];
}

function span(m, axis, cell) {  // the tokens one map cell covers: [first, last]
  const b = axis === "q" ? m.bt : m.bs, n = axis === "q" ? m.T : m.S;
  return [cell * b, Math.min(n, (cell + 1) * b) - 1];
}

function cellLabel(m, axis, cell) {
  const [a, b] = span(m, axis, cell);
  return a === b ? label(m, axis, a) : `${a}–${b}`;
}

const clip = (text, n) => (text.length > n ? `${text.slice(0, n - 1)}…` : text);

function niceStep(x) {
  const p = Math.pow(10, Math.floor(Math.log10(Math.max(x, 1))));
  return [1, 2, 5, 10].map((s) => s * p).find((s) => s >= x) || 10 * p;
}

function drawAxes(h, v) {
  const m = h.m, hot = state.hover;
  const r0 = Math.floor(v.y), r1 = Math.min(h.rows, Math.ceil(v.y + plot.h / v.k));
  const c0 = Math.floor(v.x), c1 = Math.min(h.cols, Math.ceil(v.x + plot.w / v.k));
  const named = v.k >= 9;
  const size = named ? Math.min(12, Math.floor(v.k) - 1) : 11;
  ctx.font = `${size}px ui-monospace, monospace`;
  ctx.textBaseline = "middle";
  const step = named ? 1 : niceStep(44 / v.k);
  ctx.textAlign = "right";
  for (let r = Math.ceil(r0 / step) * step; r < r1; r += step) {
    const y = plot.y + (r - v.y + 0.5) * v.k;
    ctx.fillStyle = hot && hot.row === r ? "#d62728" : "#333";
    ctx.fillText(named ? clip(cellLabel(m, "q", r), 16) : String(span(m, "q", r)[0]),
      plot.x - 4, y);
  }
  ctx.textAlign = "left";
  for (let c = Math.ceil(c0 / step) * step; c < c1; c += step) {
    const x = plot.x + (c - v.x + 0.5) * v.k;
    ctx.save();
    ctx.translate(x, plot.y - 4);
    ctx.rotate(-Math.PI / 2);
    ctx.fillStyle = hot && hot.col === c ? "#d62728" : "#333";
    ctx.fillText(named ? clip(cellLabel(m, "k", c), 14) : String(span(m, "k", c)[0]), 0, 0);
    ctx.restore();
  }
  ctx.fillStyle = "#777";
  ctx.font = "11px system-ui, sans-serif";
  ctx.textAlign = "right";
  ctx.fillText("query ↓   key →", plot.x - 4, 10);
}

// ---- drawing ---------------------------------------------------------------------------------
function draw() {
  const h = state.head, v = state.view, dpr = canvas.width / parseFloat(canvas.style.width);
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  ctx.fillStyle = "#f2f2f2";
  ctx.fillRect(plot.x, plot.y, plot.w, plot.h);
  const lv = levelFor(v.k), f = lv.f;
  const c0 = Math.floor(v.x / f), r0 = Math.floor(v.y / f);
  const c1 = Math.min(lv.cols, Math.ceil((v.x + plot.w / v.k) / f));
  const r1 = Math.min(lv.rows, Math.ceil((v.y + plot.h / v.k) / f));
  const mapW = Math.min(plot.w, (h.cols - v.x) * v.k);
  const mapH = Math.min(plot.h, (h.rows - v.y) * v.k);
  ctx.save();
  ctx.beginPath();
  ctx.rect(plot.x, plot.y, mapW, mapH);
  ctx.clip();
  ctx.imageSmoothingEnabled = false;
  ctx.drawImage(lv.canvas, c0, r0, c1 - c0, r1 - r0, plot.x + (c0 * f - v.x) * v.k,
    plot.y + (r0 * f - v.y) * v.k, (c1 - c0) * f * v.k, (r1 - r0) * f * v.k);
  if (v.k >= 14) {  // cell borders once cells are large
    ctx.strokeStyle = "rgba(0, 0, 0, 0.08)";
    ctx.lineWidth = 1;
    ctx.beginPath();
    for (let c = Math.ceil(v.x); c <= Math.min(h.cols, v.x + plot.w / v.k); c++) {
      const x = Math.round(plot.x + (c - v.x) * v.k) + 0.5;
      ctx.moveTo(x, plot.y);
      ctx.lineTo(x, plot.y + mapH);
    }
    for (let r = Math.ceil(v.y); r <= Math.min(h.rows, v.y + plot.h / v.k); r++) {
      const y = Math.round(plot.y + (r - v.y) * v.k) + 0.5;
      ctx.moveTo(plot.x, y);
      ctx.lineTo(plot.x + mapW, y);
    }
    ctx.stroke();
  }
  const hot = state.hover;
  if (hot) {
    const b = hot.block || [hot.row, hot.col, hot.row + 1, hot.col + 1];
    ctx.strokeStyle = "#d62728";
    ctx.lineWidth = 2;
    ctx.strokeRect(plot.x + (b[1] - v.x) * v.k - 1, plot.y + (b[0] - v.y) * v.k - 1,
      (b[3] - b[1]) * v.k + 2, (b[2] - b[0]) * v.k + 2);
  }
  ctx.restore();
  if (drag && drag.box) {
    ctx.strokeStyle = "#d62728";
    ctx.setLineDash([4, 3]);
    ctx.strokeRect(drag.x0, drag.y0, drag.x1 - drag.x0, drag.y1 - drag.y0);
    ctx.setLineDash([]);
  }
  drawAxes(h, v);
  drawOverview(h, v);
  $("zoom-note").textContent = f > 1
    ? `zoomed out: each drawn cell is the max of ${f} × ${f} cells; zoom in for single cells`
    : "";
}

function drawOverview(h, v) {
  const s = Math.min(OVERVIEW / h.cols, OVERVIEW / h.rows);
  const w = Math.max(1, Math.round(h.cols * s)), hh = Math.max(1, Math.round(h.rows * s));
  if (ovCanvas.width !== w || ovCanvas.height !== hh) {
    ovCanvas.width = w;
    ovCanvas.height = hh;
  }
  const lv = levelFor(s);
  ovCtx.imageSmoothingEnabled = false;
  ovCtx.clearRect(0, 0, w, hh);
  ovCtx.drawImage(lv.canvas, 0, 0, lv.cols, lv.rows, 0, 0, lv.cols * lv.f * s, lv.rows * lv.f * s);
  ovCtx.strokeStyle = "#d62728";
  ovCtx.lineWidth = 2;
  const seen = (n) => Math.max(2, (n / v.k) * s);
  ovCtx.strokeRect(v.x * s, v.y * s, seen(plot.w), seen(plot.h));
}

function drawLegend() {
  const bar = $("legend-bar"), g = bar.getContext("2d"), m = state.head.m, scale = state.scale;
  for (let y = 0; y < bar.height; y++) {
    const t = 1 - y / (bar.height - 1);
    const rgb = ramp(scale === "log" ? 0.1 + 0.9 * t : t);
    g.fillStyle = `rgb(${rgb[0]}, ${rgb[1]}, ${rgb[2]})`;
    g.fillRect(0, y, bar.width, 1);
  }
  const fmt = (x) => (x === 0 ? "0" : Number(x).toPrecision(2));
  const ticks = scale === "linear" ? ["1", "0.5", "0"]
    : scale === "max" ? [fmt(m.hi), fmt(m.hi / 2), "0"]
    : [fmt(m.hi), fmt(Math.sqrt(m.hi * m.lo)), fmt(m.lo)];
  $("legend-ticks").replaceChildren(...ticks.map((t) => Object.assign(
    document.createElement("span"), { textContent: t })));
  $("legend-below").style.display = scale === "log" ? "" : "none";
}

let hashTimer = 0;
function redraw(viewChanged) {
  draw();
  if (viewChanged) {  // the zoom goes to the URL too, without a history entry per wheel step
    clearTimeout(hashTimer);
    hashTimer = setTimeout(() => history.replaceState(null, "", `#${hashText(true)}`), 250);
  }
}

// ---- hover -----------------------------------------------------------------------------------
function shortest32(x) {  // the shortest decimal that reads back to the same float32
  if (Number.isNaN(x)) return "NaN";
  if (!Number.isFinite(x)) return x > 0 ? "inf" : "-inf";
  if (x === 0) return "0";
  for (let p = 1; p < 10; p++) {
    const s = x.toPrecision(p);
    if (Math.fround(Number(s)) === x) return String(Number(s));
  }
  return String(x);
}

const percent = (e) => (100 * e).toPrecision(2);

function describe(h, row, col) {
  const m = h.m, code = h.codes[row * h.cols + col];
  const [t0, t1] = span(m, "q", row), [s0, s1] = span(m, "k", col);
  const out = { t: t0, t1, s: s0, s1, code, exact: "0", error: "", below: "" };
  out.query = t0 === t1 ? label(m, "q", t0) : `${label(m, "q", t0)} … ${label(m, "q", t1)}`;
  out.key = s0 === s1 ? label(m, "k", s0) : `${label(m, "k", s0)} … ${label(m, "k", s1)}`;
  if (h.exact && t0 === t1 && s0 === s1) {
    out.weight = shortest32(h.exact.getFloat32((t0 * m.S + s0) * 4, true));
    out.exact = "1";
    out.shown = out.weight;
  } else if (code === CODE.below) {
    out.weight = "";
    out.below = String(m.lo);
    out.shown = `< ${Number(m.lo).toPrecision(3)}`;
  } else {
    const v = codeValue(m, code);
    const log = code >= CODE.first && code <= CODE.last && m.error > 0;
    out.weight = log ? String(v) : shortest32(v);  // NaN, inf, 0, or a map's single value
    out.error = log ? String(m.error) : "0";
    out.shown = log ? `≈ ${v.toPrecision(3)} (±${percent(m.error)} %)` : shortest32(v);
  }
  return out;
}

function hoverAt(mx, my) {  // the cell drawn at the centre of the pixel under the pointer
  const h = state.head, v = state.view, px = Math.floor(mx) + 0.5, py = Math.floor(my) + 0.5;
  const col = Math.floor(v.x + (px - plot.x) / v.k), row = Math.floor(v.y + (py - plot.y) / v.k);
  const inside = mx >= plot.x && my >= plot.y && mx < plot.x + plot.w && my < plot.y + plot.h;
  if (!inside || row < 0 || col < 0 || row >= h.rows || col >= h.cols) {
    if (state.hover) { state.hover = null; showReadout(); draw(); }
    return;
  }
  const f = levelFor(v.k).f;
  let hot = { row, col, block: null, f };
  if (f > 1) {  // the drawn cell is the max of an f x f block: point at the cell that holds it
    const br = row - (row % f), bc = col - (col % f);
    const re = Math.min(h.rows, br + f), ce = Math.min(h.cols, bc + f);
    let best = -1;
    for (let r = br; r < re; r++) {
      for (let c = bc; c < ce; c++) {
        const code = h.codes[r * h.cols + c];
        if (code > best) { best = code; hot = { row: r, col: c, block: [br, bc, re, ce], f }; }
      }
    }
  }
  state.hover = hot;
  showReadout();
  draw();
}

function showReadout() {
  const out = $("readout"), hot = state.hover;
  for (const key of Object.keys(out.dataset)) delete out.dataset[key];
  if (!hot) { out.textContent = "hover a cell"; return; }
  const d = describe(state.head, hot.row, hot.col);
  for (const key of ["t", "t1", "s", "s1", "query", "key", "weight", "exact", "error", "below"]) {
    out.dataset[key] = String(d[key]);
  }
  const q = d.t === d.t1 ? `query ${d.t}` : `queries ${d.t}–${d.t1}`;
  const k = d.s === d.s1 ? `key ${d.s}` : `keys ${d.s}–${d.s1}`;
  const what = d.t === d.t1 && d.s === d.s1 ? "weight" : "max weight";
  const note = hot.block ? ` (the max of the ${hot.f} × ${hot.f} cells drawn here)` : "";
  out.textContent =
    `${q} ${JSON.stringify(d.query)} -> ${k} ${JSON.stringify(d.key)}: ${what} ${d.shown}${note}`;
}

// ---- pickers, URL hash, switching ------------------------------------------------------------
const GROUPS = [...new Set(META.maps.map((m) => m.group))];

function mapText(m) {
  const prefix = `${m.group} · `;
  return m.group && m.title.startsWith(prefix) ? m.title.slice(prefix.length) : m.title;
}

function fillPickers(i) {
  const m = META.maps[i];
  $("group-label").style.display = GROUPS.length > 1 ? "" : "none";
  $("group").replaceChildren(...GROUPS.map((g, j) => new Option(g || "(none)", String(j))));
  $("group").value = String(GROUPS.indexOf(m.group));
  const members = META.maps.map((x, j) => [x, j]).filter(([x]) => x.group === m.group);
  $("map").replaceChildren(...members.map(([x, j]) => new Option(mapText(x), String(j))));
  $("map").value = String(i);
  $("scale").value = state.scale;
}

function showInfo(m) {
  const count = (n, what) => (n ? ` · ${n.toLocaleString("en")} ${what}` : "");
  $("dims").textContent = `${m.T} queries × ${m.S} keys · max ${m.max === null ? "none"
    : shortest32(m.max)}${count(m.nan, "NaN")}${count(m.inf, "inf")}${count(m.zero, "zero")}`;
  $("pooling").textContent = m.bt > 1 || m.bs > 1
    ? `pooled for this page: each cell is the max over ${m.bt} queries × ${m.bs} keys ` +
      "(block max; NaN if any weight in the block is NaN)" : "";
  $("quant").textContent = m.exactBytes ? "hover: the exact float32 weight"
    : `hover: 8-bit log codes, within ±${(100 * m.error).toPrecision(2)} % of the weight` +
      (m.hi > m.lo ? `; below ${Number(m.lo).toPrecision(3)}: shown as "<"` : "");
}

function hashText(withZoom) {
  let text = `map=${state.index}&scale=${state.scale}`;
  if (withZoom && state.view && state.head) {
    const v = state.view, r = (x) => Math.round(x);
    text += `&zoom=${r(v.y)},${r(v.x)},${r(v.y + plot.h / v.k)},${r(v.x + plot.w / v.k)}`;
  }
  return text;
}

function readHash() {
  const p = new URLSearchParams(location.hash.slice(1));
  const i = parseInt(p.get("map") || "0", 10);
  const scale = ["linear", "max", "log"].includes(p.get("scale")) ? p.get("scale") : META.scale;
  const zoom = (p.get("zoom") || "").split(",").map(Number);
  return {
    index: Number.isInteger(i) && i >= 0 && i < META.maps.length ? i : 0,
    scale,
    zoom: zoom.length === 4 && zoom.every(Number.isFinite) ? zoom : null,
  };
}

async function select(i, scale = state.scale, zoom = null) {
  const token = ++state.token, t0 = performance.now();
  state.want = { index: i, scale };  // what the page is about to show
  let head = state.head;
  if (!head || head.i !== i) {
    try {
      head = await decodeHead(i);
    } catch (err) {
      $("readout").textContent = `could not decode map ${i}: ${err}`;
      throw err;
    }
    timings.lastDecode = performance.now() - t0;
    if (token !== state.token) return;  // a later choice won
  }
  const same = state.head && state.head.rows === head.rows && state.head.cols === head.cols;
  if (state.head && state.head !== head) state.head.levels = null;  // one map decoded at a time
  state.head = head;
  state.index = i;
  state.scale = scale;
  if (head.scale !== scale) colour(head, scale);
  if (zoom) zoomCells(...zoom);
  else if (!same || !state.view) state.view = clampView({ x: 0, y: 0, k: fitK(head) });
  else state.view = clampView(state.view);
  state.hover = null;
  fillPickers(i);
  showInfo(head.m);
  drawLegend();
  showReadout();
  draw();
  timings.lastSwitch = performance.now() - t0;
}

function show(i, scale = state.scale, zoom = null) {  // the promise probes wait on: idle()
  state.busy = select(i, scale, zoom);
  return state.busy;
}

function choose(i, scale = state.scale) {
  location.hash = `map=${i}&scale=${scale}`;  // a link to this view
  return show(i, scale);  // now, not when the (asynchronous) hashchange event arrives
}

function step(delta) {
  const n = META.maps.length;
  return choose((state.index + delta + n) % n);
}

// ---- events ----------------------------------------------------------------------------------
const local = (e) => {
  const r = canvas.getBoundingClientRect();
  return [e.clientX - r.left, e.clientY - r.top];
};

canvas.addEventListener("mousedown", (e) => {
  const [x, y] = local(e);
  drag = e.shiftKey ? { box: true, x0: x, y0: y, x1: x, y1: y }
    : { box: false, x, y, vx: state.view.x, vy: state.view.y };
  e.preventDefault();
});
window.addEventListener("mousemove", (e) => {
  if (!state.head) return;
  const [x, y] = local(e);
  if (!drag) { if (e.target === canvas) hoverAt(x, y); return; }
  if (drag.box) { drag.x1 = x; drag.y1 = y; draw(); return; }
  const v = state.view;
  const pan = { x: drag.vx - (x - drag.x) / v.k, y: drag.vy - (y - drag.y) / v.k, k: v.k };
  state.view = clampView(pan);
  redraw(true);
});
window.addEventListener("mouseup", () => {
  if (drag && drag.box && Math.abs(drag.x1 - drag.x0) > 4 && Math.abs(drag.y1 - drag.y0) > 4) {
    const v = state.view, col = (px) => v.x + (px - plot.x) / v.k;
    const row = (py) => v.y + (py - plot.y) / v.k;
    const c0 = col(Math.min(drag.x0, drag.x1)), c1 = col(Math.max(drag.x0, drag.x1));
    const r0 = row(Math.min(drag.y0, drag.y1)), r1 = row(Math.max(drag.y0, drag.y1));
    drag = null;
    zoomCells(r0, c0, r1, c1);
    redraw(true);
    return;
  }
  const wasBox = drag && drag.box;
  drag = null;
  if (wasBox) draw();
});
canvas.addEventListener("mouseleave", () => {
  if (state.hover && !drag) { state.hover = null; showReadout(); draw(); }
});
canvas.addEventListener("wheel", (e) => {
  if (!state.head) return;
  e.preventDefault();
  const [x, y] = local(e);
  zoomAt(x, y, Math.exp(-e.deltaY * 0.0015));
}, { passive: false });
canvas.addEventListener("dblclick", () => fitAll());
const fromOverview = (e) => {
  if (!state.head || !(e.buttons & 1)) return;
  const r = ovCanvas.getBoundingClientRect(), h = state.head, v = state.view;
  const s = Math.min(OVERVIEW / h.cols, OVERVIEW / h.rows);
  const cx = (e.clientX - r.left) / s, cy = (e.clientY - r.top) / s;
  state.view = clampView({ x: cx - plot.w / v.k / 2, y: cy - plot.h / v.k / 2, k: v.k });
  redraw(true);
};
ovCanvas.addEventListener("mousedown", fromOverview);
ovCanvas.addEventListener("mousemove", fromOverview);
$("group").addEventListener("change", () => {
  const g = GROUPS[Number($("group").value)];
  const at = META.maps.filter((m) => m.group === state.head.m.group).indexOf(state.head.m);
  const members = META.maps.map((m, j) => [m, j]).filter(([m]) => m.group === g);
  choose(members[Math.min(Math.max(at, 0), members.length - 1)][1]);
});
$("map").addEventListener("change", () => choose(Number($("map").value)));
$("scale").addEventListener("change", () => choose(state.index, $("scale").value));
$("prev").addEventListener("click", () => step(-1));
$("next").addEventListener("click", () => step(1));
const fitAll = () => {
  state.view = clampView({ x: 0, y: 0, k: 0 });
  redraw(true);
};
const zoomCentre = (factor) => zoomAt(plot.x + plot.w / 2, plot.y + plot.h / 2, factor);
$("fit").addEventListener("click", fitAll);
$("zoom-in").addEventListener("click", () => zoomCentre(2));
$("zoom-out").addEventListener("click", () => zoomCentre(0.5));
window.addEventListener("keydown", (e) => {
  if (e.target instanceof HTMLSelectElement || !state.head) return;
  if (e.key === "[") step(-1);
  else if (e.key === "]") step(1);
  else if (e.key === "+" || e.key === "=") zoomCentre(2);
  else if (e.key === "-") zoomCentre(0.5);
  else if (e.key === "0") fitAll();
});
window.addEventListener("hashchange", () => {
  const want = readHash(), now = state.want || state;
  if (want.index !== now.index || want.scale !== now.scale || want.zoom) {
    show(want.index, want.scale, want.zoom);
  }
});
window.addEventListener("resize", () => {
  if (!state.head) return;
  layout();
  state.view = clampView(state.view);
  draw();
});

// ---- the API probes use ----------------------------------------------------------------------
window.qkvView = {
  timings,
  select: (i) => choose(i),
  idle: () => state.busy,
  zoomTo: (t0, s0, t1, s1) => {  // show tokens [t0, t1) x [s0, s1)
    const m = state.head.m;
    const [bt, bs] = [m.bt, m.bs];
    zoomCells(Math.floor(t0 / bt), Math.floor(s0 / bs), Math.ceil(t1 / bt), Math.ceil(s1 / bs));
    draw();
  },
  cellCenter: (t, s) => {  // client coordinates of the centre of the drawn cell of (t, s)
    const h = state.head, m = h.m, v = state.view, r = canvas.getBoundingClientRect();
    const f = levelFor(v.k).f;  // zoomed out, the block of f x f cells drawn as one
    const mid = (cell, n) => {
      const first = Math.floor(cell / f) * f;
      return (first + Math.min(n, first + f)) / 2;
    };
    const x = plot.x + (mid(Math.floor(s / m.bs), h.cols) - v.x) * v.k;
    const y = plot.y + (mid(Math.floor(t / m.bt), h.rows) - v.y) * v.k;
    const inside = x >= plot.x && y >= plot.y && x < plot.x + plot.w && y < plot.y + plot.h;
    return inside ? { x: r.left + x, y: r.top + y } : null;
  },
  pixel: (clientX, clientY) => {  // the RGB the map canvas shows there
    const r = canvas.getBoundingClientRect(), dpr = canvas.width / r.width;
    const x = Math.floor((clientX - r.left) * dpr), y = Math.floor((clientY - r.top) * dpr);
    return [...ctx.getImageData(x, y, 1, 1).data.slice(0, 3)];
  },
  state: () => ({
    index: state.index, title: state.head && state.head.m.title, scale: state.scale,
    rows: state.head && state.head.rows, cols: state.head && state.head.cols,
    k: state.view && state.view.k, f: state.head && levelFor(state.view.k).f,
  }),
};

$("title").textContent = META.title;
layout();
const first = readHash();
window.qkvView.ready = show(first.index, first.scale, first.zoom).then(() => {
  timings.firstPaint = performance.now();
});
"""

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
<div id="info"><span id="dims"></span><span id="pooling"></span><span id="quant"></span>
<span id="zoom-note"></span></div>
<div id="readout">hover a cell</div>
<div id="view">
<canvas id="map-canvas"></canvas>
<div id="side">
<canvas id="overview" width="1" height="1"></canvas>
<div>overview: click or drag to move the view</div>
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
