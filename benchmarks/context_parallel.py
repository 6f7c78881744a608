"""Context-parallel attention: bytes each rank sends, and time at 2 processes against 1.

For every rule, the keys and values each rank sends in one forward of one layer (counted in the
real exchanges, in real processes) against a plain ring that sends every rank's keys and values
to every other rank; and, for a causal and a sliding-window mask at ``--length`` (default 16k),
the time of ``context_parallel_attention`` on 2 gloo processes of 1 thread each against
``qkv.attention`` (backend ``auto``) in this process with as many threads as the 2 processes
have together, forward and forward+backward (exact gradients both). Also each rank's share of
the work (query-key pairs its tiles compute): zigzag balances a causal mask. B=1, H=8, Dh=64,
float32; times are medians of ``--repeats`` runs.

    python benchmarks/context_parallel.py            # 16k, 3 repeats
    python benchmarks/context_parallel.py --quick    # 2k, 1 repeat (a smoke run)
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

import qkv
from qkv import distributed as cp
from qkv.distributed.comm import bytes_sent, reset_bytes_sent
from qkv.masks import Causal, Documents, Padding, SlidingWindow, StructuredMask

B, H, DH = 1, 8, 64


def rules(n: int) -> dict[str, StructuredMask | None]:
    """The rules of the bytes table, at global length ``n``."""
    # 8 packed documents of uneven lengths (fractions of n), so some cross a rank boundary
    cuts = torch.tensor([0.05, 0.2, 0.3, 0.45, 0.58, 0.7, 0.85]) * n
    docs = torch.bucketize(torch.arange(n), cuts.long(), right=True)[None]  # [1, n]
    return {
        "none": None,
        "causal": Causal(),
        f"window {n // 4}": SlidingWindow(n // 4),
        "padding 3/4": Padding(torch.tensor([3 * n // 4])),
        "documents x8 | causal": Documents(docs) | Causal(),
    }


def timed_rules(n: int) -> dict[str, StructuredMask]:
    return {"causal": Causal(), f"window {n // 4}": SlidingWindow(n // 4)}


def _inputs(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, H, n, DH, generator=g) for _ in range(3))  # type: ignore[return-value]


def worker(n: int, repeats: int) -> None:
    """One rank (under torchrun): print a JSON line of bytes, work and times."""
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    q, k, v = _inputs(n)
    out: dict[str, dict[str, float]] = {}
    for layout in cp.LAYOUTS:
        lq, lk, lv = (cp.shard(t, 2, layout=layout) for t in (q, k, v))
        for name, rule in rules(n).items():
            plan = cp.plan_context(
                rule, batch=B, heads=H, kv_heads=H, length=n, world=world, rank=rank, layout=layout
            )
            reset_bytes_sent()
            with torch.no_grad():
                cp.context_parallel_attention(lq, lk, lv, mask=rule, plan=plan, layout=layout)
            row: dict[str, float] = {"bytes": bytes_sent(), "work": plan.pairs_computed()}
            row["ring_bytes"] = plan.ring_keys_sent() * B * H * DH * 2 * q.element_size()
            if name in timed_rules(n):
                for pass_ in PASSES:
                    run = _pass(pass_, functools.partial(_sharded, plan=plan))
                    row[pass_] = _median(run, (lq, lk, lv), repeats, barrier=True)
            out[f"{layout}/{name}"] = row
    print(json.dumps({"rank": rank, "rows": out}), flush=True)
    dist.destroy_process_group()


PASSES = ("fwd", "fwd+bwd")


def _sharded(t: tuple[torch.Tensor, ...], plan: cp.ContextPlan) -> torch.Tensor:
    q, k, v = t
    return cp.context_parallel_attention(q, k, v, plan=plan)


Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _pass(name: str, attend: Callable[[Inputs], torch.Tensor]) -> Callable[[Inputs], None]:
    """A forward without autograd, or a forward and backward through every input."""

    def run(t: Inputs) -> None:
        if name == "fwd":
            with torch.no_grad():
                attend(t)
            return
        leaves = tuple(x.detach().requires_grad_() for x in t)
        attend(leaves).sum().backward()  # type: ignore[arg-type]

    return run


def _median(run: Callable[[Inputs], None], t: Inputs, repeats: int, barrier: bool) -> float:
    times = []
    for _ in range(repeats):
        if barrier:
            dist.barrier()
        t0 = time.perf_counter()
        run(t)
        if barrier:
            dist.barrier()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def single(n: int, repeats: int, threads: int) -> dict[str, dict[str, float]]:
    """``qkv.attention`` on the whole sequence in this process: median seconds per rule and
    pass."""
    torch.set_num_threads(threads)
    q, k, v = _inputs(n)
    result: dict[str, dict[str, float]] = {}
    for name, rule in timed_rules(n).items():
        result[name] = {}
        for pass_ in PASSES:
            run = _pass(pass_, lambda t, r=rule: qkv.attention(*t, mask=r)[0])  # type: ignore[misc]
            result[name][pass_] = _median(run, (q, k, v), repeats, barrier=False)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=16384, help="global sequence length")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per case")
    parser.add_argument("--quick", action="store_true", help="2k positions, 1 repeat")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    n, repeats = (2048, 1) if args.quick else (args.length, args.repeats)
    if args.worker:
        worker(n, repeats)
        return
    world = 2
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={world}",
        __file__,
        "--worker",
        "--length",
        str(n),
        "--repeats",
        str(repeats),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        sys.exit(proc.stdout[-2000:] + proc.stderr[-4000:])
    ranks = sorted(
        (json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")),
        key=lambda r: r["rank"],
    )
    one = single(n, repeats, threads=world)
    print(f"context parallelism, {world} gloo processes x 1 thread, B={B} H={H} Dh={DH} n={n}")
    print("float32; bytes: keys+values one rank sends in one forward of one layer\n")
    print("| layout | rule | bytes sent per rank | plain ring | ring / sent | work imbalance |")
    print("|---|---|---|---|---|---|")
    for key in ranks[0]["rows"]:
        layout, name = key.split("/", 1)
        rows = [r["rows"][key] for r in ranks]
        sent = [int(r["bytes"]) for r in rows]
        ring = [int(r["ring_bytes"]) for r in rows]
        work = [r["work"] for r in rows]
        ratio = f"{sum(ring) / sum(sent):.2f}x" if sum(sent) else "nothing sent"
        mb = " / ".join(f"{s / 2**20:.1f} MB" for s in sent)
        ring_mb = " / ".join(f"{s / 2**20:.1f} MB" for s in ring)
        print(
            f"| {layout} | {name} | {mb} | {ring_mb} | {ratio} | {max(work) / min(work) - 1:+.1%} |"
        )
    print(
        f"\n| layout | rule | pass | 1 process ({world} threads) | {world} processes | speed-up |"
    )
    print("|---|---|---|---|---|---|")
    for key in ranks[0]["rows"]:
        layout, name = key.split("/", 1)
        for pass_ in PASSES if name in one else ():
            t = max(r["rows"][key][pass_] for r in ranks)
            base = one[name][pass_]
            print(f"| {layout} | {name} | {pass_} | {base:.3f} s | {t:.3f} s | {base / t:.2f}x |")


if __name__ == "__main__":
    main()
