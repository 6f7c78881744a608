"""qkv's one mask system: rules, the tensor builders that materialize them, and converters.

- :mod:`qkv.masks.rules`: ``Causal``, ``SlidingWindow``, ``Padding``, ``Documents``,
  ``MaskMod``, ``Dense``, combined with ``|`` into ``AnyOf``; the source of truth.
- :mod:`qkv.masks.builders`: ``causal_mask``, ``sliding_window_mask``, ``padding_mask`` (thin
  calls of the rules, returning 4-D bool tensors) and ``combine`` (OR of tensors).
- :mod:`qkv.masks.convert`: SDPA / ``nn.MultiheadAttention`` / Hugging Face / additive masks.
- :mod:`qkv.masks.tiles`: the ``Tile`` a rule is asked about, and the one alignment rule.
"""

from qkv._deprecation import warn_deprecated
from qkv.masks.builders import causal_mask, combine, padding_mask, sliding_window_mask
from qkv.masks.convert import (
    from_additive,
    from_hf,
    from_mha_attn_mask,
    from_mha_bool,
    from_sdpa_bool,
    to_additive,
    to_hf,
    to_mha_bool,
    to_sdpa_bool,
)
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
from qkv.masks.tiles import EMPTY, FULL, Align, Tile, TileMask

__all__ = [  # Union, the deprecated alias of AnyOf, is left out so that * does not warn
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
    "Tile",
    "TileMask",
    "causal_mask",
    "combine",
    "from_additive",
    "from_hf",
    "from_mha_attn_mask",
    "from_mha_bool",
    "from_sdpa_bool",
    "padding_mask",
    "sliding_window_mask",
    "to_additive",
    "to_hf",
    "to_mha_bool",
    "to_sdpa_bool",
]


def __getattr__(name: str) -> object:
    if name == "Union":
        hint = "it shadowed typing.Union; or combine rules with |"
        warn_deprecated("qkv.masks.Union", "qkv.masks.AnyOf", hint=hint)
        return AnyOf
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
