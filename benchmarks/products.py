"""Matrix products on few rows, side by side in one process: inductor's C++ GEMM template in
each register block, oneDNN, ONNX Runtime.

The products are those of all-MiniLM-L6-v2's 6 layers (24 weights, 42 MB: more than the
caches, as in a real sentence): per layer ``x @ Wqkv`` ([384, 1152]), ``x @ Wo`` ([384, 384]),
``h = x @ W1`` ([384, 1536]) and ``h @ W2`` ([1536, 384]), each with its bias. Contestants:

* ``template RxC``: an AOTInductor program of them, frozen, every product through inductor's
  C++ GEMM template alone (max-autotune with the ``CPP`` backend only), compiled within
  :func:`qkv.models.template_blocks.few_row_blocks` with that one register block (``RxC+p``:
  and its prefetch of the next weight panel); ``template (own)`` is torch's own table of
  blocks (4x24 for 8, 12 or 16 rows on AVX2);
* ``oneDNN``: the same program with freezing only (a symbolic row count: oneDNN's packed
  product);
* ``ONNX Runtime``: the same module exported to ONNX (its MatMuls on weights it prepacks).

Each program is compiled once at ``--hint`` rows with a symbolic row count, as the one-sentence
embedding program is, and checked against the eager module. Contestants take turns, each turn
after 0.15 s of untimed calls (so that another runtime's spinning threads are quiet), then 5
timed calls; a median over ``--repeats`` turns. A block ``RxC`` applies where inductor
vectorizes with AVX2, ``wRxC`` where it vectorizes with AVX-512 (elsewhere each runs torch's
own table for that CPU's vectors); ``--simdlen 256`` vectorizes the template's programs with
AVX2 on an AVX-512 CPU, so that ``RxC`` blocks can be timed there.

    python benchmarks/products.py [--rows 5,8,12,16,22] [--blocks 8x8,6x16,6x16+p] [--quick]
    python benchmarks/products.py --blocks w8x16+p,w6x32+p,own   # an AVX-512 CPU
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn

from qkv.models.template_blocks import Block, few_row_blocks

D, F = 384, 1536
SETTLE_S = 0.15
Run = Callable[[Tensor], Tensor]


class Layer(nn.Module):
    """One MiniLM layer's four products, its outputs summed (so that none is dead code)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.o = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.fc1, self.fc2 = nn.Linear(D, F), nn.Linear(F, D)

    def forward(self, x: Tensor) -> Tensor:
        a, b = self.qkv(x), self.o(x)  # [M, 3D], [M, D]
        return b + self.fc2(self.fc1(x)) + a[:, :D]  # [M, D]


class Products(nn.Module):
    """The products of ``layers`` MiniLM layers, each layer's output the next one's input."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(Layer() for _ in range(layers)))

    def forward(self, x: Tensor) -> Tensor:
        return self.layers(x)  # [M, D]

    def flops(self, rows: int) -> int:
        """Multiply-adds x 2 of all products on ``rows`` rows."""
        return 2 * rows * len(self.layers) * (3 * D * D + D * D + 2 * D * F)


def aoti(model: nn.Module, x: Tensor, configs: dict[str, object]) -> Run:
    """``model`` exported with a symbolic row count and compiled by AOTInductor."""
    rows = torch.export.Dim("M", min=2, max=512)
    with torch.no_grad():
        program = torch.export.export(model, (x,), dynamic_shapes=({0: rows},))
        with tempfile.TemporaryDirectory() as tmp:
            path = torch._inductor.aoti_compile_and_package(
                program, package_path=str(Path(tmp) / "products.pt2"), inductor_configs=configs
            )
            run = torch._inductor.aoti_load_package(path).loader.boxed_run
    return lambda t: run([t])[0]


def onnx_runtime(model: nn.Module, x: Tensor, threads: int) -> Run | None:
    """``model`` in an ONNX Runtime session (``None`` where onnxruntime is not installed)."""
    try:
        import onnxruntime as ort  # type: ignore[import-untyped]  # a dev dependency
    except ImportError:
        return None
    path = Path(tempfile.mkdtemp()) / "products.onnx"
    rows = torch.export.Dim("M", min=1, max=512)
    program = torch.onnx.export(
        model, (x,), input_names=["x"], output_names=["y"], dynamo=True,
        dynamic_shapes=({0: rows},),
    )  # fmt: skip
    assert program is not None
    program.save(str(path))
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return lambda t: torch.from_numpy(session.run(["y"], {"x": t.numpy()})[0])


def parse_block(text: str) -> Block:
    """``"8x8"`` -> ``(8, 8, 1)``."""
    rows, cols = (int(v) for v in text.split("x"))
    return (rows, cols, 1)


def block_context(text: str) -> contextlib.AbstractContextManager[bool]:
    """The :func:`few_row_blocks` context of a ``--blocks`` item: ``RxC`` an AVX2 block,
    ``wRxC`` an AVX-512 one (the AVX2 blocks then torch's own), ``+p`` with the prefetch."""
    prefetch, spec = text.endswith("+p"), text.removesuffix("+p")
    if spec.startswith("w"):
        return few_row_blocks(prefetch=prefetch, wide=(parse_block(spec[1:]),))
    return few_row_blocks((parse_block(spec),), prefetch)


def contestants(model: Products, args: argparse.Namespace) -> dict[str, Run]:
    """Every contestant, compiled (and, where ONNX Runtime is installed, exported)."""
    x = torch.randn(args.hint, D)  # [M, D]
    quiet = {"autotune_num_choices_displayed": 0, "max_autotune_report_choices_stats": False}
    template = {
        "freezing": True,
        "max_autotune_gemm": True,
        "max_autotune_gemm_backends": "CPP",
        **quiet,
    }
    if args.simdlen:
        template["cpp.simdlen"] = args.simdlen
    runs: dict[str, Run] = {}
    session = onnx_runtime(model, x, torch.get_num_threads())
    if session is not None:
        runs["ONNX Runtime"] = session
    for text in args.blocks.split(","):
        if text == "own":
            runs["template (own)"] = aoti(model, x, template)
            continue
        with block_context(text):
            runs[f"template {text}"] = aoti(model, x, template)
    runs["oneDNN"] = aoti(model, x, {"freezing": True})
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="5,8,12,16,22", help="comma-separated row counts")
    parser.add_argument(
        "--blocks", default="8x8,6x16,6x16+p,own",
        help="comma-separated register blocks RxC (AVX2, C a multiple of 8), wRxC (AVX-512, C "
        "a multiple of 16); +p: with the next panel's prefetch; 'own' for torch's table",
    )  # fmt: skip
    parser.add_argument("--hint", type=int, default=12, help="rows the programs compile at")
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument(
        "--simdlen", type=int, default=0,
        help="the template's vector bits (256: AVX2 on an AVX-512 CPU); 0: the widest",
    )  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="1 layer, 5 rows, 8x8, 2 repeats")
    args = parser.parse_args()
    layers = 6
    if args.quick:
        layers, args.rows, args.blocks, args.repeats, args.hint = 1, "5", "8x8", 2, 5
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = Products(layers).eval()
    runs = contestants(model, args)
    cap = torch.backends.cpu.get_cpu_capability()
    print(
        f"{layers} MiniLM layers of products, {args.threads} thread(s), {cap}, compiled at "
        f"{args.hint} rows, a median of {args.repeats} turns of 5 calls, torch {torch.__version__}"
    )
    names = list(runs)
    print("\n| rows | " + " | ".join(f"{n} ms (GFLOP/s)" for n in names) + " |")
    print("|---|" + "---:|" * len(names))
    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(rows, D)  # [M, D]
        with torch.no_grad():
            want = model(x)  # [M, D]
        for name, run in runs.items():
            got = run(x)
            assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), f"{name} differs at {rows}"
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(args.repeats):
            for name, run in runs.items():
                end = time.perf_counter() + SETTLE_S
                while time.perf_counter() < end:
                    run(x)
                start = time.perf_counter()
                for _ in range(5):
                    run(x)
                times[name].append((time.perf_counter() - start) / 5)
        cells = []
        for name in names:
            sec = statistics.median(times[name])
            cells.append(f"{sec * 1e3:.2f} ({model.flops(rows) / sec / 1e9:.0f})")
        print(f"| {rows} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
