"""The second half of the view page's script (:data:`qkv.doctor.view_page.JS`): the hover
readout, the pickers and the URL hash, switching maps, the mouse and keyboard events, and
``window.qkvView``, the API that probes use. Plain JavaScript in a Python string; it calls the
functions of :data:`qkv.doctor.view_draw_js.DRAW_JS`, which comes first on the page."""

from __future__ import annotations

__all__ = ["CONTROL_JS"]

CONTROL_JS = r"""
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
