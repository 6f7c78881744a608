"""What a watch found: the findings, the captured attention, a table and JSON.

Shapes: T queries, S keys.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import Tensor

from qkv.doctor.findings import Finding
from qkv.doctor.view import HeadMap, save_attention_html

__all__ = ["Captured", "Report"]


@dataclass(frozen=True)
class Captured:
    """The attention weights of one captured call.

    Attributes:
        name: the module path (or the API's name when no module is known).
        call: the index of this call among the captures of ``name`` (0 = first).
        api: the function called.
        samples: the batch rows kept.
        heads: the query heads kept.
        weights: ``[len(samples), len(heads), T, S]`` float32 on the CPU, recomputed exactly;
            rows whose real output was NaN are NaN here too.
    """

    name: str
    call: int
    api: str
    samples: tuple[int, ...]
    heads: tuple[int, ...]
    weights: Tensor


@dataclass
class Report:
    """Everything one :func:`qkv.doctor.watch` block saw.

    Attributes:
        findings: the findings, most severe first (each counts the calls that showed it).
        calls: attention calls seen.
        captured: the captured weights, in call order.
        unread: calls the doctor could not read (their message); the model ran unchanged.
    """

    findings: list[Finding] = field(default_factory=list)
    calls: int = 0
    captured: list[Captured] = field(default_factory=list)
    unread: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when no finding is an error or a warning (hints do not count)."""
        return not any(f.severity in ("error", "warning") for f in self.findings)

    def extend(self, other: Report) -> None:
        """Add another report's calls and findings (one finding per kind and module path)."""
        self.calls += other.calls
        self.unread.extend(other.unread)
        self.captured.extend(other.captured)
        for f in other.findings:
            path = f.where.split(" (")[0]
            same = [
                i
                for i, g in enumerate(self.findings)
                if g.kind == f.kind and g.where.split(" (")[0] == path
            ]
            if same:
                g = self.findings[same[0]]
                self.findings[same[0]] = Finding(
                    g.kind, g.severity, g.where, g.message, g.evidence, g.count + f.count
                )
            else:
                self.findings.append(f)
        order = {"error": 0, "warning": 1, "hint": 2}
        self.findings.sort(key=lambda f: order[f.severity])

    def by_kind(self, kind: str) -> list[Finding]:
        """The findings of one kind."""
        return [f for f in self.findings if f.kind == kind]

    def attention(self, name: str, call: int = 0) -> Tensor:
        """The captured weights of module ``name``'s ``call``-th captured call.

        Returns:
            ``[samples, heads, T, S]`` float32.

        Raises:
            KeyError: nothing was captured under that name and index (the message lists what
                was).
        """
        for c in self.captured:
            if c.name == name and c.call == call:
                return c.weights
        have = sorted({(c.name, c.call) for c in self.captured})
        raise KeyError(f"no capture of {name!r} call {call}; captured: {have}")

    def save_html(
        self, path: str | os.PathLike[str], tokens: list[str] | None = None, title: str = ""
    ) -> Path:
        """Write the captured attention as one self-contained page (canvas, overview + zoom).

        Args:
            path: the file to write.
            tokens: labels of the positions (queries take the last ``T``, keys the first ``S``,
                where there are enough).
            title: the page's title.

        Returns:
            The path written.

        Raises:
            ValueError: nothing was captured (pass ``capture=`` to the watch).
        """
        if not self.captured:
            raise ValueError("nothing was captured: pass capture=PATTERN to qkv.doctor.watch")
        maps = []
        for c in self.captured:
            T, S = c.weights.shape[-2], c.weights.shape[-1]
            q_labels = tokens[-T:] if tokens is not None and len(tokens) >= T else None
            k_labels = tokens[:S] if tokens is not None and len(tokens) >= S else None
            for i, b in enumerate(c.samples):
                for j, h in enumerate(c.heads):
                    maps.append(
                        HeadMap(
                            title=f"{c.name} · call {c.call} · sample {b} · head {h}",
                            weights=c.weights[i, j],  # [T, S]
                            query_labels=q_labels,
                            key_labels=k_labels,
                            group=c.name,
                        )
                    )
        return save_attention_html(path, maps, title=title or "qkv doctor: attention")

    def __str__(self) -> str:
        head = f"qkv doctor: {self.calls} attention calls, "
        if not self.findings:
            return head + "no findings" + self._unread_line()
        counts = {
            s: sum(f.severity == s for f in self.findings) for s in ("error", "warning", "hint")
        }
        lines = [head + ", ".join(f"{n} {s}{'s' if n != 1 else ''}" for s, n in counts.items())]
        rows = [("severity", "kind", "calls", "where", "message")]
        rows += [(f.severity, f.kind, str(f.count), f.where, f.message) for f in self.findings]
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        for r in rows:
            lines.append(
                "  ".join(c.ljust(w) for c, w in zip(r[:4], widths, strict=True)) + "  " + r[4]
            )
        return "\n".join(lines) + self._unread_line()

    def _unread_line(self) -> str:
        if not self.unread:
            return ""
        return f"\n({len(self.unread)} calls could not be read: {self.unread[0]})"

    def to_dict(self) -> dict[str, Any]:
        """The report as plain JSON-ready values."""
        return {
            "ok": self.ok,
            "calls": self.calls,
            "findings": [f.to_dict() for f in self.findings],
            "captured": [
                {
                    "name": c.name,
                    "call": c.call,
                    "api": c.api,
                    "samples": list(c.samples),
                    "heads": list(c.heads),
                    "shape": list(c.weights.shape),
                }
                for c in self.captured
            ],
            "unread": list(self.unread),
        }

    def to_json(self, indent: int | None = 2) -> str:
        """:meth:`to_dict` as a JSON string."""
        return json.dumps(self.to_dict(), indent=indent, default=str)
