"""The masks of ``benchmarks/attention.py``: for each, qkv's call (the mask as a rule, or
``is_causal``) and its peers, torch's own ways of computing that very mask, each as fast as torch
allows (SDPA unmasked, SDPA ``is_causal``, SDPA with the mask as an explicit bool tensor, SDPA on
the truncated keys, SDPA called per document, compiled ``flex_attention``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from attention_timing import sync
from qkv.backends.policy import allow_compile, allow_sdpa_backward
from qkv.functional import attention
from qkv.masks import Causal, Documents, Padding, SlidingWindow, StructuredMask, to_sdpa_bool

__all__ = ["CASES", "DH", "FLEX_PEER", "SKIPS_MORE", "Attn", "Case", "H", "flex_peer", "make_case"]

H, DH = 8, 64
CASES = (
    "none",
    "is_causal",
    "Causal()",
    "sliding window 256",
    "4 documents",
    "4 documents | Causal",
    "half padded",
    "Causal | 3/4 padded",
    "sliding window 256 | half padded",
)
"""Every mask of the table; ``--cases`` picks some."""
SKIPS_MORE = {"sliding window 256 | half padded"}
"""Cases where qkv's knowledge of the mask skips work no peer here skips: goal <= 0.8."""

Attn = Callable[[Tensor, Tensor, Tensor], Tensor]
FLEX_PEER = "flex_attention (compiled)"


@dataclass
class Case:
    """A mask at one length: qkv's mask (or ``is_causal``), the peers' calls, the useful pairs."""

    mask: StructuredMask | None
    is_causal: bool
    peers: dict[str, Attn]
    pairs: int
    allowed: MaskModFn | None = None

    def qkv(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """qkv ``auto`` on this case."""
        return attention(q, k, v, mask=self.mask, is_causal=self.is_causal)[0]

    def qkv_compiling(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """qkv ``auto`` on this case, with compilation allowed (the flex backend)."""
        with allow_compile():
            return attention(q, k, v, mask=self.mask, is_causal=self.is_causal)[0]

    def qkv_sdpa_backward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """qkv ``auto`` on this case inside :func:`~qkv.backends.policy.allow_sdpa_backward`."""
        with allow_sdpa_backward():
            return attention(q, k, v, mask=self.mask, is_causal=self.is_causal)[0]


MaskModFn = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
"""A flex ``mask_mod``: True where the query may attend the key."""


def _doc_lengths(L: int) -> list[int]:
    """Four packed documents of unequal lengths summing to ``L``."""
    parts = [L // 10, 2 * L // 10, 3 * L // 10]
    return [*parts, L - sum(parts)]


def _per_document(lengths: list[int], causal: bool) -> Attn:
    def run(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        outs, start = [], 0
        for n in lengths:
            s = slice(start, start + n)
            outs.append(
                F.scaled_dot_product_attention(q[:, :, s], k[:, :, s], v[:, :, s], is_causal=causal)
            )
            start += n
        return torch.cat(outs, dim=2)  # [B, H, T, Dh]

    return run


def _sdpa_with(allowed: Tensor | None, is_causal: bool = False) -> Attn:
    return lambda q, k, v: F.scaled_dot_product_attention(
        q, k, v, attn_mask=allowed, is_causal=is_causal
    )


def make_case(case: str, L: int, device: torch.device) -> Case:
    """qkv's call and the peers for one mask at length ``L``."""
    n_live = {"half padded": L // 2, "Causal | 3/4 padded": 3 * L // 4}.get(case, L // 2)
    lengths = torch.tensor([n_live], device=device)
    docs = _doc_lengths(L)
    ids = torch.cat([torch.full((n,), i, device=device) for i, n in enumerate(docs)])[None]
    window = SlidingWindow(256)
    rules: dict[str, StructuredMask | None] = {
        "none": None,
        "is_causal": None,
        "Causal()": Causal(),
        "sliding window 256": window,
        "4 documents": Documents(ids),
        "4 documents | Causal": Documents(ids) | Causal(),
        "half padded": Padding(lengths),
        "Causal | 3/4 padded": Causal() | Padding(lengths),
        "sliding window 256 | half padded": window | Padding(lengths),
    }
    if case not in rules:
        raise ValueError(f"unknown case {case!r}; expected one of {CASES}")
    rule = rules[case]
    allowed = _mask_mods(ids[0], n_live).get(case)
    if case == "none":
        return Case(None, False, {"SDPA": _sdpa_with(None)}, L * L)
    if case == "is_causal":
        return Case(None, True, {"SDPA is_causal": _sdpa_with(None, True)}, L * (L + 1) // 2)
    assert rule is not None
    blocked = rule.materialize(1, H, L, L, device)  # [1, 1|1, L|1, L]
    pairs = int((~blocked).sum()) * (L if blocked.shape[2] == 1 else 1)
    peers: dict[str, Attn] = {"SDPA + mask tensor": _sdpa_with(to_sdpa_bool(blocked))}
    if case == "Causal()":
        peers = {"SDPA is_causal": _sdpa_with(None, True)}
    elif case.startswith("4 documents"):
        peers["SDPA per document"] = _per_document(docs, causal=case.endswith("Causal"))
    elif case == "half padded":
        peers["SDPA on live keys"] = lambda q, k, v: F.scaled_dot_product_attention(
            q, k[:, :, :n_live], v[:, :, :n_live]
        )
    elif case == "Causal | 3/4 padded":
        peers["SDPA is_causal on live keys"] = lambda q, k, v: F.scaled_dot_product_attention(
            q, k[:, :, :n_live], v[:, :, :n_live], is_causal=True
        )
    return Case(rule, False, peers, pairs, allowed)


def _mask_mods(ids: Tensor, n_live: int) -> dict[str, MaskModFn]:
    """Each structured case as a user of ``flex_attention`` would write it (True = may attend)."""

    def causal(b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
        return q >= k

    def window(b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
        return (q >= k) & (q - k < 256)

    def docs(b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
        return ids[q] == ids[k]

    def live(b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
        return k < n_live

    def both(f: MaskModFn, g: MaskModFn) -> MaskModFn:
        return lambda b, h, q, k: f(b, h, q, k) & g(b, h, q, k)

    return {
        "Causal()": causal,
        "sliding window 256": window,
        "4 documents": docs,
        "4 documents | Causal": both(docs, causal),
        "half padded": live,
        "Causal | 3/4 padded": both(causal, live),
        "sliding window 256 | half padded": both(window, live),
    }


_FLEX: list[Callable[..., Tensor]] = []


def flex_peer(allowed: MaskModFn, L: int, device: torch.device) -> tuple[Attn, float]:
    """Compiled ``flex_attention`` with its block mask built once (outside the timing), and the
    seconds of its first (compiling) call."""
    if not _FLEX:
        # dynamic=False as in qkv's flex backend: torch 2.13's dynamic-shape CPU flex kernel
        # fails to build (undeclared cur_qSplitSize in the generated C++) at the second L.
        _FLEX.append(torch.compile(flex_attention, dynamic=False))
    block = create_block_mask(allowed, None, None, L, L, device=str(device))
    # torch refuses inputs that require grad on CPU even under no_grad: detaching is free.
    fn: Attn = lambda q, k, v: _FLEX[0](  # noqa: E731
        q.detach(), k.detach(), v.detach(), block_mask=block
    )
    x = torch.randn(1, H, L, DH, device=device)
    start = time.perf_counter()
    with torch.no_grad():
        fn(x, x, x)
    sync(device)
    return fn, time.perf_counter() - start
