"""qkv: Transformer attention you can trust.

Public API::

    qkv.scaled_dot_product_attention(q, k, v, blocked_mask)  # (output, weights)
    qkv.attention(q, k, v, mask=..., is_causal=...)           # keyword API the modules use
    qkv.masks                                                 # builders and converters
    qkv.MultiHeadAttention                                    # nn.MultiheadAttention-compatible
    qkv.Transformer(qkv.TransformerConfig(...))               # encoder-decoder model
    qkv.DecoderOnlyLM(qkv.DecoderOnlyConfig(...))             # GPT-style causal LM
    qkv.KVCache                                               # keys/values for decoding
"""

from qkv import masks
from qkv.attention import attention, scaled_dot_product_attention
from qkv.models import DecoderOnlyConfig, DecoderOnlyLM, Transformer, TransformerConfig
from qkv.modules.kv_cache import KVCache
from qkv.modules.multihead import MultiHeadAttention

__version__ = "0.1.0"

__all__ = [
    "DecoderOnlyConfig",
    "DecoderOnlyLM",
    "KVCache",
    "MultiHeadAttention",
    "Transformer",
    "TransformerConfig",
    "__version__",
    "attention",
    "masks",
    "scaled_dot_product_attention",
]
