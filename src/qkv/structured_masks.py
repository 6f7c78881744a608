"""Deprecated: the mask rules moved to :mod:`qkv.masks` (one mask system); kept for one release.

``from qkv.structured_masks import Causal`` still works and warns; write
``from qkv.masks import Causal`` (or ``qkv.Causal``) instead.
"""

import warnings

from qkv.masks.rules import (
    AnyOf,
    Causal,
    Dense,
    Documents,
    MaskMod,
    Padding,
    SlidingWindow,
    StructuredMask,
)
from qkv.masks.tiles import EMPTY, FULL, Align, TileMask

Union = AnyOf

warnings.warn(
    "qkv.structured_masks is deprecated: import the rules from qkv.masks "
    "(e.g. from qkv.masks import Causal, Padding)",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = [
    "EMPTY",
    "FULL",
    "Align",
    "AnyOf",
    "Causal",
    "Dense",
    "Documents",
    "MaskMod",
    "Padding",
    "SlidingWindow",
    "StructuredMask",
    "TileMask",
    "Union",
]
