"""How ``benchmarks/attention.py`` times a call: round-robin runs, synchronised, and one
forward's peak memory (``VmHWM`` reset through ``/proc/self/clear_refs``, or
``torch.cuda.max_memory_allocated`` on a GPU)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

__all__ = ["interleaved", "peak_memory_mb", "step", "sync"]


def sync(device: torch.device) -> None:
    """Wait for the GPU's queued work (nothing to wait for on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize()


def step(fn: Callable[..., Tensor], inputs: Sequence[Tensor], backward: bool) -> Callable[[], None]:
    """One timed unit: ``fn`` on ``inputs``, forward only (no grad) or forward + backward."""

    def run() -> None:
        if backward:
            for x in inputs:
                x.grad = None
            fn(*inputs).sum().backward()
        else:
            with torch.no_grad():
                fn(*inputs)

    return run


def interleaved(
    fns: Sequence[Callable[[], object]], repeats: int, device: torch.device
) -> list[list[float]]:
    """Times of each function, run round-robin so that all of them see the same machine load."""
    for fn in fns:
        fn()
    sync(device)
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            sync(device)
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
