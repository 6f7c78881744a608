"""Whole models built from :mod:`qkv.nn`: the encoder–decoder Transformer, the decoder-only
language model and the BERT encoder; each file holds one model, ``config`` their configs,
``registry`` the model types by name (checkpoints)."""

from qkv.models.config import DecoderOnlyConfig, ModelConfig, TransformerConfig
from qkv.models.decoder_only import DecoderOnlyLM
from qkv.models.registry import MODEL_TYPES, load_weights, model_from_config, model_type_of
from qkv.models.transformer import Transformer

__all__ = [
    "MODEL_TYPES",
    "DecoderOnlyConfig",
    "DecoderOnlyLM",
    "ModelConfig",
    "Transformer",
    "TransformerConfig",
    "load_weights",
    "model_from_config",
    "model_type_of",
]
