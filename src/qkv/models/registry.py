"""Model types by name: what a checkpoint's ``model_type`` means, and the way back.

A checkpoint stores ``model_type`` (a key of :data:`MODEL_TYPES`) and its config's ``to_dict()``;
:func:`model_from_config` rebuilds the (untrained) model from the two, :func:`model_type_of`
names a model's type when saving it.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from qkv.models.config import DecoderOnlyConfig, TransformerConfig
from qkv.models.decoder_only import DecoderOnlyLM
from qkv.models.transformer import Transformer

__all__ = ["MODEL_TYPES", "model_from_config", "model_type_of"]

# name -> (config class, model class)
MODEL_TYPES: dict[str, tuple[type[Any], type[nn.Module]]] = {
    "transformer": (TransformerConfig, Transformer),
    "decoder_only": (DecoderOnlyConfig, DecoderOnlyLM),
}


def model_from_config(model_type: str, config: dict[str, Any]) -> nn.Module:
    """A freshly initialised model of ``model_type`` built from a config dict (seed the RNG first
    for reproducible weights).

    Args:
        model_type: a key of :data:`MODEL_TYPES`.
        config: the config's ``to_dict()``.

    Returns:
        The model.

    Raises:
        ValueError: an unknown model type, or an unknown config key or invalid value (named).
    """
    if model_type not in MODEL_TYPES:
        raise ValueError(f"unknown model_type {model_type!r}; expected one of {list(MODEL_TYPES)}")
    config_cls, model_cls = MODEL_TYPES[model_type]
    return model_cls(config_cls.from_dict(config))


def model_type_of(model: nn.Module) -> str:
    """The :data:`MODEL_TYPES` key of ``model`` (exact class match, so subclasses are refused).

    Raises:
        TypeError: a model that is not of a registered type.
    """
    for name, (_, model_cls) in MODEL_TYPES.items():
        if type(model) is model_cls:
            return name
    raise TypeError(
        f"{type(model).__name__} is not a registered model type; expected one of "
        f"{[cls.__name__ for _, cls in MODEL_TYPES.values()]}"
    )
