"""The register block of inductor's C++ GEMM template (AVX2, AVX-512) for products on few rows.

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

On AVX-512 (torch's own float32 blocks 8x48, 8x32 and 16x16) the embedding programs and the
B > 1 step both compile in 8x16 blocks (:data:`WIDE_BLOCK`, measured on a Zen 4 EPYC).

Which register block a product gets is not one of inductor's settings, so
:func:`few_row_blocks` replaces the template's table of float32 AVX2 (and AVX-512) blocks
while a program compiles. That table is inductor's private state: where it is not as this
module expects (a later torch), the context changes nothing.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch

__all__ = ["FEW_ROW_BLOCK", "SENTENCE_BLOCK", "WIDE_BLOCK", "Block", "few_row_blocks"]

FEW_ROW_BLOCK = (8, 8, 1)
"""Rows, columns and K-step of the only float32 AVX2 register block :func:`few_row_blocks`
leaves the template by default: the frozen B > 1 decoding step's (see the module docstring for
the measurements)."""

SENTENCE_BLOCK = (6, 16, 1)
"""The block of the one-sentence embedding programs (:mod:`qkv.apps.embed_one`): six rows of
two vectors, twelve accumulators, the register block of BLIS's AVX2 float32 kernel. On a 2-core
Zen 3 EPYC it beat 8x8 at every row count from 5 to 32 but 8 (see the module docstring)."""

WIDE_BLOCK = (8, 16, 1)
"""The AVX-512 block of the one-sentence embedding programs and the frozen B > 1 decoding step:
eight rows of one 16-float vector. On a 2-core Zen 4 EPYC, all-MiniLM-L6-v2's 24 products
with the prefetch (one process, in turns, compiled at 16 rows), ms at 5 / 12 / 22 / 32 rows:
8x16 0.92 / 1.59 / 2.73 / 3.60, 6x32 1.06 / 1.82 / 3.29 / 4.01, 8x32 1.10 / 3.73 / 5.56 /
9.07, AVX2's 6x16 (the program on AVX2 vectors) 1.16 / 1.94 / 3.35 / 4.13, ONNX Runtime 1.70 /
2.47 / 3.28 / 4.43. 64 tokens at B=8, 2 threads, a process each, against the step on AVX2
vectors in 8x8 blocks: GPT-2 small 365.7 against 310.5 tokens/s, the Llama-style model of
``benchmarks/decode.py`` 478.2 against 405.7."""

_LOAD = "            vb[col] = Vectorized::loadu(B + k * ldb + col * VLEN);\n"
"""The line of inductor's float32 vector micro-kernel (``CppMicroGemmFP32Vec.TEMPLATE_KERNEL``)
that loads a vector of the weight panel at step ``k`` (full panels, float32 weights)."""

_PREFETCH = (
    "            if constexpr ((col * VLEN) % 16 == 0) {\n"
    "                _mm_prefetch(reinterpret_cast<const char*>(B + (K + k) * ldb + col * VLEN),\n"
    "                             _MM_HINT_T1);\n"
    "            }\n"
)
"""What :func:`few_row_blocks` adds after :data:`_LOAD` with ``prefetch``: at each step ``k``,
the cache lines (16 floats each) of the same row of the panel that follows this one, into L2
(one line for an AVX2 block of 8 or 16 columns or an AVX-512 block of 16). On a Zen 4 EPYC a
prefetch into L1 (``_MM_HINT_T0``) or of the panel after next was slower: the 24 products at
5 / 12 / 22 rows took 1.48 / 2.17 / 3.55 and 1.03 / 2.08 / 3.52 ms against 1.02 / 1.87 / 3.42
(6x16, one process)."""

_FREE = threading.Condition()
_STATE: dict[str, object] = {"depth": 0, "before": None, "blocks": None, "kernel_text": None}
"""How many :func:`few_row_blocks` contexts are open (in any thread), the table's list of
blocks before the first of them replaced it, the blocks (and whether they prefetch) they put
there, and the micro-kernel's template text before a prefetching context replaced it."""

_OWN = threading.local()
"""``depth``: how many of the open contexts are this thread's."""

Block = tuple[int, int, int]
"""A register block: rows, columns (a multiple of the vector's floats: 8 on AVX2, 16 on AVX-512)
and K-step."""

Table = tuple[dict[type, list[Any]], type, type, type, Callable[..., list[Any]]]
"""Inductor's table of micro-kernel blocks, its float32 vector kernel class (the table's key),
its ``VecAVX2`` and ``VecAVX512`` classes and its ``generate_gemm_config``."""

Setting = tuple[tuple[Block, ...], tuple[Block, ...] | None, bool]
"""What a context puts in the table: AVX2 blocks, AVX-512 blocks (``None``: torch's own),
whether the kernel prefetches."""


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
    avx512 = getattr(cpp_micro_gemm, "VecAVX512", None)
    make = getattr(cpp_micro_gemm, "generate_gemm_config", None)
    if not isinstance(table, dict) or kernel not in table or None in (avx2, avx512, make):
        return None
    return cast(Table, (table, kernel, avx2, avx512, make))


def _is_float(config: object, isa: type) -> bool:
    """Whether ``config`` is a float32-in, float32-out block of the vector ISA class ``isa``
    (one ``few_row_blocks`` may replace)."""
    dtypes = [getattr(config, f, None) for f in ("input_dtype", "input2_dtype", "output_dtype")]
    return getattr(config, "vec_isa_cls", None) is isa and dtypes == [torch.float] * 3


def _prefetching(text: object) -> str | None:
    """The micro-kernel template ``text`` with :data:`_PREFETCH` after its weight load, or
    ``None`` where the text is not as torch 2.13 writes it (then nothing is prefetched)."""
    if not isinstance(text, str) or text.count(_LOAD) != 1 or "_mm_prefetch" not in text:
        return None
    return text.replace(_LOAD, _LOAD + _PREFETCH)


def _replaced(found: Table, setting: Setting) -> list[Any] | None:
    """The table's float32 kernel list with the blocks of ``setting``, or ``None`` where the
    table has no float32 AVX2 block to replace."""
    table, kernel, avx2, avx512, make = found
    blocks, wide, _ = setting
    before = table[kernel]
    kept = [c for c in before if not _is_float(c, avx2)]
    if len(kept) == len(before):
        return None
    if wide is not None:
        kept = [c for c in kept if not _is_float(c, avx512)]
        kept += make(avx512, list(wide), input_dtype=torch.float)
    return kept + list(make(avx2, list(blocks), input_dtype=torch.float))


def _enter(found: Table, setting: Setting) -> bool:
    """Put ``setting`` in the table (the first context to open does; one asking for another
    setting than the open contexts' waits until they have closed); whether it is there.

    Raises:
        RuntimeError: another ``setting`` than that of a context this thread holds open
            (waiting for it would never end).
    """
    table, kernel = found[0], found[1]
    own = getattr(_OWN, "depth", 0)
    with _FREE:
        if _STATE["depth"] and _STATE["blocks"] != setting and own:
            blocks, wide, prefetch = setting
            raise RuntimeError(
                f"few_row_blocks({list(blocks)}, prefetch={prefetch}, wide={wide}) inside a "
                f"context of this thread with {_STATE['blocks']}: the table holds one set of "
                "blocks at a time"
            )
        _FREE.wait_for(lambda: _STATE["depth"] == 0 or _STATE["blocks"] == setting)
        if _STATE["depth"] == 0:
            replaced = _replaced(found, setting)
            if replaced is None:
                return False
            _STATE["before"], _STATE["blocks"] = table[kernel], setting
            table[kernel] = replaced
            text = getattr(kernel, "TEMPLATE_KERNEL", None)
            patched = _prefetching(text) if setting[2] else None
            if patched is not None:
                _STATE["kernel_text"] = text
                cast(Any, kernel).TEMPLATE_KERNEL = patched
        _STATE["depth"] = cast(int, _STATE["depth"]) + 1
        _OWN.depth = own + 1
        return True


def _leave(found: Table) -> None:
    """Close a context that :func:`_enter` opened (the last one restores the table)."""
    table, kernel = found[0], found[1]
    with _FREE:
        _STATE["depth"] = depth = cast(int, _STATE["depth"]) - 1
        _OWN.depth -= 1
        if depth == 0:
            table[kernel] = cast(list[Any], _STATE["before"])
            if _STATE["kernel_text"] is not None:
                cast(Any, kernel).TEMPLATE_KERNEL = _STATE["kernel_text"]
            _STATE["before"] = _STATE["blocks"] = _STATE["kernel_text"] = None
            _FREE.notify_all()


def _bad(blocks: tuple[Block, ...], floats: int) -> list[Block]:
    """The blocks of ``blocks`` that are not ``(rows >= 1, floats * n, 1)``."""
    return [
        b for b in blocks if len(b) != 3 or b[0] < 1 or b[1] < floats or b[1] % floats or b[2] != 1
    ]


@contextlib.contextmanager
def few_row_blocks(
    blocks: tuple[Block, ...] = (FEW_ROW_BLOCK,),
    prefetch: bool = False,
    wide: tuple[Block, ...] | None = None,
) -> Iterator[bool]:
    """Within: inductor's C++ GEMM template multiplies float32 on AVX2 in register blocks of
    :data:`FEW_ROW_BLOCK` only (see the module docstring), or of ``blocks`` (inductor ranks
    them when it compiles a product; ``benchmarks/products.py`` compares them), and on AVX-512
    in blocks of ``wide`` where given (:data:`WIDE_BLOCK`; ``None`` keeps torch's own).
    The table is restored when the last open context ends. Other dtypes keep their blocks. A
    product compiled within keeps its block after the context ends; one compiled outside is
    unchanged.

    With ``prefetch``, the float32 micro-kernel also prefetches into L2, a cache line at each
    step along K, the weight panel that follows the one it multiplies (``B + K * ldb``: the
    next ``Nr`` columns where the template's K block is the whole of K; any other address is
    only a wasted prefetch, never a wrong result). The next panel then streams from memory
    while this one is multiplied, where without it the first row block of each panel waits for
    memory and the others compute with the memory idle.

    The table is the process's: another thread compiling a float32 product while a context is
    open gets the same blocks. Contexts with the same setting may nest and overlap across
    threads; a context asking for another setting waits until every open one (another
    thread's) has closed.

    Args:
        blocks: AVX2 register blocks ``(rows, columns, 1)``, columns a positive multiple of 8.
        prefetch: prefetch the next weight panel (where the kernel's text is as torch 2.13
            writes it; otherwise the blocks alone are replaced).
        wide: AVX-512 register blocks, columns a positive multiple of 16; ``None``: torch's.

    Yields:
        Whether the blocks are replaced (False where inductor's table is not where this module
        expects it, or has no float32 AVX2 block).

    Raises:
        ValueError: no blocks, or a block that is not ``(rows >= 1, 8 * n, 1)`` (``wide``:
            ``16 * n``).
        RuntimeError: other ``blocks``, ``prefetch`` or ``wide`` than those of a context this
            thread holds open.
    """
    if not blocks or wide == () or _bad(blocks, 8) or _bad(wide or (), 16):
        raise ValueError(
            "blocks must be (rows >= 1, columns a multiple of 8, 1) tuples and wide ones "
            f"(rows >= 1, columns a multiple of 16, 1), got {list(blocks)} and wide={wide}"
        )
    found = _table()
    setting = (tuple(blocks), None if wide is None else tuple(wide), prefetch)
    entered = found is not None and _enter(found, setting)
    try:
        yield entered
    finally:
        if entered and found is not None:
            _leave(found)
