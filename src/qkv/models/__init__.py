"""Whole models: the encoder–decoder Transformer and the decoder-only language model."""

from qkv.models.config import DecoderOnlyConfig, TransformerConfig
from qkv.models.decoder_only import DecoderOnlyLM
from qkv.models.encoder_decoder import Transformer
from qkv.models.stacks import Decoder, Encoder, EncoderDecoder

__all__ = [
    "Decoder",
    "DecoderOnlyConfig",
    "DecoderOnlyLM",
    "Encoder",
    "EncoderDecoder",
    "Transformer",
    "TransformerConfig",
]
