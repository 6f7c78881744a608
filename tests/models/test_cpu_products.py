"""The CPU product policy of compiled decoding and the one-row products pass."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch._inductor.utils import run_and_get_code
from torch.fx.experimental.proxy_tensor import make_fx

from qkv.models import cpu_products
from qkv.models.cpu_products import LeanRowProducts, ProductsAsReductions

aten = torch.ops.aten


def test_cpu_vendor_reads_proc_cpuinfo(monkeypatch: pytest.MonkeyPatch) -> None:
    read = cpu_products.cpu_vendor.__wrapped__  # the uncached function
    text = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\n"
    monkeypatch.setattr(Path, "read_text", lambda self: text)
    assert read() == "AuthenticAMD"
    monkeypatch.setattr(Path, "read_text", lambda self: "processor\t: 0\nmodel name: X\n")
    assert read() == ""  # arm64 names no vendor_id

    def missing(self: Path) -> str:
        raise FileNotFoundError(str(self))

    monkeypatch.setattr(Path, "read_text", missing)
    assert read() == ""  # not Linux


@pytest.mark.parametrize(
    ("vendor", "mkl", "want"),
    [("GenuineIntel", True, True), ("GenuineIntel", False, False), ("AuthenticAMD", True, False),
     ("", True, False)],
)  # fmt: skip
def test_mkl_only_on_intel(
    monkeypatch: pytest.MonkeyPatch, vendor: str, mkl: bool, want: bool
) -> None:
    monkeypatch.delenv(cpu_products.ENV, raising=False)
    monkeypatch.setattr(cpu_products, "cpu_vendor", lambda: vendor)
    monkeypatch.setattr(torch.backends.mkl, "is_available", lambda: mkl)
    assert cpu_products.mkl_reads_fast() is want
    monkeypatch.setenv(cpu_products.ENV, "inductor")
    assert cpu_products.mkl_reads_fast() is False
    monkeypatch.setenv(cpu_products.ENV, "mkl")
    if mkl:
        assert cpu_products.mkl_reads_fast() is True
    else:
        with pytest.raises(ValueError, match="QKV_CPU_PRODUCTS=mkl, but this torch"):
            cpu_products.mkl_reads_fast()


def test_a_bad_override_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_products.ENV, "MKL ")
    with pytest.raises(ValueError, match=r"QKV_CPU_PRODUCTS must be 'mkl' or 'inductor'.*'MKL '"):
        cpu_products.mkl_reads_fast()


def _products(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, rows3: torch.Tensor) -> tuple:
    one = torch.nn.functional.linear(x, w, b)  # [1, N]: addmm
    bare = x @ w.t()  # [1, N]: mm
    many = rows3 @ w.t()  # [3, N]: left alone
    return one, bare, many


def _rewritten(
    rows_pass: Callable[[torch.fx.Graph], None], fn: Callable[..., object], *args: torch.Tensor
) -> torch.fx.GraphModule:
    """``fn`` traced on ``args``, rewritten in place by ``rows_pass`` and recompiled."""
    gm = make_fx(fn)(*args)
    rows_pass(gm.graph)
    gm.graph.lint()
    gm.recompile()
    return gm


def _matches_float64_products(gm: torch.fx.GraphModule, args: tuple[torch.Tensor, ...]) -> None:
    """``gm`` (a rewritten :func:`_products`) gives its float64 recomputation's values."""
    got = gm(*args)
    want = _products(*(a.double() for a in args))
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        torch.testing.assert_close(g.double(), w, atol=1e-5, rtol=1e-5)


def test_pass_rewrites_one_row_products_only() -> None:
    torch.manual_seed(0)
    args = (torch.randn(1, 6), torch.randn(5, 6), torch.randn(5), torch.randn(3, 6))
    before = [n.target for n in make_fx(_products)(*args).graph.nodes]
    assert before.count(aten.addmm.default) == 1 and before.count(aten.mm.default) == 2
    gm = _rewritten(ProductsAsReductions(), _products, *args)
    after = [n.target for n in gm.graph.nodes]
    assert aten.addmm.default not in after and after.count(aten.mm.default) == 1  # 3 rows kept
    assert after.count(aten.sum.dim_IntList) == 2
    realized = [n for n in gm.graph.nodes if "force_stride_order" in str(n.target)]
    assert len(realized) == 2  # each row computed once, then read by its reduction
    assert all(n.args[1] == [6, 1] for n in realized)
    _matches_float64_products(gm, args)


def test_pass_leaves_low_precision_rows_alone() -> None:
    args = [torch.randn(1, 6), torch.randn(5, 6), torch.randn(5), torch.randn(3, 6)]
    gm = make_fx(_products)(*(a.bfloat16() for a in args))
    ProductsAsReductions()(gm.graph)
    targets = [n.target for n in gm.graph.nodes]
    assert aten.sum.dim_IntList not in targets  # bf16: MKL/oneDNN keep their accumulation


def test_inductor_with_the_pass_reads_each_weight_in_its_own_loop() -> None:
    """The real thing: inductor compiles a one-row Linear (after a LayerNorm, before a GELU)
    with the pass into its own C++ reduction (no BLAS call), with the reference's values
    (float64 recomputation)."""
    torch.manual_seed(0)
    x, w, b = torch.randn(1, 1, 48), torch.randn(40, 48), torch.randn(40)  # [1, 1, K], [N, K]

    def f(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.layer_norm(x, (48,))  # [1, 1, K]: realized, not inlined
        return torch.nn.functional.gelu(torch.nn.functional.linear(h, w, b))  # [1, 1, N]

    options = {"post_grad_custom_post_pass": ProductsAsReductions()}
    compiled = torch.compile(f, fullgraph=True, dynamic=False, options=options)
    got, (code,) = run_and_get_code(compiled, x, w, b)
    want = f(x.double(), w.double(), b.double())
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    assert "addmm" not in code and "mm(" not in code  # no BLAS product left
    assert "cpp_fused" in code


def test_row_groups() -> None:
    assert cpu_products.ROW_STREAMS == 4
    assert cpu_products._row_groups(1024) == [(0, 256), (256, 512), (512, 768), (768, 1024)]
    assert cpu_products._row_groups(259 * 4 + 3)[-2:] == [(777, 1036), (1036, 1039)]
    assert cpu_products._row_groups(255) == [(0, None)]  # under 64 rows a group: one sum
    assert cpu_products._row_groups(object()) == [(0, None)]  # a symbolic size
    assert cpu_products._row_groups(None) == [(0, None)]  # unknown


def test_inductor_reads_the_row_groups_side_by_side() -> None:
    """A weight of 4 * 64 + 3 rows: four groups of 64 summed in one fused loop (four
    accumulators, four streams of the weight), the 3 rows left apart; the values those of
    the float64 product."""
    torch.manual_seed(0)
    x, w = torch.randn(1, 48), torch.randn(4 * 64 + 3, 48)  # [1, K], [N, K]
    gm = _rewritten(ProductsAsReductions(), lambda x, w: x @ w.t(), x, w)
    assert [n.target for n in gm.graph.nodes].count(aten.sum.dim_IntList) == 5
    options = {"post_grad_custom_post_pass": ProductsAsReductions()}
    compiled = torch.compile(lambda x, w: x @ w.t(), fullgraph=True, dynamic=False, options=options)
    got, (code,) = run_and_get_code(compiled, x, w)  # [1, N]
    torch.testing.assert_close(got.double(), x.double() @ w.double().t(), atol=1e-5, rtol=1e-5)
    assert "tmp_acc3_vec = tmp_acc3_vec" in code and "tmp_acc4" not in code


def test_lean_pass_keeps_one_row_products_for_blas() -> None:
    torch.manual_seed(0)
    args = (torch.randn(1, 6), torch.randn(5, 6), torch.randn(5), torch.randn(3, 6))
    gm = _rewritten(LeanRowProducts(), _products, *args)
    after = [n.target for n in gm.graph.nodes]
    assert aten.addmm.default not in after and after.count(aten.mm.default) == 3
    assert aten.sum.dim_IntList not in after  # still BLAS products, not reductions
    realized = [n for n in gm.graph.nodes if "force_stride_order" in str(n.target)]
    assert len(realized) == 2 and all(n.args[1] == [6, 1] for n in realized)
    (add,) = [n for n in gm.graph.nodes if n.target is aten.add.Tensor]
    assert add.args[0].target is aten.mm.default  # the bias, outside the product
    _matches_float64_products(gm, args)


def test_lean_pass_rewrites_a_product_that_reads_another() -> None:
    """A one-row product fed straight by another (no op between) reads the rewritten one."""
    torch.manual_seed(0)
    x, w1, w2, b = torch.randn(1, 6), torch.randn(4, 6), torch.randn(3, 4), torch.randn(3)

    def chain(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x @ w1.t(), w2, b)  # [1, 3]

    gm = _rewritten(LeanRowProducts(), chain, x, w1, w2, b)
    want = chain(x.double(), w1.double(), w2.double(), b.double())
    torch.testing.assert_close(gm(x, w1, w2, b).double(), want, atol=1e-5, rtol=1e-5)


def test_the_two_passes_key_inductors_cache_apart() -> None:
    assert LeanRowProducts().uuid() != ProductsAsReductions().uuid()
    assert LeanRowProducts().uuid() == LeanRowProducts().uuid()


def test_inductor_with_the_lean_pass_calls_blas_without_copies() -> None:
    """The real thing: with the pass, inductor hands ATen's product a contiguous row and no
    bias (ATen then neither clones the row nor copies the bias into its output: no ``clone``,
    ``copy_`` or ``expand`` under the profiler), with the reference's values."""
    torch.manual_seed(0)
    x, w, b = torch.randn(1, 1, 48), torch.randn(40, 48), torch.randn(40)  # [1, 1, K], [N, K]

    def f(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.layer_norm(x, (48,))  # [1, 1, K]
        return torch.nn.functional.gelu(torch.nn.functional.linear(h, w, b))  # [1, 1, N]

    def aten_calls(options: dict[str, object]) -> set[str]:
        torch._dynamo.reset()
        compiled = torch.compile(f, fullgraph=True, dynamic=False, options=options)
        got = compiled(x, w, b)
        want = f(x.double(), w.double(), b.double())
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
        with torch.profiler.profile() as prof:
            compiled(x, w, b)
        return {e.key for e in prof.key_averages()}

    plain = aten_calls({"cpp_wrapper": True})
    lean = aten_calls({"cpp_wrapper": True, "post_grad_custom_post_pass": LeanRowProducts()})
    assert {"aten::clone", "aten::copy_", "aten::expand"} <= plain  # what the pass removes
    assert not {"aten::clone", "aten::copy_", "aten::expand"} & lean


@pytest.mark.parametrize(
    ("capability", "mkl", "timed"),
    [
        ("AVX2", False, True),
        ("AVX2", True, False),
        ("AVX512", False, True),
        ("AVX512", True, False),
        ("DEFAULT", False, False),
    ],
)
def test_frozen_configs(
    monkeypatch: pytest.MonkeyPatch, capability: str, mkl: bool, timed: bool
) -> None:
    """A frozen program always freezes; only one that does not multiply through MKL, on an AVX2
    or AVX-512 CPU, times oneDNN's products against inductor's C++ GEMM template."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    configs = cpu_products.frozen_configs(mkl=mkl)
    if timed:
        assert configs == {
            "freezing": True,
            "max_autotune_gemm": True,
            "max_autotune_gemm_backends": "ATEN,CPP",
            "autotune_num_choices_displayed": 0,
            "max_autotune_report_choices_stats": False,
        }
    else:
        assert configs == {"freezing": True}


def test_a_frozen_timed_product_equals_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """The settings of :func:`~qkv.models.cpu_products.frozen_configs` compile for real, timing
    included (made to apply on any CPU): one frozen ``Linear`` of 8 rows, a product oneDNN takes
    on its packed weight or inductor's C++ GEMM template, whichever timed faster here, equals
    the eager one. (The decoders' tests freeze without the timing, ~5 s a product shape.)"""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    configs = cpu_products.frozen_configs(mkl=False)
    assert configs["max_autotune_gemm"] is True
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 48).eval()
    x = torch.randn(8, 64)  # [8, 64]
    torch._dynamo.reset()
    with torch.no_grad(), torch._inductor.config.patch(configs):
        got, codes = run_and_get_code(torch.compile(layer, fullgraph=True), x)  # [8, 48]
        want = layer(x)  # [8, 48]
    code = "\n".join(codes)
    assert "_linear_pointwise" in code or "micro_gemm" in code
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
