"""Encoder throughput: qkv's BertEncoder against Hugging Face ``BertModel``, in one run.

Both run the same all-MiniLM-L6-v2 weights on the same tokenized, padded batch; timings are
interleaved (qkv, then each reference, repeated) so load on the machine hits all alike, and
the median of the repeats is reported. Tokenizing and pooling are not timed: only the encoder.

    python benchmarks/embed.py --batch 32 --repeats 15 --threads 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local files only

import torch
import transformers

from qkv.apps.embed import SentenceEmbedder, default_model_dir
from qkv.convert import load_bert
from qkv.functional import BACKENDS

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
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    embedder = SentenceEmbedder()
    ids, attention_mask, type_ids = embedder.tokenize(sentences(args.batch))
    print(
        f"all-MiniLM-L6-v2, batch {args.batch}, padded length {ids.shape[1]}, "
        f"{int(attention_mask.sum())} real tokens, {args.threads} thread(s), "
        f"median of {args.repeats}, torch {torch.__version__}, transformers "
        f"{transformers.__version__}"
    )

    runs: dict[str, Callable[[], object]] = {}
    for backend in BACKENDS:
        model = load_bert(default_model_dir(), backend=backend)
        runs[f"qkv ({backend})"] = lambda m=model: m(ids, attention_mask, type_ids)
    for impl in ("eager", "sdpa"):
        ref = transformers.BertModel.from_pretrained(
            default_model_dir(), local_files_only=True, attn_implementation=impl
        ).eval()
        runs[f"BertModel ({impl})"] = lambda r=ref: r(
            input_ids=ids, attention_mask=attention_mask, token_type_ids=type_ids
        )

    times: dict[str, list[float]] = {name: [] for name in runs}
    with torch.inference_mode():
        for fn in runs.values():  # warm-up
            fn()
        for _ in range(args.repeats):
            for name, fn in runs.items():
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)

    base = statistics.median(times["BertModel (eager)"])
    width = max(len(name) for name in runs)
    for name, ts in times.items():
        med = statistics.median(ts)
        print(
            f"{name:<{width}}  {med * 1e3:8.2f} ms  {args.batch / med:8.1f} sentences/s  "
            f"{base / med:5.2f}x BertModel (eager)"
        )


if __name__ == "__main__":
    main()
