"""Model configurations: one frozen dataclass per model, validated in ``__post_init__``.

A config is the whole description of an architecture: ``to_dict`` gives a JSON-serialisable dict
(saved next to checkpoints) and ``from_dict`` reads it back, refusing unknown keys.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, TypeVar

from qkv.nn.feed_forward import ACTIVATIONS

__all__ = ["NORMS", "POSITIONALS", "DecoderOnlyConfig", "TransformerConfig", "layer_kwargs"]

NORMS: tuple[str, ...] = ("layer", "rms")
POSITIONALS: tuple[str, ...] = ("sinusoidal", "learned", "rotary", "alibi", "none")

_C = TypeVar("_C")


def _positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _check_common(cfg: Any, vocab_fields: tuple[str, ...], layer_fields: tuple[str, ...]) -> None:
    for name in (*vocab_fields, "d_model", "num_heads", "dim_feedforward", "max_len"):
        _positive(name, getattr(cfg, name))
    for name in layer_fields:
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    if cfg.d_model % cfg.num_heads != 0:
        raise ValueError(f"d_model={cfg.d_model} is not divisible by num_heads={cfg.num_heads}")
    if cfg.num_kv_heads is not None:
        _positive("num_kv_heads", cfg.num_kv_heads)
        if cfg.num_heads % cfg.num_kv_heads != 0:
            raise ValueError(
                f"num_heads={cfg.num_heads} is not divisible by num_kv_heads={cfg.num_kv_heads} "
                "(grouped-query attention shares each key/value head among a group of heads)"
            )
    if not isinstance(cfg.dropout, int | float) or not 0.0 <= cfg.dropout < 1.0:
        raise ValueError(f"dropout must lie in [0, 1), got {cfg.dropout!r}")
    if cfg.activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {cfg.activation!r}")
    if cfg.norm not in NORMS:
        raise ValueError(f"norm must be one of {NORMS}, got {cfg.norm!r}")
    if not cfg.layer_norm_eps > 0:
        raise ValueError(f"layer_norm_eps must be positive, got {cfg.layer_norm_eps!r}")
    if cfg.positional not in POSITIONALS:
        raise ValueError(f"positional must be one of {POSITIONALS}, got {cfg.positional!r}")
    head_dim = cfg.d_model // cfg.num_heads
    if cfg.positional == "rotary" and head_dim % 2 != 0:
        raise ValueError(
            f"positional='rotary' needs an even head width, got d_model / num_heads = {head_dim}"
        )
    if not isinstance(cfg.norm_first, bool) or not isinstance(cfg.tie_embeddings, bool):
        raise ValueError("norm_first and tie_embeddings must be bools")


def _check_token(name: str, value: int | None, vocab: int, vocab_name: str) -> None:
    if value is None:
        return
    if not isinstance(value, int) or not 0 <= value < vocab:
        raise ValueError(f"{name}={value!r} must be a token id in [0, {vocab_name}={vocab})")


def layer_kwargs(cfg: TransformerConfig | DecoderOnlyConfig) -> dict[str, Any]:
    """The constructor arguments every :class:`~qkv.nn.layers.EncoderLayer` /
    :class:`~qkv.nn.layers.DecoderLayer` of a model built from ``cfg`` shares."""
    return {
        "d_model": cfg.d_model,
        "num_heads": cfg.num_heads,
        "dim_feedforward": cfg.dim_feedforward,
        "dropout": cfg.dropout,
        "activation": cfg.activation,
        "norm_first": cfg.norm_first,
        "layer_norm_eps": cfg.layer_norm_eps,
        "norm": cfg.norm,
        "num_kv_heads": cfg.num_kv_heads,
    }


def _from_dict(cls: type[_C], d: dict[str, Any]) -> _C:
    if not isinstance(d, dict):
        raise TypeError(f"expected a dict, got {type(d).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"unknown {cls.__name__} keys {unknown}; known keys are {sorted(known)}")
    return cls(**d)


@dataclass(frozen=True)
class TransformerConfig:
    """The encoder–decoder Transformer (defaults: the paper's base model).

    Raises:
        ValueError: in ``__post_init__``, naming the first bad field and its value.
    """

    src_vocab_size: int
    tgt_vocab_size: int
    d_model: int = 512
    num_heads: int = 8
    num_encoder_layers: int = 6
    num_decoder_layers: int = 6
    dim_feedforward: int = 2048
    dropout: float = 0.1
    activation: str = "relu"
    norm_first: bool = False
    norm: str = "layer"
    layer_norm_eps: float = 1e-5
    positional: str = "sinusoidal"
    max_len: int = 512
    num_kv_heads: int | None = None
    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        _check_common(
            self,
            ("src_vocab_size", "tgt_vocab_size"),
            ("num_encoder_layers", "num_decoder_layers"),
        )
        if self.num_decoder_layers < 1:
            raise ValueError(f"num_decoder_layers must be >= 1, got {self.num_decoder_layers}")
        for name in ("pad_id", "bos_id", "eos_id"):
            _check_token(name, getattr(self, name), self.tgt_vocab_size, "tgt_vocab_size")
        if self.bos_id == self.pad_id:
            raise ValueError(
                f"bos_id and pad_id must differ (pad positions are masked out), both are "
                f"{self.pad_id}"
            )
        if self.pad_id >= self.src_vocab_size:
            raise ValueError(
                f"pad_id={self.pad_id} must be a token id in [0, src_vocab_size="
                f"{self.src_vocab_size})"
            )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict of every field."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TransformerConfig:
        """Inverse of :meth:`to_dict`.

        Raises:
            ValueError: an unknown key (named), or an invalid value.
        """
        return _from_dict(cls, d)


@dataclass(frozen=True)
class DecoderOnlyConfig:
    """A GPT-style causal language model (pre-norm, rotary positions, tied embeddings).

    Raises:
        ValueError: in ``__post_init__``, naming the first bad field and its value.
    """

    vocab_size: int
    d_model: int = 256
    num_heads: int = 4
    num_layers: int = 4
    dim_feedforward: int = 1024
    dropout: float = 0.1
    activation: str = "gelu"
    norm_first: bool = True
    norm: str = "layer"
    layer_norm_eps: float = 1e-5
    positional: str = "rotary"
    max_len: int = 1024
    num_kv_heads: int | None = None
    pad_id: int | None = None
    eos_id: int | None = None
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        _check_common(self, ("vocab_size",), ("num_layers",))
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.num_layers}")
        for name in ("pad_id", "eos_id"):
            _check_token(name, getattr(self, name), self.vocab_size, "vocab_size")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict of every field."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DecoderOnlyConfig:
        """Inverse of :meth:`to_dict`.

        Raises:
            ValueError: an unknown key (named), or an invalid value.
        """
        return _from_dict(cls, d)
