"""The cost of ``qkv.doctor.examine``: a 12-layer ~100M-parameter model on 4 texts of 128 tokens.

Randomly initialised from a config (no download): GPT-2 small (124M parameters, 12 layers, width
768) and a Llama of ~100M (12 layers, width 640, grouped-query attention). Prints each
examination's table with its time per step (a run shared by several properties is charged to the
first that needs it), the wall time and the CPU time; the issue's goal is under a minute on 2 CPU
cores. On a shared machine the wall time includes waiting for the cores, which the CPU time does
not.
``--quick``: 2 layers, width 64, 4 texts of 32 tokens (checks that the script runs).

Usage: ``python benchmarks/examine.py [--quick] [--threads N] [--model gpt2|llama|both]``
"""

import argparse
import os
import time

os.environ["HF_HUB_OFFLINE"] = "1"

import torch
import transformers as tr

from qkv.doctor.examine import examine


def _gpt2(quick: bool) -> tr.PreTrainedModel:
    if quick:
        cfg = tr.GPT2Config(
            vocab_size=1000, n_embd=64, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0
        )
    else:
        cfg = tr.GPT2Config(n_layer=12, n_embd=768, n_head=12)  # GPT-2 small: 124M
    return tr.GPT2LMHeadModel(cfg)


def _llama(quick: bool) -> tr.PreTrainedModel:
    width, layers, heads = (64, 2, 4) if quick else (640, 12, 10)
    cfg = tr.LlamaConfig(
        vocab_size=1000 if quick else 32000,
        hidden_size=width,
        intermediate_size=width * 8 // 3,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        max_position_embeddings=1024,
    )
    return tr.LlamaForCausalLM(cfg)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 layers, width 64, 32 tokens")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", choices=("gpt2", "llama", "both"), default="both")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tokens = 32 if args.quick else 128
    builders = {"gpt2": _gpt2, "llama": _llama}
    names = list(builders) if args.model == "both" else [args.model]
    for name in names:
        torch.manual_seed(0)
        model = builders[name](args.quick).eval()
        params = sum(p.numel() for p in model.parameters()) / 1e6
        ids = torch.randint(0, model.config.vocab_size, (4, tokens))
        t0, c0 = time.perf_counter(), time.process_time()
        e = examine(model, ids)
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        print(e)
        print(
            f"{name}: {params:.1f}M parameters, {model.config.num_hidden_layers} layers, "
            f"4 texts x {tokens} tokens, {args.threads} threads: examine took {seconds:.1f} s "
            f"wall, {cpu:.1f} s CPU"
        )
        print()


if __name__ == "__main__":
    main()
