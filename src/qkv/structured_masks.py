"""Deprecated: the mask rules moved to :mod:`qkv.masks` (one mask system); kept for one release.

``from qkv.structured_masks import Causal`` still works and warns; write
``from qkv.masks import Causal`` (or ``qkv.Causal``) instead. The names are those of
the rules and tiles of :mod:`qkv.masks`, plus ``Union`` (now ``AnyOf``).
"""

import qkv.masks as _masks
from qkv._deprecation import warn_deprecated

warn_deprecated(
    "qkv.structured_masks", "qkv.masks", hint="e.g. from qkv.masks import Causal, Padding"
)

# the rules and tile names of qkv.masks (its capitalized ones), as they were here in 0.1
_NAMES = {name: getattr(_masks, name) for name in _masks.__all__ if name[0].isupper()}
_NAMES["Union"] = _masks.AnyOf

__all__ = sorted(_NAMES)


def __getattr__(name: str) -> object:
    try:
        return _NAMES[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def __dir__() -> list[str]:
    return sorted([*globals(), *_NAMES])
