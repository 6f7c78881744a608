"""qkv's one mask system: rules, the tensor builders that materialize them, and converters."""

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
    EMPTY,
    FULL,
    Causal,
    Dense,
    Documents,
    MaskMod,
    Padding,
    SlidingWindow,
    StructuredMask,
    TileMask,
    Union,
)

__all__ = [
    "EMPTY",
    "FULL",
    "Causal",
    "Dense",
    "Documents",
    "MaskMod",
    "Padding",
    "SlidingWindow",
    "StructuredMask",
    "TileMask",
    "Union",
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
