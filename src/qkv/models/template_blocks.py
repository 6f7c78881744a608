"""The register block of inductor's C++ GEMM template on AVX2 for products on few rows.

Inductor's C++ GEMM template computes ``X @ W`` in register blocks of ``Mr`` rows and ``Nr``
columns: each block runs a small kernel along all of K that keeps ``Mr * Nr / 8`` vectors of
the result in registers. For float32 on AVX2 it has three blocks, 4x24, 4x16 and 8x8, and
picks one when it compiles a product, ranked first by whether the example's row count divides
by ``Mr``: 4x24 for 8, 12 or 16 rows. With 4x24 a product on 12 rows streams each weight
panel (K x 24 floats, 36 KB for K = 384: more than the 32 KB of L1) three times, the first time
from memory at one row-block's pace; an 8x8 block streams a panel of 12 KB (it stays in L1)
that a block of up to 8 rows reads once.

Measured on a 2-core AMD EPYC (Zen 1, AVX2, 2 threads), the 24 products of all-MiniLM-L6-v2
(an AOTInductor program of them, frozen, each product timed between oneDNN's and the template
while compiling), ms at 5 / 8 / 12 / 16 / 22 rows:

* 4x24 (the template's own choice): 3.74 / 5.59 / 7.87 / 10.20 / 13.09;
* 8x8 (:func:`few_row_blocks`): 3.04 / 3.84 / 5.36 / 7.15 / 9.50;
* 12x8: 3.35 / 4.02 / 5.44 / 6.89 / 8.92;
* oneDNN on its packed weights: 4.51 / 5.45 / 6.53 / 7.91 / 9.58;
* ONNX Runtime's MatMuls (its own MLAS kernels, same chain): 2.89 / 3.70 / 4.76 / 5.93 / 7.87.

Which register block a product gets is not one of inductor's settings, so
:func:`few_row_blocks` replaces the template's table of float32 AVX2 blocks while a program
compiles. That table is inductor's private state: where it is not as this module expects (a
later torch), the context changes nothing.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch

__all__ = ["FEW_ROW_BLOCK", "few_row_blocks"]

FEW_ROW_BLOCK = (8, 8, 1)
"""Rows, columns and K-step of the only float32 AVX2 register block :func:`few_row_blocks`
leaves the template (see the module docstring for the measurements)."""

_LOCK = threading.Lock()
_STATE: dict[str, object] = {"depth": 0, "before": None}
"""How many :func:`few_row_blocks` contexts are open (in any thread), and the table's list of
blocks before the first of them replaced it."""

Table = tuple[dict[type, list[Any]], type, type, Callable[..., list[Any]]]
"""Inductor's table of micro-kernel blocks, its float32 vector kernel class (the table's key),
its ``VecAVX2`` class and its ``generate_gemm_config``."""


def _table() -> Table | None:
    """Inductor's table of micro-kernel blocks and what replacing a block needs, or ``None``
    where they are not where torch 2.13 keeps them."""
    try:
        import torch._inductor.compile_fx  # noqa: F401  (cpp_micro_gemm's imports need it first)
        from torch._inductor.codegen import cpp_micro_gemm
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


def _enter(found: Table) -> bool:
    """Replace the table's float32 AVX2 blocks (the first context to open does); whether they
    are replaced."""
    table, kernel, avx2, make = found
    with _LOCK:
        if _STATE["depth"] == 0:
            before = table[kernel]
            kept = [c for c in before if not _is_float_avx2(c, avx2)]
            if len(kept) == len(before):
                return False
            _STATE["before"] = before
            table[kernel] = kept + list(make(avx2, [FEW_ROW_BLOCK], input_dtype=torch.float))
        _STATE["depth"] = cast(int, _STATE["depth"]) + 1
        return True


def _leave(found: Table) -> None:
    """Close a context that :func:`_enter` opened (the last one restores the table)."""
    table, kernel, _, _ = found
    with _LOCK:
        _STATE["depth"] = depth = cast(int, _STATE["depth"]) - 1
        if depth == 0:
            table[kernel] = cast(list[Any], _STATE["before"])
            _STATE["before"] = None


@contextlib.contextmanager
def few_row_blocks() -> Iterator[bool]:
    """Within: inductor's C++ GEMM template multiplies float32 on AVX2 in register blocks of
    :data:`FEW_ROW_BLOCK` only (see the module docstring). The table is restored when the last
    open context ends. Other dtypes and other vector widths (AVX-512) keep their blocks. A
    product compiled within keeps its block after the context ends; one compiled outside is
    unchanged.

    The table is the process's: another thread compiling a float32 AVX2 product while a context
    is open gets the same blocks. Contexts may nest and overlap across threads.

    Yields:
        Whether the blocks are replaced (False where inductor's table is not where this module
        expects it, or has no float32 AVX2 block).
    """
    found = _table()
    entered = found is not None and _enter(found)
    try:
        yield entered
    finally:
        if entered and found is not None:
            _leave(found)
