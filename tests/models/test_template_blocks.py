"""The register block inductor's C++ GEMM template gets within ``few_row_blocks``."""

from __future__ import annotations

import sys
import threading
from typing import Any, cast

import pytest
import torch
from torch._inductor import cpu_vec_isa
from torch._inductor.utils import run_and_get_code

from qkv.models import template_blocks
from qkv.models.template_blocks import (
    FEW_ROW_BLOCK,
    SENTENCE_BLOCK,
    WIDE_BLOCK,
    few_row_blocks,
)

_found = template_blocks._table()  # imports inductor's modules in an order that works
assert _found is not None, "torch 2.13 keeps the table where template_blocks looks"
TABLE, KERNEL, AVX2, AVX512, _ = _found
cpp_micro_gemm = sys.modules["torch._inductor.codegen.cpp_micro_gemm"]
CLOSED = {"depth": 0, "before": None, "blocks": None, "kernel_text": None}
"""The module's state with no context open."""


def _float_blocks(isa: type = AVX2) -> list[tuple[int, int, int]]:
    """The register blocks of the float32 kernels of vector ISA ``isa`` in inductor's table
    now."""
    blocks = TABLE[KERNEL]
    return [c.register_blocking for c in blocks if template_blocks._is_float(c, isa)]


def test_the_table_has_one_block_within_and_is_restored() -> None:
    """Within: the float32 AVX2 blocks are FEW_ROW_BLOCK alone, every other kernel kept as it
    was; nested and overlapping contexts (another thread's) restore the table when the last
    ends, an exception included."""
    before = TABLE[KERNEL]
    others = [c for c in before if not template_blocks._is_float(c, AVX2)]
    assert (4, 24, 1) in _float_blocks()  # torch 2.13's own choice for 8, 12, 16 rows
    with few_row_blocks() as replaced:
        assert replaced
        assert _float_blocks() == [FEW_ROW_BLOCK]
        assert [c for c in TABLE[KERNEL] if c in others] == others
        with few_row_blocks() as again:
            assert again
        assert _float_blocks() == [FEW_ROW_BLOCK]  # the outer one is still open
        inside: list[list[tuple[int, int, int]]] = []
        opened, release = threading.Event(), threading.Event()

        def other() -> None:
            with few_row_blocks():
                opened.set()
                release.wait(10)
                inside.append(_float_blocks())

        thread = threading.Thread(target=other)
        thread.start()
        opened.wait(10)
    assert _float_blocks() == [FEW_ROW_BLOCK]  # the other thread's context is open
    release.set()
    thread.join(10)
    assert inside == [[FEW_ROW_BLOCK]]
    assert TABLE[KERNEL] is before
    with pytest.raises(RuntimeError, match="inside"), few_row_blocks():
        raise RuntimeError("inside")
    assert TABLE[KERNEL] is before


def test_changes_nothing_where_the_table_is_not_as_expected(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A later torch without the table (or without float32 AVX2 blocks): the context yields
    False and leaves the table alone."""
    monkeypatch.setattr(cpp_micro_gemm, "micro_gemm_configs", None)
    with few_row_blocks() as replaced:
        assert not replaced
    monkeypatch.setattr(cpp_micro_gemm, "micro_gemm_configs", {KERNEL: []})
    with few_row_blocks() as replaced:
        assert not replaced
    assert cpp_micro_gemm.micro_gemm_configs == {KERNEL: []}
    assert template_blocks._STATE == CLOSED


def test_other_blocks_and_bad_blocks() -> None:
    """Blocks of the caller's choice (the benchmark's); other blocks inside a context of the
    same thread, or a block AVX2's kernel cannot be, are clear errors that leave the table as
    it was."""
    before = TABLE[KERNEL]
    with few_row_blocks(((12, 8, 1), (4, 16, 1))):
        assert _float_blocks() == [(12, 8, 1), (4, 16, 1)]
        inside = r"inside a context of this thread.*\(12, 8, 1\)"
        with pytest.raises(RuntimeError, match=inside), few_row_blocks():
            pass
        assert _float_blocks() == [(12, 8, 1), (4, 16, 1)]
    assert TABLE[KERNEL] is before
    with few_row_blocks((SENTENCE_BLOCK,)):
        assert _float_blocks() == [SENTENCE_BLOCK]
    assert TABLE[KERNEL] is before
    for bad in [(), ((8, 12, 1),), ((0, 8, 1),), ((8, 8, 2),), ((8, 8),)]:
        with pytest.raises(ValueError, match="multiple of 8"), few_row_blocks(bad):  # type: ignore[arg-type]
            pass
    for wide in [(), ((8, 8, 1),), ((8, 24, 1),), ((0, 16, 1),)]:
        with pytest.raises(ValueError, match="multiple of 16"), few_row_blocks(wide=wide):
            pass
    assert TABLE[KERNEL] is before


def test_wide_blocks_replace_the_avx512_ones_too() -> None:
    """``wide``: the float32 AVX-512 blocks are those within, the AVX2 ones ``blocks``, every
    other kernel kept; without ``wide`` the AVX-512 blocks stay torch's; another ``wide``
    inside the same thread's context is refused; the table is restored after."""
    before = TABLE[KERNEL]
    own_wide = _float_blocks(AVX512)
    assert (8, 48, 1) in own_wide  # torch 2.13's own
    others = [
        c
        for c in before
        if not template_blocks._is_float(c, AVX2) and not template_blocks._is_float(c, AVX512)
    ]
    with few_row_blocks((SENTENCE_BLOCK,), True, (WIDE_BLOCK,)) as replaced:
        assert replaced
        assert _float_blocks(AVX512) == [WIDE_BLOCK]
        assert _float_blocks() == [SENTENCE_BLOCK]
        assert [c for c in TABLE[KERNEL] if c in others] == others
        other = few_row_blocks((SENTENCE_BLOCK,), True)
        with pytest.raises(RuntimeError, match="wide=None"), other:
            pass
    assert TABLE[KERNEL] is before
    with few_row_blocks((SENTENCE_BLOCK,)):
        assert _float_blocks(AVX512) == own_wide
    assert TABLE[KERNEL] is before and template_blocks._STATE == CLOSED


def test_another_threads_other_blocks_wait_for_the_open_context() -> None:
    """A thread asking for other blocks while another thread's context is open waits until it
    closes, then gets its own blocks; the table is restored after both."""
    before = TABLE[KERNEL]
    opened, release, waiting = threading.Event(), threading.Event(), threading.Event()
    seen: list[list[tuple[int, int, int]]] = []

    def first() -> None:
        with few_row_blocks():
            opened.set()
            release.wait(10)
            seen.append(_float_blocks())

    def second() -> None:
        opened.wait(10)
        waiting.set()
        with few_row_blocks((SENTENCE_BLOCK,)):
            seen.append(_float_blocks())

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    waiting.wait(10)
    threads[1].join(0.3)
    assert threads[1].is_alive()  # waiting for the first context
    assert seen == [] and _float_blocks() == [FEW_ROW_BLOCK]
    release.set()
    for thread in threads:
        thread.join(10)
    assert seen == [[FEW_ROW_BLOCK], [SENTENCE_BLOCK]]
    assert TABLE[KERNEL] is before
    assert template_blocks._STATE == CLOSED


def test_prefetch_adds_one_line_to_the_kernel_text_and_restores_it() -> None:
    """``prefetch``: the float32 micro-kernel's template text has the next panel's prefetch
    after its weight load within, and is restored after; another setting of ``prefetch``
    inside the same thread's context is refused like other blocks; a kernel text other than
    torch 2.13's is left alone."""
    kernel = cast(Any, KERNEL)
    text = kernel.TEMPLATE_KERNEL
    with few_row_blocks((SENTENCE_BLOCK,), prefetch=True) as replaced:
        assert replaced
        load, line = template_blocks._LOAD, template_blocks._PREFETCH
        patched = kernel.TEMPLATE_KERNEL
        assert patched == text.replace(load, load + line)
        other = few_row_blocks((SENTENCE_BLOCK,))
        with pytest.raises(RuntimeError, match="prefetch=False"), other:
            pass
    assert kernel.TEMPLATE_KERNEL is text
    with few_row_blocks((SENTENCE_BLOCK,)):
        assert kernel.TEMPLATE_KERNEL is text
    assert template_blocks._prefetching(text.replace(template_blocks._LOAD, "")) is None
    assert template_blocks._prefetching(None) is None


@pytest.mark.parametrize(
    ("block", "wide", "prefetch", "bits", "kernel", "own"),
    [
        (FEW_ROW_BLOCK, None, False, 256, "<8, 8,", "<4, 24,"),
        (SENTENCE_BLOCK, None, True, 256, "<6, 16,", "<4, 24,"),
        (SENTENCE_BLOCK, WIDE_BLOCK, True, 512, "<8, 16,", "<8, 48,"),
    ],
)
def test_a_frozen_template_product_compiled_within_runs_its_blocks(
    block: tuple[int, int, int],
    wide: tuple[int, int, int] | None,
    prefetch: bool,
    bits: int,
    kernel: str,
    own: str,
) -> None:
    """For real (AVX2 vectors, forced on a wider CPU with ``cpp.simdlen``; AVX-512 vectors
    where the CPU has them): a frozen ``Linear`` on 8 rows through the template alone, compiled
    within, runs the kernel of the block asked for where inductor ranks another (``own``)
    first, prefetches the next panel where asked (only there), and equals the eager product."""
    configs = {
        "freezing": True,
        "max_autotune_gemm": True,
        "max_autotune_gemm_backends": "CPP",
        "autotune_num_choices_displayed": 0,
        "cpp.simdlen": bits,
    }
    with torch._inductor.config.patch(configs):
        if not isinstance(cpu_vec_isa.pick_vec_isa(), AVX2 if bits == 256 else AVX512):
            pytest.skip(f"this CPU has no {bits}-bit vectors")
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 48).eval()
    x = torch.randn(8, 64)  # [8, 64]
    torch._dynamo.reset()
    blocks = few_row_blocks((block,), prefetch, None if wide is None else (wide,))
    with torch.no_grad(), torch._inductor.config.patch(configs), blocks:
        got, codes = run_and_get_code(torch.compile(layer, fullgraph=True), x)  # [8, 48]
        want = layer(x)  # [8, 48]
    code = "\n".join(codes)
    assert f"micro_gemm_kernel{kernel}" in code
    assert ("(B + (K + k) * ldb + col * VLEN)," in code) is prefetch
    assert f"micro_gemm_kernel{own}" not in code
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
