"""Encoder throughput: qkv's BertEncoder against Hugging Face ``BertModel``, in one run.

Both run the same all-MiniLM-L6-v2 weights on the same tokenized, padded batch; timings are
interleaved (qkv, then each reference, repeated) so load on the machine hits all alike, and
the median of the repeats is reported, with each one's ratio to the best peer (the faster
``BertModel``). Tokenizing and pooling are not timed: only the encoder. ``qkv (auto, unpad)`` is
what ``qkv embed`` runs: the layers on the real tokens only (``BertEncoder(..., unpad=True)``).

    python benchmarks/embed.py --batch 1 32 128 --repeats 15 --threads 2
    python benchmarks/embed.py --quick   # qkv auto (padded, unpadded) against BertModel sdpa
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from collections.abc import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local files only

import torch
import transformers

from qkv.apps.embed import SentenceEmbedder, default_model_dir
from qkv.convert import load_bert
from qkv.functional import BACKENDS
from qkv.models.bert import BertEncoder

TEXT = (
    "the quick brown fox jumps over a lazy dog while attention weights sum to one and "
    "every padded key is blocked before the softmax so that nothing leaks"
)


def sentences(n: int) -> list[str]:
    """``n`` sentences of 3 to ~30 words, deterministic."""
    words = TEXT.split(" ")
    return [" ".join(words[(i * 7) % 11 : (i * 7) % 11 + 3 + (i * 5) % 24]) for i in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[32])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="only qkv auto (padded and unpadded) and BertModel sdpa, 7 repeats unless given",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    repeats = 7 if args.quick and "--repeats" not in sys.argv else args.repeats

    embedder = SentenceEmbedder()
    models = {b: load_bert(default_model_dir(), backend=b) for b in BACKENDS}
    impls = ("sdpa",) if args.quick else ("eager", "sdpa")
    refs = {
        impl: transformers.BertModel.from_pretrained(
            default_model_dir(), local_files_only=True, attn_implementation=impl
        ).eval()
        for impl in impls
    }
    for batch in args.batch:
        bench(embedder, models, refs, batch, repeats, args.threads, args.quick)


def bench(
    embedder: SentenceEmbedder,
    models: dict[str, BertEncoder],
    refs: dict[str, transformers.BertModel],
    batch: int,
    repeats: int,
    threads: int,
    quick: bool,
) -> None:
    """Time every contestant on one batch of ``batch`` sentences and print the table."""
    ids, attention_mask, type_ids = embedder.tokenize(sentences(batch))
    print(
        f"all-MiniLM-L6-v2, batch {batch}, padded length {ids.shape[1]}, "
        f"{int(attention_mask.sum())} real tokens, {threads} thread(s), "
        f"median of {repeats}, torch {torch.__version__}, transformers "
        f"{transformers.__version__}"
    )
    runs: dict[str, Callable[[], object]] = {}
    auto = models["auto"]
    runs["qkv (auto, unpad)"] = lambda: auto(ids, attention_mask, type_ids, unpad=True)
    for backend, model in models.items():
        if not quick or backend == "auto":
            runs[f"qkv ({backend})"] = functools.partial(model, ids, attention_mask, type_ids)
    for impl, ref in refs.items():
        runs[f"BertModel ({impl})"] = functools.partial(
            ref, input_ids=ids, attention_mask=attention_mask, token_type_ids=type_ids
        )

    times: dict[str, list[float]] = {name: [] for name in runs}
    with torch.inference_mode():
        for fn in runs.values():  # warm-up
            fn()
        for _ in range(repeats):
            for name, fn in runs.items():
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)

    peer = min((n for n in times if n.startswith("BertModel")), key=lambda n: _median(times[n]))
    base = _median(times[peer])
    width = max(len(name) for name in runs)
    for name, ts in times.items():
        med = _median(ts)
        print(
            f"{name:<{width}}  {med * 1e3:8.2f} ms  {batch / med:8.1f} sentences/s  "
            f"{base / med:5.2f}x {peer}"
        )


def _median(ts: list[float]) -> float:
    return statistics.median(ts)


if __name__ == "__main__":
    main()
