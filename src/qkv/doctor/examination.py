"""What :func:`qkv.doctor.examine` returns: one :class:`Property` per invariance, in an
:class:`Examination` that prints as a table and serialises to JSON.

A property holds (``passed=True``) when its ``error``, the worst difference between outputs that
must be equal, stays within its ``bound``, a tolerance measured on the model itself (never a
constant). ``passed=None`` says the property does not apply to this model, and ``detail`` says why.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

__all__ = ["PROPERTIES", "Bound", "Examination", "Property"]

PROPERTIES: dict[str, str] = {
    "batch_invariance": "each sample alone gives what it gives inside the batch",
    "padding_invariance": "left padding = right padding = no padding on the live positions",
    "pad_value_invariance": "other token ids at padded positions change no live output",
    "causality": "changing the tokens after position t changes no output at positions <= t",
    "cache_equivalence": "prefill plus cached steps = the full forward (with padding too)",
    "implementation_equivalence": "eager = sdpa = qkv, and each = the model in float64",
    "finite_gradients": "gradients of the live outputs are finite everywhere, padding included",
}
"""Every property :func:`~qkv.doctor.examine` checks, in its order, with what it claims."""


@dataclass(frozen=True)
class Bound:
    """A tolerance and where it came from.

    Attributes:
        value: the largest error that still passes (absolute, in the units of the outputs).
        source: how ``value`` was measured, for a person to read.
    """

    value: float
    source: str

    def __str__(self) -> str:
        return f"{_number(self.value)} ({self.source})"


@dataclass(frozen=True)
class Property:
    """The verdict on one invariance.

    Attributes:
        passed: True (holds), False (broken, or a probe raised / returned NaN), or None (does not
            apply to this model; ``detail`` says why).
        error: the worst difference found (NaN when an output was not finite), or None when
            nothing was compared.
        bound: the tolerance and where it came from, or None when nothing was compared.
        detail: the worst sample and position and the comparison they come from, the error a
            probe raised, or why the property does not apply.
    """

    passed: bool | None
    error: float | None
    bound: Bound | None
    detail: str

    @property
    def status(self) -> str:
        """``"pass"``, ``"FAIL"`` or ``"n/a"``."""
        return {True: "pass", False: "FAIL", None: "n/a"}[self.passed]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (non-finite numbers become the strings ``"nan"`` / ``"inf"``)."""
        bound = None
        if self.bound is not None:
            bound = {"value": _json_number(self.bound.value), "source": self.bound.source}
        return {
            "passed": self.passed,
            "error": None if self.error is None else _json_number(self.error),
            "bound": bound,
            "detail": self.detail,
        }


@dataclass(frozen=True)
class Examination:
    """Every property of one examination, with what was examined.

    Attributes:
        properties: property name (see :data:`PROPERTIES`) to its :class:`Property`.
        model: what was examined, in words (``"transformers LlamaForCausalLM (causal-lm)"``).
        notes: what a person should know to read the table (the batches built, what was added).
        seconds: wall time of each step: ``"reference"`` (the reference forward and its float64
            rerun, which gives the bound), then each property.
    """

    properties: dict[str, Property]
    model: str = ""
    notes: tuple[str, ...] = ()
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        """False when a property failed, else True (properties that do not apply are skipped)."""
        return all(p.passed is not False for p in self.properties.values())

    @property
    def failed(self) -> list[str]:
        """The names of the properties that failed."""
        return [name for name, p in self.properties.items() if p.passed is False]

    def __getitem__(self, name: str) -> Property:
        return self.properties[name]

    def __str__(self) -> str:
        rows = [("property", "result", "error", "bound", "worst / why")]
        for name, p in self.properties.items():
            error = "-" if p.error is None else _number(p.error)
            bound = "-" if p.bound is None else _number(p.bound.value)
            rows.append((name, p.status, error, bound, p.detail))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = [f"examination of {self.model}" if self.model else "examination"]
        for r in rows:
            lines.append(
                "  ".join(c.ljust(w) for c, w in zip(r[:4], widths, strict=True)) + "  " + r[4]
            )
        by_source: dict[str, list[str]] = {}
        for name, p in self.properties.items():
            if p.bound is not None:
                by_source.setdefault(p.bound.source, []).append(name)
        for source, names in by_source.items():
            lines.append(f"bound of {', '.join(names)}: {source}")
        lines += [f"note: {n}" for n in self.notes]
        if self.seconds:
            steps = ", ".join(f"{k} {v:.1f}" for k, v in self.seconds.items())
            lines.append(f"time: {sum(self.seconds.values()):.1f} s ({steps})")
        verdict = "passed" if self.passed else "FAILED: " + ", ".join(self.failed)
        lines.append(f"examination {verdict}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: ``passed``, ``model``, ``notes`` and every property's fields."""
        return {
            "passed": self.passed,
            "model": self.model,
            "notes": list(self.notes),
            "seconds": dict(self.seconds),
            "properties": {name: p.to_dict() for name, p in self.properties.items()},
        }

    def to_json(self, indent: int | None = 2) -> str:
        """The examination as strict JSON (see :meth:`to_dict`)."""
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)


def _number(x: float) -> str:
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf"
    if x == int(x) and abs(x) < 1e6:
        return str(int(x))
    return f"{x:.2e}"


def _json_number(x: float) -> float | str:
    return x if math.isfinite(x) else _number(x)
