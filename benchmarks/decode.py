"""Greedy decoding speed side by side in one run: transformers, qkv (eager, compiled), CTranslate2.

For GPT-2 small (12 layers, d_model 768, 50257 tokens) and a 12-layer Llama-style model with
grouped-query attention (d_model 768, 12 heads, 4 key/value heads, SwiGLU 2048, 32000 tokens),
both with random weights saved by ``save_pretrained`` into a temporary directory, each
contestant decodes from that same directory:

* ``transformers``: ``generate(do_sample=False)``, ``attn_implementation="sdpa"``;
* ``qkv eager``: ``qkv.convert.load_hf`` then ``generate(greedy=True)`` (growing ``KVCache``);
* ``qkv compiled``: the same with ``compile=True`` (static cache, the decode step compiled once
  by ``torch.compile(fullgraph=True)``; its compile time is printed, not timed);
* ``CTranslate2``: float32, converted from the same directory by its ``TransformersConverter``
  (a stand-in tokenizer names token ``i`` ``"t{i}"``; no tokenizer is downloaded), run in a
  process of its own (:class:`Ct2Process`; ``--same-process``: in this one), called in turn
  with the others: its OpenMP runtime and torch's slow each other down in one process.

Each decodes ``--new`` (64) tokens after a 16-token prompt at B=1 and B=8, with one thread and
with all threads. Rounds are interleaved; each contestant's median over ``--repeats`` gives its
tokens/s (B * new / seconds) and its ratio to ``transformers``; its speed relative to
CTranslate2 is the median over rounds of the two times of the same round (this machine's speed
drifts by up to a third over seconds). The tokens of every contestant
are compared with ``transformers``' (identical, or the first differing step is printed). The
models have no end token (transformers/qkv: ``eos_token_id=None``; CTranslate2: ``min_length``
= ``max_length``), so everyone decodes every step. Also printed: the time of a 512-token
prefill (the prompt and one new token) at B=1, and each contestant's share of the B=1 limit
``memory bandwidth / weight bytes per token`` (bandwidth measured here by a read of 1 GiB with
the same threads, the fastest of repeated sums, matrix-vector products and inductor's
reductions; every weight is read once per decoding step, an embedding table only where it is
also the output head).

CTranslate2 is not a qkv dependency: ``pip install ctranslate2`` (4.x) to include it; without it
its column is skipped with a note.

Usage: ``python benchmarks/decode.py [--quick] [--repeats N] [--new N] [--threads 1,2]
[--models gpt2,llama] [--same-process]``; ``--quick``: 2-layer models of width 64, 8 new
tokens, 1 repeat.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import cast

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch
import transformers as tr

from qkv.convert import load_hf
from qkv.models import DecoderOnlyLM
from qkv.models.weight_copies import huge_page_copies

try:
    import ctranslate2
    from ctranslate2.converters import TransformersConverter
except ImportError:  # pragma: no cover - optional peer
    ctranslate2 = None

PROMPT, PREFILL = 16, 512
Run = Callable[[torch.Tensor, int], list[list[int]]]


def hf_model(kind: str, quick: bool) -> tr.PreTrainedModel:
    """GPT-2 small or a 12-layer Llama-style GQA model (tiny with ``quick``), random weights."""
    torch.manual_seed(0)
    if kind == "gpt2":
        size = {"n_embd": 64, "n_layer": 2, "n_head": 4} if quick else {}
        vocab = 512 if quick else 50257
        cfg = tr.GPT2Config(
            vocab_size=vocab, n_positions=1024, bos_token_id=None, eos_token_id=None, **size
        )
        model: tr.PreTrainedModel = tr.GPT2LMHeadModel(cfg)
    else:
        size = (
            {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512}
            if quick
            else {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12,
                  "num_attention_heads": 12, "num_key_value_heads": 4, "vocab_size": 32000}
        )  # fmt: skip
        cfg = tr.LlamaConfig(
            max_position_embeddings=1024, bos_token_id=None, eos_token_id=None,
            pad_token_id=None, tie_word_embeddings=False, **size,
        )  # fmt: skip
        model = tr.LlamaForCausalLM(cfg)
    return model.eval()


class _Tokenizer:
    """What CTranslate2's converter reads of a tokenizer: token ``i`` is ``"t{i}"``."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab
        self.bos_token = self.eos_token = self.unk_token = "t0"
        self.pad_token = None

    def get_vocab(self) -> dict[str, int]:
        return {f"t{i}": i for i in range(self.vocab)}

    def __len__(self) -> int:
        return self.vocab


def ct2_dir(hf_dir: Path, out: Path, vocab: int) -> Path:
    """Convert ``hf_dir`` to a CTranslate2 float32 model (stand-in tokenizer)."""

    class Converter(TransformersConverter):  # type: ignore[misc]
        def load_tokenizer(self, *args: object, **kwargs: object) -> _Tokenizer:
            return _Tokenizer(vocab)

    Converter(str(hf_dir)).convert(str(out), quantization="float32", force=True)
    return out


def contestants(
    hf_dir: Path, ct2_path: Path | None, threads: int, same_process: bool = False
) -> dict[str, Run]:
    """Each contestant's greedy decode: ``(prompts [B, T0], n) -> n new tokens per row``;
    CTranslate2 (when ``ct2_path`` is given) in a :class:`Ct2Process` unless
    ``same_process``."""
    ref = tr.AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="sdpa").eval()
    lm = load_hf(hf_dir)
    assert isinstance(lm, DecoderOnlyLM)

    def hf(ids: torch.Tensor, n: int) -> list[list[int]]:
        with torch.no_grad():
            out = ref.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return out[:, ids.shape[1] :].tolist()

    def eager(ids: torch.Tensor, n: int) -> list[list[int]]:
        return lm.generate(ids, n, greedy=True)[:, ids.shape[1] :].tolist()

    def compiled(ids: torch.Tensor, n: int) -> list[list[int]]:
        return lm.generate(ids, n, greedy=True, compile=True)[:, ids.shape[1] :].tolist()

    runs: dict[str, Run] = {"transformers": hf, "qkv eager": eager, "qkv compiled": compiled}
    if ct2_path is not None and same_process:
        gen = ctranslate2.Generator(str(ct2_path), device="cpu", intra_threads=threads)
        runs["CTranslate2"] = lambda ids, n: ct2_generate(gen, ids.tolist(), n)
    elif ct2_path is not None:
        runs["CTranslate2"] = Ct2Process(ct2_path, threads)
    return runs


def ct2_generate(gen: ctranslate2.Generator, rows: list[list[int]], n: int) -> list[list[int]]:
    """CTranslate2's greedy decode of token ids ``rows``: ``n`` new tokens per row."""
    prompts = [[f"t{i}" for i in row] for row in rows]
    res = gen.generate_batch(
        prompts, max_length=n, min_length=n, include_prompt_in_result=False,
        beam_size=1, sampling_topk=1,
    )  # fmt: skip
    return [r.sequences_ids[0] for r in res]


def _ct2_worker(conn: Connection, path: str, threads: int) -> None:
    """The loop of :class:`Ct2Process`'s process: ``(rows, n)`` in, tokens out, None ends."""
    gen = ctranslate2.Generator(path, device="cpu", intra_threads=threads)
    while (msg := conn.recv()) is not None:
        conn.send(ct2_generate(gen, *msg))


class Ct2Process:
    """CTranslate2 in a process of its own (spawned), called like the other contestants.

    Its OpenMP runtime (a libgomp of its own) and torch's do not share a process: in one
    process each slowed the other on 2 cores (64 tokens, Llama-style, B=1, 2 threads, AMD EPYC:
    qkv 1338 ms before CTranslate2 first ran, 1514 ms after; CTranslate2 942 ms in a process
    of its own, 1283 ms after qkv had run in its process). A call's time, measured by the
    caller, includes the pipe's round trip of its ids and tokens (well under a millisecond)."""

    def __init__(self, path: Path, threads: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_ct2_worker, args=(child, str(path), threads))
        self._proc.daemon = True
        self._proc.start()

    def __call__(self, ids: torch.Tensor, n: int) -> list[list[int]]:
        self._conn.send((ids.tolist(), n))
        return cast(list[list[int]], self._conn.recv())

    def close(self) -> None:
        """End the process."""
        self._conn.send(None)
        self._proc.join()


def bandwidth() -> float:
    """Bytes/s read from 1 GiB of float32 with the current threads: the fastest of 7 sums, 7
    matrix-vector products (what a decoding step does to each weight) and 7 of the same
    products as a reduction compiled by inductor. The fastest, not the median: the limit is
    what the memory can do, and other jobs only ever slow a read down. On huge pages, as qkv's
    compiled steps read their weights (:func:`qkv.models.weight_copies.huge_page_copies`)."""
    x = huge_page_copies({"x": torch.ones(1 << 28)}, column_major=False)["x"]  # 1 GiB
    W, v = x.view(1 << 14, 1 << 14), torch.ones(1 << 14)  # [16384, 16384], [16384]
    reduction = torch.compile(lambda W, v: (W * v).sum(-1), dynamic=False)  # [16384]
    best = 0.0
    for read in (x.sum, lambda: torch.mv(W, v), lambda: reduction(W, v)):
        read()
        for _ in range(7):
            t0 = time.perf_counter()
            read()
            best = max(best, x.numel() * 4 / (time.perf_counter() - t0))
    return best


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the distinct parameters a decoding step reads whole: all but the embedding
    tables it only looks a row up in (a table tied to the output head is read whole)."""
    tables = {m.weight.data_ptr() for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    others = {
        p.data_ptr()
        for m in model.modules()
        if not isinstance(m, torch.nn.Embedding)
        for p in m.parameters(recurse=False)
    }
    read = {
        p.data_ptr(): p.numel() * p.element_size()
        for p in model.parameters()
        if p.data_ptr() not in tables or p.data_ptr() in others
    }
    return sum(read.values())


def first_difference(a: list[list[int]], b: list[list[int]]) -> str:
    for r, (x, y) in enumerate(zip(a, b, strict=True)):
        for s, (u, v) in enumerate(zip(x, y, strict=False)):
            if u != v:
                return f"row {r} step {s}: {u} vs {v}"
        if len(x) != len(y):
            return f"row {r}: {len(x)} vs {len(y)} tokens"
    return "identical"


def measure(runs: dict[str, Run], ids: torch.Tensor, n: int, repeats: int) -> dict[str, float]:
    """Median seconds per contestant, rounds interleaved (after one warm-up call each)."""
    times = rounds(runs, ids, n, repeats)
    return {name: statistics.median(t) for name, t in times.items()}


def rounds(runs: dict[str, Run], ids: torch.Tensor, n: int, repeats: int) -> dict[str, list[float]]:
    """Seconds per contestant and round, rounds interleaved (after one warm-up call each)."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            t0 = time.perf_counter()
            run(ids, n)
            times[name].append(time.perf_counter() - t0)
    return times


def per_round(times: dict[str, list[float]], name: str, peer: str) -> float:
    """The median over rounds of ``peer``'s time over ``name``'s in the same round: a speed
    ratio that a machine's slower and faster minutes move less than a ratio of medians."""
    return statistics.median(p / t for t, p in zip(times[name], times[peer], strict=True))


def bench_model(kind: str, args: argparse.Namespace, root: Path, reads: dict[int, float]) -> None:
    """Every contestant on ``kind``, per thread count and batch size, and its tables printed.

    Args:
        kind: ``"gpt2"`` or ``"llama"``.
        args: the parsed command line.
        root: a directory for the saved and converted models.
        reads: the fastest read (bytes/s, :func:`bandwidth`) per thread count so far in this
            run, updated here: each model's B=1 limit is from the fastest read of the run, so
            a read slowed by another job does not put a contestant above 100 %.
    """
    ref = hf_model(kind, args.quick)
    hf_dir = root / kind
    ref.save_pretrained(hf_dir)
    vocab = ref.config.vocab_size
    ct2_path = ct2_dir(hf_dir, root / f"{kind}-ct2", vocab) if ctranslate2 is not None else None
    wbytes = weight_bytes(ref)
    print(f"\n## {kind}: {wbytes / 1e6:.0f} MB of float32 weights read per decoding step")
    g = torch.Generator().manual_seed(1)
    for threads in args.threads:
        torch.set_num_threads(threads)
        runs = contestants(hf_dir, ct2_path, threads, args.same_process)
        bw = reads[threads] = max(reads.get(threads, 0.0), bandwidth())
        limit = bw / wbytes
        print(
            f"\n### {threads} thread(s): {bw / 1e9:.1f} GB/s read (the fastest of the run), "
            f"B=1 limit {limit:.1f} tokens/s\n"
        )
        print(
            "| B | contestant | tokens/s | vs transformers | vs CTranslate2 (per round) "
            "| share of limit | tokens |"
        )
        print("|---|---|---|---|---|---|---|")
        for B in args.batches:
            ids = torch.randint(1, vocab, (B, PROMPT), generator=g)
            want = runs["transformers"](ids, args.new)
            checks = {}
            for name, run in runs.items():  # warm-up; the compiled step compiles here
                t0 = time.perf_counter()
                checks[name] = first_difference(want, run(ids, args.new))
                if name == "qkv compiled":
                    checks[name] += f" (first call {time.perf_counter() - t0:.1f} s, compile)"
            times = rounds(runs, ids, args.new, args.repeats)
            med = {name: statistics.median(t) for name, t in times.items()}
            base = B * args.new / med["transformers"]
            for name, sec in med.items():
                tps = B * args.new / sec
                share = f"{tps / limit:.0%}" if B == 1 else ""
                peer = (
                    f"{per_round(times, name, 'CTranslate2'):.2f}" if "CTranslate2" in runs else ""
                )
                cells = f"{tps:.1f} | {tps / base:.2f} | {peer} | {share} | {checks[name]}"
                print(f"| {B} | {name} | {cells} |")
        long_ids = torch.randint(1, vocab, (1, PREFILL), generator=g)
        pre = measure(runs, long_ids, 1, args.repeats)
        cells = ", ".join(f"{name} {sec * 1e3:.0f} ms" for name, sec in pre.items())
        print(f"\nprefill of {PREFILL} tokens + 1 new token, B=1: {cells}")
        for run in runs.values():
            if isinstance(run, Ct2Process):
                run.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny models, 8 tokens, 1 repeat")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--new", type=int, default=64, help="new tokens per row")
    parser.add_argument("--threads", default=f"1,{os.cpu_count()}", help="comma-separated")
    parser.add_argument("--batches", default="1,8", help="comma-separated batch sizes")
    parser.add_argument("--models", default="gpt2,llama", help="gpt2 and/or llama")
    parser.add_argument(
        "--same-process", action="store_true",
        help="run CTranslate2 in this process too (both runtimes' thread pools then slow each "
        "other; by default it runs in a process of its own)",
    )  # fmt: skip
    args = parser.parse_args()
    args.threads = sorted({int(t) for t in args.threads.split(",")})
    args.batches = [int(b) for b in args.batches.split(",")]
    if args.quick:
        args.repeats, args.new = 1, 8
    print(f"torch {torch.__version__}, transformers {tr.__version__}, ", end="")
    if ctranslate2 is None:
        print("CTranslate2 not installed (pip install ctranslate2): its column is skipped")
    else:
        print(f"CTranslate2 {ctranslate2.__version__}")
    reads: dict[int, float] = {}  # the fastest read per thread count, over the models
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.models.split(","):
            bench_model(kind, args, Path(tmp), reads)


if __name__ == "__main__":
    main()
