"""How a Hugging Face checkpoint's keys become qkv's, shared by every HF converter.

A converter describes its weights as :class:`Rule` s: one Hugging Face key (``{}`` = layer index)
and the qkv key(s) it becomes, copied, transposed (GPT-2's ``Conv1D``), or split into equal parts
along the output dim (GPT-2's fused ``c_attn``). The same rules run both ways
(:func:`to_qkv`, :func:`from_qkv`), and check a checkpoint's headers against the shapes its
config implies before anything is loaded (:func:`check_against`, :func:`check_layers`). Reading
and writing the files is :mod:`qkv.convert.hf_files`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import Tensor

__all__ = [
    "Header",
    "Kind",
    "Rule",
    "check_against",
    "check_layers",
    "expand_rules",
    "from_qkv",
    "held_layers",
    "listing",
    "to_qkv",
]


@dataclass(frozen=True)
class Header:
    """One tensor of a safetensors file, as its header describes it."""

    shape: tuple[int, ...]
    dtype: str
    file: Path


_SHOW = 12  # names listed per kind of problem in an error message

Kind = Literal["copy", "t", "split", "split_t"]


@dataclass(frozen=True)
class Rule:
    """One Hugging Face weight and the qkv weight(s) it becomes.

    Attributes:
        hf: the Hugging Face key; ``{}`` stands for the layer index.
        ours: the qkv key(s), with the same placeholder; more than one only for ``split*``.
        kind: ``"copy"``; ``"t"`` (stored transposed, ``[in, out]``); ``"split"`` (the HF
            tensor is the qkv ones concatenated along dim 0); ``"split_t"`` (concatenated along
            the last dim of the transposed tensors: GPT-2's ``c_attn``).
    """

    hf: str
    ours: tuple[str, ...]
    kind: Kind = "copy"


def expand_rules(rules: Iterable[Rule], num_layers: int) -> list[Rule]:
    """The rules with ``{}`` replaced by each layer index ``0 .. num_layers - 1``."""
    out: list[Rule] = []
    for r in rules:
        if "{}" not in r.hf:
            out.append(r)
            continue
        for i in range(num_layers):
            out.append(Rule(r.hf.format(i), tuple(o.format(i) for o in r.ours), r.kind))
    return out


def held_layers(keys: Iterable[str], rules: Iterable[Rule]) -> set[int]:
    """The layer indices that ``keys`` hold, for the layer templates (``{}``) of ``rules``."""
    prefixes = sorted({r.hf.split("{}")[0] for r in rules if "{}" in r.hf})
    if not prefixes:
        return set()
    pattern = re.compile("^(?:" + "|".join(map(re.escape, prefixes)) + r")(\d+)\.")
    return {int(m[1]) for k in keys if (m := pattern.match(k))}


def check_layers(
    source: str, key: str, count: int, keys: Iterable[str], rules: Iterable[Rule]
) -> None:
    """Refuse a layer count beyond the layers the weights hold, before anything is built.

    A ``config.json`` claiming 20,000 layers over a 2-layer checkpoint took 20 s to build on the
    meta device before its keys were found missing; the headers answer at once.

    Args:
        source: ``config.json``'s path, for the message.
        key: the config key of the count (e.g. ``"num_hidden_layers"``).
        count: its value, already read with :func:`qkv.convert.hf_values.hf_int`.
        keys: the checkpoint's keys (as ``rules`` name them).
        rules: the layer templates (``{}``) of one stack, not expanded.

    Raises:
        ValueError: ``count`` exceeds the layers held, naming ``key``, ``count`` and that number.
    """
    held = held_layers(keys, rules)
    if count > len(held):
        raise ValueError(f"{source}: {key}={count} but the checkpoint holds {len(held)} layer(s)")


def _hf_shape(rule: Rule, ours: Mapping[str, tuple[int, ...]]) -> tuple[int, ...]:
    shapes = [ours[o] for o in rule.ours]
    if rule.kind == "copy":
        return shapes[0]
    if rule.kind == "t":
        return tuple(reversed(shapes[0]))
    rows = sum(s[0] for s in shapes)
    if rule.kind == "split":
        return (rows, *shapes[0][1:])
    return (*reversed(shapes[0][1:]), rows)  # split_t: [in, sum(out)] (or [sum] for biases)


def listing(keys: list[str]) -> str:
    """The first names of ``keys``, and how many more."""
    shown = ", ".join(keys[:_SHOW])
    return shown + (f" ... and {len(keys) - _SHOW} more" if len(keys) > _SHOW else "")


def check_against(
    what: str,
    headers: Mapping[str, Header],
    rules: list[Rule],
    ours: Mapping[str, tuple[int, ...]],
    ignored: Mapping[str, str],
) -> dict[str, str]:
    """Check a checkpoint's headers against the shapes its config implies, before loading.

    Args:
        what: the checkpoint, for the message (e.g. ``"Llama checkpoint /path"``).
        headers: from :func:`read_headers`, keys already without a task prefix.
        rules: expanded with :func:`expand_rules`.
        ours: qkv key -> shape, of the model the config describes.
        ignored: key suffix -> the reason such a key is not needed (e.g. ``"attn.masked_bias"``).

    Returns:
        Each ignored checkpoint key with its reason.

    Raises:
        ValueError: one message naming every unknown, missing and mis-shaped key, and every
            weight that is not floating point.
    """
    expected = {r.hf: _hf_shape(r, ours) for r in rules}
    skipped: dict[str, str] = {}
    unknown, misshaped, not_float = [], [], []
    for key in sorted(headers):
        reason = next((why for end, why in ignored.items() if key.endswith(end)), None)
        if key not in expected and reason is not None:
            skipped[key] = reason
        elif key not in expected:
            unknown.append(key)
        elif headers[key].shape != expected[key]:
            misshaped.append(
                f"{key} has shape {list(headers[key].shape)}, expected {list(expected[key])}"
            )
        elif headers[key].dtype not in ("F16", "BF16", "F32", "F64"):
            not_float.append(f"{key} ({headers[key].dtype})")
    missing = sorted(set(expected) - set(headers))
    problems = []
    if unknown:
        problems.append(f"{len(unknown)} unknown key(s): {listing(unknown)}")
    if missing:
        problems.append(f"{len(missing)} missing key(s): {listing(missing)}")
    if misshaped:
        problems.append(
            f"{len(misshaped)} key(s) of another shape than config.json implies: "
            f"{listing(misshaped)}"
        )
    if not_float:
        problems.append(f"weights that are not floating point: {listing(not_float)}")
    if problems:
        raise ValueError(f"{what} does not fit its config: " + "; ".join(problems))
    return skipped


def to_qkv(rules: list[Rule], tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Hugging Face tensors (already checked) -> qkv state-dict entries."""
    out: dict[str, Tensor] = {}
    for r in rules:
        t = tensors[r.hf]
        if r.kind == "copy":
            out[r.ours[0]] = t
        elif r.kind == "t":
            out[r.ours[0]] = t.t().contiguous()  # [out, in]
        else:
            dim = 0 if r.kind == "split" else -1
            for name, part in zip(r.ours, t.chunk(len(r.ours), dim=dim), strict=True):
                out[name] = part.t().contiguous() if part.dim() == 2 and dim == -1 else part
    return out


def from_qkv(rules: list[Rule], state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """qkv state-dict entries -> Hugging Face tensors (the inverse of :func:`to_qkv`)."""
    out: dict[str, Tensor] = {}
    for r in rules:
        parts = [state_dict[o].detach() for o in r.ours]
        if r.kind == "copy":
            out[r.hf] = parts[0].contiguous()
        elif r.kind == "t":
            out[r.hf] = parts[0].t().contiguous()  # [in, out]
        elif r.kind == "split":
            out[r.hf] = torch.cat(parts, dim=0)
        else:
            out[r.hf] = torch.cat([p.t() if p.dim() == 2 else p for p in parts], dim=-1)
    return out
