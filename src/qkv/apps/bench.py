"""Attention benchmarks: qkv's backends against PyTorch SDPA, measured side by side in one run.

Every time is the median of ``repeats`` runs after one warm-up, float32, B=1, H=8, Dh=64; the
contestants of a row run round-robin and each ratio is the median of back-to-back ratios, so a
shared machine's load drift hits both sides alike. Masked cases give torch SDPA the same mask as
an explicit bool tensor. GFLOP/s count the model FLOPs of
the query-key pairs a backend computes (all of them for SDPA, fused and reference; the tiles not
skipped for blockwise): ``4 · B · H · pairs · Dh`` forward, three times that forward+backward.
The matmul line is a float32 ``bmm`` ``[B·H, 1024, Dh] @ [B·H, Dh, 1024]`` into a preallocated
output, measured in the same run. Peak memory is measured as the process's peak resident set
(``VmHWM`` reset through ``/proc/self/clear_refs``) above what it held before the call, or
``torch.cuda.max_memory_allocated`` on a GPU.

Run ``python benchmarks/attention.py`` or ``qkv bench`` (``--quick`` for small sizes); both parse
their options in :mod:`qkv.apps.cli`, this module has no argparse.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from qkv.backends.blockwise import default_blocks, plan_tiles
from qkv.functional import attention
from qkv.masks import Causal, Padding, SlidingWindow, StructuredMask, to_sdpa_bool

__all__ = ["Row", "format_table", "matmul_gflops", "peak_memory_mb", "run_benchmarks"]

H, DH = 8, 64


@dataclass
class Row:
    """One measured line of the table."""

    case: str
    L: int
    mode: str
    backend: str
    seconds: float
    ratio: float | None
    gflops: float
    goal: str


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _median_time(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _step(fn: Callable[[], Tensor], inputs: Sequence[Tensor], backward: bool) -> Callable[[], None]:
    def run() -> None:
        if backward:
            for x in inputs:
                x.grad = None
            fn().sum().backward()
        else:
            with torch.no_grad():
                fn()

    return run


def matmul_gflops(repeats: int, device: torch.device) -> float:
    """GFLOP/s of a float32 ``[H, 1024, Dh] @ [H, Dh, 1024]`` batched matmul."""
    a = torch.randn(H, 1024, DH, device=device)
    b = torch.randn(H, DH, 1024, device=device)
    out = torch.empty(H, 1024, 1024, device=device)
    t = _median_time(lambda: torch.bmm(a, b, out=out), max(repeats, 5), device)
    return 2 * H * 1024 * 1024 * DH / t / 1e9


def _case_mask(case: str, L: int, device: torch.device) -> StructuredMask | None:
    if case == "dense":
        return None
    if case == "causal":
        return Causal()
    if case == "padding+causal":
        return Causal() | Padding(torch.tensor([3 * L // 4], device=device))
    if case.startswith("sliding"):
        return SlidingWindow(int(case.split()[-1]))
    raise ValueError(f"unknown case {case!r}")


def _interleaved(
    fns: Sequence[Callable[[], object]], repeats: int, device: torch.device
) -> list[list[float]]:
    """Times of each function, run round-robin so that all of them see the same machine load."""
    for fn in fns:
        fn()
    _sync(device)
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            _sync(device)
            times[i].append(time.perf_counter() - start)
    return times


def _bench_case(
    case: str,
    L: int,
    backends: Sequence[str],
    goals: dict[str, str],
    repeats: int,
    device: torch.device,
) -> list[Row]:
    sm = _case_mask(case, L, device)
    q, k, v = (torch.randn(1, H, L, DH, device=device, requires_grad=True) for _ in range(3))
    dense = None if sm is None else sm.materialize(1, H, L, L, device)  # [1, 1, L, L]
    allowed = None if dense is None else to_sdpa_bool(dense)
    plan = plan_tiles(sm, 1, H, L, L, *default_blocks(sm), device)
    rows = []
    for backward, mode in ((False, "fwd"), (True, "fwd+bwd")):
        flop_mult = 3 if backward else 1
        fns = [
            _step(
                lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=allowed),
                (q, k, v),
                backward,
            )
        ]
        for backend in backends:
            fns.append(
                _step(
                    lambda backend=backend: attention(q, k, v, mask=sm, backend=backend)[0],  # type: ignore[misc]
                    (q, k, v),
                    backward,
                )
            )
        times = _interleaved(fns, repeats, device)
        t_sdpa = statistics.median(times[0])
        dense_gflops = flop_mult * 4 * H * L * L * DH / t_sdpa / 1e9
        rows.append(Row(case, L, mode, "torch SDPA", t_sdpa, None, dense_gflops, ""))
        for backend, ts in zip(backends, times[1:], strict=True):
            t = statistics.median(ts)
            # The ratio is the median of ratios of runs made back to back: robust to load drift.
            ratio = statistics.median(a / b for a, b in zip(ts, times[0], strict=True))
            pairs = plan.computed_pairs if backend == "blockwise" else L * L
            gflops = flop_mult * 4 * H * pairs * DH / t / 1e9
            goal = goals.get(f"{backend} {mode}", goals.get(backend, ""))
            rows.append(Row(case, L, mode, f"qkv {backend}", t, ratio, gflops, goal))
    return rows


def peak_memory_mb(backend: str, L: int, heads: int, window: int, device: torch.device) -> float:
    """Peak memory (MB) of one forward above the inputs, sliding-window mask, no autograd."""
    q, k, v = (torch.randn(1, heads, L, DH, device=device) for _ in range(3))
    mask = SlidingWindow(window)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.no_grad():
            attention(q, k, v, mask=mask, backend=backend)  # type: ignore[arg-type]
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    base = _rss_kb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM (peak RSS) to the current RSS
    with torch.no_grad():
        attention(q, k, v, mask=mask, backend=backend)  # type: ignore[arg-type]
    return (_rss_kb("VmHWM") - base) / 1024


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not found in /proc/self/status")


def run_benchmarks(
    *,
    quick: bool = False,
    repeats: int | None = None,
    device: str = "cpu",
    threads: int | None = None,
    shrink: int | None = None,
) -> tuple[list[Row], float, list[str]]:
    """Measure the whole table.

    Args:
        quick: lengths divided by 8 (seconds instead of minutes), a smoke run; goals, which are
            stated for the full sizes, are not judged.
        shrink: divide every length by this instead (tests use it).
        repeats: timed runs per entry (median); default 5 (quick: 2).
        device: ``"cpu"`` or ``"cuda"``.
        threads: ``torch.set_num_threads`` for the run (CPU), default unchanged.

    Returns:
        ``(rows, matmul GFLOP/s, memory lines)``.

    Raises:
        ValueError: ``device="cuda"`` without a GPU.
    """
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but torch.cuda.is_available() is False")
    if threads is not None:
        torch.set_num_threads(threads)
    n = repeats if repeats is not None else (2 if quick else 5)
    scale = shrink if shrink is not None else (8 if quick else 1)
    judge = scale == 1
    torch.manual_seed(0)
    mm = matmul_gflops(n, dev)
    rows: list[Row] = []
    dense_goals = {"fused": "<= 1.05"} if judge else {}
    for L in (1024, 4096):
        rows += _bench_case("dense", L // scale, ("fused", "reference"), dense_goals, n, dev)
    causal_goals = {"blockwise": "<= 0.6 at 8192"} if judge else {}
    for case in ("causal", "padding+causal"):
        for L in (4096, 8192):
            goals = causal_goals if case == "causal" and L == 8192 else {}
            rows += _bench_case(case, L // scale, ("blockwise", "fused"), goals, n, dev)
    window = 256 // scale
    for L in (8192, 16384):
        rows += _bench_case(
            f"sliding window {window}",
            L // scale,
            ("blockwise",),
            {"blockwise": "<= 0.15"} if judge else {},
            n,
            dev,
        )
    L = 16384 // scale
    mem = [f"peak memory of one forward, sliding window {window}, L = {L}, above the inputs:"]
    if dev.type == "cpu":
        # RSS only grows when the allocator asks the OS for more: memory freed by the runs above
        # is reused without showing, so on CPU the figure is a lower bound, never the truth.
        mem.append(
            "  (CPU: growth of the peak resident set, a lower bound: memory that earlier runs "
            "freed is reused unseen)"
        )
    out_mb = H * L * DH * 4 / 2**20  # the [1, H, L, Dh] float32 output alone
    bw = peak_memory_mb("blockwise", L, H, window, dev)
    bound = max(bw, out_mb)
    mem.append(
        f"  qkv blockwise H={H}: {bw:.1f} MB measured, at least {out_mb:.1f} MB (the output "
        f"alone) (goal < 256 MB: {'met' if bound < 256 else 'NOT met'})"
    )
    # The reference at H=8 needs several [8, L, L] float32 tensors (8 GiB each at L=16384):
    # more than this machine has. It is measured at H=1; its memory is linear in H.
    ref1 = peak_memory_mb("reference", L, 1, window, dev)
    mem.append(f"  qkv reference H=1: {ref1:.1f} MB measured (x{H} heads: ~{ref1 * H:.0f} MB)")
    return rows, mm, mem


def format_table(rows: Sequence[Row], mm: float, mem: Sequence[str]) -> str:
    """The markdown table that ``qkv bench`` prints."""
    lines = [
        f"float32 matmul [{H}, 1024, {DH}] @ [{H}, {DH}, 1024]: {mm:.1f} GFLOP/s",
        "",
        "| case | L | pass | backend | ms | / torch SDPA | GFLOP/s | % of matmul | goal |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = "" if r.ratio is None else f"{r.ratio:.3f}"
        met = ""
        if r.goal and r.ratio is not None:
            bound = float(r.goal.split()[1])
            met = f"{r.goal}: {'met' if r.ratio <= bound else 'NOT met'}"
        pct = f"{100 * r.gflops / mm:.0f} %"
        lines.append(
            f"| {r.case} | {r.L} | {r.mode} | {r.backend} | {1e3 * r.seconds:.1f} | {ratio} | "
            f"{r.gflops:.1f} | {pct} | {met} |"
        )
    return "\n".join([*lines, "", *mem])
