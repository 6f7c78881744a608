"""attn_implementation="qkv" against "sdpa", measured side by side in one process.

MiniLM (the real all-MiniLM-L6-v2, a padded batch of sentences): sentences/s.
A tiny random Llama (GQA, greedy generate with DynamicCache): tokens/s.
Medians over ``--repeats`` runs, the implementations interleaved.

Usage: ``python benchmarks/hf.py [--quick] [--repeats N] [--threads N]``
"""

import argparse
import os
import statistics
import time
from collections.abc import Callable

os.environ["HF_HUB_OFFLINE"] = "1"

import torch
import transformers as tr

from qkv.apps.embed import default_model_dir
from qkv.integrations.transformers import register

IMPLS = ("sdpa", "qkv")


def _medians_s(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds per call of each function, the functions interleaved in every repeat (so
    a slow phase of the machine hits all of them alike)."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small batches, 3 repeats")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    repeats = 3 if args.quick else args.repeats
    register()
    d = default_model_dir()
    tok = tr.AutoTokenizer.from_pretrained(d)
    n = 16 if args.quick else 64
    sentences = [("a sentence of some length " * (1 + i % 5)).strip() for i in range(n)]
    batch = tok(sentences, padding=True, return_tensors="pt")
    bert = {i: tr.BertModel.from_pretrained(d, attn_implementation=i).eval() for i in IMPLS}
    torch.manual_seed(0)
    cfg = tr.LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    base = tr.LlamaForCausalLM(cfg).eval()
    llama = {}
    for i in IMPLS:
        m = tr.LlamaForCausalLM(cfg).eval()
        m.load_state_dict(base.state_dict())
        m.set_attn_implementation(i)
        llama[i] = m
    new = 16 if args.quick else 64
    prompt = torch.randint(0, 512, (4, 32))
    rows = []
    with torch.no_grad():
        for i in IMPLS:  # warm-up
            bert[i](**batch)
            llama[i].generate(prompt, max_new_tokens=4, min_new_tokens=4, do_sample=False)
        s_bert = _medians_s({i: lambda i=i: bert[i](**batch) for i in IMPLS}, repeats)
        s_llama = _medians_s(
            {
                i: lambda i=i: llama[i].generate(
                    prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False
                )
                for i in IMPLS
            },
            repeats,
        )
    for i in IMPLS:
        rows.append((i, n / s_bert[i], prompt.shape[0] * new / s_llama[i]))
    print(f"{'impl':6} {'MiniLM sentences/s':>20} {'tiny Llama tokens/s':>20}")
    for i, a, b in rows:
        print(f"{i:6} {a:20.1f} {b:20.1f}")
    print(f"qkv/sdpa: MiniLM {rows[1][1] / rows[0][1]:.2f}x, Llama {rows[1][2] / rows[0][2]:.2f}x")


if __name__ == "__main__":
    main()
