"""The value types of the ``qkv`` command's options (argparse ``type=``): each refuses a bad
value with an ``ArgumentTypeError`` that says what it expected and what it got."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from qkv.apps.viz import KINDS

__all__ = [
    "accuracy",
    "int_at_least",
    "nonnegative",
    "plot_kind",
    "positive",
    "positive_float",
    "text_file",
    "unit_interval",
]


def int_at_least(lowest: int, highest: int | None = None) -> Callable[[str], int]:
    """The type of an int option in ``[lowest, highest]`` (no upper bound if None)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an int, got {text!r}") from None
        if value < lowest or (highest is not None and value > highest):
            bound = f">= {lowest}" if highest is None else f"in [{lowest}, {highest}]"
            raise argparse.ArgumentTypeError(f"expected an int {bound}, got {value}")
        return value

    parse.__name__ = f"int >= {lowest}"
    return parse


positive = int_at_least(1)
nonnegative = int_at_least(0)


def positive_float(text: str) -> float:
    """A finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text}")
    return value


def unit_interval(text: str) -> float:
    """A number in (0, 1]."""
    value = positive_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text}")
    return value


def accuracy(text: str) -> float:
    """A fraction in (0, 1] (an accuracy)."""
    value = positive_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {text}")
    return value


def text_file(text: str) -> str:
    """The path of an existing file (not a directory, not a dangling link)."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory, expected a UTF-8 text file")
    if path.is_symlink() and not path.exists():
        raise argparse.ArgumentTypeError(f"{text} is a dangling symbolic link")
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"no such file: {text}")
    return text


def plot_kind(text: str) -> str:
    """``encoder-self`` (or the old ``"encoder self"``) -> the plot's kind name."""
    for kind in KINDS:
        if text in (kind, kind.replace(" ", "-")):
            return kind
    raise argparse.ArgumentTypeError(
        f"expected one of {', '.join(k.replace(' ', '-') for k in KINDS)}, got {text!r}"
    )
