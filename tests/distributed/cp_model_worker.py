"""Run under torchrun (gloo): qkv's models forward and backward on a sharded sequence.

Each rank builds the same float64 models and batches (same seed), runs the whole batch in one
process as the reference, then its shard with ``context_parallel=``; compares its logits shard
and the parameter gradients summed over the ranks (each rank holds its tokens' share) with the
reference. Writes ``rank{r}.json`` with the largest differences into the directory given.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn

import qkv
from qkv import distributed as cp


def _grads(model: nn.Module, loss: Tensor, summed: bool) -> list[Tensor]:
    model.zero_grad()
    loss.backward()
    grads = [
        p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()
    ]
    if summed:
        for g in grads:
            dist.all_reduce(g)
    return grads


def _worst(a: list[Tensor], b: list[Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def decoder_only(layout: cp.Layout, n: int) -> float:
    torch.manual_seed(0)
    cfg = qkv.DecoderOnlyConfig(
        vocab_size=40, d_model=16, num_heads=4, num_kv_heads=2, num_layers=2,
        positional="rotary", dropout=0.0, pad_id=0,
    )  # fmt: skip
    model = qkv.DecoderOnlyLM(cfg).double()
    ids = torch.randint(1, 40, (2, n))
    ids[1, :5] = 0  # left padding: positions count from the first real token
    g = torch.randn(2, n, 40, dtype=torch.float64)
    full = model(ids)
    ref = _grads(model, (full * g).sum(), summed=False)
    setting = cp.ContextParallel(layout=layout)
    local = model(cp.shard(ids, 1, layout=layout), context_parallel=setting)
    got = _grads(model, (local * cp.shard(g, 1, layout=layout)).sum(), summed=True)
    out = float((local - cp.shard(full.detach(), 1, layout=layout)).abs().max())
    return max(out, _worst(got, ref))


def encoder_decoder(layout: cp.Layout, s: int, t: int) -> float:
    torch.manual_seed(0)
    cfg = qkv.TransformerConfig(
        src_vocab_size=30, tgt_vocab_size=30, d_model=16, num_heads=4,
        num_encoder_layers=2, num_decoder_layers=2, positional="learned", dropout=0.0,
    )  # fmt: skip
    model = qkv.Transformer(cfg).double()
    src = torch.randint(3, 30, (2, s))
    src[1, s - 6 :] = cfg.pad_id
    tgt = torch.randint(3, 30, (2, t))
    tgt[:, 0] = cfg.bos_id
    tgt[0, t - 4 :] = cfg.pad_id
    g = torch.randn(2, t, 30, dtype=torch.float64)
    full = model(src, tgt)
    ref = _grads(model, (full * g).sum(), summed=False)
    setting = cp.ContextParallel(layout=layout)
    local = model(
        cp.shard(src, 1, layout=layout), cp.shard(tgt, 1, layout=layout), context_parallel=setting
    )
    got = _grads(model, (local * cp.shard(g, 1, layout=layout)).sum(), summed=True)
    out = float((local - cp.shard(full.detach(), 1, layout=layout)).abs().max())
    return max(out, _worst(got, ref))


def main() -> int:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    worst = {}
    for layout in cp.LAYOUTS:
        worst[f"{layout}/decoder_only"] = decoder_only(layout, 23)
        worst[f"{layout}/transformer"] = encoder_decoder(layout, 19, 14)
    path = Path(sys.argv[1]) / f"rank{rank}.json"
    path.write_text(json.dumps({"rank": rank, "world": world, "worst": worst}))
    dist.destroy_process_group()
    return 0 if max(worst.values()) <= 1e-9 else 1


if __name__ == "__main__":
    sys.exit(main())
