"""The band reduction of a sliding window against blockwise and SDPA over the dense mask.

Times, for ``B=1 H=8 Dh=64`` float32, the forward (or forward + backward with ``--grad``) of

- ``sdpa-dense``: ``F.scaled_dot_product_attention`` with the materialized ``[T, S]`` mask
  (built once, outside the timing);
- ``blockwise``: ``qkv.attention(backend="blockwise")``;
- ``band``: the band reduction (:func:`~qkv.backends.pieces.reduce_mask` with ``band=True``,
  planned once, run by :func:`~qkv.backends.reductions.reduced_attention`), what ``auto`` runs
  without a gradient;

interleaved (each round times every method once, so a change in the machine's load hits them
alike), and prints median and min of the rounds and band's ratio to the best other method.
``--sweep`` runs wider windows, to see up to which share of the grid the band pays
(``Policy.band_max_share`` in :mod:`qkv.backends.policy`).

Usage: ``python benchmarks/band.py [--threads N] [--repeats N] [--grad] [--sweep]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import qkv
from qkv.backends.pieces import reduce_mask
from qkv.backends.reductions import reduced_attention
from qkv.masks import Padding, SlidingWindow, StructuredMask

MAIN = [(1024, 256, False), (1024, 256, True), (4096, 256, False), (4096, 256, True)]
SWEEP = [(1024, 64, False), (1024, 512, False), (1024, 640, False), (2048, 512, False)]
SWEEP += [(2048, 1536, False), (4096, 1024, False), (4096, 2048, False)]


def _case(L: int, window: int, padded: bool, grad: bool, repeats: int) -> str:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8, L, 64, generator=g, requires_grad=grad) for _ in range(3))
    mask: StructuredMask = SlidingWindow(window)
    if padded:
        mask = mask | Padding(torch.tensor([L // 2]))  # half the keys are padding
    allow = ~mask.materialize(1, 8, L, L)  # [1, 1, T, S], SDPA's True = may attend
    red = reduce_mask(mask, 1, 8, L, L, band=True)
    fns: dict[str, Callable[[], torch.Tensor]] = {
        "sdpa-dense": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=allow),
        "blockwise": lambda: qkv.attention(q, k, v, mask=mask, backend="blockwise")[0],
    }
    if red is not None:
        fns["band"] = lambda: reduced_attention(
            q, k, v, red, None, scale=0.125, dropout_p=0.0, training=False
        )
    times: dict[str, list[float]] = {name: [] for name in fns}
    with torch.set_grad_enabled(grad):
        for r in range(repeats + 1):  # round 0 warms up
            for name, fn in fns.items():
                start = time.perf_counter()
                out = fn()
                if grad:
                    out.sum().backward()
                if r:
                    times[name].append(time.perf_counter() - start)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    line = " ".join(f"{n}={med[n] * 1e3:.1f}ms (min {min(times[n]) * 1e3:.1f})" for n in fns)
    share = f"{red.pairs / (L * L):.0%}" if red is not None else "-"
    ratio = ""
    if red is not None:
        best = min(m for n, m in med.items() if n != "band")
        ratio = f"  band / best other = {med['band'] / best:.2f}"
    what = f"SlidingWindow({window}){' | Padding(L/2)' if padded else ''}"
    return f"L={L} {what} band share {share}: {line}{ratio}"


def main() -> None:
    """Parse the options and print one line per case."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds (default 5)")
    parser.add_argument("--grad", action="store_true", help="time forward + backward")
    parser.add_argument("--sweep", action="store_true", help="wider windows (forward)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for L, window, padded in SWEEP if args.sweep else MAIN:
        print(_case(L, window, padded, args.grad, args.repeats), flush=True)


if __name__ == "__main__":
    main()
