"""The backend policy: every tuning constant of the backends, and the per-context opt-ins.

One frozen :class:`Policy` holds each number the planner and the kernels decide by, with the
measurement behind it and its date. Nothing else in :mod:`qkv.backends` holds a threshold.

The policy in force is per context (a :class:`contextvars.ContextVar`): each thread, and each
asyncio task, sees its own. :func:`use_policy` changes fields within a block;
:func:`allow_compile` and :func:`allow_sdpa_backward` are two such blocks. Two threads whose
blocks end out of order leave each other untouched, and nothing on once both are done. The
process-wide setters (:func:`set_compile_allowed`, :func:`set_sdpa_backward_allowed`) change
the default that a context without a block of its own sees.

While torch.compile or torch.export traces, the process default applies (see
:func:`current_policy`). Figures measured "2 threads" were taken on the project's 2-core CPU
machine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "POLICY",
    "Policy",
    "allow_compile",
    "allow_sdpa_backward",
    "compile_allowed",
    "current_policy",
    "sdpa_backward_allowed",
    "set_compile_allowed",
    "set_sdpa_backward_allowed",
    "use_policy",
]


@dataclass(frozen=True)
class Policy:
    """The numbers and opt-ins the backends decide by. Every field is read from here only.

    Attributes:
        blockwise_min_pairs: below this many query-key pairs ``T · S`` blockwise's Python tile
            loop costs more than the tiles it skips, and a structured mask goes to SDPA.
            Measured by ``benchmarks/attention.py``, 2026-12-02: blockwise lost to SDPA over
            the dense mask below L = 1024.
        blockwise_min_skip: the share of fully masked tiles from which skipping them beats
            SDPA over the dense mask. ``benchmarks/attention.py``, 2026-12-02.
        materialize_limit_bytes: a bool ``[T, S]`` mask plus SDPA's float copy (5 bytes a
            pair) above this goes to blockwise, which never builds it; a reduction whose
            masked pieces would pass it is not made. A memory cap (256 MB), 2026-12-02.
        exact_backward_max_bytes: above this, the exact CPU backward's ~4 ``[B, H, T, S]``
            tensors (scores, probabilities, their gradients) cost more memory than its
            precision is worth, and SDPA's own backward runs. A memory cap (256 MB; at
            B=1, H=8, L=16k the tensors were tens of GB), 2026-12-02.
        exact_grad_blockwise_min_pairs: from this many pairs, a CPU call that needs a gradient
            runs faster on blockwise than through fused's recomputing exact backward.
            ``benchmarks/attention.py`` fwd+bwd, 2 threads, 2026-12-03: 14.9 vs 18.8 ms at
            B=16, H=4, T=S=128; 5.4 vs 7.2 ms at B=1, H=8, T=S=256; 78 vs 201 ms at
            T=S=1024; about even at 32.
        max_calls: a reduction needing more SDPA calls than this (many tiny documents) is not
            made. A cap, 2026-12-02.
        max_length_groups: suffix padding with at most this many distinct lengths runs one
            maskless SDPA call per length, more shares one masked call. A cap, 2026-12-02.
        band_block: query rows per band call of a sliding window; each call spans
            ``band_block + window - 1`` keys at most. ``benchmarks/band.py``, 1-thread sweep,
            2026-12-03.
        band_max_share: a band reduction computing more than this share of the ``T x S``
            pairs is not made: the band stayed faster than the dense mask and blockwise up to
            about 0.5 (``benchmarks/band.py``, 2026-12-03).
        band_max_calls: a band reduction needing more SDPA calls than this is not made
            (``band_block`` rows each: ``max_calls`` would cap it at 32k queries). A cap,
            2026-12-03.
        block_q: blockwise's default tile height (query rows), narrowed to a sliding window's
            width. ``benchmarks/attention.py``, 2026-12-02.
        block_k: blockwise's default tile width (keys), likewise.
        mask_cache_bytes: at most this many bytes of partial tile masks are kept between
            planning, forward and backward. A memory cap (32 MB), 2026-12-02.
        flex_max_kernels: compiled flex kernels kept per process (torch's recompile limit,
            raised from its default 8 for qkv's calls only). Past it torch would run
            flex_attention eagerly, every score materialized (2 s a call at L=4096 in
            ``benchmarks/attention.py --compile``, 2026-12-03); qkv stops using flex instead.
        flex_block: flex_attention's block size both ways, the grain at which it skips
            blocks: flex's own default, 2026-12-03.
        block_mask_cache_size: flex block masks kept (least recently used dropped), one per
            (rule, grid, device). A cap, 2026-12-03.
        max_shared_plans: plans one :func:`~qkv.backends.shared.share_plans` block keeps (a
            forward makes a handful: self- and cross-attention, one per length). A cap,
            2026-12-04.
        allow_compile: ``auto`` may choose the compiled flex backend (:func:`allow_compile`).
            Off by default: ``auto`` never compiles by surprise.
        allow_sdpa_backward: CPU calls that need a gradient keep SDPA's own backward
            (:func:`allow_sdpa_backward`): faster, less exact. Off by default.
    """

    blockwise_min_pairs: int = 1024 * 1024
    blockwise_min_skip: float = 0.25
    materialize_limit_bytes: int = 256 * 2**20
    exact_backward_max_bytes: int = 256 * 2**20
    exact_grad_blockwise_min_pairs: int = 64 * 64
    max_calls: int = 256
    max_length_groups: int = 1024
    band_block: int = 128
    band_max_share: float = 0.5
    band_max_calls: int = 4096
    block_q: int = 256
    block_k: int = 512
    mask_cache_bytes: int = 32 * 2**20
    flex_max_kernels: int = 64
    flex_block: int = 128
    block_mask_cache_size: int = 16
    max_shared_plans: int = 16
    allow_compile: bool = False
    allow_sdpa_backward: bool = False

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type in ("bool", bool):
                if not isinstance(value, bool):
                    raise TypeError(f"{f.name} must be a bool, got {value!r}")
            elif isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError(f"{f.name} must be a number, got {value!r}")
            elif value <= 0:
                raise ValueError(f"{f.name} must be positive, got {value}")


POLICY = Policy()
"""The defaults."""

_default: list[Policy] = [POLICY]  # what a context without a block of its own sees
_current: ContextVar[Policy | None] = ContextVar("qkv_policy", default=None)


def current_policy() -> Policy:
    """The policy in force in this context (thread, task): the innermost :func:`use_policy`
    block's, else the process default.

    While ``torch.compile`` or ``torch.export`` traces, the process default: dynamo cannot read
    a ``ContextVar`` (and a compiled graph could not follow a per-context change anyway).
    """
    if torch.compiler.is_compiling():
        return _default[0]
    return _current.get() or _default[0]


@contextmanager
def use_policy(policy: Policy | None = None, /, **changes: Any) -> Iterator[Policy]:
    """Within the block, this context (only) plans and runs under ``policy`` with ``changes``.

    Args:
        policy: the base policy; default the one in force.
        **changes: fields of :class:`Policy` to change, e.g. ``band_max_share=0.3``.

    Yields:
        The policy in force inside the block.

    Raises:
        TypeError: an unknown field, or a value of the wrong type.
        ValueError: a value that is not positive.
    """
    new = dataclasses.replace(policy or current_policy(), **changes)
    token = _current.set(new)
    try:
        yield new
    finally:
        _current.reset(token)


def _check_bool(value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"allowed must be a bool, got {value!r}")
    return value


@contextmanager
def allow_compile(allowed: bool = True) -> Iterator[None]:
    """Within the block (in this thread or task only), ``backend="auto"`` may choose the
    compiled flex backend.

    The first flex call of each input signature compiles (seconds on CPU; the measured time is
    in :func:`qkv.backends.flex.compile_seconds` and in ``explain_backend``); later ones reuse
    the kernel.

    Args:
        allowed: the state inside the block (False forbids it inside an outer ``allow_compile``).

    Raises:
        TypeError: ``allowed`` is not a bool.
    """
    with use_policy(allow_compile=_check_bool(allowed)):
        yield


@contextmanager
def allow_sdpa_backward(allowed: bool = True) -> Iterator[None]:
    """Within the block (in this thread or task only), calls that need a gradient on CPU keep
    SDPA's own backward.

    By default qkv's CPU gradients are exact (within 2x a naive float32 formula's error): where
    SDPA's CPU backward would run, the call takes blockwise's exact tiled backward, or fused's
    recomputing one. SDPA's backward is faster at short lengths (fwd+bwd at L=1024 measured
    1.3-1.4x faster than through blockwise) but less exact: its dv error measured up to 15x,
    and its dq / dk error up to 4.4x, a naive float32 formula's (``benchmarks/float32_error.py``,
    300 cases, its ``sdpa-backward`` line). The choice is made when the forward runs, so the block
    must hold the forward, not only ``backward()``.

    Args:
        allowed: the state inside the block (False restores exact gradients inside an outer
            ``allow_sdpa_backward``).

    Raises:
        TypeError: ``allowed`` is not a bool.
    """
    with use_policy(allow_sdpa_backward=_check_bool(allowed)):
        yield


def set_compile_allowed(allowed: bool) -> None:
    """Let ``backend="auto"`` use the compiled flex backend, process-wide (every context
    without an :func:`allow_compile` block of its own), or stop it.

    Raises:
        TypeError: ``allowed`` is not a bool.
    """
    _default[0] = dataclasses.replace(_default[0], allow_compile=_check_bool(allowed))


def set_sdpa_backward_allowed(allowed: bool) -> None:
    """Let CPU calls that need a gradient train through SDPA's own backward, process-wide
    (every context without an :func:`allow_sdpa_backward` block of its own).

    Raises:
        TypeError: ``allowed`` is not a bool.
    """
    _default[0] = dataclasses.replace(_default[0], allow_sdpa_backward=_check_bool(allowed))


def compile_allowed() -> bool:
    """Whether ``auto`` may use the compiled flex backend here and now."""
    return current_policy().allow_compile


def sdpa_backward_allowed() -> bool:
    """Whether CPU calls may train through SDPA's own backward here and now."""
    return current_policy().allow_sdpa_backward
