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
const STRIP = 24;  // the least height (width) of a cell of a map with few rows (columns)
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

function level(h, fx, fy) {  // the map pooled by fy x fx block maxima, coloured; a few are kept
  const key = `${fx},${fy}`;
  let lv = h.levels.get(key);
  if (lv) return lv;
  const rows = Math.ceil(h.rows / fy), cols = Math.ceil(h.cols / fx);
  let codes = h.codes;
  if (fx > 1 || fy > 1) {  // codes grow with weights (NaN on top): the max code is the max
    codes = new Uint8Array(rows * cols);
    const sx = Math.log2(fx), sy = Math.log2(fy);
    for (let r = 0; r < h.rows; r++) {
      const base = (r >> sy) * cols, row = r * h.cols;
      for (let c = 0; c < h.cols; c++) {
        const v = h.codes[row + c], j = base + (c >> sx);
        if (v > codes[j]) codes[j] = v;
      }
    }
  }
  const img = new ImageData(cols, rows), px = new Uint32Array(img.data.buffer);
  for (let k = 0; k < codes.length; k++) px[k] = h.lut[codes[k]];
  const cv = document.createElement("canvas");
  cv.width = cols;
  cv.height = rows;
  cv.getContext("2d").putImageData(img, 0, 0);
  lv = { fx, fy, rows, cols, canvas: cv };
  h.levels.set(key, lv);
  if (h.levels.size > 6) h.levels.delete(h.levels.keys().next().value);
  return lv;
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
  return { i, m, rows: m.rows, cols: m.cols, codes, exact, levels: new Map(), scale: null };
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
  head.lut = palette(head.m, scale);
  head.levels = new Map();
  head.scale = scale;
}

// ---- the view: x, y (top-left, in map cells), z (zoom, 1 = fit), kx and ky (pixels per cell) ---
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

// Pixels per cell that show the whole map in w x h: square cells, except that the short side of
// an elongated map (one query of a decoding step: 1 x S) is stretched to at least `least`.
function fitScales(w, h, rows, cols, least) {
  const k = Math.min(w / cols, h / rows);
  return [Math.min(w / cols, Math.max(k, least)), Math.min(h / rows, Math.max(k, least))];
}

function clampView(v) {
  const h = state.head, [k0x, k0y] = fitScales(plot.w, plot.h, h.rows, h.cols, STRIP);
  const top = (k0) => Math.max(k0, MAX_CELL);
  v.z = Math.min(Math.max(v.z, 1), Math.max(top(k0x) / k0x, top(k0y) / k0y));
  v.kx = Math.min(k0x * v.z, top(k0x));
  v.ky = Math.min(k0y * v.z, top(k0y));
  v.x = Math.min(Math.max(v.x, 0), Math.max(0, h.cols - plot.w / v.kx));
  v.y = Math.min(Math.max(v.y, 0), Math.max(0, h.rows - plot.h / v.ky));
  return v;
}

// The pooling that draws every cell at least one pixel wide and tall: a power of 2 per axis.
const pooling = (k) => (k >= 1 ? 1 : Math.pow(2, Math.ceil(Math.log2(1 / k))));
const levelFor = (kx, ky) => level(state.head, pooling(kx), pooling(ky));

function zoomCells(r0, c0, r1, c1) {  // show map cells [r0, r1) x [c0, c1)
  const h = state.head, [k0x, k0y] = fitScales(plot.w, plot.h, h.rows, h.cols, STRIP);
  const z = Math.min(plot.w / Math.max(1, c1 - c0) / k0x, plot.h / Math.max(1, r1 - r0) / k0y);
  state.view = clampView({ x: c0, y: r0, z });
}

function zoomAt(px, py, factor) {  // the cell under (px, py) stays there
  const v = state.view, cx = v.x + (px - plot.x) / v.kx, cy = v.y + (py - plot.y) / v.ky;
  const next = clampView({ x: 0, y: 0, z: v.z * factor });
  next.x = cx - (px - plot.x) / next.kx;
  next.y = cy - (py - plot.y) / next.ky;
  state.view = clampView(next);
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
  const r0 = Math.floor(v.y), r1 = Math.min(h.rows, Math.ceil(v.y + plot.h / v.ky));
  const c0 = Math.floor(v.x), c1 = Math.min(h.cols, Math.ceil(v.x + plot.w / v.kx));
  const font = (k) => `${k >= 9 ? Math.min(12, Math.floor(k) - 1) : 11}px ui-monospace, monospace`;
  const text = (axis, cell, k, n) =>
    k >= 9 ? clip(cellLabel(m, axis, cell), n) : String(span(m, axis, cell)[0]);
  ctx.textBaseline = "middle";
  ctx.font = font(v.ky);
  ctx.textAlign = "right";
  const stepR = v.ky >= 9 ? 1 : niceStep(30 / v.ky);
  for (let r = Math.ceil(r0 / stepR) * stepR; r < r1; r += stepR) {
    ctx.fillStyle = hot && hot.row === r ? "#d62728" : "#333";
    ctx.fillText(text("q", r, v.ky, 16), plot.x - 4, plot.y + (r - v.y + 0.5) * v.ky);
  }
  ctx.font = font(v.kx);
  ctx.textAlign = "left";
  const stepC = v.kx >= 9 ? 1 : niceStep(30 / v.kx);
  for (let c = Math.ceil(c0 / stepC) * stepC; c < c1; c += stepC) {
    ctx.save();
    ctx.translate(plot.x + (c - v.x + 0.5) * v.kx, plot.y - 4);
    ctx.rotate(-Math.PI / 2);
    ctx.fillStyle = hot && hot.col === c ? "#d62728" : "#333";
    ctx.fillText(text("k", c, v.kx, 14), 0, 0);
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
  const lv = levelFor(v.kx, v.ky), fx = lv.fx, fy = lv.fy;
  const c0 = Math.floor(v.x / fx), r0 = Math.floor(v.y / fy);
  const c1 = Math.min(lv.cols, Math.ceil((v.x + plot.w / v.kx) / fx));
  const r1 = Math.min(lv.rows, Math.ceil((v.y + plot.h / v.ky) / fy));
  const mapW = Math.min(plot.w, (h.cols - v.x) * v.kx);
  const mapH = Math.min(plot.h, (h.rows - v.y) * v.ky);
  ctx.save();
  ctx.beginPath();
  ctx.rect(plot.x, plot.y, mapW, mapH);
  ctx.clip();
  ctx.imageSmoothingEnabled = false;
  ctx.drawImage(lv.canvas, c0, r0, c1 - c0, r1 - r0, plot.x + (c0 * fx - v.x) * v.kx,
    plot.y + (r0 * fy - v.y) * v.ky, (c1 - c0) * fx * v.kx, (r1 - r0) * fy * v.ky);
  ctx.strokeStyle = "rgba(0, 0, 0, 0.08)";  // cell borders once cells are large
  ctx.lineWidth = 1;
  ctx.beginPath();
  for (let c = Math.ceil(v.x); v.kx >= 14 && c <= Math.min(h.cols, v.x + plot.w / v.kx); c++) {
    const x = Math.round(plot.x + (c - v.x) * v.kx) + 0.5;
    ctx.moveTo(x, plot.y);
    ctx.lineTo(x, plot.y + mapH);
  }
  for (let r = Math.ceil(v.y); v.ky >= 14 && r <= Math.min(h.rows, v.y + plot.h / v.ky); r++) {
    const y = Math.round(plot.y + (r - v.y) * v.ky) + 0.5;
    ctx.moveTo(plot.x, y);
    ctx.lineTo(plot.x + mapW, y);
  }
  ctx.stroke();
  const hot = state.hover;
  if (hot) {
    const b = hot.block || [hot.row, hot.col, hot.row + 1, hot.col + 1];
    ctx.strokeStyle = "#d62728";
    ctx.lineWidth = 2;
    ctx.strokeRect(plot.x + (b[1] - v.x) * v.kx - 1, plot.y + (b[0] - v.y) * v.ky - 1,
      (b[3] - b[1]) * v.kx + 2, (b[2] - b[0]) * v.ky + 2);
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
  $("zoom-note").textContent = fx > 1 || fy > 1
    ? `zoomed out: each drawn cell is the max of ${fy} × ${fx} cells (queries × keys); ` +
      "zoom in for single cells" : "";
}

const overviewScales = (h) => fitScales(OVERVIEW, OVERVIEW, h.rows, h.cols, 6);

function drawOverview(h, v) {
  const [sx, sy] = overviewScales(h);
  const w = Math.max(1, Math.round(h.cols * sx)), hh = Math.max(1, Math.round(h.rows * sy));
  if (ovCanvas.width !== w || ovCanvas.height !== hh) {
    ovCanvas.width = w;
    ovCanvas.height = hh;
  }
  const lv = levelFor(sx, sy);
  ovCtx.imageSmoothingEnabled = false;
  ovCtx.clearRect(0, 0, w, hh);
  ovCtx.drawImage(lv.canvas, 0, 0, lv.cols, lv.rows, 0, 0, lv.cols * lv.fx * sx,
    lv.rows * lv.fy * sy);
  ovCtx.strokeStyle = "#d62728";
  ovCtx.lineWidth = 2;
  ovCtx.strokeRect(v.x * sx, v.y * sy, Math.max(2, (plot.w / v.kx) * sx),
    Math.max(2, (plot.h / v.ky) * sy));
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
  const col = Math.floor(v.x + (px - plot.x) / v.kx), row = Math.floor(v.y + (py - plot.y) / v.ky);
  const inside = mx >= plot.x && my >= plot.y && mx < plot.x + plot.w && my < plot.y + plot.h;
  if (!inside || row < 0 || col < 0 || row >= h.rows || col >= h.cols) {
    if (state.hover) { state.hover = null; showReadout(); draw(); }
    return;
  }
  const fx = pooling(v.kx), fy = pooling(v.ky);
  let hot = { row, col, block: null, fx, fy };
  if (fx > 1 || fy > 1) {  // the drawn cell is a block's max: point at the cell that holds it
    const br = row - (row % fy), bc = col - (col % fx);
    const re = Math.min(h.rows, br + fy), ce = Math.min(h.cols, bc + fx);
    let best = -1;
    for (let r = br; r < re; r++) {
      for (let c = bc; c < ce; c++) {
        const code = h.codes[r * h.cols + c];
        if (code > best) { best = code; hot = { row: r, col: c, block: [br, bc, re, ce], fx, fy }; }
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
  const note = hot.block ? ` (the max of the ${hot.fy} × ${hot.fx} cells drawn here)` : "";
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
    text += `&zoom=${r(v.y)},${r(v.x)},${r(v.y + plot.h / v.ky)},${r(v.x + plot.w / v.kx)}`;
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
  fillPickers(i);
  showInfo(head.m);
  layout();  // the info line above may have changed height
  if (zoom) zoomCells(...zoom);
  else if (!same || !state.view) state.view = clampView({ x: 0, y: 0, z: 1 });
  else state.view = clampView(state.view);
  state.hover = null;
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
  const pan = { x: drag.vx - (x - drag.x) / v.kx, y: drag.vy - (y - drag.y) / v.ky, z: v.z };
  state.view = clampView(pan);
  redraw(true);
});
window.addEventListener("mouseup", () => {
  if (drag && drag.box && Math.abs(drag.x1 - drag.x0) > 4 && Math.abs(drag.y1 - drag.y0) > 4) {
    const v = state.view, col = (px) => v.x + (px - plot.x) / v.kx;
    const row = (py) => v.y + (py - plot.y) / v.ky;
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
  const r = ovCanvas.getBoundingClientRect(), v = state.view, [sx, sy] = overviewScales(state.head);
  const cx = (e.clientX - r.left) / sx, cy = (e.clientY - r.top) / sy;
  state.view = clampView({ x: cx - plot.w / v.kx / 2, y: cy - plot.h / v.ky / 2, z: v.z });
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
  state.view = clampView({ x: 0, y: 0, z: 1 });
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
    const mid = (cell, f, n) => {  // zoomed out, the f cells drawn as one
      const first = Math.floor(cell / f) * f;
      return (first + Math.min(n, first + f)) / 2;
    };
    const x = plot.x + (mid(Math.floor(s / m.bs), pooling(v.kx), h.cols) - v.x) * v.kx;
    const y = plot.y + (mid(Math.floor(t / m.bt), pooling(v.ky), h.rows) - v.y) * v.ky;
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
    kx: state.view && state.view.kx, ky: state.view && state.view.ky,
    k: state.view && Math.min(state.view.kx, state.view.ky),
    f: state.view && Math.max(pooling(state.view.kx), pooling(state.view.ky)),
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
