"""Argument checks shared by every layer (this module imports nothing from qkv).

Each check returns the value it accepted, so a caller can write ``n = check_positive_int("n", n)``,
and raises an error that names the argument and the value it got. ``bool`` is refused where an
int is wanted (``True`` is an ``int`` to Python, never a count to a user).
"""

from __future__ import annotations

__all__ = ["check_bool", "check_nonnegative_int", "check_positive_int", "check_probability"]


def _check_int_at_least(name: str, value: object, low: int, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < low:
        raise ValueError(f"{name} must be a {what} int, got {value!r}")
    return value


def check_positive_int(name: str, value: object) -> int:
    """``value``, an int >= 1, named ``name`` in the error.

    Raises:
        TypeError: ``value`` is not an int (or is a bool).
        ValueError: ``value < 1``.
    """
    return _check_int_at_least(name, value, 1, "positive")


def check_nonnegative_int(name: str, value: object) -> int:
    """``value``, an int >= 0, named ``name`` in the error.

    Raises:
        TypeError: ``value`` is not an int (or is a bool).
        ValueError: ``value < 0``.
    """
    return _check_int_at_least(name, value, 0, "non-negative")


def check_bool(name: str, value: object) -> bool:
    """``value`` as a bool (``0``/``1`` are refused: a flag is spelled ``True``/``False``).

    Args:
        name: the argument's name, for the message.
        value: what the caller passed.

    Returns:
        ``value``.

    Raises:
        TypeError: ``value`` is not a bool.
    """
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r} ({type(value).__name__})")
    return value


def check_probability(name: str, value: object, *, inclusive_one: bool = True) -> float:
    """``value`` as a float in ``[0, 1]`` (or ``[0, 1)`` with ``inclusive_one=False``).

    Args:
        name: the argument's name, for the message.
        value: what the caller passed (an int or a float, not a bool).
        inclusive_one: whether 1 itself is allowed.

    Returns:
        ``float(value)``.

    Raises:
        TypeError: ``value`` is not a real number (or is a bool).
        ValueError: ``value`` outside the interval (or NaN).
    """
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise TypeError(f"{name} must be a float, got {value!r} ({type(value).__name__})")
    p = float(value)
    inside = 0.0 <= p <= 1.0 if inclusive_one else 0.0 <= p < 1.0
    if not inside:
        interval = "[0, 1]" if inclusive_one else "[0, 1)"
        raise ValueError(f"{name} must lie in {interval}, got {value!r}")
    return p
