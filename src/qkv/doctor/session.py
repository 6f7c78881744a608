"""One examination's state: the adapter, the batches, the outputs shared between properties, and
the tolerance measured on the model itself.

The tolerance: the reference batch runs in the model's dtype and again with the model cast to
float64; the largest difference on live outputs is that dtype's rounding noise for this model and
input. Two runs that must agree mathematically, each that close to the exact value, differ by at
most twice it (the triangle inequality), so the bound is twice the noise. A bug shows orders of
magnitude above it; a clean model stays below.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from qkv.doctor.batches import Batch, Samples, Side
from qkv.doctor.examination import Bound
from qkv.doctor.probes import Adapter
from qkv.doctor.restore import cast_floating, floating_dtype

__all__ = ["FALLBACK_ULPS", "ProbeError", "Session"]

FALLBACK_ULPS = 1024
"""When the model cannot run in float64 (a callable that hides its modules, an op without a
float64 kernel), the bound is ``2 * FALLBACK_ULPS * eps(dtype) * max|output|``, an estimate that
the table says is one."""


class ProbeError(RuntimeError):
    """A model call of a probe raised; the message names the batch and the original error."""


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
        ref64: the reference batch's live outputs from the model in float64, once measured.
        bound: the tolerance of every comparison of two runs (see the module docstring).
    """

    def __init__(self, adapter: Adapter, samples: Samples) -> None:
        self.adapter = adapter
        self.samples = samples
        self.side: Side = "left" if adapter.kind == "causal-lm" else "right"
        self.default = samples.padded(self.side)
        self.generator = torch.Generator().manual_seed(0)
        self.pool = sorted({int(x) for s in samples.seqs for x in s.tolist()})
        self.ref64: list[Tensor] | None = None
        self._outputs: dict[str, list[Tensor]] = {}
        self._ref_error: ProbeError | None = None
        self.bound = Bound(math.nan, "not measured")

    def outputs(self, batch: Batch, key: str | None = None) -> list[Tensor]:
        """The live outputs of ``batch`` (kept under ``key`` for the other properties).

        Raises:
            ProbeError: the model raised, or returned a tensor of another shape.
        """
        if key is not None and key in self._outputs:
            return self._outputs[key]
        try:
            out = self.adapter.forward(batch)
            live = [x.detach() for x in self.adapter.live(batch, out)]
        except Exception as e:
            raise ProbeError(f"the {batch.name} raised {type(e).__name__}: {e}") from e
        if key is not None:
            self._outputs[key] = live
        return live

    @property
    def ref(self) -> list[Tensor]:
        """The reference batch's live outputs.

        Raises:
            ProbeError: the reference forward raised.
        """
        if self._ref_error is not None:
            raise ProbeError(f"reference forward: {self._ref_error}")
        return self.outputs(self.default, "ref")

    def alone(self, i: int) -> list[Tensor]:
        """Sample ``i`` alone, unpadded: its live outputs as a one-element list."""
        return self.outputs(self.samples.alone(i), f"alone {i}")

    def padded(self, side: Side) -> list[Tensor]:
        """The live outputs of the batch padded on ``side``."""
        return self.outputs(self.samples.padded(side), "ref" if side == self.side else side)

    def measure(self) -> None:
        """Run the reference batch and measure :attr:`bound`; never raises."""
        try:
            ref = self.ref
        except ProbeError as e:
            self._ref_error = e
            return
        modules = self.adapter.modules()
        dtype = floating_dtype(modules)
        reason = "no nn.Module found behind the callable"
        if modules and dtype is not None:
            try:
                self.bound = self._float64_bound(ref, modules, dtype)
                return
            except Exception as e:
                reason = f"the float64 rerun raised {type(e).__name__}: {e}"
        self.bound = self._fallback_bound(ref, reason)

    def _float64_bound(self, ref: list[Tensor], modules: list, dtype: torch.dtype) -> Bound:
        name = str(dtype).removeprefix("torch.")
        if dtype == torch.float64:
            with cast_floating(modules, torch.float32):
                low = self.outputs(self.default)
            self.ref64 = ref
            scale = torch.finfo(torch.float64).eps / torch.finfo(torch.float32).eps
            noise = _max_diff(low, ref) * scale
            what = "float64 rounding (float32 rerun's noise x eps64/eps32)"
        else:
            with cast_floating(modules, torch.float64):
                self.ref64 = self.outputs(self.default)
            noise = _max_diff(ref, self.ref64)
            what = f"{name} rounding of the {self.default.name} vs the model in float64"
        return Bound(2 * noise, f"2 x {noise:.2e}, the {what}")

    def _fallback_bound(self, ref: list[Tensor], reason: str) -> Bound:
        finite = [x[torch.isfinite(x)] for x in ref]
        top = max((float(x.abs().max()) for x in finite if x.numel()), default=math.nan)
        eps = torch.finfo(ref[0].dtype).eps
        value = 2 * FALLBACK_ULPS * eps * top
        return Bound(value, f"estimate 2 x {FALLBACK_ULPS} eps x max|output| ({reason})")


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
