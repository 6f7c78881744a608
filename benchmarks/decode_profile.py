"""Where a B=1 decoding step's time goes: qkv compiled against CTranslate2, step by step.

``benchmarks/decode.py`` times whole generations; this script splits a step. For GPT-2 small or
the 12-layer Llama-style model of ``decode.py`` (random weights, ``save_pretrained``, the same
directory converted for CTranslate2), at B=1 after a 16-token prompt:

1. **Step times, interleaved in one process**: qkv's compiled step
   (:class:`qkv.models.static_decode.StaticDecoder` as ``generate`` drives it: the guards checked
   on the first step only) and CTranslate2's ``generate_tokens`` (the time between two tokens),
   rounds interleaved, the median step of each; the greedy tokens of both are checked equal.
   Two OpenMP runtimes in one process slow each other (``decode.py`` runs CTranslate2 in a
   process of its own for that reason): compare these steps with each other, not with
   ``decode.py``'s tokens/s.
2. **The matrix products of a step**, each contestant in a process of its own under
   ``MKL_VERBOSE=1`` (both call MKL, which prints each call's time): that process's median
   step, and its products (per weight shape the median time of a one-row call, times the
   calls of that shape per step); the rest of the step is the difference. Both come from the
   same process, so they are what the products cost inside the contestant's own step, not in a
   loop apart (MKL's printing slows both steps a little). Off Intel CPUs neither multiplies a
   row through MKL (qkv: :mod:`qkv.models.cpu_products`; CTranslate2: oneDNN), and the
   products print as ``nan``.
3. **qkv's step under ``torch.profiler``**: dynamo's guard check, the compiled graph, and the
   ATen calls the graph's wrapper makes around each product (``addmm_out``'s bias copy, the
   clone of its one-row input, the views).

CTranslate2 is optional (``pip install ctranslate2``); without it only qkv's rows print.

Usage: ``python benchmarks/decode_profile.py [--model gpt2|llama] [--threads N] [--steps N]
[--rounds N] [--quick]``; ``--quick``: the 2-layer models of ``decode.py --quick``, 8 steps,
2 rounds.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from decode import ct2_dir, ctranslate2, hf_model
from qkv.convert import load_hf
from qkv.models import DecoderOnlyLM
from qkv.models.static_decode import StaticDecoder, static_capacity

PROMPT = 16
BOOKKEEPING = (
    "aten::clone", "aten::copy_", "aten::expand", "aten::empty_like", "aten::empty",
    "aten::as_strided", "aten::transpose", "aten::resolve_conj",
)  # fmt: skip
"""The ATen calls a compiled step's wrapper makes around its products (none of them math)."""
PRODUCTS = ("SGEMM", "SGEMM_COMPUTE", "SGEMV")
"""MKL's calls that multiply (CTranslate2's ``SGEMM_PACK``, once a generation, is left out)."""
MKL_CALL = re.compile(r"MKL_VERBOSE (\w+)\(([^)]*)\) ([\d.]+)(us|ms|s) ")


def prompt(vocab: int) -> torch.Tensor:
    """The ``[1, 16]`` prompt every run decodes from."""
    return torch.randint(1, vocab, (1, PROMPT), generator=torch.Generator().manual_seed(1))


def qkv_steps(lm: DecoderOnlyLM, ids: torch.Tensor, steps: int) -> tuple[list[float], list[int]]:
    """Seconds of each compiled step after the prompt, and the greedy tokens."""
    T0 = ids.shape[1]
    decoder = StaticDecoder(lm, 1, static_capacity(T0, steps + 1), compile=True, skip_guards=True)
    with torch.no_grad():
        nxt = decoder.prefill(ids, None).argmax(-1)  # [1]
        times, tokens = [], [int(nxt)]
        for s in range(steps):
            t0 = time.perf_counter()
            logits = decoder.step(nxt, T0 + s)  # [1, V]
            times.append(time.perf_counter() - t0)
            nxt = logits.argmax(-1)  # [1]
            tokens.append(int(nxt))
    return times, tokens


def ct2_steps(gen: object, ids: torch.Tensor, steps: int) -> tuple[list[float], list[int]]:
    """Seconds between CTranslate2's tokens after the first (which pays for the prompt), and
    its greedy tokens."""
    words = [f"t{i}" for i in ids[0].tolist()]
    times, tokens = [], []
    t0 = time.perf_counter()
    for r in gen.generate_tokens(words, max_length=steps + 1, sampling_topk=1):  # type: ignore[attr-defined]
        now = time.perf_counter()
        times.append(now - t0)
        tokens.append(r.token_id)
        t0 = now
    return times[1:], tokens


def step_times(hf_dir: Path, ct2_path: Path | None, args: argparse.Namespace) -> dict[str, float]:
    """Median step (ms) of each contestant over interleaved rounds; the tokens checked equal."""
    lm = load_hf(hf_dir)
    assert isinstance(lm, DecoderOnlyLM)
    ids = prompt(lm.config.vocab_size)
    runs = {"qkv compiled": lambda: qkv_steps(lm, ids, args.steps)}
    if ct2_path is not None:
        gen = ctranslate2.Generator(str(ct2_path), device="cpu", intra_threads=args.threads)
        runs["CTranslate2"] = lambda: ct2_steps(gen, ids, args.steps)
    tokens = {name: run()[1] for name, run in runs.items()}  # warm-up: qkv compiles here
    if len(set(map(tuple, tokens.values()))) != 1:
        raise SystemExit(f"the contestants' tokens differ: {tokens}")
    times: dict[str, list[float]] = defaultdict(list)
    for _ in range(args.rounds):
        for name, run in runs.items():
            times[name] += run()[0]
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def breakdown(hf_dir: Path, args: argparse.Namespace) -> dict[str, float]:
    """ms per step of qkv's step under ``torch.profiler``: the guard check, the compiled graph,
    and the ATen bookkeeping inside it (self times)."""
    lm = load_hf(hf_dir)
    assert isinstance(lm, DecoderOnlyLM)
    ids = prompt(lm.config.vocab_size)
    qkv_steps(lm, ids, args.steps)  # compiled and warm
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        qkv_steps(lm, ids, args.steps)
    out = {"guard check (all steps but the first skip it)": 0.0, "compiled graph": 0.0}
    out["ATen bookkeeping around the products"] = 0.0
    for e in prof.key_averages():
        if e.key == "TorchDynamo Cache Lookup":
            out["guard check (all steps but the first skip it)"] += e.cpu_time_total
        elif e.key.startswith("## Call CompiledFxGraph"):
            out["compiled graph"] += e.cpu_time_total
        elif e.key in BOOKKEEPING:
            out["ATen bookkeeping around the products"] += e.self_cpu_time_total
    return {k: v / 1e3 / args.steps for k, v in out.items()}


def products(log: str, width: int, steps: int) -> float:
    """ms of one step's matrix products from an ``MKL_VERBOSE`` log of ``steps`` steps: per
    weight shape (the :data:`PRODUCTS` calls with one row and at least ``width`` x ``width``
    weights, so not attention's), the median call times the calls per step (the calls of that
    shape over those of the output head, which runs once a step). Shapes called fewer than
    ``steps`` times are not a step's: the prefill's one-row output head, which runs through
    MKL even where the steps do not (off Intel CPUs), so that a log without a step's products
    gives ``nan``."""
    calls: dict[tuple[str, ...], list[float]] = defaultdict(list)
    for m in MKL_CALL.finditer(log):
        if m.group(1) not in PRODUCTS:
            continue
        dims = m.group(2).split(",")[2:5]  # m, n, k of ?GEMM(transa, transb, m, n, k, ...)
        if len(dims) < 3 or not all(d.isdigit() for d in dims):
            continue
        rows, cols, inner = (int(d) for d in dims)
        one_row = 1 in (rows, cols)
        if one_row and max(rows, cols) * inner >= width * width:
            scale = {"us": 1e-3, "ms": 1.0, "s": 1e3}[m.group(4)]
            calls[(m.group(1), str(max(rows, cols)), str(inner))].append(float(m.group(3)) * scale)
    calls = {k: v for k, v in calls.items() if len(v) >= steps}
    if not calls:
        return float("nan")
    head = max(calls, key=lambda k: int(k[1]) * int(k[2]))  # the widest: the output head
    per_step = {k: round(len(v) / len(calls[head])) for k, v in calls.items()}
    return sum(statistics.median(v) * per_step[k] for k, v in calls.items())


def child(args: argparse.Namespace) -> None:
    """Under ``MKL_VERBOSE=1``: one contestant's warm-up, then ``--rounds`` rounds of
    ``--steps`` steps; the median step (ms) goes to stderr as ``STEP <ms>``."""
    torch.set_num_threads(args.threads)
    ids = prompt(args.vocab)
    if args.child == "qkv":
        lm = load_hf(Path(args.dir))
        assert isinstance(lm, DecoderOnlyLM)
        run = lambda: qkv_steps(lm, ids, args.steps)[0]  # noqa: E731
    else:
        gen = ctranslate2.Generator(args.dir, device="cpu", intra_threads=args.threads)
        run = lambda: ct2_steps(gen, ids, args.steps)[0]  # noqa: E731
    run()  # warm-up (qkv compiles here)
    times = [t for _ in range(args.rounds) for t in run()]
    print(f"STEP {statistics.median(times) * 1e3}", file=sys.stderr)


def verbose_run(
    name: str, path: Path, vocab: int, width: int, args: argparse.Namespace
) -> tuple[float, float]:
    """``name`` run by :func:`child` in a process of its own under ``MKL_VERBOSE=1``: its
    median step and its :func:`products` (ms), from the same process."""
    cmd = [sys.executable, __file__, "--child", name, "--dir", str(path), "--vocab", str(vocab)]
    cmd += ["--threads", str(args.threads), "--steps", str(args.steps)]
    cmd += ["--rounds", str(args.rounds)]
    env = {**os.environ, "MKL_VERBOSE": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    step = re.search(r"^STEP ([\d.]+)$", done.stderr, re.MULTILINE)
    if step is None:
        raise SystemExit(f"the {name} child printed no step time:\n{done.stderr[-2000:]}")
    steps = (args.rounds + 1) * args.steps  # the warm-up round and the timed ones
    return float(step.group(1)), products(done.stdout, width, steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2", choices=("gpt2", "llama"))
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--steps", type=int, default=64, help="decoding steps a round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="2-layer model, 8 steps, 2 rounds")
    parser.add_argument("--child", choices=("qkv", "ct2"), help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    parser.add_argument("--vocab", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    if args.quick:
        args.steps, args.rounds = 8, 2
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.model}, B=1, {args.threads} thread(s), ", end="")
    print(f"{args.steps} steps after {PROMPT} tokens, {args.rounds} rounds")
    with tempfile.TemporaryDirectory() as tmp:
        ref = hf_model(args.model, args.quick)
        hf_dir = Path(tmp) / args.model
        ref.save_pretrained(hf_dir)
        vocab, width = ref.config.vocab_size, ref.config.hidden_size
        ct2_path = None
        if ctranslate2 is not None:
            ct2_path = ct2_dir(hf_dir, Path(tmp) / "ct2", vocab)
        step = step_times(hf_dir, ct2_path, args)
        paths = {"qkv compiled": ("qkv", hf_dir), "CTranslate2": ("ct2", ct2_path)}
        verbose = {n: verbose_run(*paths[n], vocab, width, args) for n in step}  # type: ignore[arg-type]
        rows = {
            "step (median, interleaved in one process)": step,
            "step under MKL_VERBOSE (a process each)": {n: v[0] for n, v in verbose.items()},
            "its matrix products (the same process)": {n: v[1] for n, v in verbose.items()},
            "the rest of that step": {n: v[0] - v[1] for n, v in verbose.items()},
        }
        print("\n| ms a step | " + " | ".join(step) + " |")
        print("|---|" + "---:|" * len(step))
        for what, cells in rows.items():
            print(f"| {what} | " + " | ".join(f"{cells[n]:.2f}" for n in step) + " |")
        print("\nqkv's step under torch.profiler (ms a step):")
        for what, ms in breakdown(hf_dir, args).items():
            print(f"- {what}: {ms:.3f}")


if __name__ == "__main__":
    main()
