"""The register block of inductor's C++ GEMM template on AVX2 for products on few rows.

Inductor's C++ GEMM template computes ``X @ W`` in register blocks of ``Mr`` rows and ``Nr``
columns: each block runs a small kernel along all of K that keeps ``Mr * Nr / 8`` vectors of
the result in registers. For float32 on AVX2 it has three blocks, 4x24, 4x16 and 8x8, and
picks one when it compiles a product, ranked first by whether the example's row count divides
by ``Mr`` and the columns by ``Nr``, then by the block's size: 4x24 for 8, 12 or 16 rows
where N divides by 24 (every weight of all-MiniLM-L6-v2 and of GPT-2 small but its vocabulary
head). With 4x24 a product on 12 rows streams each weight
panel (K x 24 floats, 36 KB for K = 384: more than the 32 KB of L1) three times, the first time
from memory at one row-block's pace; an 8x8 block streams a panel of 12 KB (it stays in L1)
that a block of up to 8 rows reads once.

Measured on a 2-core AMD EPYC (Zen 1, AVX2, 2 threads) by ``benchmarks/products.py``: the 24
products of all-MiniLM-L6-v2 (AOTInductor programs of them, frozen, compiled at 12 rows with a
symbolic row count, timed in turns in one process), ms at 5 / 8 / 12 / 16 / 22 rows:

* the template in 4x24 blocks (its own choice): 4.46 / 6.08 / 8.23 / 10.84 / 13.85;
* in 8x8 blocks (:func:`few_row_blocks`): 3.48 / 3.95 / 5.53 / 7.26 / 9.46;
* in 12x8 blocks: 3.50 / 4.01 / 5.24 / 7.03 / 9.15;
* oneDNN on its packed weights: 4.83 / 5.49 / 6.59 / 8.09 / 9.92;
* ONNX Runtime's MatMuls (its own MLAS kernels, the same module): 3.11 / 3.94 / 4.98 / 6.26 /
  8.05.

On a 2-core Zen 3 EPYC (AVX2, 2 threads; the same benchmark compiled at 16 rows), ms at 8 /
12 / 16 / 22 / 32 rows:

* 8x8: 3.94 / 5.02 / 6.51 / 7.94 / 10.87;
* 6x16 (:data:`SENTENCE_BLOCK`): 3.94 / 4.79 / 5.89 / 7.23 / 8.72;
* 12x8: 3.61 / 5.09 / 6.28 / 7.33 / 10.42;
* oneDNN: 5.95 / 7.47 / 9.36 / 10.50 / 13.34;
* ONNX Runtime: 3.52 / 4.50 / 5.80 / 6.75 / 8.67;

and at 5 rows (compiled at 12) 8x8 3.76, 6x16 3.33, 12x8 3.56, ONNX Runtime 3.24. So the
one-sentence embedding programs compile in 6x16 blocks: 5-, 12- and 22-token sentences took
4.04 / 6.46 / 8.75 ms against 4.62 / 6.57 / 9.31 in 8x8 blocks (``benchmarks/embed.py``, a
process each). A 6x16 block reads a panel of K x 16 floats (24 KB for K = 384, within L1).

The frozen B > 1 decoding step (:mod:`qkv.models.static_decode`) compiles within it too: on
the same machine, 64 tokens at B=8, 2 threads, GPT-2 small went from 112.1 to 132.8 tokens/s
and a 12-layer Llama-style model from 146.1 to 160.9 (a median of 7 generations, a process
each).

Which register block a product gets is not one of inductor's settings, so
:func:`few_row_blocks` replaces the template's table of float32 AVX2 blocks while a program
compiles. That table is inductor's private state: where it is not as this module expects (a
later torch), the context changes nothing.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch

__all__ = ["FEW_ROW_BLOCK", "SENTENCE_BLOCK", "Block", "few_row_blocks"]

FEW_ROW_BLOCK = (8, 8, 1)
"""Rows, columns and K-step of the only float32 AVX2 register block :func:`few_row_blocks`
leaves the template by default: the frozen B > 1 decoding step's (see the module docstring for
the measurements)."""

SENTENCE_BLOCK = (6, 16, 1)
"""The block of the one-sentence embedding programs (:mod:`qkv.apps.embed_one`): six rows of
two vectors, twelve accumulators, the register block of BLIS's AVX2 float32 kernel. On a 2-core
Zen 3 EPYC it beat 8x8 at every row count from 5 to 32 but 8 (see the module docstring)."""

_LOAD = "            vb[col] = Vectorized::loadu(B + k * ldb + col * VLEN);\n"
"""The line of inductor's float32 vector micro-kernel (``CppMicroGemmFP32Vec.TEMPLATE_KERNEL``)
that loads a vector of the weight panel at step ``k`` (full panels, float32 weights)."""

_PREFETCH = (
    "            if constexpr (col == 0) {\n"
    "                _mm_prefetch(reinterpret_cast<const char*>(B + (K + k) * ldb), _MM_HINT_T1);\n"
    "            }\n"
)
"""What :func:`few_row_blocks` adds after :data:`_LOAD` with ``prefetch``: at each step ``k``,
one cache line (``ldb`` = 16 floats) of the panel that follows this one, into L2."""

_FREE = threading.Condition()
_STATE: dict[str, object] = {"depth": 0, "before": None, "blocks": None, "kernel_text": None}
"""How many :func:`few_row_blocks` contexts are open (in any thread), the table's list of
blocks before the first of them replaced it, the blocks (and whether they prefetch) they put
there, and the micro-kernel's template text before a prefetching context replaced it."""

_OWN = threading.local()
"""``depth``: how many of the open contexts are this thread's."""

Block = tuple[int, int, int]
"""A register block: rows, columns (a multiple of 8, AVX2's float32 vector) and K-step."""

Table = tuple[dict[type, list[Any]], type, type, Callable[..., list[Any]]]
"""Inductor's table of micro-kernel blocks, its float32 vector kernel class (the table's key),
its ``VecAVX2`` class and its ``generate_gemm_config``."""


def _table() -> Table | None:
    """Inductor's table of micro-kernel blocks and what replacing a block needs, or ``None``
    where they are not where torch 2.13 keeps them."""
    try:  # loaded when first needed (inductor is slow to import); compile_fx first, or
        # cpp_micro_gemm's own imports run into a cycle
        importlib.import_module("torch._inductor.compile_fx")
        cpp_micro_gemm = importlib.import_module("torch._inductor.codegen.cpp_micro_gemm")
    except ImportError:
        return None
    table = getattr(cpp_micro_gemm, "micro_gemm_configs", None)
    kernel = getattr(cpp_micro_gemm, "CppMicroGemmFP32Vec", None)
    avx2 = getattr(cpp_micro_gemm, "VecAVX2", None)
    make = getattr(cpp_micro_gemm, "generate_gemm_config", None)
    if not isinstance(table, dict) or kernel not in table or avx2 is None or make is None:
        return None
    return cast(Table, (table, kernel, avx2, make))


def _is_float_avx2(config: object, avx2: type) -> bool:
    """Whether ``config`` is a float32-in, float32-out AVX2 block (one ``few_row_blocks``
    replaces)."""
    dtypes = [getattr(config, f, None) for f in ("input_dtype", "input2_dtype", "output_dtype")]
    return getattr(config, "vec_isa_cls", None) is avx2 and dtypes == [torch.float] * 3


def _prefetching(text: object) -> str | None:
    """The micro-kernel template ``text`` with :data:`_PREFETCH` after its weight load, or
    ``None`` where the text is not as torch 2.13 writes it (then nothing is prefetched)."""
    if not isinstance(text, str) or text.count(_LOAD) != 1 or "_mm_prefetch" not in text:
        return None
    return text.replace(_LOAD, _LOAD + _PREFETCH)


def _enter(found: Table, blocks: tuple[Block, ...], prefetch: bool) -> bool:
    """Replace the table's float32 AVX2 blocks with ``blocks`` (the first context to open
    does; one asking for other blocks than the open contexts' waits until they have closed);
    whether they are replaced.

    Raises:
        RuntimeError: other ``blocks`` than those of a context this thread holds open (waiting
            for it would never end).
    """
    table, kernel, avx2, make = found
    own = getattr(_OWN, "depth", 0)
    setting = (blocks, prefetch)
    with _FREE:
        if _STATE["depth"] and _STATE["blocks"] != setting and own:
            raise RuntimeError(
                f"few_row_blocks({list(blocks)}, prefetch={prefetch}) inside a context of this "
                f"thread with {_STATE['blocks']}: the table holds one set of blocks at a time"
            )
        _FREE.wait_for(lambda: _STATE["depth"] == 0 or _STATE["blocks"] == setting)
        if _STATE["depth"] == 0:
            before = table[kernel]
            kept = [c for c in before if not _is_float_avx2(c, avx2)]
            if len(kept) == len(before):
                return False
            _STATE["before"], _STATE["blocks"] = before, setting
            table[kernel] = kept + list(make(avx2, list(blocks), input_dtype=torch.float))
            text = getattr(kernel, "TEMPLATE_KERNEL", None)
            patched = _prefetching(text) if prefetch else None
            if patched is not None:
                _STATE["kernel_text"] = text
                cast(Any, kernel).TEMPLATE_KERNEL = patched
        _STATE["depth"] = cast(int, _STATE["depth"]) + 1
        _OWN.depth = own + 1
        return True


def _leave(found: Table) -> None:
    """Close a context that :func:`_enter` opened (the last one restores the table)."""
    table, kernel, _, _ = found
    with _FREE:
        _STATE["depth"] = depth = cast(int, _STATE["depth"]) - 1
        _OWN.depth -= 1
        if depth == 0:
            table[kernel] = cast(list[Any], _STATE["before"])
            if _STATE["kernel_text"] is not None:
                cast(Any, kernel).TEMPLATE_KERNEL = _STATE["kernel_text"]
            _STATE["before"] = _STATE["blocks"] = _STATE["kernel_text"] = None
            _FREE.notify_all()


@contextlib.contextmanager
def few_row_blocks(
    blocks: tuple[Block, ...] = (FEW_ROW_BLOCK,), prefetch: bool = False
) -> Iterator[bool]:
    """Within: inductor's C++ GEMM template multiplies float32 on AVX2 in register blocks of
    :data:`FEW_ROW_BLOCK` only (see the module docstring), or of ``blocks`` (inductor ranks
    them when it compiles a product; ``benchmarks/products.py`` compares them). The table is
    restored when the last open context ends. Other dtypes and other vector widths (AVX-512)
    keep their blocks. A product compiled within keeps its block after the context ends; one
    compiled outside is unchanged.

    With ``prefetch``, the float32 micro-kernel also prefetches into L2, a cache line at each
    step along K, the weight panel that follows the one it multiplies (``B + K * ldb``: the
    next ``Nr`` columns where the template's K block is the whole of K; any other address is
    only a wasted prefetch, never a wrong result). The next panel then streams from memory
    while this one is multiplied, where without it the first row block of each panel waits for
    memory and the others compute with the memory idle.

    The table is the process's: another thread compiling a float32 AVX2 product while a context
    is open gets the same blocks. Contexts with the same ``blocks`` may nest and overlap across
    threads; a context asking for other blocks waits until every open one (another thread's)
    has closed.

    Args:
        blocks: register blocks ``(rows, columns, 1)``, columns a positive multiple of 8.
        prefetch: prefetch the next weight panel (where the kernel's text is as torch 2.13
            writes it; otherwise the blocks alone are replaced).

    Yields:
        Whether the blocks are replaced (False where inductor's table is not where this module
        expects it, or has no float32 AVX2 block).

    Raises:
        ValueError: no blocks, or a block that is not ``(rows >= 1, 8 * n, 1)``.
        RuntimeError: other ``blocks`` or ``prefetch`` than those of a context this thread
            holds open.
    """
    bad = [b for b in blocks if len(b) != 3 or b[0] < 1 or b[1] < 8 or b[1] % 8 or b[2] != 1]
    if not blocks or bad:
        raise ValueError(
            f"blocks must be (rows >= 1, columns a multiple of 8, 1) tuples, got {list(blocks)}"
        )
    found = _table()
    entered = found is not None and _enter(found, tuple(blocks), prefetch)
    try:
        yield entered
    finally:
        if entered and found is not None:
            _leave(found)
