"""Argument checks shared by every layer of qkv; this module imports nothing from qkv.

Each check returns the value it accepted and raises an error that names the argument and the
value received. ``bool`` is refused where an int is wanted (``True`` is an ``int`` in Python).
"""

from __future__ import annotations

__all__ = ["check_bool", "check_nonnegative_int", "check_positive_int", "check_probability"]


def check_positive_int(name: str, value: object) -> int:
    """``value`` if it is an int >= 1.

    Raises:
        TypeError: not an int (or a bool).
        ValueError: an int < 1.
    """
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be a positive int, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def check_nonnegative_int(name: str, value: object) -> int:
    """``value`` if it is an int >= 0.

    Raises:
        TypeError: not an int (or a bool).
        ValueError: an int < 0.
    """
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be a non-negative int, got {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return value


def check_bool(name: str, value: object) -> bool:
    """``value`` if it is a bool.

    Raises:
        TypeError: anything else.
    """
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return value


def check_probability(name: str, value: object, *, inclusive_one: bool = True) -> float:
    """``value`` as a float if it lies in [0, 1] (or [0, 1) with ``inclusive_one=False``).

    Raises:
        TypeError: not a real number (or a bool).
        ValueError: outside the interval.
    """
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise TypeError(f"{name} must be a float, got {value!r}")
    ok = 0.0 <= value <= 1.0 if inclusive_one else 0.0 <= value < 1.0
    if not ok:
        interval = "[0, 1]" if inclusive_one else "[0, 1)"
        raise ValueError(f"{name} must lie in {interval}, got {value!r}")
    return float(value)
