"""Building blocks above the attention function: they project, reshape and call it."""

from qkv.dropout import Dropout
from qkv.nn.feed_forward import FeedForward
from qkv.nn.kv_cache import KVCache
from qkv.nn.layers import DecoderLayer, EncoderLayer
from qkv.nn.multihead import MultiHeadAttention
from qkv.nn.stacks import Decoder, Encoder, EncoderDecoder
from qkv.nn.static_kv_cache import StaticKVCache

__all__ = [
    "Decoder",
    "DecoderLayer",
    "Dropout",
    "Encoder",
    "EncoderDecoder",
    "EncoderLayer",
    "FeedForward",
    "KVCache",
    "MultiHeadAttention",
    "StaticKVCache",
]
