"""Model configurations: frozen dataclasses, validated in ``__post_init__``.

:class:`ModelConfig` holds the fields the encoder–decoder :class:`TransformerConfig` and the
decoder-only :class:`DecoderOnlyConfig` share (widths, dropout, activation, norm, positions);
each model adds its vocabulary, layer counts and special tokens, and sets its own defaults.
A config is the whole description of an architecture: ``to_dict`` gives a JSON-serialisable dict
(saved next to checkpoints) and ``from_dict`` reads it back, refusing unknown keys and mapping
the keys of earlier releases (``max_len`` -> ``max_positions``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Self, TypeVar, cast

from qkv._checks import (
    check_bool,
    check_nonnegative_int,
    check_positive_int,
    check_probability,
)
from qkv._deprecation import RenamedAttribute, renamed_keyword
from qkv.nn.feed_forward import ACTIVATIONS, Activation
from qkv.nn.norms import NORMS, NormKind
from qkv.nn.positions import POSITIONALS, ROPE_LAYOUTS, Positional, RopeLayout

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = [
    "NORMS",
    "POSITIONALS",
    "ConfigDict",
    "DecoderOnlyConfig",
    "ModelConfig",
    "TransformerConfig",
]

_T = TypeVar("_T", bound=type)


class ConfigDict:
    """``to_dict`` / ``from_dict`` for a frozen config dataclass, written once.

    Attributes:
        legacy_keys: keys of earlier releases and the field each became; ``from_dict`` maps them.
    """

    legacy_keys: ClassVar[dict[str, str]] = {}

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict of every field."""
        return dataclasses.asdict(cast("DataclassInstance", self))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Self:
        """Inverse of :meth:`to_dict`; also reads the keys of earlier releases.

        Raises:
            TypeError: ``d`` is not a dict.
            ValueError: an unknown key (named), a legacy key next to its new name, or an
                invalid value.
        """
        if not isinstance(d, dict):
            raise TypeError(f"{cls.__name__}.from_dict expects a dict, got {type(d).__name__}")
        d = dict(d)
        for old, new in cls.legacy_keys.items():
            if old in d:
                if new in d:
                    raise ValueError(f"{cls.__name__}: give {new!r} only, not also {old!r}")
                d[new] = d.pop(old)
        known = {f.name for f in dataclasses.fields(cast("type[DataclassInstance]", cls))}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(
                f"unknown {cls.__name__} keys {unknown}; known keys are {sorted(known)}"
            )
        return cls(**d)


def _accepts_max_len(cls: _T) -> _T:
    """Let ``cls(max_len=...)`` stand for ``max_positions`` for one release, with a warning."""
    init: Callable[..., None] = cls.__init__  # type: ignore[misc]

    @functools.wraps(init)
    def init_accepting_max_len(self: Any, *args: Any, **kwargs: Any) -> None:
        if "max_len" in kwargs:
            old, new = kwargs.pop("max_len"), kwargs.pop("max_positions", None)
            owner = cls.__name__
            kwargs["max_positions"] = renamed_keyword(
                "max_len", old, "max_positions", new, owner=owner
            )
        init(self, *args, **kwargs)

    cls.__init__ = init_accepting_max_len  # type: ignore[misc]
    return cls


@dataclass(frozen=True, kw_only=True)
class ModelConfig(ConfigDict):
    """The fields every qkv language model shares (defaults: the paper's base model).

    Args:
        d_model: D, the model width.
        num_heads: H; must divide ``d_model``.
        dim_feedforward: inner width of the feed-forward blocks.
        dropout: on attention weights, the FFN activation, residual branches, embeddings.
        activation: ``"relu"``, ``"gelu"`` or ``"swiglu"``.
        norm_first: pre-norm (True) or post-norm (False) layers.
        norm: ``"layer"`` (LayerNorm) or ``"rms"`` (RMSNorm).
        layer_norm_eps: eps of every norm.
        positional: ``"sinusoidal"``, ``"learned"``, ``"rotary"``, ``"alibi"`` or ``"none"``.
        max_positions: the longest sequence the positions (and a default KV cache) cover.
        num_kv_heads: key/value heads for grouped-query attention (default H).
        tie_embeddings: the output head shares the (target) token embedding matrix.
        qkv_bias: biases on the attention's query/key/value projections.
        out_bias: a bias on the attention's output projection.
        ffn_bias: biases in the feed-forward blocks.
        rope_theta: the rotary wavelength base (``positional="rotary"``).
        rope_layout: which head dims rotary embeddings rotate together: ``"half_split"``
            ``(x[i], x[i + Dh/2])`` (Hugging Face Llama) or ``"interleaved"`` ``(x[2i], x[2i+1])``
            (GPT-J, Meta's original Llama); see :data:`qkv.nn.positional.ROPE_LAYOUTS`.
        attn_scale: the attention's score multiplier; None: ``1 / sqrt(head_dim)``. T5 uses
            1.0 (its query weights carry the scale).
        relative_buckets: buckets of T5's relative position bias (``positional="relative"``).
        relative_max_distance: its longest bucketed distance (``positional="relative"``).

    Raises:
        TypeError / ValueError: in ``__post_init__``, naming the first bad field and its value.
    """

    legacy_keys: ClassVar[dict[str, str]] = {"max_len": "max_positions"}

    d_model: int = 512
    num_heads: int = 8
    dim_feedforward: int = 2048
    dropout: float = 0.1
    activation: Activation = "relu"
    norm_first: bool = False
    norm: NormKind = "layer"
    layer_norm_eps: float = 1e-5
    positional: Positional = "sinusoidal"
    max_positions: int = 512
    num_kv_heads: int | None = None
    tie_embeddings: bool = False
    qkv_bias: bool = True
    out_bias: bool = True
    ffn_bias: bool = True
    rope_theta: float = 10000.0
    rope_layout: RopeLayout = "half_split"
    attn_scale: float | None = None
    relative_buckets: int = 32
    relative_max_distance: int = 128

    def __post_init__(self) -> None:
        for name in ("d_model", "num_heads", "dim_feedforward", "max_positions"):
            check_positive_int(name, getattr(self, name))
        if self.d_model % self.num_heads != 0:
            raise ValueError(
                f"d_model={self.d_model} is not divisible by num_heads={self.num_heads}"
            )
        if self.num_kv_heads is not None:
            check_positive_int("num_kv_heads", self.num_kv_heads)
            if self.num_heads % self.num_kv_heads != 0:
                raise ValueError(
                    f"num_heads={self.num_heads} is not divisible by num_kv_heads="
                    f"{self.num_kv_heads} (grouped-query attention shares each key/value head "
                    "among a group of heads)"
                )
        check_probability("dropout", self.dropout, inclusive_one=False)
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if self.norm not in NORMS:
            raise ValueError(f"norm must be one of {NORMS}, got {self.norm!r}")
        eps = self.layer_norm_eps
        if not isinstance(eps, int | float) or isinstance(eps, bool) or not eps > 0:
            raise ValueError(f"layer_norm_eps must be a positive float, got {eps!r}")
        if self.positional not in POSITIONALS:
            raise ValueError(f"positional must be one of {POSITIONALS}, got {self.positional!r}")
        if self.positional == "rotary" and self.head_dim % 2 != 0:
            raise ValueError(
                f"positional='rotary' needs an even head width, got d_model / num_heads = "
                f"{self.head_dim}"
            )
        for name in ("norm_first", "tie_embeddings", "qkv_bias", "out_bias", "ffn_bias"):
            check_bool(name, getattr(self, name))
        theta = self.rope_theta
        if not isinstance(theta, int | float) or isinstance(theta, bool) or not theta > 1:
            raise ValueError(f"rope_theta must be a float > 1, got {theta!r}")
        if self.rope_layout not in ROPE_LAYOUTS:
            raise ValueError(f"rope_layout must be one of {ROPE_LAYOUTS}, got {self.rope_layout!r}")
        if self.attn_scale is not None:
            _check_positive_float("attn_scale", self.attn_scale)
        check_positive_int("relative_buckets", self.relative_buckets)
        check_positive_int("relative_max_distance", self.relative_max_distance)
        if self.positional == "relative" and (
            self.relative_buckets < 4 or self.relative_max_distance <= self.relative_buckets // 2
        ):
            raise ValueError(
                f"positional='relative' needs relative_buckets >= 4 and relative_max_distance > "
                f"relative_buckets // 2, got {self.relative_buckets} and "
                f"{self.relative_max_distance}"
            )

    @property
    def head_dim(self) -> int:
        """Dh = ``d_model // num_heads``."""
        return self.d_model // self.num_heads

    max_len = RenamedAttribute[int]("max_positions")

    def positional_kwargs(self) -> dict[str, Any]:
        """The arguments of :func:`~qkv.nn.positions.make_positional` for a model built from
        this config (its ``positional`` module)."""
        return {
            "kind": self.positional,
            "d_model": self.d_model,
            "num_heads": self.num_heads,
            "max_positions": self.max_positions,
            "rope_theta": self.rope_theta,
            "rope_layout": self.rope_layout,
            "relative_buckets": self.relative_buckets,
            "relative_max_distance": self.relative_max_distance,
        }

    def layer_kwargs(self) -> dict[str, Any]:
        """The constructor arguments every :class:`~qkv.nn.layers.EncoderLayer` /
        :class:`~qkv.nn.layers.DecoderLayer` of a model built from this config shares."""
        return {
            "d_model": self.d_model,
            "num_heads": self.num_heads,
            "dim_feedforward": self.dim_feedforward,
            "dropout": self.dropout,
            "activation": self.activation,
            "norm_first": self.norm_first,
            "layer_norm_eps": self.layer_norm_eps,
            "norm": self.norm,
            "num_kv_heads": self.num_kv_heads,
            "qkv_bias": self.qkv_bias,
            "out_bias": self.out_bias,
            "ffn_bias": self.ffn_bias,
            "attn_scale": self.attn_scale,
        }


def _check_positive_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"{name} must be a positive float, got {value!r}")
    return float(value)


def _check_token(name: str, value: int | None, vocab: int, vocab_name: str) -> None:
    if value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < vocab:
        raise ValueError(f"{name}={value!r} must be a token id in [0, {vocab_name}={vocab})")


@_accepts_max_len
@dataclass(frozen=True)
class TransformerConfig(ModelConfig):
    """The encoder–decoder Transformer (defaults: the paper's base model).

    Only the vocabulary sizes may be given positionally; every other field is keyword-only.

    Args:
        src_vocab_size: source vocabulary.
        tgt_vocab_size: target vocabulary (the head's width).
        num_encoder_layers: encoder layers (0 allowed).
        num_decoder_layers: decoder layers (at least 1).
        pad_id: padding token of both vocabularies.
        bos_id: the token decoding starts from. It may equal ``pad_id`` (Marian and T5 start
            from the pad token): the first target token is then never taken for padding.
        eos_id: the token that ends a target.
        scale_embeddings: multiply token embeddings by ``sqrt(d_model)`` (the paper, Marian);
            False: unscaled (BART).
        embed_norm: a norm right after the embeddings and positions of each stack
            (``src_embed_norm``, ``tgt_embed_norm``: BART's ``layernorm_embedding``).
        final_norm: each stack ends with a norm (``encoder.norm``, ``decoder.norm``), as
            ``nn.Transformer`` and pre-norm models do; False: none (BART's post-norm stacks).
        share_positions: the encoder and decoder share one positional module; False: the
            decoder has its own (``tgt_positional``; BART learns one table per stack).
        head_bias: a bias on the output head (BART's and Marian's ``final_logits_bias``).
        output_scale: the decoder's output is multiplied by it before the head (T5 with a head
            tied to its embedding: ``d_model ** -0.5``).
        forced_bos_id: :meth:`~qkv.Transformer.generate` makes it the first generated token
            (``transformers``' ``forced_bos_token_id``), or None.
        forced_eos_id: the token the last step of :meth:`~qkv.Transformer.generate` is forced
            to (``forced_eos_token_id``; BART's default config sets it to its ``eos``), or None.
        others: see :class:`ModelConfig`.

    Raises:
        TypeError / ValueError: in ``__post_init__``, naming the first bad field and its value.
    """

    src_vocab_size: int
    tgt_vocab_size: int
    _: KW_ONLY
    num_encoder_layers: int = 6
    num_decoder_layers: int = 6
    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    scale_embeddings: bool = True
    embed_norm: bool = False
    final_norm: bool = True
    share_positions: bool = True
    head_bias: bool = False
    output_scale: float = 1.0
    forced_bos_id: int | None = None
    forced_eos_id: int | None = None

    def __post_init__(self) -> None:
        check_positive_int("src_vocab_size", self.src_vocab_size)
        check_positive_int("tgt_vocab_size", self.tgt_vocab_size)
        super().__post_init__()
        check_nonnegative_int("num_encoder_layers", self.num_encoder_layers)
        check_positive_int("num_decoder_layers", self.num_decoder_layers)
        for name in ("pad_id", "bos_id", "eos_id", "forced_bos_id", "forced_eos_id"):
            _check_token(name, getattr(self, name), self.tgt_vocab_size, "tgt_vocab_size")
        _check_token("pad_id", self.pad_id, self.src_vocab_size, "src_vocab_size")
        for name in ("scale_embeddings", "embed_norm", "final_norm", "share_positions"):
            check_bool(name, getattr(self, name))
        check_bool("head_bias", self.head_bias)
        _check_positive_float("output_scale", self.output_scale)


@_accepts_max_len
@dataclass(frozen=True)
class DecoderOnlyConfig(ModelConfig):
    """A GPT-style causal language model (pre-norm, rotary positions, tied embeddings).

    Only ``vocab_size`` may be given positionally; every other field is keyword-only.

    Args:
        vocab_size: V.
        num_layers: causal blocks (at least 1).
        pad_id: padding token, or None (no padding derived from the ids).
        eos_id: the token that ends a generation, or None.
        others: see :class:`ModelConfig`; the defaults differ (a small GPT).

    Raises:
        TypeError / ValueError: in ``__post_init__``, naming the first bad field and its value.
    """

    vocab_size: int
    _: KW_ONLY
    num_layers: int = 4
    pad_id: int | None = None
    eos_id: int | None = None
    d_model: int = 256
    num_heads: int = 4
    dim_feedforward: int = 1024
    activation: Activation = "gelu"
    norm_first: bool = True
    positional: Positional = "rotary"
    max_positions: int = 1024
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        check_positive_int("vocab_size", self.vocab_size)
        super().__post_init__()
        check_positive_int("num_layers", self.num_layers)
        for name in ("pad_id", "eos_id"):
            _check_token(name, getattr(self, name), self.vocab_size, "vocab_size")
