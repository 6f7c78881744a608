"""Model types by name: build a model from a saved config, name a model's type, load weights.

A checkpoint stores a model as ``(model_type, config dict, weights)``; this module turns the
three back into a model. :func:`load_weights` is the one way weights enter a model here: it
upgrades the state-dict keys of earlier releases, checks every name and shape with a message
that names the key and both shapes, then loads strictly.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from qkv.models.config import DecoderOnlyConfig, TransformerConfig
from qkv.models.decoder_only import DecoderOnlyLM, upgrade_state_dict
from qkv.models.transformer import Transformer

__all__ = [
    "MODEL_TYPES",
    "ModelType",
    "check_weights",
    "load_weights",
    "model_from_config",
    "model_type_of",
    "upgrade_weights",
]


@dataclass(frozen=True)
class ModelType:
    """One registered model: its class, its config class, and its legacy-key upgrade.

    Attributes:
        model: the ``nn.Module`` class, built as ``model(config)``.
        config: the config dataclass, read with ``config.from_dict``.
        upgrade: maps the state-dict keys of earlier releases to today's (identity if none).
    """

    model: type[nn.Module]
    config: type[TransformerConfig] | type[DecoderOnlyConfig]
    upgrade: Callable[[Mapping[str, Tensor]], dict[str, Tensor]] = dict


MODEL_TYPES: dict[str, ModelType] = {
    "transformer": ModelType(Transformer, TransformerConfig),
    "decoder_only": ModelType(DecoderOnlyLM, DecoderOnlyConfig, upgrade_state_dict),
}
"""Model type name (as saved in checkpoints) -> :class:`ModelType`."""


def _entry(model_type: object) -> ModelType:
    if not isinstance(model_type, str) or model_type not in MODEL_TYPES:
        raise ValueError(
            f"unknown model_type {model_type!r}; expected one of {sorted(MODEL_TYPES)}"
        )
    return MODEL_TYPES[model_type]


def model_from_config(model_type: str, config: dict[str, Any]) -> nn.Module:
    """A freshly initialised model of ``model_type`` built from a saved config dict.

    Args:
        model_type: a key of :data:`MODEL_TYPES`.
        config: the config's ``to_dict()`` (keys of earlier releases such as ``max_len`` read).

    Returns:
        The model (seed the RNG first for reproducible initial weights).

    Raises:
        TypeError: ``config`` is not a dict.
        ValueError: an unknown model type, an unknown config key (named), an invalid value.
    """
    entry = _entry(model_type)
    return entry.model(entry.config.from_dict(config))


def model_type_of(model: nn.Module) -> str:
    """The :data:`MODEL_TYPES` name of ``model``'s class.

    Raises:
        TypeError: a model of no registered type.
    """
    for name, entry in MODEL_TYPES.items():
        if type(model) is entry.model:
            return name
    raise TypeError(
        f"{type(model).__name__} is not a registered model type; expected one of "
        f"{[e.model.__name__ for e in MODEL_TYPES.values()]}"
    )


def upgrade_weights(model: nn.Module, weights: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``weights`` with the keys of earlier releases renamed for ``model``'s type.

    For code that inspects keys before loading; :func:`load_weights` calls it itself.

    Raises:
        TypeError: a model of no registered type.
    """
    return MODEL_TYPES[model_type_of(model)].upgrade(weights)


def load_weights(
    model: nn.Module, weights: Mapping[str, Tensor], where: str = "the weights"
) -> nn.Module:
    """Load ``weights`` into ``model`` after upgrading legacy keys and checking every tensor.

    Args:
        model: a model of a registered type.
        weights: a state dict (of this or an earlier release).
        where: what the weights are (a checkpoint path), for the messages.

    Returns:
        ``model``, its weights replaced.

    Raises:
        TypeError: a model of no registered type.
        ValueError: names every missing, unexpected or differently shaped/typed key, with both
            shapes; nothing is copied then.
    """
    upgraded = upgrade_weights(model, weights)
    check_weights(model, upgraded, where)
    model.load_state_dict(upgraded, strict=True)
    return model


def check_weights(model: nn.Module, weights: Mapping[str, Tensor], where: str) -> None:
    """Check that ``weights`` (keys already upgraded) fit ``model`` exactly, copying nothing.

    Raises:
        ValueError: names every missing, unexpected or differently shaped/typed key, with both
            shapes (the first five, and how many more).
    """
    upgraded = weights
    expected = model.state_dict()
    problems = []
    for k in sorted(set(expected) | set(upgraded)):
        if k not in upgraded:
            problems.append(
                f"{k!r} is missing from the weights (model expects shape "
                f"{tuple(expected[k].shape)})"
            )
        elif k not in expected:
            problems.append(
                f"{k!r} (shape {tuple(upgraded[k].shape)}) in the weights is not in the model"
            )
        elif upgraded[k].shape != expected[k].shape or upgraded[k].dtype != expected[k].dtype:
            problems.append(
                f"{k!r} has shape {tuple(upgraded[k].shape)} {upgraded[k].dtype} in the weights "
                f"but {tuple(expected[k].shape)} {expected[k].dtype} in the model built from "
                f"the config"
            )
    if problems:
        shown = "; ".join(problems[:5]) + (
            f"; ... {len(problems) - 5} more" if len(problems) > 5 else ""
        )
        raise ValueError(f"config/weights mismatch in {where}: {shown}")
