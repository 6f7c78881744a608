"""Eager ``F.linear`` calls routed to oneDNN on CPUs where MKL multiplies slowly.

torch's CPU build multiplies float32 matrices with Intel's MKL, which on other vendors' CPUs
runs generic code (:mod:`qkv.models.cpu_products`). The prompt of a compiled decoder runs
eagerly, so its products go to MKL. oneDNN, which torch also carries, multiplies plain
row-major weights (``[N, K]`` contiguous, as ``nn.Linear`` keeps them) without packing them
first (``torch.ops.mkldnn._linear_pointwise``). Measured on a 2-core AMD EPYC (Zen 3, AVX2),
GPT-2 small's 48 layer products, ms, MKL against oneDNN, 2 threads: 20.7 / 15.8 at 1 row, 53.5
/ 39.8 at 16, 67.9 / 57.4 at 32, 106 / 92 at 64, 255 / 212 at 128, 369 / 350 at 256, 639 /
693 at 512; 1 thread: 21.6 / 22.1 at 1 row, 78.1 / 79.3 at 16, 105 / 108 at 32, 304 / 339 at
128, 1047 / 1155 at 512. oneDNN gains where MKL's generic code divides few rows among threads,
so it takes products with more than one thread. A 16-token prompt of GPT-2 small (2 threads)
took 64.0 ms against 82.1 (the 12-layer Llama-style model of ``benchmarks/decode.py``: 65.5
against 74.8), the greedy token the same, logits within 4e-6.

On a CPU with AVX-512 it takes them on one thread too: on a 2-core Zen 4 EPYC (2026-12-08, 1
thread, the compiled decoder's prompt on its row-major weights, MKL and oneDNN in turns, the
median of 6-14), GPT-2 small's 16- and 512-token prompts took 88.9 / 1069 ms through oneDNN
against 106.0 / 1176 through MKL, the Llama-style model's 66.6 / 993 against 71.8 / 1058, the
greedy token the same, logits within 3.1e-6 (GPT-2's 48 layer products alone at 512 rows:
861 ms against 1114). oneDNN runs its AVX-512 kernel there (``brg_matmul:avx512_core``),
MKL on a CPU not Intel's its generic code.

Products of more than 256 rows stayed with MKL at first, after the 512-row figure above. On
another 2-core Zen 3 EPYC (2026-12-07, night; GPT-2 small's shapes, 12 layers of distinct
weights, 2 threads, MKL and oneDNN in turns, the median of per-turn ratios) oneDNN took 0.70x
MKL's time at 16 rows, 0.67x at 64, 0.77x at 256, 0.76x at 512, 0.84x at 1024, 0.93x at 2048
and 0.87x at 4096 (``brg_matmul:avx2`` against MKL's generic ``SGEMM``), and a whole 512-token
prompt 0.86x (GPT-2 small) and 0.91x (the Llama-style model), 1000 tokens of GPT-2 small 0.83x,
the greedy token the same. So it now takes products of any row count.

:class:`OneDnnProducts` is a :class:`~torch.overrides.TorchFunctionMode` (per thread, for the
``with`` block only) that sends each ``F.linear`` it can to oneDNN and leaves every other call
alone; :func:`onednn_products_fit` says whether this CPU and build should use it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from qkv.models.cpu_products import mkl_reads_fast

__all__ = ["OneDnnProducts", "onednn_products_fit"]


def onednn_products_fit() -> bool:
    """Whether eager CPU products should go through oneDNN now: torch has oneDNN and the
    linear op, MKL does not read fast here (:func:`~qkv.models.cpu_products.mkl_reads_fast`:
    not an Intel CPU, or ``QKV_CPU_PRODUCTS=inductor``), and torch runs more than one thread
    or the CPU has AVX-512 (``torch.backends.cpu.get_cpu_capability()``; see the module
    docstring for both measurements).

    Raises:
        ValueError: ``QKV_CPU_PRODUCTS`` set to something else than ``mkl`` or ``inductor``.
    """
    if mkl_reads_fast() or not torch.backends.mkldnn.is_available():
        return False
    wide = torch.backends.cpu.get_cpu_capability() == "AVX512"
    if torch.get_num_threads() < 2 and not wide:
        return False
    return hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _plain(t: Tensor) -> bool:
    """A dense float32 CPU tensor or parameter (no other subclass) that no autograd graph
    will need a derivative through."""
    return (
        type(t) in (Tensor, nn.Parameter)
        and t.layout == torch.strided
        and t.device.type == "cpu"
        and t.dtype == torch.float32
        and not (t.requires_grad and torch.is_grad_enabled())
    )


def _fits(x: Any, w: Any, b: Any) -> bool:
    """Whether oneDNN takes ``F.linear(x, w, b)`` (and computes it as ATen would): ``x``
    ``[..., K]`` (at least 2-D) of at least one row, ``w`` a contiguous ``[N, K]``,
    ``b`` None or ``[N]``, all :func:`_plain`. Anything else (and any shape error) is left to
    ``F.linear``."""
    if not (isinstance(x, Tensor) and isinstance(w, Tensor) and _plain(x) and _plain(w)):
        return False
    if x.dim() < 2 or w.dim() != 2 or not w.is_contiguous() or x.shape[-1] != w.shape[1]:
        return False
    if x.numel() == 0:  # no rows, or K = 0: ATen's
        return False
    if b is None:
        return True
    return isinstance(b, Tensor) and _plain(b) and b.shape == (w.shape[0],)


class OneDnnProducts(TorchFunctionMode):
    """Inside ``with OneDnnProducts():``, each ``F.linear(x, w, b)`` of float32 CPU tensors
    with a contiguous ``[N, K]`` weight (``nn.Linear``'s) and at least one row
    runs as oneDNN's product on the plain weight (``torch.ops.mkldnn._linear_pointwise``);
    every other call, and every product it cannot take (other dtypes, a transposed weight,
    empty inputs, tensors that autograd follows, tensor subclasses), runs unchanged. The results
    differ from MKL's by rounding only (another summation order, fused multiply-adds)."""

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        """``func(*args, **kwargs)``, through oneDNN where it is a product it can take."""
        kwargs = kwargs or {}
        if func is F.linear:
            x = args[0] if args else kwargs.get("input")
            w = args[1] if len(args) > 1 else kwargs.get("weight")
            b = args[2] if len(args) > 2 else kwargs.get("bias")
            if _fits(x, w, b):
                return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")  # [..., N]
        return func(*args, **kwargs)
