"""Encoder throughput: qkv's BertEncoder against Hugging Face ``BertModel``, in one run.

Both run the same all-MiniLM-L6-v2 weights on the same tokenized, padded batch; timings are
interleaved block by block (each contestant: 0.1 s of untimed calls, then ``--block`` timed
calls in a row; then the next one) so load on the machine hits all alike without timing the
hand-over between ONNX Runtime's and torch's thread pools, and the median of all timed calls
is reported, with each one's ratio to the best peer (the faster
``BertModel``). Tokenizing and pooling are not timed: only the encoder. ``qkv (auto, unpad)`` is
what ``qkv embed`` runs: the layers on the real tokens only (``BertEncoder(..., unpad=True)``).
``ONNX Runtime`` runs the same ``BertModel`` exported with ``torch.onnx.export(dynamo=True)``
(dynamic batch and length; its output checked against ``BertModel``'s within 1e-4 on the real
tokens) in an ``InferenceSession`` with all graph optimizations and the same thread count;
``--no-onnx`` leaves it out. ``qkv (compiled)`` is what ``qkv embed --compile`` runs
(:class:`~qkv.apps.embed_compiled.CompiledEmbedder`: one ``torch.compile`` graph from the packed
real tokens to the pooled unit embeddings, so it also pools and normalizes, which the others
do not); its compile time is printed once, and its embeddings are checked against the eager
path's within 1e-5. ``--no-compile`` leaves it out. ``--products mkl inductor`` runs one
``qkv (compiled)`` contestant per setting of ``QKV_CPU_PRODUCTS``
(:data:`~qkv.models.cpu_products.ENV`, read when its one-sentence program compiles): at batch 1
the program on MKL with the weights as inputs (``mkl``, the default on Intel CPUs) against the
frozen one whose products are timed against inductor's C++ GEMM template (``inductor``, the
default elsewhere), side by side; ``default`` is this CPU's own choice.

    python benchmarks/embed.py --batch 1 32 128 --repeats 15 --threads 2
    python benchmarks/embed.py --quick   # qkv auto (padded, unpadded, compiled), BertModel sdpa
    python benchmarks/embed.py --quick --batch 1 --words 3 10 20   # one sentence, 5 to 22 tokens
    python benchmarks/embed.py --quick --batch 1 --words 3 10 20 --products mkl inductor
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local files only

import torch
import transformers

from qkv.apps.embed import SentenceEmbedder, default_model_dir
from qkv.apps.embed_compiled import CompiledEmbedder
from qkv.apps.pooling import l2_normalize, mean_pool
from qkv.convert import load_bert
from qkv.functional import BACKENDS
from qkv.models.bert import BertEncoder
from qkv.models.cpu_products import ENV

TEXT = (
    "the quick brown fox jumps over a lazy dog while attention weights sum to one and "
    "every padded key is blocked before the softmax so that nothing leaks"
)


def sentences(n: int, words: int | None = None) -> list[str]:
    """``n`` sentences of 3 to ~30 words (``words`` each where given: the first words of
    :data:`TEXT`, cycled), deterministic."""
    vocab = TEXT.split(" ")
    if words is not None:
        return [" ".join(vocab[(i + j) % len(vocab)] for j in range(words)) for i in range(n)]
    return [" ".join(vocab[(i * 7) % 11 : (i * 7) % 11 + 3 + (i * 5) % 24]) for i in range(n)]


SETTLE_S = 0.1
"""Seconds of untimed calls before a contestant's timed ones (see :func:`bench`)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[32])
    parser.add_argument("--repeats", type=int, default=15, help="blocks per contestant")
    parser.add_argument(
        "--block", type=int, default=3, help=f"timed calls per block (after {SETTLE_S} s untimed)"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--words",
        type=int,
        nargs="+",
        default=[None],
        help="words in every sentence, one run each (default: 3 to ~30, varied)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="only qkv auto (padded and unpadded) and BertModel sdpa, 7 repeats unless given",
    )
    parser.add_argument("--no-onnx", action="store_true", help="leave ONNX Runtime out")
    parser.add_argument("--no-compile", action="store_true", help="leave qkv (compiled) out")
    parser.add_argument(
        "--products",
        nargs="+",
        choices=PRODUCTS,
        default=["default"],
        help=f"one qkv (compiled) contestant per {ENV} setting (default: this CPU's choice)",
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
    session = None if args.no_onnx else onnx_session(embedder, refs["sdpa"], args.threads)
    compiled = {}
    for products in [] if args.no_compile else dict.fromkeys(args.products):
        name = "qkv (compiled)" if products == "default" else f"qkv (compiled, {products})"
        with cpu_products(products):  # read while its programs compile, on the first calls
            compiled[name] = compiled_embedder(
                models["auto"], embedder, args.batch, args.words, name
            )
    for words in args.words:
        for batch in args.batch:
            bench(
                embedder, models, refs, batch, repeats, args.threads, args.quick, session,
                compiled, args.block, words,
            )  # fmt: skip


PRODUCTS = ("default", "mkl", "inductor")
"""The ``--products`` settings: this CPU's own choice, or a value of ``QKV_CPU_PRODUCTS``."""


@contextlib.contextmanager
def cpu_products(setting: str) -> Iterator[None]:
    """``QKV_CPU_PRODUCTS`` (:data:`~qkv.models.cpu_products.ENV`) set to ``setting`` within
    the block (unset for ``"default"``), as it was after.

    Raises:
        ValueError: ``setting`` not one of :data:`PRODUCTS`.
    """
    if setting not in PRODUCTS:
        raise ValueError(f"products must be one of {PRODUCTS}, got {setting!r}")
    before = os.environ.pop(ENV, None)
    if setting != "default":
        os.environ[ENV] = setting
    try:
        yield
    finally:
        os.environ.pop(ENV, None)
        if before is not None:
            os.environ[ENV] = before


def compiled_embedder(
    model: BertEncoder,
    embedder: SentenceEmbedder,
    batches: list[int],
    lengths: list[int | None] | None = None,
    name: str = "qkv (compiled)",
) -> CompiledEmbedder:
    """``model`` compiled for every batch size and sentence length of the run, its compile
    time printed under ``name``.

    Raises:
        AssertionError: its embeddings are not the eager unpadded path's within 1e-5.
    """
    compiled = CompiledEmbedder(model)
    for words in lengths or [None]:
        for batch in batches:
            ids, mask, types = embedder.tokenize(sentences(batch, words))
            with torch.no_grad():
                got = compiled(ids, mask, types)  # [B, D]
                want = l2_normalize(mean_pool(model(ids, mask, types, unpad=True), mask))
            diff = float((got - want).abs().max())
            assert diff <= 1e-5, f"compiled embeddings differ by {diff:.2g} at {batch=} {words=}"
    print(
        f"{name}: {compiled.graphs} graph(s) compiled in {compiled.compile_seconds:.1f} s "
        f"(batches {batches}), embeddings within 1e-5 of the eager path"
    )
    return compiled


def onnx_session(
    embedder: SentenceEmbedder, ref: transformers.BertModel, threads: int
) -> Callable[[dict[str, object]], object]:
    """``ref`` exported to ONNX (dynamic batch and length) in an ONNX Runtime session.

    Returns:
        ``run(feeds)``, the session's ``run`` for its outputs.

    Raises:
        AssertionError: its output is not ``ref``'s within 1e-4 on the real tokens.
    """
    import onnxruntime as ort  # a dev dependency; only this contestant needs it

    ids, mask, types = embedder.tokenize(sentences(4))
    B, L = torch.export.Dim("B", min=1, max=4096), torch.export.Dim("L", min=2, max=512)
    path = Path(tempfile.mkdtemp()) / "bert.onnx"
    program = torch.onnx.export(
        ref, (ids, mask, types), input_names=["input_ids", "attention_mask", "token_type_ids"],
        output_names=["last_hidden_state"], dynamo=True,
        dynamic_shapes=({0: B, 1: L}, {0: B, 1: L}, {0: B, 1: L}),
    )  # fmt: skip
    assert program is not None
    program.save(str(path))
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    feeds = {
        "input_ids": ids.numpy(),
        "attention_mask": mask.numpy(),
        "token_type_ids": types.numpy(),
    }
    got = torch.from_numpy(session.run(["last_hidden_state"], feeds)[0])
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask, token_type_ids=types).last_hidden_state
    real = mask.bool()
    assert torch.allclose(got[real], want[real], atol=1e-4), "ONNX Runtime differs from BertModel"
    return lambda f: session.run(["last_hidden_state"], f)


def bench(
    embedder: SentenceEmbedder,
    models: dict[str, BertEncoder],
    refs: dict[str, transformers.BertModel],
    batch: int,
    repeats: int,
    threads: int,
    quick: bool,
    session: Callable[[dict[str, object]], object] | None = None,
    compiled: dict[str, CompiledEmbedder] | None = None,
    block: int = 3,
    words: int | None = None,
) -> None:
    """Time every contestant on one batch of ``batch`` sentences and print the table.

    Contestants take turns block by block: each block is untimed calls for
    :data:`SETTLE_S` (one at least), then ``block`` timed calls in a row. Timing single calls
    in turn measured mostly the hand-over: ONNX Runtime's and torch's thread pools spin for a
    while after a call, and on 2 cores the next runtime's calls wait for them (batch 1 here:
    torch's first five calls after ONNX Runtime took 3.4x, 3.0x, 2.2x, 1.7x, 1.2x their time,
    ONNX Runtime's first after torch 5x).
    """
    ids, attention_mask, type_ids = embedder.tokenize(sentences(batch, words))
    print(
        f"all-MiniLM-L6-v2, batch {batch}, padded length {ids.shape[1]}, "
        f"{int(attention_mask.sum())} real tokens, {threads} thread(s), "
        f"median of {repeats} blocks of {block}, torch {torch.__version__}, transformers "
        f"{transformers.__version__}"
    )
    runs: dict[str, Callable[[], object]] = {}
    auto = models["auto"]
    runs["qkv (auto, unpad)"] = lambda: auto(ids, attention_mask, type_ids, unpad=True)
    for name, program in (compiled or {}).items():
        runs[name] = functools.partial(program, ids, attention_mask, type_ids)
    for backend, model in models.items():
        if not quick or backend == "auto":
            runs[f"qkv ({backend})"] = functools.partial(model, ids, attention_mask, type_ids)
    for impl, ref in refs.items():
        runs[f"BertModel ({impl})"] = functools.partial(
            ref, input_ids=ids, attention_mask=attention_mask, token_type_ids=type_ids
        )

    if session is not None:
        feeds = {"input_ids": ids.numpy(), "attention_mask": attention_mask.numpy()}
        feeds["token_type_ids"] = type_ids.numpy()
        runs["ONNX Runtime (BertModel)"] = functools.partial(session, feeds)

    times: dict[str, list[float]] = {name: [] for name in runs}
    with torch.no_grad():  # not inference_mode: attention plans read a mask's version counter
        for _ in range(repeats):
            for name, fn in runs.items():
                settle = time.perf_counter() + SETTLE_S
                fn()  # untimed until the other runtime's threads, still spinning, let go
                while time.perf_counter() < settle:
                    fn()
                for _ in range(block):
                    start = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - start)

    peers = [n for n in times if n.startswith(("BertModel", "ONNX"))]
    peer = min(peers, key=lambda n: _median(times[n]))
    base, sdpa = _median(times[peer]), _median(times["BertModel (sdpa)"])
    width = max(len(name) for name in runs)
    for name, ts in times.items():
        med = _median(ts)
        print(
            f"{name:<{width}}  {med * 1e3:8.2f} ms  {batch / med:8.1f} sentences/s  "
            f"{sdpa / med:5.2f}x BertModel (sdpa)  {base / med:5.2f}x {peer}"
        )


def _median(ts: list[float]) -> float:
    return statistics.median(ts)


if __name__ == "__main__":
    main()
