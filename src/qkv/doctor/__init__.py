"""The attention doctor: find silent attention bugs in other people's models.

``qkv.doctor.watch`` inspects every attention call a model makes at run time (PyTorch SDPA,
``nn.MultiheadAttention``, flex attention, ``qkv.attention`` and every ``transformers`` attention
implementation) and reports findings; ``qkv.doctor.examine`` checks a model's invariances
(batch, padding, causality, cache, implementation equivalence) by metamorphic probes.
"""

from __future__ import annotations

from qkv.doctor.examination import PROPERTIES, Bound, Examination, Property
from qkv.doctor.examine import examine, examine_texts
from qkv.doctor.findings import KINDS, Finding, KindDoc
from qkv.doctor.report import Captured, Report
from qkv.doctor.watch import watch

__all__ = [
    "KINDS",
    "PROPERTIES",
    "Bound",
    "Captured",
    "Examination",
    "Finding",
    "KindDoc",
    "Property",
    "Report",
    "examine",
    "examine_texts",
    "watch",
]
