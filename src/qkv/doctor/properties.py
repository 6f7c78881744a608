"""The seven properties an examination checks, one function each: ``f(session) -> Property``.

Each compares live outputs of runs that must agree mathematically (see
:mod:`qkv.doctor.session` for the bound) and names the worst text and token. A function may raise
(:class:`~qkv.doctor.session.ProbeError` when the model raised); :func:`qkv.doctor.examine` turns
that into a failed property.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
from torch import Tensor, nn

from qkv.doctor.batches import Batch, other_tokens
from qkv.doctor.examination import Bound, Property
from qkv.doctor.probes import HFAdapter
from qkv.doctor.restore import requiring_grad
from qkv.doctor.session import Pair, ProbeError, Run, Session
from qkv.integrations.transformers import register

__all__ = ["IMPLEMENTATIONS", "PROBES", "cache_schedule"]

IMPLEMENTATIONS = ("eager", "sdpa", "qkv")
"""The ``transformers`` attention implementations ``implementation_equivalence`` compares (and
the model's own, when it is another)."""

_QKV_REFUSES = "attn_implementation='qkv' does not support"


def _not_applicable(why: str) -> Property:
    return Property(None, None, None, why)


def batch_invariance(s: Session) -> Property:
    """Each row of the reference batch alone (with its padding) = that row inside the batch."""
    b, ref = s.default, s.ref
    pairs = []
    for i in range(s.samples.size):
        if bool(b.mask[i].all()) and len(s.samples.same_length(i)) == 1:
            alone = s.unpadded(i)  # the same call: padding_invariance runs it too
        else:
            row = s.batch_run(b.row(i), f"row {i}")
            alone = Run(row.key, f"text {i} alone (same padding)", row.call, (0,), (i,))
        pairs.append(Pair(ref.only(i), alone))
    return s.judge(pairs)


def _left_applies(s: Session) -> str:
    if s.adapter.kind == "causal-lm" or s.adapter.takes_positions:
        return ""
    return (
        "; left padding not compared: the model takes no position ids, so left padding shifts "
        "its absolute positions (pad encoders on the right)"
    )


def padding_invariance(s: Session) -> Property:
    """Left-padded = right-padded = each text without padding (alone, or with the texts of its
    length), on live positions."""
    right = s.padded("right")
    pairs = [Pair(right.only(i), s.unpadded(i)) for i in range(s.samples.size)]
    note = _left_applies(s)
    if not note:
        left = s.padded("left")
        pairs += [Pair(left.only(i), s.unpadded(i)) for i in range(s.samples.size)]
        pairs.append(Pair(left, right))
    return s.judge(pairs, note)


def pad_value_invariance(s: Session) -> Property:
    """Other ids at the padded positions of the reference batch change no live output."""
    b = s.default
    pads = b.mask == 0  # [B, W]
    other = other_tokens(b.ids, s.adapter.vocab_size, s.pool, s.generator)
    ids = torch.where(pads, other, b.ids)  # [B, W]
    changed = Batch(ids, b.mask, b.decoder_ids, f"{b.name} with other pad ids")
    return s.judge([Pair(s.batch_run(changed, "pad values"), s.ref)])


def causality(s: Session) -> Property:
    """Tokens after a cut changed (the later half of each text, or of the decoder input): the
    outputs up to the cut do not change."""
    if s.adapter.kind == "encoder":
        return _not_applicable("an encoder attends both ways")
    b, n = s.default, s.samples.size
    ids, dec = b.ids.clone(), b.decoder_ids
    if dec is not None:  # seq2seq: the decoder is the causal part
        cut = (dec.shape[1] - 1) // 2
        dec = dec.clone()
        vocab = s.adapter.decoder_vocab_size
        dec[:, cut + 1 :] = other_tokens(dec[:, cut + 1 :], vocab, s.pool, s.generator)
        cuts = [cut] * n
        note = f"; decoder tokens after token {cut} changed"
    else:
        cuts = []
        for i in range(n):
            where = b.live(i).nonzero()[:, 0]  # [L_i] positions of the tokens
            cut = (len(where) - 1) // 2
            later = where[cut + 1 :]
            ids[i, later] = other_tokens(ids[i, later], s.adapter.vocab_size, s.pool, s.generator)
            cuts.append(cut)
        note = "; the later half of each text changed"
    changed = Batch(ids, b.mask, dec, f"{b.name}, tokens after the cut changed")
    return s.judge([Pair(s.batch_run(changed, "future tokens"), s.ref, tuple(cuts))], note)


def cache_schedule(n: int) -> list[int]:
    """Call sizes for ``n`` tokens: a prefill, then a chunk of 2 and single steps (4 at most)."""
    k = min(4, n - 1)
    if k <= 0:
        return [n]
    steps = [2] + [1] * (k - 2) if k >= 3 else [1] * k
    return [n - k, *steps]


def _cached_run(s: Session, batch: Batch, key: str, texts: tuple[int, ...]) -> Run:
    dec = batch.decoder_ids
    sizes = cache_schedule(batch.ids.shape[1] if dec is None else dec.shape[1])

    def call() -> list[Tensor]:
        return s.adapter.live(batch, s.adapter.cached(batch, sizes))

    name = f"{batch.name}, prefill {sizes[0]} + cached steps {sizes[1:]}"
    return Run(key, name, call, tuple(range(len(texts))), texts)


def cache_equivalence(s: Session) -> Property:
    """Prefill plus cached steps = the full forward: the reference batch (left-padded for causal
    LMs) and the texts of one length, unpadded."""
    if s.adapter.cache is not None:
        return _not_applicable(s.adapter.cache)
    # the unpadded case: the texts as long as the shortest text of 5 tokens or more (the
    # cheapest that still gets a chunk and single steps), else as the longest
    lengths = [len(x) for x in s.samples.seqs]
    long_enough = [(n, j) for j, n in enumerate(lengths) if n >= 5]
    i = min(long_enough)[1] if long_enough else lengths.index(max(lengths))
    batch, _ = s.samples.unpadded(i)
    full = s.unpadded(i)
    group = s.samples.same_length(i)
    rows = tuple(range(len(group)))
    return s.judge(
        [
            Pair(_cached_run(s, s.default, "cached", tuple(range(s.samples.size))), s.ref),
            Pair(
                _cached_run(s, batch, "cached unpadded", group),
                Run(full.key, full.name, full.call, rows, group),
            ),
        ]
    )


def _implementation_run(s: Session, a: HFAdapter, name: str, own: str) -> Run:
    forward = s.batch_run(s.default).call

    def call() -> list[Tensor]:
        a.set_implementation(name)
        try:
            return forward()
        finally:
            a.set_implementation(own)

    texts = tuple(range(s.samples.size))
    return Run(f"implementation {name}", name, call, texts, texts)


def implementation_equivalence(s: Session) -> Property:
    """``eager`` = ``sdpa`` = ``qkv`` (and the model's own), each = the model in float64; the
    model's implementation is restored afterwards."""
    a = s.adapter
    if not isinstance(a, HFAdapter):
        return _not_applicable("not a transformers model: it has one attention implementation")
    register()  # idempotent: (re)binds "qkv" in transformers' registries
    own = a.implementation
    ref = s.ref
    runs = [Run(ref.key, own, ref.call, ref.pick, ref.texts)]
    skipped: list[str] = []
    for name in IMPLEMENTATIONS:
        if name == own:
            continue
        try:
            a.set_implementation(name)
        except Exception as e:
            skipped.append(f"{name} ({type(e).__name__}: {str(e)[:80]})")
            continue
        finally:
            a.set_implementation(own)
        run = _implementation_run(s, a, name, own)
        try:
            s.live(run)
        except ProbeError as e:
            refused = re.search(re.escape(_QKV_REFUSES) + r" (\w+)", str(e))
            if name == "qkv" and refused:
                skipped.append(f"qkv (it does not support {refused.group(1)})")
                continue
            raise
        runs.append(run)
    pairs = [Pair(x, y) for j, x in enumerate(runs) for y in runs[j + 1 :]]
    if s.provable and s.exact_texts:
        texts = s.exact_texts
        exact = Run(ref.key, f"float64 {own}", ref.call, texts, texts, float64=True)
        pairs += [Pair(Run(x.key, x.name, x.call, texts, texts), exact) for x in runs]
    note = "; not compared: " + ", ".join(skipped) if skipped else ""
    if not s.provable:
        note += "; no float64 run (see the bound)"
    return s.judge(pairs, note)


def finite_gradients(s: Session) -> Property:
    """Gradients of a random projection of the live outputs with respect to every parameter and
    every embedding output (padded rows included) are finite."""
    modules = s.adapter.modules()
    if not modules:
        return _not_applicable("no nn.Module found to differentiate")
    b = s.default
    embedded: list[tuple[str, Tensor]] = []

    def keep(name: str) -> Callable[[nn.Module, object, object], None]:
        def hook(module: nn.Module, args: object, out: object) -> None:
            if isinstance(out, Tensor) and out.requires_grad:
                embedded.append((name, out))

        return hook

    handles = [
        m.register_forward_hook(keep(name))
        for root in modules
        for name, m in root.named_modules()
        if isinstance(m, nn.Embedding)
    ]
    try:
        with torch.enable_grad(), requiring_grad(modules) as params:
            try:
                live = s.adapter.live(b, s.adapter.forward(b))
            except Exception as e:
                raise ProbeError(f"the {b.name} raised {type(e).__name__}: {e}") from e
            weights = [torch.randn(x.shape, generator=s.generator).to(x) for x in live]
            loss = sum((x * w).sum() for x, w in zip(live, weights, strict=True))
            assert isinstance(loss, Tensor)
            inputs = [t for _, t in embedded] + [p for _, p in params]
            grads = torch.autograd.grad(loss, inputs, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    names = [f"output of {n}" for n, _ in embedded] + [f"parameter {n}" for n, _ in params]
    bad, first, total = 0, "", 0
    for name, g in zip(names, grads, strict=True):
        if g is None:
            continue
        total += g.numel()
        wrong = ~torch.isfinite(g)
        count = int(wrong.sum())
        if count and not first:
            first = name
            if name.startswith("output of") and g.dim() >= 2:
                i, p = (int(v) for v in wrong.nonzero()[0, :2])
                state = "padding" if int(b.mask[i, p]) == 0 else "token"
                first += f" at row {i}, position {p} ({state})"
        bad += count
    bound = Bound(0.0, "exact: every gradient value must be finite")
    if bad:
        return Property(
            False, float(bad), bound, f"{bad} of {total} values not finite; first: {first}"
        )
    detail = f"all {total} values finite ({len(params)} parameters, {len(embedded)} embeddings)"
    return Property(True, 0.0, bound, detail)


PROBES: dict[str, Callable[[Session], Property]] = {
    "batch_invariance": batch_invariance,
    "padding_invariance": padding_invariance,
    "pad_value_invariance": pad_value_invariance,
    "causality": causality,
    "cache_equivalence": cache_equivalence,
    "implementation_equivalence": implementation_equivalence,
    "finite_gradients": finite_gradients,
}
"""Each property's function, in the order of :data:`~qkv.doctor.examination.PROPERTIES`."""
