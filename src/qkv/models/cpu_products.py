"""Which matrix products a compiled CPU decoding step runs: MKL's on Intel CPUs, others elsewhere.

Decoding reads every weight once per step and is bound by memory bandwidth. torch's CPU build
multiplies with Intel's MKL, which reads weights at about the bandwidth on Intel CPUs but not
on others. Measured on an AMD EPYC (Zen 4, 2 cores, 2 threads) with the 61 weight matrices of
the 12-layer Llama-style model of ``benchmarks/decode.py`` (400 MB), ms per step:

* one row (B = 1): MKL ``addmm`` on column-major weights 21.4 (18.7 GB/s), inductor's own
  vectorized reduction over row-major weights 13.6 (29.4 GB/s; 1 thread: 20.0 and 18.7);
* eight rows: MKL on prepacked weights 50.2, MKL unpacked 40.9, oneDNN on weights it
  prepacked 14.4.

On an Intel Xeon MKL was the fastest of these (the reduction took 1.07-1.08x its time at one
row, oneDNN 1.17-1.28x). CTranslate2 draws the same line: it multiplies with MKL on Intel CPUs
only (oneDNN elsewhere). :func:`mkl_reads_fast` says which side of it this CPU is on;
:class:`ProductsAsReductions` is the inductor pass that rewrites each one-row ``mm`` /
``addmm`` of a graph as ``sum(W * x) (+ b)``, which inductor fuses into one loop that reads
``W`` once (the weight must then be row-major, ``[N, K]`` contiguous, so that the reduction
runs along contiguous memory); :class:`LeanRowProducts` is the pass for the other side, which
keeps MKL's products and removes the copies ATen makes around each.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import os
from collections.abc import Iterator
from pathlib import Path

import torch

__all__ = [
    "ENV",
    "LeanRowProducts",
    "ProductsAsReductions",
    "cpu_vendor",
    "frozen_configs",
    "mkl_reads_fast",
]

aten = torch.ops.aten


@functools.cache
def cpu_vendor() -> str:
    """The CPU's vendor string from ``/proc/cpuinfo`` (``"GenuineIntel"``, ``"AuthenticAMD"``,
    ...), or ``""`` where the file or the field is missing (not Linux, arm64)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "vendor_id":
            return value.strip()
    return ""


ENV = "QKV_CPU_PRODUCTS"
"""The environment variable that overrides :func:`mkl_reads_fast`: ``mkl`` or ``inductor``."""


def mkl_reads_fast() -> bool:
    """Whether a compiled CPU decoding step multiplies with MKL: True on an Intel CPU with
    torch built with MKL (B = 1: column-major weights, ``addmm``; B > 1: weights prepacked for
    MKL by inductor's freezing). False elsewhere (B = 1: row-major weights,
    :class:`ProductsAsReductions`; B > 1: weights prepacked for oneDNN). The one-sentence
    embedding program (:mod:`qkv.apps.embed_one`) reads it too: False freezes its weights
    for oneDNN. The environment variable ``QKV_CPU_PRODUCTS`` (:data:`ENV`) overrides it:
    ``mkl`` (where torch has MKL) or ``inductor``; read when a step or program is compiled.

    Raises:
        ValueError: ``QKV_CPU_PRODUCTS`` set to anything else, or to ``mkl`` without MKL.
    """
    forced = os.environ.get(ENV, "")
    if forced not in ("", "mkl", "inductor"):
        raise ValueError(f"{ENV} must be 'mkl' or 'inductor' (or unset), got {forced!r}")
    if forced == "mkl" and not torch.backends.mkl.is_available():
        raise ValueError(f"{ENV}=mkl, but this torch was built without MKL")
    if forced:
        return forced == "mkl"
    return cpu_vendor() == "GenuineIntel" and torch.backends.mkl.is_available()


def frozen_configs(*, mkl: bool) -> dict[str, object]:
    """Inductor's settings for a compiled CPU program whose weights are frozen into it (the
    B > 1 decoding step, the one-sentence embedding program): freezing, which packs each
    weight for MKL (a static row count) or oneDNN (a symbolic one); and, where the program
    does not multiply through MKL (``mkl`` False: the caller's :func:`mkl_reads_fast`) on a CPU
    with AVX2 or AVX-512 (``torch.backends.cpu.get_cpu_capability()``), max-autotune of each
    matrix product between oneDNN's (``ATEN``) and inductor's own C++ GEMM template (``CPP``),
    both timed on this CPU while compiling (the callers compile within
    :func:`~qkv.models.template_blocks.few_row_blocks`, which sets the template's register
    blocks for few rows, AVX2's and AVX-512's).

    On a 2-core AMD EPYC with AVX2 only (Zen 3), 2 threads, the template was the faster for
    every shape timed: all-MiniLM-L6-v2's 24 products at 5 rows 2.3-2.5 ms against 4.3-4.9 ms
    packed for oneDNN; GPT-2 small's 49 products at 8 rows (a symbolic row count) 34.1-36.5 ms
    against 45.6-46.9 ms. On a 2-core Zen 4 EPYC (AVX-512), the same 24 products at 5 / 12 / 22
    rows (``benchmarks/products.py``, one run): oneDNN 1.78 / 2.31 / 3.13 ms, the template on
    AVX2 vectors in 6x16 blocks with the prefetch 0.95 / 1.51 / 2.92 (ONNX Runtime 1.56 / 1.98
    / 3.06). In other runs: the template's own AVX-512 blocks 1.55 / 3.38 / 6.25 (oneDNN 1.72 /
    2.45 / 3.37); 8x16 AVX-512 blocks with the prefetch 0.92 / 1.59 / 2.73 against 1.16 / 1.94
    / 3.35 in 6x16 AVX2 blocks (:data:`~qkv.models.template_blocks.WIDE_BLOCK`). The timing
    costs ~5 s of compiling per product shape (the timings are not printed).

    Args:
        mkl: the program multiplies through MKL (no timing then).
    """
    configs: dict[str, object] = {"freezing": True}
    capability = torch.backends.cpu.get_cpu_capability()
    if not mkl and capability in ("AVX2", "AVX512"):
        configs |= {"max_autotune_gemm": True, "max_autotune_gemm_backends": "ATEN,CPP"}
        # silent: inductor writes each shape's timings to stderr unless told not to
        configs |= {"autotune_num_choices_displayed": 0, "max_autotune_report_choices_stats": False}
    return configs


def _one_row_products(
    graph: torch.fx.Graph,
) -> Iterator[tuple[torch.fx.Node, torch.fx.Node | None, torch.fx.Node, torch.fx.Node]]:
    """``(node, bias, x, w)`` for each ``mm(x, w)`` and ``addmm(bias, x, w)`` (beta = alpha = 1)
    of ``graph`` whose ``x`` is one float32 or float64 row (``[1, K]``, a static 1). Each
    node's arguments are read when it is reached, so the caller may rewrite the graph (and
    erase the node) between two."""
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is aten.mm.default:
            bias, (x, w) = None, node.args
        elif node.target is aten.addmm.default and not node.kwargs:
            bias, x, w = node.args
        else:
            continue
        val = x.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.dtype not in (torch.float32, torch.float64):
            continue
        if val.dim() != 2 or not isinstance(val.shape[0], int) or val.shape[0] != 1:
            continue  # not one row (or a symbolic count of rows)
        yield node, bias, x, w


class _OneRowPass:
    """An inductor post-grad pass that replaces each one-row product of a graph
    (:func:`_one_row_products`) with :meth:`_product` of its row, realized first in a buffer of
    its own with strides ``(K, 1)`` (inductor's ``prims.inductor_force_stride_order``).

    A virtual subclass of inductor's ``CustomGraphPass`` (registered when a pass is made), which
    inductor's graph cache requires of a pass: inductor (and dynamo, ~2 s) is imported when a
    pass is made, to compile, not when this module is (``import qkv`` and the command line
    need neither)."""

    def __init__(self) -> None:
        torch._inductor.custom_graph_pass.CustomGraphPass.register(type(self))
        importlib.import_module("torch._inductor.inductor_prims")  # registers the prim below
        self._realize = torch.ops.prims.inductor_force_stride_order.default

    def _product(
        self,
        graph: torch.fx.Graph,
        row: torch.fx.Node,
        w: torch.fx.Node,
        bias: torch.fx.Node | None,
        val: object,
    ) -> torch.fx.Node:
        """The nodes computing ``row @ w (+ bias)`` (``[1, N]``), inserted where the graph
        inserts; returns the last. ``val`` is the product's ``node.meta["val"]`` (the pass
        gives it to the last node)."""
        raise NotImplementedError

    def __call__(self, graph: torch.fx.Graph) -> None:
        """Rewrite ``graph`` in place."""
        for node, bias, x, w in _one_row_products(graph):
            val, product = x.meta["val"], node.meta.get("val")
            with graph.inserting_before(node):
                row = graph.call_function(self._realize, (x, [val.shape[1], 1]))  # [1, K]
                row.meta["val"] = val
                out = self._product(graph, row, w, bias, product)  # [1, N]
            out.meta["val"] = product
            node.replace_all_uses_with(out)
            graph.erase_node(node)

    def uuid(self) -> bytes:
        """A hash of this file and the pass's name: inductor's cache keys a compiled graph by
        it (two passes of one file must not share a key)."""
        return hashlib.sha256(Path(__file__).read_bytes()).digest() + type(self).__name__.encode()


ROW_STREAMS = 4
"""How many groups of a weight's rows :class:`ProductsAsReductions` reads at once."""


def _row_groups(n: object) -> list[tuple[int, int | None]]:
    """The ``(start, stop)`` row slices of a one-row product's ``n`` weight rows that
    :class:`ProductsAsReductions` sums apart: :data:`ROW_STREAMS` equal groups, then the
    ``n % ROW_STREAMS`` rows left, if any; ``[(0, None)]`` (all rows at once) where ``n`` is
    symbolic or unknown (``None``) or under 64 rows a group.

    Inductor fuses reductions over the same ranges into one loop, so equal groups are read
    side by side: ``ROW_STREAMS`` streams of memory and as many accumulators, where one
    reduction reads one row at a time into one accumulator. Measured on a 2-core Zen 1 EPYC,
    GPT-2 small's 48 layer products (340 MB) chained through 12 layers in one graph: 18.1 GB/s
    against 12.3-12.9 on one thread, 23.5-23.8 against 20.5 on two (2 groups: 16.7 and 22.9;
    8: 15.6 and 21.1). Each output is the same sum as before, over its row in the same order.
    """
    if not isinstance(n, int) or n < 64 * ROW_STREAMS:
        return [(0, None)]
    size = n // ROW_STREAMS
    groups: list[tuple[int, int | None]] = [(g * size, (g + 1) * size) for g in range(ROW_STREAMS)]
    if n % ROW_STREAMS:
        groups.append((ROW_STREAMS * size, n))
    return groups


class ProductsAsReductions(_OneRowPass):
    """Inductor post-grad pass: ``mm(x, w)`` and ``addmm(b, x, w)`` (beta = alpha = 1) whose
    ``x`` is one float32 or float64 row, ``[1, K] @ [K, N]``, become ``sum(w.t() * x, dim=1)``
    (``[N, 1]``, plus ``b``) viewed as ``[1, N]``, summed in groups of rows read side by side
    (:func:`_row_groups`). Other products are left alone. The row is computed once into a
    buffer of its own, not inlined into the reduction, where inductor would recompute it (a
    LayerNorm, a SiLU) for each of the ``N`` rows.

    Pass it as ``torch.compile(..., options={"post_grad_custom_post_pass":
    ProductsAsReductions()})``."""

    def _product(
        self,
        graph: torch.fx.Graph,
        row: torch.fx.Node,
        w: torch.fx.Node,
        bias: torch.fx.Node | None,
        val: object,
    ) -> torch.fx.Node:
        """``sum(w.t() * row, dim=1)`` viewed as ``[1, N]`` (plus ``bias``), as the sums of
        :func:`_row_groups` concatenated."""
        wt = graph.call_function(aten.permute.default, (w, [1, 0]))  # [N, K]
        weight = w.meta.get("val")  # [K, N], where the graph carries it
        n = weight.shape[1] if isinstance(weight, torch.Tensor) else None
        sums = []
        for start, stop in _row_groups(n):
            rows = wt
            if (start, stop) != (0, None):
                rows = graph.call_function(aten.slice.Tensor, (wt, 0, start, stop))  # [n, K]
            prod = graph.call_function(aten.mul.Tensor, (rows, row))  # [n, K]
            sums.append(graph.call_function(aten.sum.dim_IntList, (prod, [1], True)))  # [n, 1]
        out = sums[0]  # [N, 1]
        if len(sums) > 1:
            out = graph.call_function(aten.cat.default, (sums, 0))  # [N, 1]
        out = graph.call_function(aten.permute.default, (out, [1, 0]))  # [1, N]
        if bias is not None:
            out = graph.call_function(aten.add.Tensor, (out, bias))  # [1, N]
        return out


class LeanRowProducts(_OneRowPass):
    """Inductor post-grad pass for one-row products left to ATen (MKL): each ``mm(x, w)`` and
    ``addmm(b, x, w)`` (beta = alpha = 1) whose ``x`` is one float32 or float64 row becomes
    ``mm(row, w) (+ b)``, where ``row`` is ``x`` in a buffer of its own with strides ``(K, 1)``.

    Both remove work ATen does around the product on every call, not in it. Inductor hands ATen
    a ``[1, K]`` view whose size-1 dimension has stride 0, which ATen's ``addmm`` does not
    accept as a BLAS matrix and clones (an allocation and a copy per product); and ATen's
    ``addmm_out`` first copies the broadcast bias into its output, where inductor adds a bias
    left outside the product inside the kernel that reads the product next. Measured on GPT-2
    small's B = 1 decoding step (49 products, an Intel Xeon, 1 thread): ~1.2 ms a step of
    ``clone``, ``copy_``, ``expand`` and allocations around the products.

    Pass it as ``torch.compile(..., options={"post_grad_custom_post_pass":
    LeanRowProducts()})``."""

    def _product(
        self,
        graph: torch.fx.Graph,
        row: torch.fx.Node,
        w: torch.fx.Node,
        bias: torch.fx.Node | None,
        val: object,
    ) -> torch.fx.Node:
        """``mm(row, w)`` (plus ``bias``, outside the product)."""
        out = graph.call_function(aten.mm.default, (row, w))  # [1, N]
        if bias is not None:
            out.meta["val"] = val
            out = graph.call_function(aten.add.Tensor, (out, bias))  # [1, N]
        return out
