"""The canvas attention view: its encoding checked in Python, its page in a real headless browser.

The encoding is read back with decoders of the test's own (a Python ``unpack7``, Pillow for the
PNG) and compared with the weights. The page is opened in Debian's ``chromium`` through
:class:`qkv.doctor.view_browser.Browser`; a probe hovers cells with real mouse events, reads the
readout and the canvas pixels, switches maps through the page's own controls, and the weights it
reports are compared with the tensors: exactly where the page says it is exact, within the
relative error it states otherwise.
"""

from __future__ import annotations

import io
import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from qkv.doctor.view import HeadMap, attention_html, save_attention_html
from qkv.doctor.view_browser import Browser, chromium
from qkv.doctor.view_encode import ILLEGAL, block_max, pack7, png_gray8, quantize

needs_chromium = pytest.mark.skipif(
    chromium() is None,
    reason="Debian's chromium is not installed (apt-get install chromium; .ci/run installs it)",
)

DARK = (8, 48, 107)  # the page's colour for weight 1; 0 is white


# ---- the test's own decoders ---------------------------------------------------------------
def _unpack7(text: str, n: int) -> bytes:
    bits = []
    for ch in text:
        c = ord(ch)
        if c < 128:
            groups = [c]
        elif (c - 256) >> 7 == 3:
            groups = [ILLEGAL[(c - 256) & 127]]
        else:
            groups = [ILLEGAL[(c - 256) >> 7], (c - 256) & 127]
        for g in groups:
            bits.extend((g >> k) & 1 for k in range(6, -1, -1))
    return bytes(int("".join(map(str, bits[8 * i : 8 * i + 8])), 2) for i in range(n))


def _page_parts(page: str) -> tuple[dict[str, Any], dict[str, str]]:
    meta = json.loads(page.split('id="qkv-data">', 1)[1].split("</script>", 1)[0])
    payloads = dict(re.findall(r'<script type="text/plain" id="([^"]+)">([^<]*)</script>', page))
    return meta, payloads


def _decoded_codes(page: str, i: int) -> np.ndarray:
    meta, payloads = _page_parts(page)
    png = _unpack7(payloads[f"qkv-png-{i}"], meta["maps"][i]["pngBytes"])
    return np.array(Image.open(io.BytesIO(png)))


def _code_value(code: int, lo: float, hi: float) -> float:
    return hi if hi == lo else lo * (hi / lo) ** ((code - 2) / 251)


def _rgb(t: float) -> list[float]:
    return [255 + (d - 255) * min(1.0, t) for d in DARK]


# ---- encoding, no browser --------------------------------------------------------------------
def test_pack7_round_trips_and_never_writes_what_ends_a_script() -> None:
    rng = np.random.default_rng(0)
    for n in [*range(16), 97, 1000]:
        for trial in range(6):
            if trial % 2:  # runs of groups that must be escaped, and the last group escaped
                pool = np.array([0x00, 0x0D, 0x3C, 0x1E, 0x78, 0x3C, 0xFF], dtype=np.uint8)
                data = rng.choice(pool, size=n).tobytes()
            else:
                data = rng.integers(0, 256, size=n, dtype=np.uint8).tobytes()
            text = pack7(data)
            assert _unpack7(text, n) == data
            assert not set(text) & {"\x00", "\r", "<"} and all(ord(c) < 0x283 for c in text)
            assert len(text) <= -(-8 * n // 7)


def test_png_decodes_to_the_codes() -> None:
    rng = np.random.default_rng(1)
    for shape in [(1, 1), (3, 5), (64, 301)]:
        codes = rng.integers(0, 256, size=shape, dtype=np.uint8)
        codes[: shape[0] // 2] = codes[0]  # repeated rows: the Up filter wins somewhere
        assert np.array_equal(np.array(Image.open(io.BytesIO(png_gray8(codes)))), codes)


def test_codes_read_back_within_the_stated_error() -> None:
    w = torch.rand(40, 50, dtype=torch.float64).pow(12).float()  # [40, 50] 1e-9 .. 1
    w[0, :5] = torch.tensor([0.0, float("nan"), float("inf"), 1e-30, 3e-12])
    c = quantize(w)
    # 1e-30 lies below the floor, so the codes span 8 decades (lo is rounded to float32)
    assert c.lo == pytest.approx(c.hi * 1e-8, rel=1e-7)
    assert c.error == pytest.approx(10 ** (8 / 502) - 1, rel=1e-7)
    for (t, s), code in np.ndenumerate(c.codes):
        x = float(w[t, s])
        if math.isnan(x):
            assert code == 255
        elif math.isinf(x):
            assert code == 254
        elif x == 0:
            assert code == 0
        elif code == 1:
            assert x < c.lo
        else:
            assert 2 <= code <= 253 and x >= c.lo
            assert abs(_code_value(int(code), c.lo, c.hi) - x) <= c.error * x * (1 + 1e-12)
    uniform = quantize(torch.full((3, 4), 0.25))  # one value: read back exactly
    assert (uniform.codes == 253).all() and uniform.lo == uniform.hi == 0.25
    assert uniform.error == 0


def test_block_max_is_the_max_of_each_block_nan_first() -> None:
    w = torch.rand(11, 7)
    w[4, 5] = float("nan")
    pooled, bt, bs = block_max(w, 4, 3)
    assert (bt, bs) == (3, 3) and pooled.shape == (4, 3)
    for r in range(4):
        for c in range(3):
            block = w[r * 3 : r * 3 + 3, c * 3 : c * 3 + 3]
            want = float("nan") if block.isnan().any() else float(block.max())
            torch.testing.assert_close(pooled[r, c], torch.tensor(want), equal_nan=True)
    assert block_max(w, 11, 7)[0] is w


def test_a_2k_head_takes_at_most_5_mb_whatever_its_weights(tmp_path: Path) -> None:
    # Log-uniform weights over the 8 decades: codes spread over all 252 values, which zlib
    # cannot shrink, the worst case for the page's size.
    g = torch.Generator().manual_seed(0)
    w = torch.pow(10.0, -8 * torch.rand(2048, 2048, generator=g))  # [2048, 2048]
    page = save_attention_html(tmp_path / "2k.html", [HeadMap("2k", w)])
    assert page.stat().st_size <= 5_000_000, page.stat().st_size
    meta, _ = _page_parts(page.read_text(encoding="utf-8"))
    assert (meta["maps"][0]["rows"], meta["maps"][0]["bt"]) == (2048, 1)  # not pooled


def test_exact_weights_and_labels_travel_in_the_page() -> None:
    w = torch.rand(3, 4)
    page = attention_html([HeadMap("a", w, ["x", "y", "z"], list("ABCD"))], title="t")
    meta, payloads = _page_parts(page)
    raw = _unpack7(payloads["qkv-f32-0"], meta["maps"][0]["exactBytes"])
    assert torch.equal(torch.frombuffer(bytearray(raw), dtype=torch.float32).view(3, 4), w)
    assert meta["labels"] == [["x", "y", "z"], list("ABCD")]
    assert np.array_equal(_decoded_codes(page, 0), quantize(w).codes)
    assert not re.search(r"https?://|\bsrc=|<link|@import|fetch\(|XMLHttpRequest", page)


def test_tokens_and_titles_cannot_break_out_of_the_script_element() -> None:
    tokens = ["</script><b>", "&amp;"]
    page = attention_html([HeadMap("<i>h</i>", torch.full((2, 2), 0.5), tokens, tokens)], "</b>")
    data = page.split('id="qkv-data">', 1)[1].split("</script>", 1)[0]
    assert "<" not in data and ">" not in data and "&" not in data
    assert json.loads(data)["labels"] == [tokens] and json.loads(data)["title"] == "</b>"


def test_bad_input_is_refused_with_its_value() -> None:
    with pytest.raises(ValueError, match=r"non-empty \[T, S\] matrix, got shape \(2, 2, 2\)"):
        HeadMap("a", torch.zeros(2, 2, 2))
    with pytest.raises(TypeError, match=r"floating-point torch.Tensor, got Tensor of torch.int64"):
        HeadMap("a", torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"key_labels must be 2 labels, got 3 labels"):
        HeadMap("a", torch.zeros(2, 2), key_labels=["a", "b", "c"])
    with pytest.raises(ValueError, match=r"at least one HeadMap, got none"):
        attention_html([])
    with pytest.raises(ValueError, match=r"maps\[0\] \('a'\): attention weights must be >= 0"):
        attention_html([HeadMap("a", torch.tensor([[0.5, -0.25]]))])
    with pytest.raises(ValueError, match=r"max_side"):
        attention_html([HeadMap("a", torch.ones(1, 1))], max_side=0)


# ---- the page in chromium --------------------------------------------------------------------
HELPERS = """
const canvas = document.getElementById("map-canvas");
const readout = () => {
  const o = document.getElementById("readout");
  return { ...o.dataset, text: o.textContent };
};
const at = (t, s) => {
  const c = qkvView.cellCenter(t, s);
  if (!c) throw new Error(`cell ${t}, ${s} is not in view`);
  return c;
};
const hover = (t, s) => {  // the pixel first (no hover outline), then the readout
  canvas.dispatchEvent(new MouseEvent("mouseleave"));
  const c = at(t, s), rgb = qkvView.pixel(c.x, c.y);
  canvas.dispatchEvent(new MouseEvent("mousemove", { clientX: c.x, clientY: c.y, bubbles: true }));
  return { ...readout(), rgb };
};
const pick = async (id, value) => {
  const el = document.getElementById(id);
  el.value = String(value);
  el.dispatchEvent(new Event("change"));
  await qkvView.idle();
};
const text = (id) => document.getElementById(id).textContent;
"""


@pytest.fixture(scope="module")
def browser() -> Any:
    if chromium() is None:
        pytest.skip("Debian's chromium is not installed")
    with Browser(width=1000, height=800) as b:
        yield b


def _probe(browser: Browser, page: Path, view: str, body: str) -> Any:
    """Open ``page#view``, run ``body`` (an async function body) after the first paint."""
    session = browser.open(f"{page.as_uri()}#{view}")
    try:
        return browser.evaluate(
            f"(async () => {{ {HELPERS}\nawait qkvView.ready;\n{body} }})()", session
        )
    finally:
        browser.close_page(session)


def _check_reading(seen: dict[str, Any], w: torch.Tensor, t: int, s: int) -> None:
    """The readout at query t, key s says what the weight is, as exactly as the page claims."""
    x = float(w[t, s])
    assert (int(seen["t"]), int(seen["s"])) == (t, s), seen
    if seen["exact"] == "1":
        assert torch.tensor(float(seen["weight"]), dtype=torch.float32) == w[t, s] or (
            math.isnan(x) and seen["weight"] == "NaN"
        ), (seen, x)
    elif seen["below"]:
        assert 0 < x < float(seen["below"]), (seen, x)
    elif seen["weight"] in ("NaN", "inf", "0"):
        assert seen["weight"] == ("NaN" if math.isnan(x) else "inf" if math.isinf(x) else "0")
        assert (math.isnan(x) or math.isinf(x) or x == 0) and seen["error"] == "0"
    else:
        error = float(seen["error"])
        assert 0 < error <= 0.0375, seen
        assert abs(float(seen["weight"]) - x) <= error * x * (1 + 1e-9), (seen, x)


@needs_chromium
def test_hover_reads_every_weight_exactly_or_within_the_stated_error(
    browser: Browser, tmp_path: Path
) -> None:
    small = torch.rand(6, 9).softmax(-1)  # [6, 9]: exact float32 in the page
    large = torch.rand(300, 260, dtype=torch.float64).pow(30).float()  # [300, 260] 78k cells
    large[7, :3] = torch.tensor([0.0, float("nan"), 1e-30])  # zero, NaN, below the floor
    queries, keys = [f"q{i}" for i in range(6)], [f"k{i}" for i in range(9)]
    page = save_attention_html(
        tmp_path / "p.html", [HeadMap("small", small, queries, keys), HeadMap("large", large)]
    )
    cells = [(t, s) for t in range(6) for s in range(9)]
    seen = _probe(
        browser,
        page,
        "map=0&scale=linear",
        f"return {json.dumps(cells)}.map(([t, s]) => hover(t, s));",
    )
    for (t, s), got in zip(cells, seen, strict=True):
        _check_reading(got, small, t, s)
        assert (got["query"], got["key"]) == (queries[t], keys[s])
        assert got["text"] == f'query {t} "q{t}" -> key {s} "k{s}": weight {got["weight"]}'
        # Drawn: the linear 0-1 colour of its 8-bit code, within what the code's error moves it.
        tol = 247 * quantize(small).error * float(small[t, s]) + 1
        assert np.abs(np.array(got["rgb"]) - _rgb(float(small[t, s]))).max() <= tol

    rng = np.random.default_rng(2)
    spread = zip(rng.integers(0, 300, 40), rng.integers(0, 260, 40), strict=True)
    picks = [(7, 0), (7, 1), (7, 2), *spread]
    body = f"""const out = [];
    for (const [t, s] of {json.dumps([(int(t), int(s)) for t, s in picks])}) {{
      qkvView.zoomTo(t - 5, s - 5, t + 5, s + 5);  // 10 x 10 cells in view
      out.push(hover(t, s));
    }}
    return {{ out, quant: text("quant"), scale: qkvView.state().scale }};"""
    seen = _probe(browser, page, "map=1", body)
    assert seen["scale"] == "log"  # more than 256 keys: the log scale unless the URL says
    assert re.fullmatch(
        r"hover: 8-bit log codes, within ±3\.7 % of the weight; below .*", seen["quant"]
    )
    codes = quantize(large)
    for (t, s), got in zip(picks, seen["out"], strict=True):
        _check_reading(got, large, int(t), int(s))
        code = int(codes.codes[t, s])
        t_log = 0.0 if code == 0 else 0.04 if code == 1 else 0.1 + 0.9 * (code - 2) / 251
        want = [255, 0, 255] if code == 255 else _rgb(t_log)
        assert np.abs(np.array(got["rgb"]) - want).max() <= 1, (t, s, got)


@needs_chromium
def test_switching_maps_through_every_control(browser: Browser, tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(3)
    maps = [
        HeadMap(
            f"layer {layer} · head {head}", torch.rand(5, 8, generator=g), group=f"layer {layer}"
        )
        for layer in range(2)
        for head in range(2)
    ]
    page = save_attention_html(tmp_path / "switch.html", maps)
    body = """const out = {};
    const now = () => ({ ...qkvView.state(), cell: hover(2, 3), hash: location.hash,
      group: document.getElementById("group").value, map: document.getElementById("map").value,
      options: [...document.getElementById("map").options].map((o) => o.text) });
    out.opened = now();
    await pick("map", 0); out.map0 = now();
    await pick("group", 1); out.group1 = now();  // the same head of the other layer
    document.getElementById("next").click(); await qkvView.idle(); out.next = now();
    location.hash = "map=1&scale=max";
    await new Promise((done) => setTimeout(done, 50)); await qkvView.idle(); out.hashed = now();
    out.switchMs = qkvView.timings.lastSwitch;
    return out;"""
    seen = _probe(browser, page, "map=1", body)
    for step, index in [("opened", 1), ("map0", 0), ("group1", 2), ("next", 3), ("hashed", 1)]:
        got = seen[step]
        assert (got["index"], got["title"]) == (index, maps[index].title), step
        _check_reading(got["cell"], maps[index].weights, 2, 3)
        assert got["options"] == ["head 0", "head 1"] and got["map"] == str(index)
    assert seen["map0"]["hash"] == "#map=0&scale=linear" and seen["group1"]["group"] == "1"
    assert seen["hashed"]["scale"] == "max" and seen["next"]["hash"] == "#map=3&scale=linear"
    assert seen["switchMs"] < 1000


@needs_chromium
def test_nan_weights_are_drawn_in_their_own_colour_and_break_nothing(
    browser: Browser, tmp_path: Path
) -> None:
    rows_nan = torch.rand(6, 6).softmax(-1)
    rows_nan[2] = float("nan")  # a fully blocked query, as nn.MultiheadAttention returns it
    all_nan = torch.full((4, 5), float("nan"))
    pooled = torch.rand(200, 150) * 0.01  # [200, 150], pooled to 50 x 50 below
    pooled[101, 7] = float("nan")
    maps = [HeadMap("rows", rows_nan), HeadMap("all", all_nan), HeadMap("pooled", pooled)]
    page = save_attention_html(tmp_path / "nan.html", maps, max_side=50)
    body = """const out = {};
    out.rows = [hover(2, 4), hover(3, 4)];
    out.rowsInfo = text("dims");
    await pick("map", 1);
    out.all = hover(1, 1); out.allInfo = text("dims");
    await pick("map", 2);
    out.pooledInfo = text("pooling");
    qkvView.zoomTo(96, 0, 108, 12);
    out.block = hover(101, 7);
    out.other = hover(96, 0);
    return out;"""
    seen = _probe(browser, page, "map=0", body)
    nan_cell, fine = seen["rows"]
    assert nan_cell["weight"] == "NaN" and nan_cell["rgb"] == [255, 0, 255]
    _check_reading(fine, rows_nan, 3, 4)
    assert "6 NaN" in seen["rowsInfo"]
    assert seen["all"]["weight"] == "NaN" and seen["all"]["rgb"] == [255, 0, 255]
    assert "max none · 20 NaN" in seen["allInfo"]
    assert seen["pooledInfo"].startswith(
        "pooled for this page: each cell is the max over 4 queries × 3 keys"
    )
    block = seen["block"]  # queries 100-103, keys 6-8 hold the NaN
    assert (block["t"], block["t1"], block["s"], block["s1"]) == ("100", "103", "6", "8")
    assert block["weight"] == "NaN" and block["rgb"] == [255, 0, 255]
    want = float(pooled[96:100, 0:3].max())
    other = seen["other"]
    assert abs(float(other["weight"]) - want) <= float(other["error"]) * want * (1 + 1e-9)


@needs_chromium
def test_zoom_keeps_the_cell_under_the_cursor_and_zoomed_out_keeps_every_spike(
    browser: Browser, tmp_path: Path
) -> None:
    w = torch.full((900, 900), 1e-4)  # [900, 900]: more cells than pixels when fitted
    w[413, 611] = 0.9
    page = save_attention_html(tmp_path / "zoom.html", [HeadMap("spike", w)])
    body = """const out = { fitted: qkvView.state() };
    out.far = hover(413, 611);  // zoomed out: the drawn cell is the max of its block
    qkvView.zoomTo(313, 511, 513, 711);  // 200 x 200 cells, about 2 pixels each
    out.mid = qkvView.state();
    const c = at(413, 611);
    out.before = hover(413, 611);
    canvas.dispatchEvent(new WheelEvent("wheel", { clientX: c.x, clientY: c.y, deltaY: -1000,
      bubbles: true, cancelable: true }));
    out.zoomed = qkvView.state();
    const move = { clientX: c.x, clientY: c.y, bubbles: true };
    canvas.dispatchEvent(new MouseEvent("mousemove", move));
    out.after = readout();
    canvas.dispatchEvent(new MouseEvent("dblclick"));
    out.refit = qkvView.state();
    return out;"""
    seen = _probe(browser, page, "map=0&scale=linear", body)
    assert seen["fitted"]["k"] < 1 and seen["fitted"]["f"] > 1
    far = seen["far"]
    assert (far["t"], far["s"], far["weight"]) == ("413", "611", str(float(np.float32(0.9))))
    assert np.abs(np.array(far["rgb"]) - _rgb(0.9)).max() <= 1  # the spike is not lost
    assert seen["mid"]["f"] == 1 and seen["zoomed"]["k"] > 4 * seen["mid"]["k"]
    for got in (seen["before"], seen["after"]):  # the wheel keeps the cell under the cursor
        assert (got["t"], got["s"]) == ("413", "611")
    assert seen["refit"]["k"] == seen["fitted"]["k"]


@needs_chromium
def test_a_decoding_step_is_a_readable_strip(browser: Browser, tmp_path: Path) -> None:
    w = torch.rand(1, 1500).softmax(-1)  # [1, 1500]: one query of a cached decoding step
    w[0, 1234] = 0.5
    page = save_attention_html(tmp_path / "step.html", [HeadMap("step", w, ["next"])])
    seen = _probe(browser, page, "map=0&scale=linear", "return [qkvView.state(), hover(0, 1234)];")
    state, got = seen
    assert state["ky"] == 24 and state["kx"] < 1  # stretched to a strip, not a 0.5 px line
    assert (got["t"], got["s"], got["query"]) == ("0", "1234", "next")
    _check_reading(got, w, 0, 1234)
    assert np.abs(np.array(got["rgb"]) - _rgb(float(w[0, 1234]))).max() <= 1 + 247 * 0.04 * 0.5
