"""Argument checks shared by every layer of qkv (the bottom layer: it imports nothing from qkv).

Each check returns the value it accepted, so a call reads ``n = check_positive_int("n", n)``,
and raises with the argument's name and the value it got. ``bool`` is refused where an int is
wanted: ``True`` is an ``int`` to Python, but never a length or a count to a user.
"""

from __future__ import annotations

import torch

__all__ = [
    "check_bool",
    "check_nonnegative_int",
    "check_positive_int",
    "check_probability",
    "checks_values",
]


def checks_values(validate: bool = True) -> bool:
    """Whether a forward path should check the *values* of its tensors (token ids in range, ...).

    Such checks read tensor data on the host: they make the host wait for the device on every
    call and cannot be traced. So they run eagerly only: never under ``torch.compile``,
    ``torch.export`` or the ONNX exporter (``torch.compiler.is_compiling()``), nor when the
    caller passes ``validate=False``. Shape and dtype checks are not value checks and always run.

    Args:
        validate: the caller's switch (a model's ``validate=`` argument).

    Returns:
        True when the values should be checked.
    """
    return validate and not torch.compiler.is_compiling()


def _check_int_from(lowest: int, what: str, name: str, value: object) -> int:
    # a torch.SymInt is a length while torch.export / torch.compile trace with dynamic shapes
    if isinstance(value, bool) or not isinstance(value, int | torch.SymInt):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < lowest:
        raise ValueError(f"{name} must be a {what} int, got {value}")
    return value  # type: ignore[return-value]


def check_positive_int(name: str, value: object) -> int:
    """Accept an int ``>= 1`` (a length, a width, a number of heads or layers).

    Args:
        name: the argument's name, for the message.
        value: the value to check.

    Returns:
        ``value``, unchanged.

    Raises:
        TypeError: ``value`` is not an int, or is a bool.
        ValueError: ``value < 1``.
    """
    return _check_int_from(1, "positive", name, value)


def check_nonnegative_int(name: str, value: object) -> int:
    """As :func:`check_positive_int`, but 0 is accepted too (an offset, a count that may be
    empty); raises TypeError / ValueError (``value < 0``) alike and returns ``value``."""
    return _check_int_from(0, "non-negative", name, value)


def check_bool(name: str, value: object) -> bool:
    """Return ``value`` if it is ``True`` or ``False``; raise TypeError naming ``name`` for
    anything else (``0``, ``1``, a numpy or tensor bool), which ``if value:`` would accept."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r} ({type(value).__name__})")
    return value


def check_probability(name: str, value: object, *, inclusive_one: bool = True) -> float:
    """Accept a number in ``[0, 1]`` (or ``[0, 1)`` with ``inclusive_one=False``).

    Args:
        name: the argument's name, for the message.
        value: the value to check (an int or a float; not a bool).
        inclusive_one: whether 1 itself is allowed.

    Returns:
        ``value`` as a float.

    Raises:
        TypeError: ``value`` is not an int or float, or is a bool.
        ValueError: ``value`` lies outside the interval (NaN included).
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a float, got {value!r} ({type(value).__name__})")
    p = float(value)
    ok = 0.0 <= p <= 1.0 if inclusive_one else 0.0 <= p < 1.0
    if not ok:
        interval = "[0, 1]" if inclusive_one else "[0, 1)"
        raise ValueError(f"{name} must lie in {interval}, got {value}")
    return p
