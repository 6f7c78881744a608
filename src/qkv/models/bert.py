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

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.checks import check_positive_int, check_probability, checks_values
from qkv.dropout import Dropout
from qkv.functional import BACKENDS, Backend, attention
from qkv.masks import from_hf
from qkv.masks import padding_mask as padding_mask_of
from qkv.models.config import ConfigDict
from qkv.models.inputs import check_ids, key_padding
from qkv.models.packing import plan_packing
from qkv.nn.layers import EncoderLayer
from qkv.nn.multihead import MultiHeadAttention
from qkv.nn.stacks import Encoder

__all__ = ["BERT_ACTIVATIONS", "BertActivation", "BertConfig", "BertEmbeddings", "BertEncoder"]

_BIAS_BACKENDS = ("auto", "fused")
"""Backends the unpadded path gives its padding as a float bias (see ``BertEncoder.forward``)."""

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
        # layer index -> (what its weights were built from, the weights), see _weights
        self._transposed: dict[int, tuple[tuple[object, ...], _LayerWeights]] = {}

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
            validate: check the id and ``attention_mask`` values (a host sync per call);
                False, or tracing / compiling, skips it (see :func:`qkv.checks.checks_values`).
                A checked mask without any padding is dropped, so attention runs maskless.
            unpad: run the layers on the real tokens only, packed by length (see
                :mod:`qkv.models.packing`): no linear layer, norm or attention works on padding.
                The real tokens' states are those of the padded path (to float roundoff);
                padding positions come back as zeros. Plans on the host (one sync). Tracing,
                compiling and recording attention weights take the padded path.

        Returns:
            ``[B, T, D]`` last hidden states.

        Raises:
            TypeError: ids that are not integer tensors, a ``padding_mask`` that is not bool.
            ValueError: ids that are not ``[B, T]`` or lie outside their embedding, ``T`` longer
                than ``max_position_embeddings``, an ``attention_mask`` or ``padding_mask`` of
                another shape, an ``attention_mask`` with values other than 0 and 1, or both
                masks.
        """
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
        check_ids(
            "token_type_ids",
            token_type_ids,
            cfg.type_vocab_size,
            field="type_vocab_size",
            shape=(B, T),
            validate=validate,
        )
        if attention_mask is not None and padding_mask is not None:
            raise ValueError("give attention_mask (Hugging Face) or padding_mask (qkv), not both")
        mask = None
        if padding_mask is not None:
            is_pad = key_padding(padding_mask, input_ids, "padding_mask", validate)  # [B, T]|None
            mask = None if is_pad is None else padding_mask_of(is_pad)  # [B, 1, 1, T]
        if attention_mask is not None:
            if tuple(attention_mask.shape) != (B, T):
                raise ValueError(
                    f"attention_mask must be [B, T] = {[B, T]}, got {list(attention_mask.shape)}"
                )
            mask = from_hf(attention_mask, validate=validate)  # [B, 1, 1, T], True = padding
        x = self.embeddings(input_ids, token_type_ids)  # [B, T, D]
        if not self._lean():
            return self.encoder(x, mask)  # [B, T, D]
        # A checked mask: without padding it is dropped (SDPA runs maskless); when every
        # sample has a token, no row is fully blocked and SDPA backends may take it as a bias.
        as_bias = False
        if mask is not None and checks_values(validate):
            padded, empty = torch.stack([mask.any(), mask.all(dim=-1).any()]).tolist()
            mask, as_bias = (mask if padded else None), padded and not empty
        if unpad and mask is not None:
            return self._encode_unpadded(x, mask)  # [B, T, D]
        return self._encode_padded(x, mask, as_bias)  # [B, T, D]

    def _encode_padded(self, x: Tensor, mask: Tensor | None, as_bias: bool) -> Tensor:
        """The lean layer loop on the padded batch ``x`` ``[B, T, D]``; ``mask``
        ``[B, 1, 1, T]`` True = padding, given to SDPA backends as a float bias when
        ``as_bias`` (no row fully blocked)."""
        B, T, D = x.shape
        bias = None  # [B, 1, 1, T]
        if as_bias and mask is not None:
            bias = x.new_zeros(mask.shape).masked_fill(mask, float("-inf"))

        def attend(qkv: Tensor, attn: MultiHeadAttention) -> Tensor:
            grid = qkv.view(B, T, 3 * D)  # [B, T, 3D]
            if bias is not None and attn.backend in _BIAS_BACKENDS:
                out = _attend_padded(grid, attn, None, bias)  # [B, T, D]
            else:
                out = _attend_padded(grid, attn, mask, None)  # [B, T, D]
            return out.view(B * T, D)  # [B * T, D]

        rows = x.reshape(B * T, D)  # [B * T, D]
        for i, layer in enumerate(self._layers()):
            rows = self._layer(i, layer, rows, attend)  # [B * T, D]
        return rows.view(B, T, D)  # [B, T, D]

    def _encode_unpadded(self, x: Tensor, mask: Tensor) -> Tensor:
        """The lean layer loop on the real tokens of ``x`` ``[B, T, D]`` only (``mask``
        ``[B, 1, 1, T]``, True = padding); padding positions come back as zeros."""
        plan = plan_packing(mask[:, 0, 0])
        if plan.rows == 0:
            return x.new_zeros(x.shape)  # [B, T, D]: no token at all
        # SDPA backends get the grid's padding keys as a float bias: one batched call, which
        # they do not split into per-length calls as they would a bool mask (the calls cost
        # more than the padding they skip); the others take the bool mask. No row is fully
        # blocked: samples without a token have no row.
        blocked = plan.grid_padding  # [B', 1, 1, T'] or None
        bias = None
        if blocked is not None:
            bias = x.new_zeros(blocked.shape).masked_fill(blocked, float("-inf"))

        def attend(qkv: Tensor, attn: MultiHeadAttention) -> Tensor:
            grid = plan.to_grid(qkv)  # [B', T', 3D]
            if attn.backend in _BIAS_BACKENDS:
                return plan.from_grid(_attend_padded(grid, attn, None, bias))  # [N, D]
            return plan.from_grid(_attend_padded(grid, attn, blocked, None))  # [N, D]

        packed = plan.pack(x)  # [N, D]
        for i, layer in enumerate(self._layers()):
            packed = self._layer(i, layer, packed, attend)  # [N, D]
        return plan.unpack(packed)  # [B, T, D], zeros at padding

    def _layers(self) -> list[EncoderLayer]:
        return cast(list[EncoderLayer], list(self.encoder.layers))

    def _lean(self) -> bool:
        """Whether :meth:`forward` may run its own layer loop (transposed weights, a fused
        input projection, no per-layer mask handling) instead of the :class:`Encoder`'s:
        eagerly only, for BERT's layers (post-norm, biases, GELU or ReLU), and only where
        nothing observes the layers (recorded weights, forward hooks)."""
        if torch.jit.is_tracing() or torch.compiler.is_compiling():
            return False
        if self.encoder._forward_hooks or self.encoder._forward_pre_hooks:
            return False
        for layer in self._layers():
            attn = layer.self_attn
            if attn.record_weights or layer.norm_first or not attn.batch_first:
                return False
            if attn.num_kv_heads != attn.num_heads or attn.kdim != attn.embed_dim:
                return False
            if layer.ffn.gate is not None or layer.ffn.activation not in ("gelu", "relu"):
                return False
            linears = (attn.q_proj, attn.k_proj, attn.v_proj, attn.out_proj)
            if any(m.bias is None for m in (*linears, layer.ffn.fc1, layer.ffn.fc2)):
                return False
            for m in (layer, attn):
                if m._forward_hooks or m._forward_pre_hooks:
                    return False
        return True

    def _weights(self, i: int, layer: EncoderLayer) -> _LayerWeights:
        """Layer ``i``'s linear weights, transposed to ``[in, out]``, Q, K, V fused into one.

        Without gradients they are contiguous copies (an ``[in, out]`` GEMM is the faster
        one for the few rows of a small batch), built once and kept outside the state dict;
        they are rebuilt when a weight changes (another tensor, device or dtype, or an in-place
        update such as ``load_state_dict``). With gradients they are views and one ``cat``
        per call, so gradients flow to the parameters; so they are for weights made under
        ``torch.inference_mode``, which keep no version counter to tell a change by.
        """
        attn, ffn = layer.self_attn, layer.ffn
        linears = (attn.q_proj, attn.k_proj, attn.v_proj, attn.out_proj, ffn.fc1, ffn.fc2)
        tensors = [t for m in linears for t in (m.weight, m.bias) if t is not None]

        def build(copy: bool) -> _LayerWeights:
            q, k, v, o, fc1, fc2 = linears
            ts = [torch.cat([q.weight, k.weight, v.weight]).t(), o.weight.t()]  # [D, 3D], [D, D]
            ts += [fc1.weight.t(), fc2.weight.t()]  # [D, F], [F, D]
            if copy:
                ts = [t.contiguous() for t in ts]
            bias = torch.cat([q.bias, k.bias, v.bias])  # [3D]
            return _LayerWeights(ts[0], bias, ts[1], o.bias, ts[2], fc1.bias, ts[3], fc2.bias)

        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            return build(copy=False)
        if any(t.is_inference() for t in tensors):
            return build(copy=False)  # no version counter tells when such weights change
        key = tuple((t.data_ptr(), t._version, t.dtype, t.device) for t in tensors)
        cached = self._transposed.get(i)
        if cached is None or cached[0] != key:
            with torch.inference_mode(False), torch.no_grad():  # tensors usable in any mode
                cached = (key, build(copy=True))
            self._transposed[i] = cached
        return cached[1]

    def _layer(
        self,
        i: int,
        layer: EncoderLayer,
        x: Tensor,
        attend: Callable[[Tensor, MultiHeadAttention], Tensor],
    ) -> Tensor:
        """One post-norm layer, as :meth:`EncoderLayer.forward`, on ``[M, D]`` rows.

        ``attend`` maps the fused projections ``[M, 3D]`` to the heads' merged outputs
        ``[M, D]``; everything else works row by row, so the rows may be a padded batch
        ``[B * T]`` or packed tokens ``[N]``.
        """
        w = self._weights(i, layer)
        act = F.gelu if layer.ffn.activation == "gelu" else F.relu
        qkv = torch.addmm(w.qkv_b, x, w.qkv_t)  # [M, 3D]
        h = torch.addmm(w.out_b, attend(qkv, layer.self_attn), w.out_t)  # [M, D]
        x = layer.norm1(x + layer.dropout1(h))  # [M, D]
        h = layer.ffn.dropout(act(torch.addmm(w.fc1_b, x, w.fc1_t)))  # [M, F]
        h = torch.addmm(w.fc2_b, h, w.fc2_t)  # [M, D]
        return layer.norm2(x + layer.dropout2(h))  # [M, D]


@dataclass(frozen=True)
class _LayerWeights:
    """One layer's linear weights for the lean loop: ``[in, out]`` and bias per projection."""

    qkv_t: Tensor
    qkv_b: Tensor
    out_t: Tensor
    out_b: Tensor
    fc1_t: Tensor
    fc1_b: Tensor
    fc2_t: Tensor
    fc2_b: Tensor


def _heads(attn: MultiHeadAttention, part: Tensor, B: int, T: int) -> tuple[Tensor, Tensor, Tensor]:
    """``[B * T, 3D]`` or ``[B, T, 3D]`` fused projections -> ``q, k, v`` ``[B, H, T, Dh]``."""
    H, Dh = attn.num_heads, attn.head_dim
    q, k, v = part.view(B, T, 3, H, Dh).permute(2, 0, 3, 1, 4).unbind(0)  # 3 x [B, H, T, Dh]
    return q, k, v


def _sdpa(
    attn: MultiHeadAttention,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    attn_bias: Tensor | None,
) -> Tensor:
    """qkv attention with the module's backend and dropout; ``[B, H, T, Dh]`` -> ``[B, T, D]``."""
    B, H, T, Dh = q.shape
    out, _ = attention(
        q,
        k,
        v,
        mask=mask,
        attn_bias=attn_bias,
        dropout_p=attn.dropout,
        training=attn.training,
        backend=attn.backend,
    )  # [B, H, T, Dh]
    return out.transpose(1, 2).reshape(B, T, H * Dh)  # [B, T, D]


def _attend_padded(
    qkv: Tensor, attn: MultiHeadAttention, mask: Tensor | None, attn_bias: Tensor | None
) -> Tensor:
    """Self-attention of a padded batch ``[B, T, 3D]`` -> ``[B, T, D]``; the padding as a bool
    ``mask`` or a float ``attn_bias`` ``[B, 1, 1, T]``, or neither."""
    B, T, _ = qkv.shape
    return _sdpa(attn, *_heads(attn, qkv, B, T), mask, attn_bias)  # [B, T, D]
