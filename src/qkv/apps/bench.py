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

Run ``python benchmarks/attention.py`` or ``qkv bench`` (``--quick`` for small sizes,
``--cases``, ``--lengths``, ``--compile``); both parse their options in :mod:`qkv.apps.cli`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from qkv.backends.policy import allow_compile, allow_sdpa_backward, current_policy
from qkv.functional import attention, explain_backend
from qkv.masks import Causal, Documents, Padding, SlidingWindow, StructuredMask, to_sdpa_bool

__all__ = ["CASES", "Row", "format_table", "matmul_gflops", "peak_memory_mb", "run_benchmarks"]

SDPA_BACKWARD = "qkv auto (SDPA backward allowed)"
"""The contestant of CPU fwd+bwd rows that trades qkv's exact gradients for SDPA's backward."""

H, DH = 8, 64
LENGTHS = (1024, 4096, 8192, 16384)
CASES = (
    "none",
    "is_causal",
    "Causal()",
    "sliding window 256",
    "4 documents",
    "4 documents | Causal",
    "half padded",
    "Causal | 3/4 padded",
    "sliding window 256 | half padded",
)
"""Every mask of the table; ``--cases`` picks some."""
SKIPS_MORE = {"sliding window 256 | half padded"}
"""Cases where qkv's knowledge of the mask skips work no peer here skips: goal <= 0.8."""

Attn = Callable[[Tensor, Tensor, Tensor], Tensor]
FLEX_PEER = "flex_attention (compiled)"


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


@dataclass
class _Case:
    """A mask at one length: qkv's mask (or ``is_causal``), the peers' calls, the useful pairs."""

    mask: StructuredMask | None
    is_causal: bool
    peers: dict[str, Attn]
    pairs: int
    allowed: MaskModFn | None = None

    def qkv(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """qkv ``auto`` on this case."""
        return attention(q, k, v, mask=self.mask, is_causal=self.is_causal)[0]

    def qkv_compiling(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """qkv ``auto`` on this case, with compilation allowed (the flex backend)."""
        with allow_compile():
            return attention(q, k, v, mask=self.mask, is_causal=self.is_causal)[0]

    def qkv_sdpa_backward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """qkv ``auto`` on this case inside :func:`~qkv.backends.policy.allow_sdpa_backward`."""
        with allow_sdpa_backward():
            return attention(q, k, v, mask=self.mask, is_causal=self.is_causal)[0]


MaskModFn = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
"""A flex ``mask_mod``: True where the query may attend the key."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def matmul_gflops(repeats: int, device: torch.device) -> float:
    """GFLOP/s of a float32 ``[H, 1024, Dh] @ [H, Dh, 1024]`` batched matmul."""
    a = torch.randn(H, 1024, DH, device=device)
    b = torch.randn(H, DH, 1024, device=device)
    out = torch.empty(H, 1024, 1024, device=device)
    fn = lambda: torch.bmm(a, b, out=out)  # noqa: E731
    (times,) = _interleaved([fn], max(repeats, 5), device)
    return 2 * H * 1024 * 1024 * DH / statistics.median(times) / 1e9


def _doc_lengths(L: int) -> list[int]:
    """Four packed documents of unequal lengths summing to ``L``."""
    parts = [L // 10, 2 * L // 10, 3 * L // 10]
    return [*parts, L - sum(parts)]


def _per_document(lengths: list[int], causal: bool) -> Attn:
    def run(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        outs, start = [], 0
        for n in lengths:
            s = slice(start, start + n)
            outs.append(
                F.scaled_dot_product_attention(q[:, :, s], k[:, :, s], v[:, :, s], is_causal=causal)
            )
            start += n
        return torch.cat(outs, dim=2)  # [B, H, T, Dh]

    return run


def _sdpa_with(allowed: Tensor | None, is_causal: bool = False) -> Attn:
    return lambda q, k, v: F.scaled_dot_product_attention(
        q, k, v, attn_mask=allowed, is_causal=is_causal
    )


def _make_case(case: str, L: int, device: torch.device) -> _Case:
    """qkv's call and the peers for one mask at length ``L``."""
    n_live = {"half padded": L // 2, "Causal | 3/4 padded": 3 * L // 4}.get(case, L // 2)
    lengths = torch.tensor([n_live], device=device)
    docs = _doc_lengths(L)
    ids = torch.cat([torch.full((n,), i, device=device) for i, n in enumerate(docs)])[None]
    window = SlidingWindow(256)
    rules: dict[str, StructuredMask | None] = {
        "none": None,
        "is_causal": None,
        "Causal()": Causal(),
        "sliding window 256": window,
        "4 documents": Documents(ids),
        "4 documents | Causal": Documents(ids) | Causal(),
        "half padded": Padding(lengths),
        "Causal | 3/4 padded": Causal() | Padding(lengths),
        "sliding window 256 | half padded": window | Padding(lengths),
    }
    if case not in rules:
        raise ValueError(f"unknown case {case!r}; expected one of {CASES}")
    rule = rules[case]
    allowed = _mask_mods(ids[0], n_live).get(case)
    if case == "none":
        return _Case(None, False, {"SDPA": _sdpa_with(None)}, L * L)
    if case == "is_causal":
        return _Case(None, True, {"SDPA is_causal": _sdpa_with(None, True)}, L * (L + 1) // 2)
    assert rule is not None
    blocked = rule.materialize(1, H, L, L, device)  # [1, 1|1, L|1, L]
    pairs = int((~blocked).sum()) * (L if blocked.shape[2] == 1 else 1)
    peers: dict[str, Attn] = {"SDPA + mask tensor": _sdpa_with(to_sdpa_bool(blocked))}
    if case == "Causal()":
        peers = {"SDPA is_causal": _sdpa_with(None, True)}
    elif case.startswith("4 documents"):
        peers["SDPA per document"] = _per_document(docs, causal=case.endswith("Causal"))
    elif case == "half padded":
        peers["SDPA on live keys"] = lambda q, k, v: F.scaled_dot_product_attention(
            q, k[:, :, :n_live], v[:, :, :n_live]
        )
    elif case == "Causal | 3/4 padded":
        peers["SDPA is_causal on live keys"] = lambda q, k, v: F.scaled_dot_product_attention(
            q, k[:, :, :n_live], v[:, :, :n_live], is_causal=True
        )
    return _Case(rule, False, peers, pairs, allowed)


def _mask_mods(ids: Tensor, n_live: int) -> dict[str, MaskModFn]:
    """Each structured case as a user of ``flex_attention`` would write it (True = may attend)."""

    def causal(b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
        return q >= k

    def window(b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
        return (q >= k) & (q - k < 256)

    def docs(b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
        return ids[q] == ids[k]

    def live(b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
        return k < n_live

    def both(f: MaskModFn, g: MaskModFn) -> MaskModFn:
        return lambda b, h, q, k: f(b, h, q, k) & g(b, h, q, k)

    return {
        "Causal()": causal,
        "sliding window 256": window,
        "4 documents": docs,
        "4 documents | Causal": both(docs, causal),
        "half padded": live,
        "Causal | 3/4 padded": both(causal, live),
        "sliding window 256 | half padded": both(window, live),
    }


_FLEX: list[Callable[..., Tensor]] = []


def _flex_peer(allowed: MaskModFn, L: int, device: torch.device) -> tuple[Attn, float]:
    """Compiled ``flex_attention`` with its block mask built once (outside the timing), and the
    seconds of its first (compiling) call."""
    if not _FLEX:
        # dynamic=False as in qkv's flex backend: torch 2.13's dynamic-shape CPU flex kernel
        # fails to build (undeclared cur_qSplitSize in the generated C++) at the second L.
        _FLEX.append(torch.compile(flex_attention, dynamic=False))
    block = create_block_mask(allowed, None, None, L, L, device=str(device))
    # torch refuses inputs that require grad on CPU even under no_grad: detaching is free.
    fn: Attn = lambda q, k, v: _FLEX[0](  # noqa: E731
        q.detach(), k.detach(), v.detach(), block_mask=block
    )
    x = torch.randn(1, H, L, DH, device=device)
    start = time.perf_counter()
    with torch.no_grad():
        fn(x, x, x)
    _sync(device)
    return fn, time.perf_counter() - start


def _step(fn: Attn, inputs: Sequence[Tensor], backward: bool) -> Callable[[], None]:
    def run() -> None:
        if backward:
            for x in inputs:
                x.grad = None
            fn(*inputs).sum().backward()
        else:
            with torch.no_grad():
                fn(*inputs)

    return run


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


def peak_memory_mb(fn: Callable[[], object], device: torch.device) -> float:
    """Peak memory (MB) of one call of ``fn`` above what was held before it."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    base = _rss_kb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM (peak RSS) to the current RSS
    fn()
    return (_rss_kb("VmHWM") - base) / 1024


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not found in /proc/self/status")


def _bench_case(
    case: str,
    L: int,
    repeats: int,
    judge: bool,
    device: torch.device,
    compile: bool = False,
    notes: list[str] | None = None,
) -> list[Row]:
    c = _make_case(case, L, device)
    q, k, v = (torch.randn(1, H, L, DH, device=device, requires_grad=True) for _ in range(3))
    peers = dict(c.peers)
    ours: dict[str, Attn] = {"qkv auto": c.qkv}
    if compile and c.allowed is not None:
        peers[FLEX_PEER], seconds = _flex_peer(c.allowed, L, device)
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
        fns = [_step(fn, (q, k, v), backward) for fn in calls]
        times = _interleaved(fns, repeats, device)
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
    made = _make_case(case, L, device)
    return explain_backend(c, c, c, mask=made.mask, is_causal=made.is_causal)


def format_table(rows: Sequence[Row], mm: float, notes: Sequence[str]) -> str:
    """The markdown table that ``qkv bench`` prints."""
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
