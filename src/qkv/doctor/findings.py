"""What the doctor can find: the kinds, their documentation, and one finding.

Each kind is one silent attention bug (or, for ``hint``, a call that is right but slow). A
:class:`Finding` names its kind, how bad it is, where it happened (module path and call site), a
sentence a person reads, and the numbers that prove it (``evidence``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["KINDS", "SEVERITIES", "Finding", "KindDoc", "Severity"]

Severity = Literal["error", "warning", "hint"]
SEVERITIES: tuple[Severity, ...] = ("error", "warning", "hint")


@dataclass(frozen=True)
class KindDoc:
    """The documentation of one kind: what a user sees, why it happens, how to fix it."""

    symptom: str
    cause: str
    fix: str


KINDS: dict[str, KindDoc] = {
    "nonfinite_output": KindDoc(
        symptom="the attention call returned NaN or inf",
        cause="NaN/inf in the query, key or value, a mask holding NaN, scores that overflow the "
        "compute dtype, or rows whose keys are all blocked (nn.MultiheadAttention and SDPA "
        "return NaN there)",
        fix="follow the finding's 'came from'; for blocked rows use qkv.attention (output 0) or "
        "give padding queries one visible key",
    ),
    "nonfinite_mask": KindDoc(
        symptom="an additive mask holds NaN or +inf",
        cause="a float16 mask built as `mask * -inf` (0 * -inf = NaN) or `(1 - m) * inf`",
        fix="build it with torch.where(blocked, -inf, 0) or qkv.masks.to_additive, or pass a "
        "bool mask",
    ),
    "weak_mask": KindDoc(
        symptom="a key the additive mask meant to block still gets weight > 1e-3",
        cause="a 'mask' of -1, -100 or -1e4 that is small next to the scores of this call",
        fix="block with -inf or torch.finfo(dtype).min (qkv.masks.to_additive), or a bool mask",
    ),
    "all_blocked_rows": KindDoc(
        symptom="a real (non-padding) query has every key blocked, or a fully blocked row's "
        "output is NaN",
        cause="a mask that blocks too much (inverted, misaligned or off-by-one), or "
        "nn.MultiheadAttention on fully padded rows",
        fix="check the mask's polarity and alignment; padding queries may be fully blocked if "
        "their output stays finite (qkv.attention gives 0)",
    ),
    "inverted_mask": KindDoc(
        symptom="tokens are blocked and padding is attended",
        cause="a bool mask passed with the other polarity (SDPA and Hugging Face: True/1 = "
        "attend; nn.MultiheadAttention: True = ignore), or a 0/1 keep mask passed as an "
        "additive float mask",
        fix="convert at the boundary: qkv.masks.from_sdpa_bool / to_mha_bool / from_hf / "
        "to_additive, or invert with ~mask",
    ),
    "causal_misaligned": KindDoc(
        symptom="with a KV cache, a new query sees only the first keys, not the cached past",
        cause="is_causal=True (or a top-left triangular mask) with fewer queries than keys: "
        "PyTorch aligns causal masks top-left, so query 0 sees key 0 only",
        fix="pass an explicit bottom-right mask (torch.nn.attention.bias.causal_lower_right, "
        "qkv.masks.causal_mask) or no causal flag for a single decode query",
    ),
    "mask_broadcast": KindDoc(
        symptom="a sample's queries are masked with another sample's padding",
        cause="a [B, S] mask passed where [T, S] is read (silent when B == T), a [B, T, S] mask "
        "read as [H, T, S], or a [B*H, T, S] mask built with repeat instead of "
        "repeat_interleave",
        fix="shape padding masks as [B, 1, 1, S] (qkv.masks.padding_mask) before passing them",
    ),
    "padding_leak": KindDoc(
        symptom="a key marked as padding gets weight > 1e-3 from a real query",
        cause="a layer that drops or never receives the mask, or a mask that does not cover "
        "the padding of this call (cache steps, cross-attention)",
        fix="pass the padding mask to every attention call of the model",
    ),
    "hint": KindDoc(
        symptom="a correct call that could be faster",
        cause="a dense [B, 1, T, S] mask that is exactly causal or exactly padding",
        fix="pass is_causal=True, or a [B, 1, 1, S] padding mask, and let the kernel skip work",
    ),
}
"""Every finding kind, mapped to its documentation (symptom, cause, fix)."""


@dataclass(frozen=True)
class Finding:
    """One problem found in one or more attention calls.

    Attributes:
        kind: a key of :data:`KINDS`.
        severity: ``"error"`` (wrong results), ``"warning"`` (probably wrong) or ``"hint"``.
        where: the module path (``model.layers.3.self_attn``) and the call site (file:line).
        message: one sentence for a person.
        evidence: the numbers behind it (shapes, the worst weight, the sample and row, counts).
        count: how many calls produced this same finding.
    """

    kind: str
    severity: Severity
    where: str
    message: str
    evidence: dict[str, Any] = field(default_factory=dict)
    count: int = 1

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {sorted(KINDS)}, got {self.kind!r}")
        if self.severity not in SEVERITIES:
            raise ValueError(f"severity must be one of {SEVERITIES}, got {self.severity!r}")

    def to_dict(self) -> dict[str, Any]:
        """The finding as plain JSON-ready values."""
        return {
            "kind": self.kind,
            "severity": self.severity,
            "where": self.where,
            "message": self.message,
            "evidence": self.evidence,
            "count": self.count,
        }
