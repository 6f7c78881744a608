"""Deprecation warnings of renamed or moved names, in one wording (the bottom layer).

Every name qkv keeps for one release after a rename or a move warns through here, so each message
reads ``"<old> is deprecated; use <new>"`` (and a hint in parentheses where one helps) and points
at the line that used the old name. Three shapes of shim cover every case:

- a moved module or a renamed module attribute calls :func:`warn_deprecated` itself
  (``qkv.embed``, ``qkv.structured_masks``, ``qkv.masks.Union``);
- a renamed keyword argument goes through :func:`renamed_keyword`, which also refuses both
  spellings at once (``KVCache(max_len=)``, ``attention(bias=)``, ``cache=``, a config's
  ``max_len=``);
- a renamed attribute is a :class:`RenamedAttribute` on the class (``KVCache.max_len``, a config's
  ``max_len``).

``stacklevel`` means what it means to :func:`warnings.warn` called in the shim itself: 1 the shim,
2 its caller, and so on.
"""

from __future__ import annotations

import warnings
from typing import Any, Generic, TypeVar

__all__ = ["RenamedAttribute", "renamed_keyword", "warn_deprecated"]

_T = TypeVar("_T")


def warn_deprecated(old: str, new: str, *, hint: str = "", stacklevel: int = 2) -> None:
    """Warn (``DeprecationWarning``) that ``old`` is deprecated in favour of ``new``.

    Args:
        old: the deprecated spelling as a user writes it (``"KVCache(max_len=)"``, ``"qkv.embed"``).
        new: what to write instead.
        hint: appended in parentheses (an example, or why the name changed); none if empty.
        stacklevel: the frame the warning names, counted from the caller of this function.
    """
    message = f"{old} is deprecated; use {new}" + (f" ({hint})" if hint else "")
    warnings.warn(message, DeprecationWarning, stacklevel=stacklevel + 1)


def renamed_keyword(
    old: str,
    old_value: _T | None,
    new: str,
    new_value: _T | None,
    *,
    owner: str = "",
    hint: str = "",
    stacklevel: int = 2,
) -> _T | None:
    """The value of keyword argument ``new``, which a caller may still pass as ``old``.

    ``None`` means "not given", as for every keyword qkv renamed.

    Args:
        old: the old keyword's name.
        old_value: what the caller passed under ``old``.
        new: the keyword's name now.
        new_value: what the caller passed under ``new``.
        owner: the function or class taking the keyword, named in the message (``"KVCache"``);
            empty for the bare ``old=``.
        hint: see :func:`warn_deprecated`.
        stacklevel: the frame the warning names, counted from the caller of this function.

    Returns:
        ``new_value`` when ``old`` was not given, else ``old_value`` (after a warning).

    Raises:
        TypeError: both ``old`` and ``new`` given.
    """
    if old_value is None:
        return new_value
    spelled = f"{owner}({old}=)" if owner else f"{old}="
    warn_deprecated(spelled, f"{new}=", hint=hint, stacklevel=stacklevel + 1)
    if new_value is not None:
        where = f"{owner}: " if owner else ""
        raise TypeError(f"{where}got both {new} and its deprecated alias {old}; pass {new} only")
    return old_value


class RenamedAttribute(Generic[_T]):
    """A class attribute kept under its old name: reading it warns and returns the new one.

    ``max_len = RenamedAttribute[int]("max_positions")`` in a class body makes ``obj.max_len``
    warn ``"<Class>.max_len is deprecated; use <Class>.max_positions"`` and return
    ``obj.max_positions``. It takes no annotation, so a dataclass does not see it as a field.

    Args:
        new: the attribute's name now.
    """

    def __init__(self, new: str) -> None:
        self.new = new
        self.old = ""
        self.__doc__ = f"Deprecated alias of :attr:`{new}` (one release)."

    def __set_name__(self, owner: type, name: str) -> None:
        self.old = name

    def __get__(self, obj: object, objtype: Any = None) -> _T:
        if obj is None:
            return self  # type: ignore[return-value]  # the class's own attribute, for help()
        name = type(obj).__name__
        warn_deprecated(f"{name}.{self.old}", f"{name}.{self.new}", stacklevel=2)
        value: _T = getattr(obj, self.new)
        return value
