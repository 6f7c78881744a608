"""Copies of a model's weights laid out for decoding few rows on the CPU.

A decoding step reads every weight once; how it lies in memory decides how fast the product
reads it. :func:`huge_page_copies` copies tensors column-major (MKL's matrix-vector product
reads those fastest) or row-major (inductor's own reductions, see
:mod:`qkv.models.cpu_products`) into one memory map on transparent huge pages;
:func:`linear_weights` copies every ``nn.Linear`` weight of a model, :func:`fused_qkv_weights`
packs each self-attention's query, key and value projections into one matrix.
:mod:`qkv.models.static_decode` keeps the copies per model and fingerprint.
"""

from __future__ import annotations

import contextlib
import mmap

import torch
from torch import Tensor, nn

from qkv.nn.multihead import MultiHeadAttention

__all__ = [
    "HUGE_PAGE",
    "column_major_copies",
    "fused_qkv_weights",
    "huge_page_copies",
    "linear_weights",
]

HUGE_PAGE = 2 << 20
"""The size of a transparent huge page on x86-64 and arm64 Linux (bytes)."""


def column_major_copies(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """:func:`huge_page_copies` with every matrix column-major."""
    return huge_page_copies(tensors, column_major=True)


def huge_page_copies(tensors: dict[str, Tensor], *, column_major: bool) -> dict[str, Tensor]:
    """``tensors`` copied once each: a matrix ``[N, K]`` column-major (``column_major``: stored
    as a contiguous ``[K, N]``, strides ``(1, N)``) or row-major (contiguous), a vector
    contiguous. On the CPU (Linux) all of them lie in one anonymous memory map that asks for
    transparent huge pages (``madvise(MADV_HUGEPAGE)``; Linux's default THP mode honours it,
    torch's allocator does not ask unless ``THP_MEM_ALLOC_ENABLE=1``); elsewhere each is a
    tensor of its own.

    Reading hundreds of MB per token through 4 KB pages pays a TLB miss every 4 KB; on 2 MB
    pages B=1 decoding of GPT-2 small ran 1.5-11% faster here (median 3%, five interleaved
    pairs of processes, 1 thread).

    Raises:
        ValueError: a tensor that is neither a vector nor a matrix.
    """
    for name, t in tensors.items():
        if t.dim() not in (1, 2):
            raise ValueError(
                f"huge_page_copies: {name!r} must be a vector or a matrix, got shape "
                f"{tuple(t.shape)}"
            )

    def stored(t: Tensor) -> Tensor:  # the layout in memory: [K, N] column-major, else as is
        return t.t() if column_major else t

    on_cpu = all(t.device.type == "cpu" for t in tensors.values())
    if not tensors or not on_cpu or not hasattr(mmap, "MADV_HUGEPAGE"):
        return {name: stored(stored(t.detach()).contiguous()) for name, t in tensors.items()}
    sizes = {name: -(-t.nbytes // 64) * 64 for name, t in tensors.items()}  # 64-byte aligned
    private = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS  # shared anonymous maps are shmem: no THP
    region = mmap.mmap(-1, sum(sizes.values()) + HUGE_PAGE, flags=private)
    with contextlib.suppress(OSError):  # THP disabled by the system: plain pages, still correct
        region.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(region, dtype=torch.uint8)  # keeps the map alive
    offset = -raw.data_ptr() % HUGE_PAGE  # start on a huge-page boundary
    out: dict[str, Tensor] = {}
    for name, t in tensors.items():
        dst = (
            raw[offset : offset + t.nbytes].view(t.dtype).view(stored(t).shape)
        )  # [K, N] or [N, K]
        dst.copy_(stored(t.detach()))
        out[name] = stored(dst)  # [N, K], strides (1, N) or (K, 1)
        offset += sizes[name]
    return out


def linear_weights(
    model: nn.Module, skip: frozenset[str] = frozenset(), *, column_major: bool = True
) -> dict[str, Tensor]:
    """A copy (:func:`huge_page_copies`) of every ``nn.Linear`` weight of ``model`` (a tied
    output head's too), by its parameter name: column-major (the same ``[N, K]`` values stored
    as a contiguous ``[K, N]``, so that ``x @ W.t()`` reads the weight as MKL's matrix-vector
    product reads it fastest) or row-major (as :class:`~qkv.models.cpu_products.
    ProductsAsReductions` reads it). Parameters named in ``skip`` are left out."""
    names = {id(p): name for name, p in model.named_parameters()}
    return huge_page_copies(
        {
            names[id(m.weight)]: m.weight  # [N, K]
            for m in model.modules()
            if isinstance(m, nn.Linear) and names[id(m.weight)] not in skip
        },
        column_major=column_major,
    )


def fused_qkv_weights(
    model: nn.Module, *, column_major: bool = True
) -> tuple[dict[str, Tensor], frozenset[str]]:
    """For each :class:`~qkv.nn.MultiHeadAttention` of ``model`` whose keys and values may come
    from its queries' input (``kdim == vdim == embed_dim``): its projections packed, as
    ``{path}.fused_qkv_weight`` (the rows of ``q_proj``, ``k_proj``, ``v_proj`` stacked,
    ``[D + 2 * Hkv * Dh, D]``, column-major or row-major: :func:`huge_page_copies`) and
    ``{path}.fused_qkv_bias`` when all three have biases (a module with biases on some of them
    only is left out).

    Returns:
        ``(tensors by attribute path, the names of the parameters they pack)``. Run the model
        with them through ``torch.func.functional_call``; its self-attention then reads them
        (cross-attention and calls whose key is not the query still read the projections).
    """
    stacked: dict[str, Tensor] = {}
    covered: set[str] = set()
    for path, m in model.named_modules():
        if not isinstance(m, MultiHeadAttention) or not m.kdim == m.vdim == m.embed_dim:
            continue
        projs = {p: getattr(m, p) for p in ("q_proj", "k_proj", "v_proj")}
        if len({lin.bias is None for lin in projs.values()}) > 1:
            continue  # biases on some projections only: nothing to stack them into
        prefix = f"{path}." if path else ""
        weights = [lin.weight.detach() for lin in projs.values()]
        stacked[f"{prefix}fused_qkv_weight"] = torch.cat(weights)  # [P, D]
        if m.q_proj.bias is not None:
            biases = [lin.bias.detach() for lin in projs.values()]
            stacked[f"{prefix}fused_qkv_bias"] = torch.cat(biases)  # [P]
        covered.update(f"{prefix}{p}.weight" for p in projs)
    return huge_page_copies(stacked, column_major=column_major), frozenset(covered)
