"""Eager against ``torch.compile``: a training step of qkv.Transformer, cached decoding of the LM.

One run prints, each as a ratio eager / compiled (above 1: compile is faster), median of
repeats measured alternately in one process, after a warm-up that pays the compilation:

1. a training step (forward, cross-entropy, backward) of ``qkv.Transformer``, d_model 256,
   4 heads, 2 + 2 layers, batch 16, length 64, float32;
2. cached decoding of ``qkv.DecoderOnlyLM`` (d_model 256, 4 heads, 4 layers, batch 8): a
   prefill of 64 prompt tokens into a fresh KV cache and one cached step of one new token.

``validate=False`` in the eager runs too, so both measure the same work. Compiled with
``fullgraph=True``: it fails loudly if a graph break comes back.

Usage: ``python benchmarks/compile.py [--threads N] [--repeats N] [--quick]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

import qkv
from qkv.models.config import DecoderOnlyConfig, TransformerConfig


def _median_ratio(
    eager: Callable[[], object], compiled: Callable[[], object], repeats: int
) -> tuple[float, float]:
    """Median milliseconds of (eager, compiled), measured alternately."""
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    for _ in range(repeats):
        for name, fn in (("eager", eager), ("compiled", compiled)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return statistics.median(times["eager"]) * 1e3, statistics.median(times["compiled"]) * 1e3


def _eager_vs_compiled(
    model: torch.nn.Module,
    step: Callable[[Callable[..., Tensor]], Callable[[], None]],
    repeats: int,
) -> tuple[float, float]:
    """Median ms of ``step(model)`` and ``step(torch.compile(model, fullgraph=True))``."""
    eager_run, compiled_run = step(model), step(torch.compile(model, fullgraph=True))
    for _ in range(2):  # warm-up: compilation, allocator
        eager_run()
        compiled_run()
    return _median_ratio(eager_run, compiled_run, repeats)


def training_step(repeats: int, B: int, L: int, d_model: int) -> tuple[float, float]:
    cfg = TransformerConfig(
        src_vocab_size=1000,
        tgt_vocab_size=1000,
        d_model=d_model,
        num_heads=4,
        dim_feedforward=4 * d_model,
        num_encoder_layers=2,
        num_decoder_layers=2,
        dropout=0.0,
        max_positions=2 * L,
    )
    model = qkv.Transformer(cfg).train()
    src = torch.randint(3, 1000, (B, L))
    tgt = torch.randint(3, 1000, (B, L))

    def step(fn: Callable[..., Tensor]) -> Callable[[], None]:
        def run() -> None:
            logits = fn(src, tgt[:, :-1], validate=False)  # [B, L - 1, V]
            loss = F.cross_entropy(logits.flatten(0, 1), tgt[:, 1:].flatten())
            loss.backward()
            model.zero_grad(set_to_none=True)

        return run

    return _eager_vs_compiled(model, step, repeats)


def cached_decode(repeats: int, B: int, prompt: int, d_model: int) -> tuple[float, float]:
    cfg = DecoderOnlyConfig(
        vocab_size=1000,
        d_model=d_model,
        num_heads=4,
        dim_feedforward=4 * d_model,
        num_layers=4,
        dropout=0.0,
        max_positions=2 * prompt,
    )
    model = qkv.DecoderOnlyLM(cfg).eval()
    ids = torch.randint(0, 1000, (B, prompt))
    new = torch.randint(0, 1000, (B, 1))

    def step(fn: Callable[..., Tensor]) -> Callable[[], None]:
        def run() -> None:
            cache = model.new_cache()
            with torch.no_grad():
                fn(ids, kv_cache=cache, validate=False)  # prefill [B, prompt, V]
                fn(new, kv_cache=cache, validate=False)  # the cached step [B, 1, V]

        return run

    return _eager_vs_compiled(model, step, repeats)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--repeats", type=int, default=11, help="timed repeats (median)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 3 repeats (smoke run)")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    repeats = 3 if args.quick else args.repeats
    B, L, D = (2, 8, 32) if args.quick else (16, 64, 256)
    eager, comp = training_step(repeats, B, L, D)
    print(
        f"Transformer training step: eager {eager:.1f} ms, compiled {comp:.1f} ms, "
        f"eager/compiled = {eager / comp:.2f}x"
    )
    B, P = (2, 8) if args.quick else (8, 64)
    eager, comp = cached_decode(repeats, B, P, D)
    print(
        f"DecoderOnlyLM prefill + cached step: eager {eager:.1f} ms, compiled {comp:.1f} ms, "
        f"eager/compiled = {eager / comp:.2f}x"
    )


if __name__ == "__main__":
    main()
