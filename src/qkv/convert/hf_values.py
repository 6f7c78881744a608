"""Typed reading of one ``config.json`` value: each error names the key, the value and what was
expected.

A checkpoint directory is data someone else wrote. Reading ``hf["rms_norm_eps"]`` with
``float()`` says "could not convert string to float: 'x'" without the key, ``hf["hidden_size"]
// hf["num_attention_heads"]`` divides by zero, and a size of 2**40 reaches torch as a storage
overflow. Every value the Hugging Face converters read goes through one of these functions
instead, so a wrong one is a ``ValueError`` such as ``config.json: num_attention_heads must be
an int in [1, 16777216], got 0``.

Sizes are bounded by :data:`MAX_SIZE`, far above any released model (the widest hidden size is
tens of thousands, the largest vocabulary about a million) and low enough that the product of
two sizes fits an int64 element count: a shape built from them cannot overflow, and the
checkpoint's headers, not the config, decide what is allocated.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

__all__ = [
    "MAX_SIZE",
    "hf_bool",
    "hf_dict",
    "hf_float",
    "hf_int",
    "hf_str",
]

MAX_SIZE = 2**24
"""The largest width, vocabulary, layer count or position count a config may give."""

_REQUIRED: Any = object()


def _get(hf: Mapping[str, Any], key: str, source: str, default: Any) -> Any:
    if key not in hf:
        if default is _REQUIRED:
            raise ValueError(f"{source} lacks {key}")
        return default
    return hf[key]


def _shown(value: object) -> str:
    text = repr(value)
    return (text if len(text) <= 60 else text[:57] + "...") + f" ({type(value).__name__})"


def hf_int(
    hf: Mapping[str, Any],
    key: str,
    source: str,
    *,
    default: int | None = _REQUIRED,
    low: int = 1,
    high: int = MAX_SIZE,
    nullable: bool = False,
) -> int | None:
    """``hf[key]`` as an int in ``[low, high]`` (``true`` / ``3.0`` are refused).

    Args:
        hf: the parsed ``config.json``.
        key: the key to read.
        source: the file, for the message.
        default: the value when the key is absent; required when not given.
        low: the smallest value accepted.
        high: the largest value accepted.
        nullable: a JSON ``null`` stands for ``default`` (e.g. ``"head_dim": null``).

    Returns:
        The int, or ``default``.

    Raises:
        ValueError: the key is missing and required, or the value is not such an int.
    """
    value = _get(hf, key, source, default)
    if value is None and (nullable or key not in hf):
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{source}: {key} must be an int in [{low}, {high}], got {_shown(value)}")
    return value


def hf_float(
    hf: Mapping[str, Any],
    key: str,
    source: str,
    *,
    default: float,
    positive: bool = True,
) -> float:
    """``hf[key]`` as a finite float (an int is accepted, a bool is not), positive if asked.

    Raises:
        ValueError: the value is not a finite number, or not positive when ``positive``.
    """
    value = _get(hf, key, source, default)
    ok = (
        not isinstance(value, bool)
        and isinstance(value, int | float)
        and math.isfinite(value)
        and (value > 0 or not positive)
    )
    if not ok:
        want = "a finite number > 0" if positive else "a finite number"
        raise ValueError(f"{source}: {key} must be {want}, got {_shown(value)}")
    return float(value)


def hf_bool(hf: Mapping[str, Any], key: str, source: str, *, default: bool) -> bool:
    """``hf[key]`` as ``true`` / ``false`` (``null`` means the default).

    Raises:
        ValueError: any other value (``1``, ``"yes"``).
    """
    value = _get(hf, key, source, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"{source}: {key} must be true or false, got {_shown(value)}")
    return value


def hf_str(hf: Mapping[str, Any], key: str, source: str, *, default: str) -> str:
    """``hf[key]`` as a string (``null`` means the default).

    Raises:
        ValueError: any other value.
    """
    value = _get(hf, key, source, default)
    if value is None:
        return default
    if not isinstance(value, str):
        raise ValueError(f"{source}: {key} must be a string, got {_shown(value)}")
    return value


def hf_dict(hf: Mapping[str, Any], key: str, source: str) -> dict[str, Any]:
    """``hf[key]`` as a JSON object; absent or ``null`` is ``{}``.

    Raises:
        ValueError: any other value (a list, a string).
    """
    value = hf.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{source}: {key} must be a JSON object or null, got {_shown(value)}")
    return value
