"""Whole models built from :mod:`qkv.modules`: the encoder–decoder Transformer, the decoder-only
language model and the BERT encoder; each file holds one model and its config."""

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
