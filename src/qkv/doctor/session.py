"""One examination's state: the adapter, the batches, the runs shared between properties, and the
tolerances measured on the model itself.

Every property compares pairs of runs that must agree mathematically on the live outputs. The
tolerance comes in two steps, both measured:

1. **Screen**: the reference batch runs in the model's dtype and again with the model cast to
   float64; the largest difference on live outputs is that dtype's rounding noise for this model
   and input. Two runs that close to the exact value differ by at most twice it (the triangle
   inequality), so a pair within ``2 x noise`` passes.
2. **Proof**: a pair above it is run again with the model in float64, both sides; each side's own
   rounding noise ``n_a``, ``n_b`` is measured. A correct model satisfies
   ``|a - b| <= n_a + n_b`` exactly (up to float64 rounding), whatever the two runs' kernels
   (an implementation with low-precision internals is noisier, not wrong); a bug exceeds it by
   orders of magnitude. The pair fails only then, and the table shows that bound.

A clean model therefore never fails, and a bug costs two float64 reruns of the pair it breaks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from qkv.doctor.batches import Batch, Samples, Side
from qkv.doctor.compare import Worst, compare, worst_of
from qkv.doctor.examination import Bound, Property
from qkv.doctor.probes import Adapter
from qkv.doctor.restore import cast_floating, floating_dtype

__all__ = ["FALLBACK_ULPS", "Pair", "ProbeError", "Run", "Session"]

FALLBACK_ULPS = 1024
"""When the model cannot run in float64 (a callable that hides its modules, an op without a
float64 kernel), the bound is ``2 * FALLBACK_ULPS * eps(dtype) * max|output|``, an estimate that
the table says is one."""


class ProbeError(RuntimeError):
    """A model call of a probe raised; the message names the run and the original error."""


@dataclass(frozen=True)
class Run:
    """One way of computing some texts' live outputs.

    Attributes:
        key: identifies the computation (runs are cached by key, per dtype).
        name: what it is, for a person ("left-padded batch").
        call: computes the live outputs of every sample the model was called with.
        pick: which of ``call``'s outputs this run stands for.
        texts: the text number of each picked output.
        float64: always computed with the model in float64 (a reference, not a float32 run).
    """

    key: str
    name: str
    call: Callable[[], list[Tensor]]
    pick: tuple[int, ...]
    texts: tuple[int, ...]
    float64: bool = False

    def only(self, i: int) -> Run:
        """The same run, text ``i`` of it only."""
        j = self.texts.index(i)
        return Run(self.key, self.name, self.call, (self.pick[j],), (i,), self.float64)


@dataclass(frozen=True)
class Pair:
    """Two runs of the same texts that must agree; ``upto`` limits each text's tokens compared."""

    a: Run
    b: Run
    upto: tuple[int, ...] | None = None


class Session:
    """The shared state of one examination.

    Args:
        adapter: calls the model.
        samples: the caller's samples.

    Attributes:
        side: the padding of the reference batch: left for causal LMs (as ``generate`` pads),
            right for the others (as their tokenizers pad).
        default: the reference batch, ``samples.padded(side)``.
        generator: the random generator of every token replacement (reproducible).
        pool: the token ids of the caller's batch (replacements when the vocabulary is unknown).
        bound: the screening bound (see the module docstring).
        provable: pairs above the screen can be rerun in float64.
        notes: what the reader should know about the float64 reruns.
        exact_texts: the texts whose float64 reference outputs are finite (a float64 rerun can
            break where the model's dtype does not: ``transformers``' eager attention takes its
            softmax in float32, where float64's mask value overflows to -inf).
    """

    def __init__(self, adapter: Adapter, samples: Samples) -> None:
        self.adapter = adapter
        self.samples = samples
        self.side: Side = "left" if adapter.kind == "causal-lm" else "right"
        self.default = samples.padded(self.side)
        self.generator = torch.Generator().manual_seed(0)
        self.pool = sorted({int(x) for s in samples.seqs for x in s.tolist()})
        self.modules = adapter.modules()
        self.bound = Bound(math.nan, "not measured")
        self.provable = False
        self.notes: list[str] = []
        self.exact_texts: tuple[int, ...] = ()
        self._cache: dict[tuple[str, bool], list[Tensor]] = {}
        self._ref_error: ProbeError | None = None

    # ---- runs -----------------------------------------------------------------------------

    def batch_run(self, batch: Batch, key: str | None = None) -> Run:
        """The forward of ``batch``: every sample of it (text i is output i)."""
        n = batch.ids.shape[0]
        texts = tuple(range(n))

        def call() -> list[Tensor]:
            return self.adapter.live(batch, self.adapter.forward(batch))

        return Run(key or batch.name, batch.name, call, texts, texts)

    @property
    def ref(self) -> Run:
        """The reference batch's forward."""
        return self.batch_run(self.default, "ref")

    def unpadded(self, i: int) -> Run:
        """Text ``i`` without padding: alone, or with the texts of its length (one call)."""
        batch, row = self.samples.unpadded(i)
        run = self.batch_run(batch, f"unpadded {len(self.samples.seqs[i])}")
        return Run(run.key, batch.name, run.call, (row,), (i,))

    def padded(self, side: Side) -> Run:
        """The batch padded on ``side`` (the reference batch on the reference side)."""
        if side == self.side:
            return self.ref
        return self.batch_run(self.samples.padded(side), side)

    def live(self, run: Run, float64: bool = False) -> list[Tensor]:
        """The picked live outputs of ``run``, in the model's dtype or in float64 (cached).

        Raises:
            ProbeError: the model raised, or returned a tensor of another shape.
        """
        if run.key == "ref" and self._ref_error is not None:
            raise ProbeError(f"reference forward: {self._ref_error}")
        float64 = float64 or run.float64
        if (run.key, float64) not in self._cache:
            try:
                if float64:
                    with cast_floating(self.modules, torch.float64):
                        out = run.call()
                else:
                    out = run.call()
            except Exception as e:
                precision = " in float64" if float64 else ""
                raise ProbeError(f"the {run.name}{precision} raised {type(e).__name__}: {e}") from e
            self._cache[(run.key, float64)] = [x.detach() for x in out]
        out = self._cache[(run.key, float64)]
        return [out[j] for j in run.pick]

    # ---- bounds ---------------------------------------------------------------------------

    def measure(self) -> None:
        """Run the reference batch and measure the screening :attr:`bound`; never raises."""
        try:
            ref = self.live(self.ref)
        except ProbeError as e:
            self._ref_error = e
            return
        dtype = floating_dtype(self.modules)
        reason = "no nn.Module found behind the callable"
        if self.modules and dtype is not None:
            try:
                self.bound = self._float64_bound(ref, dtype)
                self.provable = dtype != torch.float64
                return
            except ProbeError as e:
                reason = str(e)
        self.bound = self._fallback_bound(ref, reason)

    def _float64_bound(self, ref: list[Tensor], dtype: torch.dtype) -> Bound:
        if dtype == torch.float64:
            with cast_floating(self.modules, torch.float32):
                low = self.ref.call()
            scale = torch.finfo(torch.float64).eps / torch.finfo(torch.float32).eps
            noise = _max_diff(low, ref) * scale
            what = "float64 rounding (float32 rerun's noise x eps64/eps32)"
        else:
            ref64 = self.live(self.ref, float64=True)
            noise = _max_diff(ref, ref64)
            self.exact_texts = tuple(i for i, x in enumerate(ref64) if _finite(x))
            broken = [
                i
                for i, (x, y) in enumerate(zip(ref, ref64, strict=True))
                if _finite(x) and not _finite(y)
            ]
            if broken:
                self.notes.append(
                    f"the model in float64 returned non-finite outputs for texts {broken} (its own "
                    "dtype did not): the bound comes from the other texts, and those texts are "
                    "left out of the float64 comparisons"
                )
            name = str(dtype).removeprefix("torch.")
            what = f"{name} rounding of the {self.default.name} vs the model in float64"
        return Bound(2 * noise, f"2 x {noise:.2e}, the {what}")

    def _fallback_bound(self, ref: list[Tensor], reason: str) -> Bound:
        finite = [x[torch.isfinite(x)] for x in ref]
        top = max((float(x.abs().max()) for x in finite if x.numel()), default=math.nan)
        eps = torch.finfo(ref[0].dtype).eps
        value = 2 * FALLBACK_ULPS * eps * top
        return Bound(value, f"estimate 2 x {FALLBACK_ULPS} eps x max|output| ({reason})")

    # ---- verdicts -------------------------------------------------------------------------

    def judge(self, pairs: Sequence[Pair], note: str = "") -> Property:
        """Compare every pair: screened against :attr:`bound`, a pair above it proven or failed
        against its own runs' float64 noise (see the module docstring).

        Raises:
            ProbeError: a run raised.
        """
        if not pairs:
            return Property(None, None, None, "nothing to compare" + note)
        found: list[tuple[Pair, Worst]] = []
        for pair in pairs:
            a, b = self.live(pair.a), self.live(pair.b)
            cuts = pair.upto or (None,) * len(a)
            worsts = [
                compare(t, x, y, pair.a.name, pair.b.name, c)
                for t, x, y, c in zip(pair.a.texts, a, b, cuts, strict=True)
            ]
            found.append((pair, worst_of(worsts)))
        worst = worst_of([w for _, w in found])
        screen = self.bound
        if worst.error <= screen.value or math.isnan(worst.error) or not self.provable:
            passed = not math.isnan(worst.error) and worst.error <= screen.value
            return Property(passed, worst.error, screen, worst.where + note)
        # above the screen: each such pair against its own runs' float64 noise
        judged: list[tuple[float, Worst, Bound]] = []
        for pair, w in found:
            if w.error <= screen.value:
                continue
            if math.isnan(w.error):
                return Property(False, w.error, screen, w.where + note)
            bound = self._pair_bound(pair)
            if bound is None:  # a float64 rerun broke: no proof, the screen stands
                why = "; no proof: a float64 rerun of these runs is not finite"
                return Property(False, w.error, screen, w.where + why + note)
            judged.append((w.error / bound.value if bound.value else math.inf, w, bound))
        _, w, bound = max(judged, key=lambda r: r[0])
        return Property(w.error <= bound.value, w.error, bound, w.where + note)

    def _pair_bound(self, pair: Pair) -> Bound | None:
        noises = []
        for run in (pair.a, pair.b):
            if run.float64:
                noises.append(0.0)
                continue
            cuts = pair.upto or (None,) * len(run.pick)
            low, high = self.live(run), self.live(run, float64=True)
            if any(_finite(x) and not _finite(y) for x, y in zip(low, high, strict=True)):
                return None
            end = [None if c is None else c + 1 for c in cuts]
            noises.append(
                _max_diff(
                    [x[:e] for x, e in zip(low, end, strict=True)],
                    [y[:e] for y, e in zip(high, end, strict=True)],
                )
            )
        na, nb = noises
        return Bound(
            na + nb,
            f"{na:.2e} + {nb:.2e}: each run's own rounding, measured against it in float64",
        )


def _finite(x: Tensor) -> bool:
    return bool(torch.isfinite(x).all())


def _max_diff(a: list[Tensor], b: list[Tensor]) -> float:
    """The largest finite difference between two runs' live outputs (NaNs are the properties'
    to report, not the noise's)."""
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        d = (x.double() - y.double()).abs()
        d = d[torch.isfinite(d)]
        if d.numel():
            worst = max(worst, float(d.max()))
    return worst
