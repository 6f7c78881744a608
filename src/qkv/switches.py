"""Process-wide on/off settings of qkv, each with a setter, a getter and a context manager.

``auto`` decides from facts about a call, never from hidden state, except where the user opts in
to a trade it must not make by surprise: compiling (:func:`qkv.allow_compile`) and SDPA's less
exact CPU backward (:func:`qkv.allow_sdpa_backward`). Each such opt-in is one :class:`Switch`.
The bottom layer: it imports nothing from qkv.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["Switch"]


class Switch:
    """A named process-wide bool, off until set.

    Args:
        name: the argument name errors mention (``"allowed"``).

    Example::

        COMPILE = Switch("allowed")
        with COMPILE.scoped(True):
            assert COMPILE.on
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.on = False

    def set(self, value: bool) -> None:
        """Turn the switch on or off for the whole process.

        Raises:
            TypeError: ``value`` is not a bool (``1`` or ``"yes"`` would hide a typo).
        """
        if not isinstance(value, bool):
            raise TypeError(f"{self.name} must be a bool, got {value!r}")
        self.on = value

    @contextmanager
    def scoped(self, value: bool = True) -> Iterator[None]:
        """Within the block the switch is ``value``; afterwards it is what it was before.

        Raises:
            TypeError: ``value`` is not a bool.
        """
        before = self.on
        self.set(value)
        try:
            yield
        finally:
            self.on = before
