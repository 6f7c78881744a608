"""qkv.Transformer against nn.Transformer, and cached decoding against recomputing the prefix.

One run prints:

1. the time ratio of a training step (forward + backward + optimizer-free) of ``qkv.Transformer``
   to the same model built on ``nn.Transformer`` (same embeddings, positions and head, the same
   weights), d_model 256, 4 heads, 3 + 3 layers, batch 16, length 128, float32, measured
   interleaved, median of repeats;
2. greedy generation of 256 tokens with the KV cache against recomputing the whole target prefix
   every step (the encoder runs once in both), with the per-token cost at several prefix lengths:
   with the cache it should stay flat, without it grow with the prefix.

Usage: ``python benchmarks/transformer.py [--threads N] [--repeats N] [--quick]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import qkv
from qkv.convert import from_torch_transformer


class TorchSeq2Seq(nn.Module):
    """``nn.Transformer`` with a qkv model's embeddings, positions and head (shared modules)."""

    def __init__(self, model: qkv.Transformer, body: nn.Transformer) -> None:
        super().__init__()
        self.model = model
        self.body = body

    def forward(self, src: Tensor, tgt: Tensor) -> Tensor:
        m = self.model
        assert m.positional is not None
        s = m.positional(m.src_embed(src) * m.embed_scale)  # [B, S, D]
        t = m.positional(m.tgt_embed(tgt) * m.embed_scale)  # [B, T, D]
        T = tgt.shape[1]
        causal = torch.ones(T, T, dtype=torch.bool).triu(1)  # [T, T] True = not allowed
        return m.lm_head(self.body(s, t, tgt_mask=causal, tgt_is_causal=True))  # [B, T, V]


def _median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def _time(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def training_ratio(repeats: int, B: int, L: int, V: int) -> tuple[float, float]:
    """Median training-step times (qkv, torch) in milliseconds, measured alternately."""
    torch.manual_seed(0)
    body = nn.Transformer(256, 4, 3, 3, 1024, dropout=0.1, batch_first=True)
    cfg = qkv.TransformerConfig(
        src_vocab_size=V, tgt_vocab_size=V, d_model=256, num_heads=4, num_encoder_layers=3,
        num_decoder_layers=3, dim_feedforward=1024, dropout=0.1, max_positions=L + 1,
    )  # fmt: skip
    ours = qkv.Transformer(cfg).train()
    converted = from_torch_transformer(body)
    ours.encoder.load_state_dict(converted.encoder.state_dict())
    ours.decoder.load_state_dict(converted.decoder.state_dict())
    theirs = TorchSeq2Seq(ours, body).train()
    src = torch.randint(3, V, (B, L))
    tgt = torch.randint(3, V, (B, L))
    labels = torch.randint(3, V, (B, L))

    def step(model: Callable[[Tensor, Tensor], Tensor]) -> Callable[[], None]:
        def run() -> None:
            logits = model(src, tgt)  # [B, L, V]
            loss = F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1))
            loss.backward()
            ours.zero_grad(set_to_none=True)
            body.zero_grad(set_to_none=True)

        return run

    q_step, t_step = step(ours), step(theirs)
    for _ in range(2):  # warm up both
        q_step()
        t_step()
    q_times, t_times = [], []
    for _ in range(repeats):
        q_times.append(_time(q_step))
        t_times.append(_time(t_step))
    return _median_ms(q_times), _median_ms(t_times)


@torch.no_grad()
def decoding(n: int, B: int, S: int, V: int, repeats: int) -> dict[str, list[float]]:
    """Per-step seconds (median over repeats) of cached vs recomputed greedy decoding."""
    torch.manual_seed(0)
    cfg = qkv.TransformerConfig(
        src_vocab_size=V, tgt_vocab_size=V, d_model=256, num_heads=4, num_encoder_layers=3,
        num_decoder_layers=3, dim_feedforward=1024, dropout=0.0, max_positions=n + 1,
    )  # fmt: skip
    model = qkv.Transformer(cfg).eval()
    src = torch.randint(3, V, (B, S))
    memory = model.encode(src)  # [B, S, D]
    no_pad = torch.zeros(B, S, dtype=torch.bool)
    runs: dict[str, list[list[float]]] = {"cached": [], "recompute": []}
    tokens: dict[str, Tensor] = {}
    for _ in range(repeats):  # alternate the modes so that machine load hits both alike
        for mode in ("cached", "recompute"):
            cache = model.new_cache(n + 1) if mode == "cached" else None
            out = torch.full((B, 1), cfg.bos_id)  # [B, 1]
            step_times = []
            for _ in range(n):
                t0 = time.perf_counter()
                step_in = out[:, -1:] if cache is not None else out
                logits = model.decode(step_in, memory, no_pad, kv_cache=cache)[:, -1]  # [B, V]
                # keep special tokens out so both runs decode all n tokens
                nxt = logits[:, 3:].argmax(-1) + 3  # [B]
                out = torch.cat([out, nxt[:, None]], dim=1)  # [B, L]
                step_times.append(time.perf_counter() - t0)
            runs[mode].append(step_times)
            tokens[mode] = out
    # per step, the median over the repeats
    times = {mode: [statistics.median(s) for s in zip(*r, strict=True)] for mode, r in runs.items()}
    assert torch.equal(tokens["cached"], tokens["recompute"]), "cached tokens differ"
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--decode-repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    B, L, n = (4, 32, 48) if args.quick else (16, 128, 256)
    V = 1000
    print(f"torch {torch.__version__}, {args.threads} threads, float32, CPU")
    q_ms, t_ms = training_ratio(args.repeats, B, L, V)
    print(
        f"\n1. training step (fwd + bwd), d_model 256, 4 heads, 3+3 layers, batch {B}, length {L}, "
        f"vocab {V}, median of {args.repeats}:"
    )
    print(
        f"   qkv.Transformer {q_ms:8.1f} ms   nn.Transformer {t_ms:8.1f} ms   "
        f"ratio qkv/torch = {q_ms / t_ms:.2f}"
    )
    marks = [m for m in (1, 16, 64, 128, 192, 256) if m <= n]
    times = decoding(n, 4, 32, V, args.decode_repeats)
    c_total, r_total = sum(times["cached"]), sum(times["recompute"])
    print(
        f"\n2. greedy decoding of {n} tokens, batch 4, source length 32 (encoder run once), "
        f"per-step median of {args.decode_repeats} runs:"
    )
    print(
        f"   with KV cache {c_total * 1e3:8.1f} ms   recomputing the prefix "
        f"{r_total * 1e3:8.1f} ms   ratio cached/recompute = {c_total / r_total:.3f}"
    )
    print("   per-token cost (median of the 8 steps ending at each prefix length):")
    print("   prefix length   cached ms   recompute ms")
    for m in marks:
        lo = max(0, m - 8)
        c = _median_ms(times["cached"][lo:m])
        r = _median_ms(times["recompute"][lo:m])
        print(f"   {m:13d}   {c:9.2f}   {r:12.2f}")


if __name__ == "__main__":
    main()
