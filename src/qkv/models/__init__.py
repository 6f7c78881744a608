"""Whole models built from :mod:`qkv.nn`: the encoder–decoder Transformer, the decoder-only
language model and the BERT encoder; each file holds one model and its config."""

from qkv.models.config import DecoderOnlyConfig, TransformerConfig
from qkv.models.decoder_only import DecoderOnlyLM
from qkv.models.transformer import Transformer

__all__ = [
    "DecoderOnlyConfig",
    "DecoderOnlyLM",
    "Transformer",
    "TransformerConfig",
]
