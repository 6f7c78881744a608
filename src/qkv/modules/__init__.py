"""Building blocks above the attention function: they project, reshape and call it."""

from qkv.modules.feed_forward import FeedForward
from qkv.modules.kv_cache import KVCache
from qkv.modules.layers import DecoderLayer, EncoderLayer
from qkv.modules.multihead import MultiHeadAttention

__all__ = ["DecoderLayer", "EncoderLayer", "FeedForward", "KVCache", "MultiHeadAttention"]
