"""Eager ``F.linear`` through oneDNN: the products it takes match a float64 product, every
other call runs as it would without it, and compiled decoders use it for the prompt off Intel
only."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import qkv.models.onednn_products as onednn_products
import qkv.models.static_decode as static_decode
from qkv.models import DecoderOnlyConfig, DecoderOnlyLM
from qkv.models.onednn_products import OneDnnProducts

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN"
)
ONEDNN = "mkldnn._linear_pointwise.default"


class _Ops(TorchDispatchMode):
    """Records the name of each ATen op dispatched inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def _linear_inputs(shape: tuple[int, ...], bias: bool) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, 24, generator=g)  # [..., K]
    w = torch.randn(40, 24, generator=g)  # [N, K]
    b = torch.randn(40, generator=g) if bias else None  # [N]
    return x, w, b  # type: ignore[return-value]


@pytest.mark.parametrize("shape", [(5,), (2, 3), (1, 16), (256,), (1000,)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("keywords", [True, False])
def test_products_it_takes_match_a_float64_product(
    shape: tuple[int, ...], bias: bool, keywords: bool
) -> None:
    x, w, b = _linear_inputs(shape, bias)
    want = F.linear(x.double(), w.double(), None if b is None else b.double())  # [..., N]
    with OneDnnProducts(), _Ops() as ops:
        got = F.linear(input=x, weight=w, bias=b) if keywords else F.linear(x, w, b)  # [..., N]
    assert ops.names == [ONEDNN]
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def _refused() -> list[tuple[str, tuple[torch.Tensor, ...]]]:
    x, w, b = _linear_inputs((3,), True)
    return [
        ("float64", (x.double(), w.double(), b.double())),
        ("a transposed weight", (x, w.t().contiguous().t(), b)),
        ("one row as a vector", (x[0], w, b)),
        ("no rows", (x[:0], w, b)),
        ("a broadcast bias", (x, w, b[:1])),
        ("no columns", (x[:, :0], w[:, :0], b)),
    ]


@pytest.mark.parametrize("case", range(len(_refused())), ids=[n for n, _ in _refused()])
def test_products_it_cannot_take_run_unchanged(case: int) -> None:
    args = _refused()[case][1]
    want = F.linear(*args)
    with OneDnnProducts(), _Ops() as ops:
        got = F.linear(*args)
    assert ONEDNN not in ops.names
    assert torch.equal(got, want)


def test_autograd_and_errors_are_left_to_torch() -> None:
    x, w, b = _linear_inputs((3,), True)
    w.requires_grad_(True)
    with torch.enable_grad(), OneDnnProducts(), _Ops() as ops:  # (the models' tests run without)
        F.linear(x, w, b).sum().backward()
        with torch.no_grad():
            F.linear(x, w, b)  # no graph to follow: oneDNN's
    assert ops.names.count(ONEDNN) == 1
    assert w.grad is not None
    torch.testing.assert_close(w.grad, x.sum(0).expand_as(w))
    with pytest.raises(RuntimeError) as outside:
        F.linear(x, w[:, :5], b)
    with OneDnnProducts(), pytest.raises(RuntimeError) as inside:
        F.linear(x, w[:, :5], b)
    assert str(inside.value) == str(outside.value)
    with OneDnnProducts():
        assert torch.equal(torch.add(x, 1.0), x + 1.0)


@pytest.mark.parametrize("capability", ["AVX2", "AVX512"])
@pytest.mark.parametrize(("mkl", "want"), [(True, False), (False, True)])
def test_it_fits_where_mkl_does_not_read_fast(
    monkeypatch: pytest.MonkeyPatch, mkl: bool, want: bool, capability: str
) -> None:
    monkeypatch.setattr(onednn_products, "mkl_reads_fast", lambda: mkl)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert onednn_products.onednn_products_fit() is want
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # one thread: AVX-512 only
    assert onednn_products.onednn_products_fit() is (want and capability == "AVX512")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    assert onednn_products.onednn_products_fit() is False


@pytest.mark.parametrize("fit", [True, False])
@pytest.mark.parametrize("batch", [1, 2])
def test_a_compiled_decoders_prompt_goes_through_onednn_where_it_fits(
    monkeypatch: pytest.MonkeyPatch, fit: bool, batch: int
) -> None:
    """The prompt's products of a compiled CPU decoder go to oneDNN where it fits (and only
    there), with the eager model's logits and tokens."""
    compile_ = torch.compile
    monkeypatch.setattr(static_decode, "_COMPILED", {})
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, backend="eager"))
    monkeypatch.setattr(static_decode, "onednn_products_fit", lambda: fit)
    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = DecoderOnlyConfig(
        vocab_size=97, d_model=32, num_heads=4, num_layers=2, dim_feedforward=64, dropout=0.0,
        pad_id=0, max_positions=64, positional="rotary", norm="rms", activation="swiglu",
    )  # fmt: skip
    model = DecoderOnlyLM(cfg).eval()
    ids = torch.randint(1, 97, (batch, 9), generator=torch.Generator().manual_seed(1))
    decoder = static_decode.StaticDecoder(model, batch, 64, compile=True)
    with torch.no_grad():
        with _Ops() as ops:
            got = decoder.prefill(ids, None)  # [B, V]
        want = model(ids)[:, -1]  # [B, V]
    mkl = [n for n in ops.names if n.startswith(("aten.mm", "aten.addmm", "aten.linear"))]
    assert (ops.names.count(ONEDNN) > 0, mkl == []) == (fit, fit)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(
        model.generate(ids, 6, greedy=True, compile=True), model.generate(ids, 6, greedy=True)
    )
