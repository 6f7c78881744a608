"""What a watch costs: a watched forward against the same forward unwatched, in one run.

Two models people run, built from configs with random weights (the cost does not depend on the
weights): a BERT-base-sized encoder (12 layers, width 768, 12 heads) on a padded batch of
B=8 x L=512, and a small Llama's cached decode step (B=4, 512 cached tokens). Rounds are
interleaved (unwatched, watched, ...) so machine load hits both alike; the medians and their
ratio are printed. The unwatched run has no watch anywhere in the process: the doctor installs
nothing until a ``with qkv.doctor.watch()`` block starts.

    python benchmarks/doctor.py            # the issue's sizes (a few minutes on 2 cores)
    python benchmarks/doctor.py --quick    # smaller, for a smoke run
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
import transformers

from qkv import doctor


def _time(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _times(fn: Callable[[], object]) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds): CPU time is what the doctor adds, and other
    jobs on a shared machine move it far less than wall time."""
    w0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w0, time.process_time() - c0


def measure(name: str, run: Callable[[], object], model: torch.nn.Module, repeats: int) -> None:
    """Print the medians of ``repeats`` interleaved unwatched / watched runs and their ratios,
    in wall time and in CPU time."""

    def watched() -> None:
        with doctor.watch(model) as report:
            run()
        assert report.calls > 0 and report.ok, str(report)

    run()  # warm up both paths once
    watched()
    plain, inside = [], []
    for _ in range(repeats):
        plain.append(_times(run))
        inside.append(_times(watched))
    pw, pc = (statistics.median(t[i] for t in plain) for i in (0, 1))
    ww, wc = (statistics.median(t[i] for t in inside) for i in (0, 1))
    print(
        f"| {name} | {pw * 1e3:.1f} ms | {ww * 1e3:.1f} ms | {ww / pw:.2f}x "
        f"| {pc * 1e3:.1f} ms | {wc * 1e3:.1f} ms | {wc / pc:.2f}x |",
        flush=True,
    )


def bert_case(batch: int, length: int, layers: int, width: int, heads: int):
    config = transformers.BertConfig(
        hidden_size=width,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=4 * width,
        max_position_embeddings=max(512, length),
        attn_implementation="sdpa",
    )
    model = transformers.BertModel(config).eval()
    ids = torch.randint(5, config.vocab_size, (batch, length))
    mask = torch.ones(batch, length, dtype=torch.long)
    for b in range(batch):  # a padded batch: lengths from L down to L/2
        mask[b, length - b * length // (2 * batch) :] = 0
    mask[:, 0] = 1

    def run() -> None:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)

    return model, run


def llama_decode_case(batch: int, cached: int, layers: int, width: int):
    config = transformers.LlamaConfig(
        vocab_size=1000,
        hidden_size=width,
        intermediate_size=4 * width,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=cached + 64,
        attn_implementation="sdpa",
    )
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(1, 1000, (batch, cached))
    mask = torch.ones(batch, cached + 1, dtype=torch.long)
    mask[1:, :8] = 0  # left padding in all rows but the first
    with torch.no_grad():
        past = model(input_ids=ids, attention_mask=mask[:, :-1], use_cache=True).past_key_values
    step = torch.randint(1, 1000, (batch, 1))

    def run() -> None:
        with torch.no_grad():
            model(input_ids=step, attention_mask=mask, past_key_values=past, use_cache=True)
            past.crop(-1)  # back to the same cache for the next round

    return model, run


def capture_case(length: int, heads: int = 8, width: int = 64) -> None:
    """One head of one causal SDPA call at ``length`` tokens: time and peak memory."""
    q, k, v = (torch.randn(1, heads, length, width) for _ in range(3))
    F.scaled_dot_product_attention(q[:, :, :256], k[:, :, :256], v[:, :, :256])  # warm up
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # GiB (Linux: KiB)
    t_call = _time(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    after_call = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20

    def watched() -> None:
        with doctor.watch(capture=".", heads=[0]) as report:
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
        w = report.attention("F.scaled_dot_product_attention")
        assert w.shape == (1, 1, length, length)

    t_watched = _time(watched)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    stored = length * length * 4 / 2**30
    print(
        f"capture of 1 head of [1, {heads}, {length}, {length}]: call {t_call:.2f} s, "
        f"watched call + capture {t_watched:.2f} s; peak memory {peak - base:.2f} GiB above "
        f"the inputs (the call alone {after_call - base:.2f} GiB; the kept head is "
        f"{stored:.2f} GiB float32; the whole [B, H, T, S] would be {stored * heads:.1f} GiB)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--capture-length",
        type=int,
        default=None,
        metavar="T",
        help="instead: capture one head of a T-token call (16384 in the README)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.capture_length:
        capture_case(args.capture_length)
        return
    repeats = args.repeats or (3 if args.quick else 7)
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{args.threads} threads, median of {repeats}"
    )
    print(
        "| case | wall, unwatched | wall, watched | ratio | CPU, unwatched | CPU, watched "
        "| ratio |\n|---|---|---|---|---|---|---|"
    )
    if args.quick:
        bert = bert_case(batch=2, length=128, layers=2, width=256, heads=4)
        llama = llama_decode_case(batch=2, cached=128, layers=2, width=256)
        names = ("BERT 2x256, B=2, L=128", "Llama 2x256 decode step, B=2, 128 cached")
    else:
        bert = bert_case(batch=8, length=512, layers=12, width=768, heads=12)
        llama = llama_decode_case(batch=4, cached=512, layers=8, width=512)
        names = ("BERT-base 12x768, B=8, L=512", "Llama 8x512 decode step, B=4, 512 cached")
    measure(names[0], bert[1], bert[0], repeats)
    measure(names[1], llama[1], llama[0], repeats)


if __name__ == "__main__":
    main()
