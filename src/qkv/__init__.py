"""qkv: Transformer attention you can trust.

Public API::

    qkv.scaled_dot_product_attention(q, k, v, blocked_mask)  # (output, weights)
    qkv.attention(q, k, v, mask=..., is_causal=...)           # keyword API the modules use
    qkv.attention(q, k, v, mask=qkv.Causal(), backend="blockwise")  # fused / blockwise too
    qkv.explain_backend(q, k, v, mask=...)                    # which backend, and why
    qkv.masks                                                 # builders and converters
    qkv.masks                                      # masks as rules, never [T, S]
    qkv.MultiHeadAttention                                    # nn.MultiheadAttention-compatible
    qkv.Transformer(qkv.TransformerConfig(...))               # encoder-decoder model
    qkv.DecoderOnlyLM(qkv.DecoderOnlyConfig(...))             # GPT-style causal LM
    qkv.KVCache                                               # keys/values for decoding
"""

from qkv import masks
from qkv.functional import (
    BACKENDS,
    Backend,
    attention,
    explain_backend,
    scaled_dot_product_attention,
)
from qkv.masks import (
    Causal,
    Documents,
    MaskMod,
    Padding,
    SlidingWindow,
    StructuredMask,
)
from qkv.models import DecoderOnlyConfig, DecoderOnlyLM, Transformer, TransformerConfig
from qkv.nn.kv_cache import KVCache
from qkv.nn.multihead import MultiHeadAttention

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "Backend",
    "Causal",
    "DecoderOnlyConfig",
    "DecoderOnlyLM",
    "Documents",
    "KVCache",
    "MaskMod",
    "MultiHeadAttention",
    "Padding",
    "SlidingWindow",
    "StructuredMask",
    "Transformer",
    "TransformerConfig",
    "__version__",
    "attention",
    "explain_backend",
    "masks",
    "scaled_dot_product_attention",
]
