"""The canvas attention view at 2k tokens: file size per head, time to first paint, time to switch.

Builds ``--layers x --heads`` attention maps of ``--tokens`` tokens, writes them as one page with
:func:`qkv.doctor.view.save_attention_html`, opens it in headless ``chromium`` (driven over the
DevTools pipe, :class:`qkv.doctor.view_browser.Browser`) and prints

- the page's bytes per head (each head's ``<script>`` payload, and the whole file divided by the
  heads), and the time Python took to encode them;
- time to first paint: ``performance.now()`` when the first map is drawn (from the start of the
  navigation, so parsing the whole file is included);
- time to switch heads: ``performance.now()`` around ``qkvView.select(i)`` (decode the next head's
  PNG, build its block-max pyramid, colour and draw it) followed by a one-pixel read of the canvas,
  which waits for the drawing; median and max over every switch;
- the page's JavaScript heap after the switches (one map decoded at a time).

The maps are softmaxes of random scores shaped like a model's (``q k^T / sqrt(64)`` with per-head
temperatures, an attention sink on key 0, a local band on every other head), causal on odd layers;
a last head of log-uniform weights is the size's worst case (its codes do not compress). With
``--long N`` one more page holds a single ``N x N`` head, pooled by block max to 2048 x 2048.

Usage: ``python benchmarks/view.py [--tokens 2048] [--layers 2] [--heads 4] [--long 16384]``;
``--quick``: 2 heads, no long page.
"""

from __future__ import annotations

import argparse
import re
import statistics
import tempfile
import time
from pathlib import Path

import torch

from qkv.doctor.view import HeadMap, save_attention_html
from qkv.doctor.view_browser import Browser, chromium


def _head(T: int, layer: int, head: int, g: torch.Generator) -> torch.Tensor:
    """One synthetic map ``[T, T]`` built in row blocks (a 16k map is 1 GB of float32)."""
    q, k = torch.randn(T, 64, generator=g), torch.randn(T, 64, generator=g)  # [T, 64]
    temperature = (0.5, 1.0, 2.0, 3.0)[head % 4]
    out = torch.empty(T, T)  # [T, T]
    keys = torch.arange(T)
    for start in range(0, T, 1024):
        rows = torch.arange(start, min(T, start + 1024))
        scores = q[rows] @ k.T * (temperature / 8)  # [R, T]
        scores[:, 0] += 4.0  # an attention sink
        if head % 2:
            scores -= (rows[:, None] - keys[None, :]).abs() / 32  # a local band
        if layer % 2:
            scores.masked_fill_(keys[None, :] > rows[:, None], float("-inf"))  # causal
        out[rows] = scores.softmax(-1)
    return out


def _maps(T: int, layers: int, heads: int) -> list[HeadMap]:
    g = torch.Generator().manual_seed(0)
    maps = [
        HeadMap(f"layer {layer} · head {head}", _head(T, layer, head, g), group=f"layer {layer}")
        for layer in range(layers)
        for head in range(heads)
    ]
    worst = torch.pow(10.0, -8 * torch.rand(T, T, generator=g))  # [T, T] log-uniform
    maps.append(HeadMap("worst case · log-uniform", worst, group="worst case"))
    return maps


PROBE = """(async () => {
  await qkvView.ready;
  const firstPaint = qkvView.timings.firstPaint, n = %d, order = %s, switches = [];
  const corner = qkvView.cellCenter(0, 0);
  for (const i of order) {
    const t0 = performance.now();
    await qkvView.select(i);
    qkvView.pixel(corner.x, corner.y);  // waits until the canvas is drawn
    switches.push([i, performance.now() - t0, qkvView.timings.lastDecode]);
  }
  const heap = performance.memory ? performance.memory.usedJSHeapSize : null;
  return { firstPaint, switches, heap, n };
})()"""


def _measure(page: Path, n: int, rounds: int) -> dict:
    order = [i for _ in range(rounds) for i in range(1, n)] + [0] if n > 1 else []
    with Browser(width=1400, height=1000, timeout=300) as browser:
        start = time.perf_counter()
        session = browser.open(page.as_uri())
        opened = time.perf_counter() - start
        seen: dict = browser.evaluate(PROBE % (n, order), session)
    seen["opened"] = opened
    return seen


def _payload_bytes(page: Path) -> list[int]:
    text = page.read_text(encoding="utf-8")
    found = re.findall(r'<script type="text/plain" id="qkv-png-(\d+)">([^<]*)</script>', text)
    return [len(body.encode()) for _, body in found]


def _report(label: str, page: Path, maps: list[HeadMap], encode_s: float, rounds: int) -> None:
    size = page.stat().st_size
    payloads = _payload_bytes(page)
    print(f"\n== {label}: {len(maps)} heads, file {size / 1e6:.2f} MB ({page.name})")
    print(f"encode (Python): {encode_s:.2f} s, {encode_s / len(maps):.2f} s per head")
    for m, nbytes in zip(maps, payloads, strict=True):
        T, S = m.weights.shape
        print(f"  {m.title:<28} {T}x{S}: {nbytes / 1e6:.2f} MB")
    print(f"  file / heads: {size / len(maps) / 1e6:.2f} MB per head")
    seen = _measure(page, len(maps), rounds)
    times = [t for _, t, _ in seen["switches"]]
    decode = [d for _, _, d in seen["switches"]]
    print(f"first paint: {seen['firstPaint']:.0f} ms after navigation start")
    print(f"open (Python, navigate to loaded): {seen['opened']:.2f} s")
    if times:
        print(
            f"switch heads ({len(times)} switches): median {statistics.median(times):.0f} ms, "
            f"max {max(times):.0f} ms (decode part: median {statistics.median(decode):.0f} ms)"
        )
    if seen["heap"] is not None:
        heap = seen["heap"] / 1e6
        print(f"JS heap after the switches (garbage not yet collected): {heap:.1f} MB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2, help="switches through every head")
    parser.add_argument("--long", type=int, default=16384, help="one N x N head (0: none)")
    parser.add_argument("--quick", action="store_true", help="1 layer x 2 heads, no long page")
    args = parser.parse_args()
    if chromium() is None:
        raise SystemExit("benchmarks/view.py needs Debian's chromium (apt-get install chromium)")
    if args.quick:
        args.layers, args.heads, args.long, args.rounds = 1, 2, 0, 2
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        maps = _maps(args.tokens, args.layers, args.heads)
        start = time.perf_counter()
        page = save_attention_html(Path(tmp) / "view.html", maps, f"{args.tokens} tokens")
        _report(f"{args.tokens} tokens", page, maps, time.perf_counter() - start, args.rounds)
        if args.long:
            long_maps = [HeadMap("long · head 0", _head(args.long, 1, 1, torch.Generator()))]
            start = time.perf_counter()
            page = save_attention_html(Path(tmp) / "long.html", long_maps, f"{args.long} tokens")
            _report(f"{args.long} tokens", page, long_maps, time.perf_counter() - start, 0)


if __name__ == "__main__":
    main()
