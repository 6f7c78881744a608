"""Attention benchmarks: qkv ``auto`` against the best peer for each mask, side by side in one run.

For every mask x length x pass (forward, forward+backward) the contestants are torch's own ways
of computing that very mask, each as fast as torch allows: SDPA unmasked, SDPA ``is_causal``,
SDPA with the mask as an explicit bool tensor, SDPA on the truncated keys, SDPA called per
document. qkv runs with ``backend="auto"`` and the mask as a rule (or ``is_causal``). Each time
is the median of ``repeats`` runs after one warm-up, float32, B=1, H=8, Dh=64; contestants run
round-robin and the ratio is the median over rounds of qkv's time over the best peer's time in
the same round (the best peer: the one with the lowest median), so a shared machine's load
drift hits both sides alike. GFLOP/s count the useful pairs only (those the mask lets through):
``4 · B · H · pairs · Dh`` forward, three times that forward+backward, next to a measured
float32 ``bmm`` ``[H, 1024, Dh] @ [H, Dh, 1024]``. Peak memory is one forward's peak resident
set (``VmHWM`` reset through ``/proc/self/clear_refs``) above what the process held before it,
or ``torch.cuda.max_memory_allocated`` on a GPU.

With ``--compile``, compiled ``flex_attention`` joins the peers of every structured mask (its
block mask built once, outside the timing, and its compile time in the notes; on CPU forward
only, as torch 2.13 has no flex backward there), and qkv ``auto`` under
:func:`~qkv.backends.policy.allow_compile` joins the contestants. On CPU, forward+backward rows
also time qkv ``auto`` inside :func:`~qkv.backends.policy.allow_sdpa_backward` (SDPA's own,
less exact backward instead of qkv's exact one), so the price of exact gradients is in the table.

Usage: ``python benchmarks/attention.py [--quick] [--cases ...] [--lengths ...] [--repeats N]
[--device cuda] [--threads N] [--compile]`` (``--quick`` for small sizes). The masks and their
peers are in ``attention_cases.py``, the timing in ``attention_timing.py``.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from attention_cases import (
    CASES,
    DH,
    FLEX_PEER,
    SKIPS_MORE,
    Attn,
    H,
    flex_peer,
    make_case,
)
from attention_timing import interleaved, peak_memory_mb, step
from qkv.backends.policy import current_policy
from qkv.functional import explain_backend

__all__ = [
    "CASES",
    "SDPA_BACKWARD",
    "Row",
    "build_parser",
    "format_table",
    "main",
    "matmul_gflops",
    "run_benchmarks",
]

SDPA_BACKWARD = "qkv auto (SDPA backward allowed)"
"""The contestant of CPU fwd+bwd rows that trades qkv's exact gradients for SDPA's backward."""

LENGTHS = (1024, 4096, 8192, 16384)


@dataclass
class Row:
    """One measured line of the table."""

    case: str
    L: int
    mode: str
    contestant: str
    seconds: float
    ratio: float | None
    gflops: float
    peak_mb: float | None
    goal: str


def matmul_gflops(repeats: int, device: torch.device) -> float:
    """GFLOP/s of a float32 ``[H, 1024, Dh] @ [H, Dh, 1024]`` batched matmul."""
    a = torch.randn(H, 1024, DH, device=device)
    b = torch.randn(H, DH, 1024, device=device)
    out = torch.empty(H, 1024, 1024, device=device)
    fn = lambda: torch.bmm(a, b, out=out)  # noqa: E731
    (times,) = interleaved([fn], max(repeats, 5), device)
    return 2 * H * 1024 * 1024 * DH / statistics.median(times) / 1e9


def _bench_case(
    case: str,
    L: int,
    repeats: int,
    judge: bool,
    device: torch.device,
    compile: bool = False,
    notes: list[str] | None = None,
) -> list[Row]:
    c = make_case(case, L, device)
    q, k, v = (torch.randn(1, H, L, DH, device=device, requires_grad=True) for _ in range(3))
    peers = dict(c.peers)
    ours: dict[str, Attn] = {"qkv auto": c.qkv}
    if compile and c.allowed is not None:
        peers[FLEX_PEER], seconds = flex_peer(c.allowed, L, device)
        if notes is not None:
            notes.append(
                f"{case} at L={L}: compiled flex_attention's first call took {seconds:.1f} s"
            )
    if compile:
        ours["qkv auto (compile allowed)"] = c.qkv_compiling
    rows = []
    for backward, mode in ((False, "fwd"), (True, "fwd+bwd")):
        # torch 2.13's flex_attention has no backward on CPU: that peer runs forward only there.
        these = {
            n: f
            for n, f in peers.items()
            if not (backward and n == FLEX_PEER and device.type == "cpu")
        }
        contestants = dict(ours)
        if backward and device.type == "cpu":
            contestants[SDPA_BACKWARD] = c.qkv_sdpa_backward
        names, calls = [*these, *contestants], [*these.values(), *contestants.values()]
        fns = [step(fn, (q, k, v), backward) for fn in calls]
        times = interleaved(fns, repeats, device)
        peaks: list[float | None] = [None] * len(fns)
        if not backward:
            peaks = [peak_memory_mb(fn, device) for fn in fns]
        medians = [statistics.median(ts) for ts in times]
        best = min(range(len(these)), key=lambda i: medians[i])
        goal = ("<= 0.8" if case in SKIPS_MORE else "<= 1.05") if judge else ""
        flops = (3 if backward else 1) * 4 * H * c.pairs * DH
        for i, name in enumerate(names):
            mine = i >= len(these)
            # The ratio is the median of ratios of runs made back to back: robust to load drift.
            ratio = statistics.median(a / b for a, b in zip(times[i], times[best], strict=True))
            rows.append(
                Row(
                    case,
                    L,
                    mode,
                    name,
                    medians[i],
                    ratio if mine else None,
                    flops / medians[i] / 1e9,
                    peaks[i],
                    goal if mine else "",
                )
            )
    return rows


def run_benchmarks(
    *,
    quick: bool = False,
    repeats: int | None = None,
    device: str = "cpu",
    threads: int | None = None,
    shrink: int | None = None,
    cases: Sequence[str] | None = None,
    lengths: Sequence[int] | None = None,
    compile: bool = False,
) -> tuple[list[Row], float, list[str]]:
    """Measure the whole table.

    Args:
        quick: lengths divided by 8 (seconds instead of minutes), a smoke run; goals, which are
            stated for the full sizes, are not judged.
        repeats: timed runs per entry (median); default 5 (quick: 2).
        device: ``"cpu"`` or ``"cuda"``.
        threads: ``torch.set_num_threads`` for the run (CPU), default unchanged.
        shrink: divide every length by this instead (tests use it).
        cases: the masks to run, from :data:`CASES` (default all).
        lengths: the lengths before shrinking (default :data:`LENGTHS`).
        compile: add compiled ``flex_attention`` as a peer (forward only on CPU; its compile
            time goes to the notes, not the table) and qkv ``auto`` under
            :func:`~qkv.backends.policy.allow_compile` as a contestant.

    Returns:
        ``(rows, matmul GFLOP/s, explanation lines)``: the lines say what ``auto`` chose for
        each case at the first length.

    Raises:
        ValueError: ``device="cuda"`` without a GPU, an unknown case.
    """
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but torch.cuda.is_available() is False")
    chosen = tuple(CASES if cases is None else cases)
    for case in chosen:
        if case not in CASES:
            raise ValueError(f"unknown case {case!r}; expected one of {CASES}")
    if threads is not None:
        torch.set_num_threads(threads)
    n = repeats if repeats is not None else (2 if quick else 5)
    scale = shrink if shrink is not None else (8 if quick else 1)
    judge = scale == 1
    torch.manual_seed(0)
    mm = matmul_gflops(n, dev)
    rows: list[Row] = []
    notes = []
    if dev.type == "cpu":
        # RSS only grows when the allocator asks the OS for more: memory that earlier runs freed
        # is reused without showing, so on CPU the peak column is a lower bound.
        notes.append(
            "peak MB on CPU: growth of the peak resident set, a lower bound (memory that earlier "
            "runs freed is reused unseen)"
        )
    Ls = [max(L // scale, 8) for L in (LENGTHS if lengths is None else lengths)]
    # Every case and length compiles its own flex kernel (peer and qkv alike): past torch's
    # default recompile limit (8) the peer would run flex_attention eagerly, so raise it.
    with torch._dynamo.config.patch(recompile_limit=current_policy().flex_max_kernels):
        for case in chosen:
            notes.append(f"{case} at L={Ls[0]}: qkv auto -> {_explain(case, Ls[0], dev)}")
            for L in Ls:
                rows += _bench_case(case, L, n, judge, dev, compile, notes)
    return rows, mm, notes


def _explain(case: str, L: int, device: torch.device) -> str:
    c = torch.zeros(1, 1, 1, 1, device=device).expand(1, H, L, DH)  # [B, H, L, Dh], no memory
    made = make_case(case, L, device)
    return explain_backend(c, c, c, mask=made.mask, is_causal=made.is_causal)


def format_table(rows: Sequence[Row], mm: float, notes: Sequence[str]) -> str:
    """The markdown table that this script prints."""
    lines = [
        f"float32 matmul [{H}, 1024, {DH}] @ [{H}, {DH}, 1024]: {mm:.1f} GFLOP/s",
        "",
        "| mask | L | pass | contestant | ms | auto / best peer | useful GFLOP/s | % of matmul "
        "| peak MB (fwd) | goal |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = "" if r.ratio is None else f"{r.ratio:.3f}"
        met = ""
        if r.goal and r.ratio is not None:
            bound = float(r.goal.split()[1])
            met = f"{r.goal}: {'met' if r.ratio <= bound else 'NOT met'}"
        peak = "" if r.peak_mb is None else f"{r.peak_mb:.0f}"
        case = r.case.replace("|", "\\|")  # "4 documents | Causal" is one cell, not two
        lines.append(
            f"| {case} | {r.L} | {r.mode} | {r.contestant} | {1e3 * r.seconds:.1f} | {ratio} | "
            f"{r.gflops:.1f} | {100 * r.gflops / mm:.0f} % | {peak} | {met} |"
        )
    return "\n".join([*lines, "", *notes])


CASE_SLUGS = {re.sub(r"[^a-z0-9]+", "-", c.lower()).strip("-"): c for c in CASES}
"""``--cases`` spellings (lower case, no spaces: ``4-documents-causal``) -> the table's names."""


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {value}")
    return value


def _device(text: str) -> str:
    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"expected cpu or cuda[:N], got {text!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"expected cpu or cuda[:N], got {text!r}")
    return text


def build_parser() -> argparse.ArgumentParser:
    """The options of ``python benchmarks/attention.py``."""
    p = argparse.ArgumentParser(
        prog="benchmarks/attention.py", description=(__doc__ or "").splitlines()[0]
    )
    p.add_argument("--quick", action="store_true", help="lengths / 8: a smoke run")
    p.add_argument(
        "--cases",
        nargs="+",
        choices=list(CASE_SLUGS),
        default=None,
        help="masks to run (default all)",
    )
    p.add_argument(
        "--lengths", nargs="+", type=_positive, default=None, help="L values (default 1k-16k)"
    )
    p.add_argument(
        "--repeats", type=_positive, default=None, help="timed runs per entry (default 5, quick 2)"
    )
    p.add_argument("--device", type=_device, default="cpu", help="cpu or cuda[:N] (default cpu)")
    p.add_argument(
        "--threads", type=_positive, default=None, help="torch CPU threads (default: unchanged)"
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="add compiled flex_attention as a peer and qkv auto with compilation allowed",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the options, run the table and print it; the exit code (0)."""
    args = build_parser().parse_args(argv)
    rows, mm, notes = run_benchmarks(
        quick=args.quick,
        repeats=args.repeats,
        device=args.device,
        threads=args.threads,
        cases=None if args.cases is None else [CASE_SLUGS[c] for c in args.cases],
        lengths=args.lengths,
        compile=args.compile,
    )
    print(format_table(rows, mm, notes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
