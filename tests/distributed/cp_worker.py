"""Run under torchrun (gloo): every rule x layout, context-parallel against one process.

Each rank builds the same whole tensors (same seed), runs its shard through
``context_parallel_attention`` and compares its output shard and its gradient shards with
``qkv.attention`` on the whole sequence. Writes ``rank{r}.json`` with the largest differences
into the directory given first (then the lengths); exits 1 if any exceeds the bound.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import qkv
from qkv import distributed as cp
from qkv.masks import Causal, Documents, MaskMod, Padding, SlidingWindow, StructuredMask


def prefix_lm(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Bidirectional over the first 9 positions, causal after (True = may attend)."""
    return (k <= q) | (k < 9)


def rules(n: int) -> dict[str, StructuredMask | None]:
    cut = torch.arange(n)
    docs = torch.stack([(cut >= n // 5).long() + (cut >= n - n // 4).long(), (cut >= n - 4).long()])
    is_pad = torch.zeros(2, n, dtype=torch.bool)
    is_pad[0, :3] = True  # left padding
    is_pad[1, max(n - 6, 1) :] = True
    return {
        "none": None,
        "causal": Causal(),
        "window": SlidingWindow(7),
        "padding": Padding(torch.tensor([max(n - 5, 1), 0])),  # sample 1: every key blocked
        "padding_is_pad|causal": Padding(is_pad) | Causal(),
        "documents": Documents(docs),
        "documents|causal": Documents(docs) | Causal(),
        "window|padding": SlidingWindow(4) | Padding(torch.tensor([n, max(n - 9, 0)])),
        "mask_mod": MaskMod(prefix_lm),
    }


def main() -> int:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    worst: dict[str, float] = {}
    out_dir = Path(sys.argv[1])
    for n in map(int, sys.argv[2:]):
        check(n, worst)
    (out_dir / f"rank{rank}.json").write_text(
        json.dumps({"rank": rank, "world": world, "worst": worst})
    )
    dist.destroy_process_group()
    return 0 if max(worst.values()) <= 1e-9 else 1


def cross_rules(s: int) -> dict[str, StructuredMask | None]:
    """Rules of a cross-attention grid with ``s`` keys (queries of another length)."""
    return {
        "cross/none": None,
        "cross/padding": Padding(torch.tensor([s, max(s - 7, 1)])),
        "cross/padding|causal": Padding(torch.tensor([s, max(s - 7, 1)])) | Causal(),
    }


def check(n: int, worst: dict[str, float]) -> None:
    """Every rule x layout at length ``n``; the largest difference of each into ``worst``."""
    for layout in cp.LAYOUTS:
        s = n * 2 // 3 + 1  # the key length of the cross-attention rules
        cases = [(name, rule, n) for name, rule in rules(n).items()]
        cases += [(name, rule, s) for name, rule in cross_rules(s).items()]
        for name, rule, m in cases:
            torch.manual_seed(0)
            B, H, Hkv, D = 2, 4, 2, 8
            q = torch.randn(B, H, n, D, dtype=torch.float64, requires_grad=True)
            k = torch.randn(B, Hkv, m, D, dtype=torch.float64, requires_grad=True)
            v = torch.randn(B, Hkv, m, D, dtype=torch.float64, requires_grad=True)
            g = torch.randn(B, H, n, D, dtype=torch.float64)
            ref, _ = qkv.attention(q, k, v, mask=rule)
            ref_grads = torch.autograd.grad(ref, (q, k, v), g)
            local = [cp.shard(t.detach(), 2, layout=layout).requires_grad_() for t in (q, k, v)]
            lq, lk, lv = local
            out = cp.context_parallel_attention(lq, lk, lv, mask=rule, layout=layout)
            grads = torch.autograd.grad(out, local, cp.shard(g, 2, layout=layout))
            diffs = [(out.detach() - cp.shard(ref.detach(), 2, layout=layout)).abs().max()]
            diffs += [
                (a - cp.shard(b, 2, layout=layout)).abs().max()
                for a, b in zip(grads, ref_grads, strict=True)
            ]
            if not all(torch.isfinite(x).all() for x in (out, *grads)):
                diffs.append(torch.tensor(float("inf")))
            worst[f"{n}/{layout}/{name}"] = max(float(d) for d in diffs)
            whole = cp.unshard(out.detach(), 2, layout=layout)
            worst[f"{n}/{layout}/{name}/unshard"] = float((whole - ref.detach()).abs().max())


if __name__ == "__main__":
    sys.exit(main())
