"""A BERT encoder built from qkv parts: embeddings, then post-norm :class:`EncoderLayer` s.

This is the architecture of Hugging Face ``BertModel`` without its pooler (sentence embeddings
mean-pool the last hidden states instead; see :mod:`qkv.apps.embed`). Weights come from a checkpoint
through :func:`qkv.convert.load_bert`.

Shapes: B batch, T tokens, D ``hidden_size``, H ``num_attention_heads``, V ``vocab_size``.
Padding arrives as a Hugging Face ``attention_mask`` ``[B, T]`` (1 = token, 0 = padding),
converted once, at the edge, with :func:`qkv.masks.from_hf` into qkv's convention, or as the
``padding_mask`` every qkv model takes (bool ``[B, T]``, True = padding).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
from torch import Tensor, nn

from qkv._checks import check_positive_int, check_probability, checks_values
from qkv.backends.shared import share_plans
from qkv.dropout import Dropout
from qkv.functional import BACKENDS, Backend
from qkv.masks import from_hf
from qkv.models.config import ConfigDict
from qkv.models.inputs import check_ids, key_padding
from qkv.models.unpadded import BIAS_BACKENDS, encode_unpadded, runs_unpadded
from qkv.nn.layers import EncoderLayer
from qkv.nn.stacks import Encoder

__all__ = ["BERT_ACTIVATIONS", "BertActivation", "BertConfig", "BertEmbeddings", "BertEncoder"]

BertActivation = Literal["gelu", "relu"]
BERT_ACTIVATIONS: tuple[BertActivation, ...] = ("gelu", "relu")
"""``hidden_act`` values qkv reproduces exactly: ``"gelu"`` is the erf form in both libraries."""


@dataclass(frozen=True)
class BertConfig(ConfigDict):
    """The sizes of a BERT encoder; field names are those of Hugging Face's ``config.json``.

    Args:
        vocab_size: V, rows of the word embedding.
        hidden_size: D.
        num_hidden_layers: number of encoder layers.
        num_attention_heads: H; must divide ``hidden_size``.
        intermediate_size: inner width of the feed-forward blocks.
        hidden_act: ``"gelu"`` (exact erf form) or ``"relu"``.
        hidden_dropout_prob: dropout after the embeddings and on each residual branch.
        attention_probs_dropout_prob: dropout on the attention weights.
        max_position_embeddings: rows of the learned absolute position embedding (longest T).
        type_vocab_size: rows of the token-type (segment) embedding.
        layer_norm_eps: eps of every LayerNorm.
        pad_token_id: the padding token (its word-embedding row gets no gradient).

    Raises:
        TypeError: a size that is not an int, a probability that is not a number.
        ValueError: a non-positive size, heads that do not divide the width, an unsupported
            activation, a probability outside [0, 1], a pad id outside the vocabulary.
    """

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    hidden_act: BertActivation = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "max_position_embeddings",
            "type_vocab_size",
        ):
            check_positive_int(f"BertConfig.{name}", getattr(self, name))
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"BertConfig.hidden_size={self.hidden_size} is not divisible by "
                f"num_attention_heads={self.num_attention_heads}"
            )
        if self.hidden_act not in BERT_ACTIVATIONS:
            raise ValueError(
                f"BertConfig.hidden_act must be one of {BERT_ACTIVATIONS}, got "
                f"{self.hidden_act!r} (tanh-approximated GELUs such as 'gelu_new' would give "
                "other numbers than the checkpoint was trained with)"
            )
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
            check_probability(f"BertConfig.{name}", getattr(self, name))
        if not isinstance(self.layer_norm_eps, int | float) or not self.layer_norm_eps > 0:
            raise ValueError(f"BertConfig.layer_norm_eps must be > 0, got {self.layer_norm_eps!r}")
        if not isinstance(self.pad_token_id, int) or not 0 <= self.pad_token_id < self.vocab_size:
            raise ValueError(
                f"BertConfig.pad_token_id must lie in [0, vocab_size={self.vocab_size}), "
                f"got {self.pad_token_id!r}"
            )


class BertEmbeddings(nn.Module):
    """``dropout(norm(word[ids] + position[0..T-1] + token_type[type_ids]))``.

    Args:
        config: the sizes.
        device: parameter device.
        dtype: parameter dtype.
    """

    def __init__(
        self,
        config: BertConfig,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        D = config.hidden_size
        self.word_embeddings = nn.Embedding(
            config.vocab_size, D, padding_idx=config.pad_token_id, **factory
        )
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, D, **factory)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, D, **factory)
        self.norm = nn.LayerNorm(D, eps=config.layer_norm_eps, **factory)
        self.dropout = Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids: Tensor, token_type_ids: Tensor) -> Tensor:
        """Args:
            input_ids: ``[B, T]`` token ids.
            token_type_ids: ``[B, T]`` segment ids.

        Returns:
            ``[B, T, D]``.
        """
        T = input_ids.shape[1]
        positions = torch.arange(T, device=input_ids.device)  # [T]
        x = self.word_embeddings(input_ids)  # [B, T, D]
        x = x + self.position_embeddings(positions)[None]  # [B, T, D]
        x = x + self.token_type_embeddings(token_type_ids)  # [B, T, D]
        return self.dropout(self.norm(x))  # [B, T, D]


class BertEncoder(nn.Module):
    """Token ids to contextual hidden states, as ``BertModel(...).last_hidden_state``.

    Args:
        config: the sizes.
        backend: the :func:`qkv.attention` backend of every layer (see :attr:`backend`).
        device: parameter device.
        dtype: parameter dtype.

    Attributes:
        embeddings: :class:`BertEmbeddings`.
        encoder: :class:`~qkv.nn.stacks.Encoder` of post-norm :class:`EncoderLayer`
            (GELU, the config's eps), no final norm.

    Raises:
        ValueError: an unknown backend.
    """

    def __init__(
        self,
        config: BertConfig,
        *,
        backend: str = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        self.config = config
        self.embeddings = BertEmbeddings(config, **factory)
        layers = []
        for _ in range(config.num_hidden_layers):
            layer = EncoderLayer(
                config.hidden_size,
                config.num_attention_heads,
                config.intermediate_size,
                dropout=config.hidden_dropout_prob,
                activation=config.hidden_act,
                norm_first=False,
                layer_norm_eps=config.layer_norm_eps,
                **factory,
            )
            # BERT's dropouts differ from EncoderLayer's single rate: its own rate on the
            # attention weights, and none on the feed-forward activation.
            layer.self_attn.dropout = config.attention_probs_dropout_prob
            layer.ffn.dropout.p = 0.0
            layers.append(layer)
        self.encoder = Encoder(layers, norm=None)  # post-norm: each layer already ends in one
        self.backend = backend

    @property
    def backend(self) -> str:
        """The attention backend of every layer; one of ``qkv.attention.BACKENDS``."""
        return self._backend

    @backend.setter
    def backend(self, value: str) -> None:
        if value not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {value!r}")
        self._backend = value
        for layer in self.encoder.layers:
            assert isinstance(layer, EncoderLayer)
            layer.self_attn.backend = cast(Backend, value)

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        *,
        padding_mask: Tensor | None = None,
        validate: bool = True,
        unpad: bool = False,
    ) -> Tensor:
        """Encode a batch.

        Args:
            input_ids: ``[B, T]`` int token ids, ``T <= max_position_embeddings``.
            attention_mask: Hugging Face ``[B, T]``, 1 = token, 0 = padding (default: no
                padding). Padded keys are blocked; padded positions still get (unused) outputs,
                exactly as in ``BertModel``.
            token_type_ids: ``[B, T]`` segment ids (default: all 0).
            padding_mask: qkv's spelling of the same padding, as every qkv model takes it: bool
                ``[B, T]``, True = padding. Give this or ``attention_mask``, not both.
            validate: check the id and mask values (host syncs); False, or tracing / compiling,
                skips them (see :func:`qkv._checks.checks_values`) and each attention output's
                overflow look (see :func:`qkv.backends.shared.share_plans`): the layers then
                share one attention plan, with one host sync at most (a padding mask's
                lengths). A checked mask without any padding is dropped (attention runs
                maskless).
            unpad: run the layers on the real tokens only (see :mod:`qkv.models.unpadded`):
                no linear layer, norm or attention works on padding. The real tokens' states
                are those of the padded path (to float roundoff); padding positions come back
                as zeros. Plans on the host (one sync). Tracing, compiling, hooks and recording
                attention weights take the padded path.

        Returns:
            ``[B, T, D]`` last hidden states.

        Raises:
            TypeError: ids that are not integer tensors, a ``padding_mask`` that is not bool.
            ValueError: ids that are not ``[B, T]`` or lie outside their embedding, ``T`` longer
                than ``max_position_embeddings``, an ``attention_mask`` or ``padding_mask`` of
                another shape, an ``attention_mask`` with values other than 0 and 1, or both
                masks.
        """
        token_type_ids = self._checked_ids(input_ids, token_type_ids, validate)
        is_pad = self._padding(input_ids, attention_mask, padding_mask, validate)  # [B, T]|None
        x = self.embeddings(input_ids, token_type_ids)  # [B, T, D]
        with share_plans(validate=validate):  # the layers share one attention plan
            if unpad and is_pad is not None and self._unpaddable():
                return encode_unpadded(self._layers(), x, is_pad)  # [B, T, D]
            return self._encode_padded(x, is_pad, checks_values(validate))  # [B, T, D]

    def _checked_ids(
        self, input_ids: Tensor, token_type_ids: Tensor | None, validate: bool
    ) -> Tensor:
        """Check the ids (see :meth:`forward`); return the token types (default all 0)."""
        cfg = self.config
        if not isinstance(input_ids, Tensor) or input_ids.dim() != 2:
            got = list(input_ids.shape) if isinstance(input_ids, Tensor) else type(input_ids)
            raise ValueError(f"input_ids must be [B, T], got {got}")
        B, T = input_ids.shape
        check_ids("input_ids", input_ids, cfg.vocab_size, field="vocab_size", validate=validate)
        if cfg.max_position_embeddings < T:
            raise ValueError(
                f"input_ids has T={T} tokens but max_position_embeddings="
                f"{cfg.max_position_embeddings}; truncate the input"
            )
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        field = "type_vocab_size"
        vocab = cfg.type_vocab_size
        check_ids(
            "token_type_ids", token_type_ids, vocab, field=field, shape=(B, T), validate=validate
        )
        return token_type_ids

    @staticmethod
    def _padding(
        input_ids: Tensor,
        attention_mask: Tensor | None,
        padding_mask: Tensor | None,
        validate: bool,
    ) -> Tensor | None:
        """The padding of either spelling as bool ``[B, T]``, True = padding, or None (checked
        and without any padding). Raises as :meth:`forward`."""
        if attention_mask is not None and padding_mask is not None:
            raise ValueError("give attention_mask (Hugging Face) or padding_mask (qkv), not both")
        if padding_mask is not None:
            return key_padding(padding_mask, input_ids, "padding_mask", validate)  # [B, T]|None
        if attention_mask is None:
            return None
        if tuple(attention_mask.shape) != tuple(input_ids.shape):
            raise ValueError(
                f"attention_mask must be [B, T] = {list(input_ids.shape)}, "
                f"got {list(attention_mask.shape)}"
            )
        is_pad = from_hf(attention_mask, validate=validate)[:, 0, 0]  # [B, T]
        if checks_values(validate) and not bool(is_pad.any()):
            return None
        return is_pad

    def _encode_padded(self, x: Tensor, is_pad: Tensor | None, checked: bool) -> Tensor:
        """The :class:`Encoder` on the padded batch ``x`` ``[B, T, D]``.

        A ``checked`` padding with a token in every sample (no row fully blocked) goes to SDPA
        backends as a float bias: one batched call, not the per-length calls a bool mask is cut
        into.
        """
        if is_pad is None:
            return self.encoder(x)  # [B, T, D]
        mask = is_pad[:, None, None, :]  # [B, 1, 1, T], True = padding
        sdpa = all(layer.self_attn.backend in BIAS_BACKENDS for layer in self._layers())
        if sdpa and checked and not bool(is_pad.all(dim=-1).any()):
            bias = x.new_zeros(mask.shape).masked_fill(mask, -torch.inf)  # [B, 1, 1, T]
            return self.encoder(x, attn_bias=bias)  # [B, T, D]
        return self.encoder(x, mask)  # [B, T, D]

    def _layers(self) -> list[EncoderLayer]:
        return cast(list[EncoderLayer], list(self.encoder.layers))

    def _unpaddable(self) -> bool:
        """Whether :func:`encode_unpadded` may run the layers: eagerly, and where nothing
        observes the stack or a layer (hooks, recorded weights)."""
        if torch.jit.is_tracing() or torch.compiler.is_compiling():
            return False
        if self.encoder._forward_hooks or self.encoder._forward_pre_hooks:
            return False
        return all(runs_unpadded(layer) for layer in self._layers())
