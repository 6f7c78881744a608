"""The first half of the view page's script (:data:`qkv.doctor.view_page.JS`): decoding a map
from its text to codes, its colours, the view's geometry (pan, zoom, pooling), the axis labels and
the drawing of the map, the overview and the legend. Plain JavaScript in a Python string."""

from __future__ import annotations

__all__ = ["DRAW_JS"]

DRAW_JS = r"""
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
"""
