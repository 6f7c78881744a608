"""The encoder–decoder Transformer (Vaswani et al. 2017): embeddings, positions, encoder and
decoder stacks, output head; ``encode`` / ``decode`` / ``forward`` / ``generate``.

Shapes: B batch, S source length, T target length, D model width, V target vocabulary.
Padding masks at this level are bool ``[B, L]`` with True = padding.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from qkv.backends.shared import share_plans
from qkv.distributed import ContextParallel, global_length, local_positions
from qkv.distributed import context_parallel as parallel_scope
from qkv.dropout import Dropout
from qkv.masks import padding_mask
from qkv.models.config import TransformerConfig
from qkv.models.generate import beam_search, check_beam_options, greedy_encoder_decoder
from qkv.models.inputs import (
    check_ids,
    key_padding,
    padding_from_ids,
    resolve_kv_cache,
    self_attention_padding,
)
from qkv.models.sharded import GlobalPadding, global_padding, sharded_positions, sharded_rule
from qkv.nn.kv_cache import KVCache
from qkv.nn.layers import DecoderLayer, EncoderLayer
from qkv.nn.norms import make_norm
from qkv.nn.positions import make_positional, position_inputs
from qkv.nn.stacks import Decoder, Encoder


def _continues(cache: KVCache | None) -> bool:
    """Whether the target tokens of this call follow cached ones (so none is the first)."""
    return cache is not None and cache.length > 0


# check_ids / key_padding were defined here in 0.1; kept importable from here for one release.
__all__ = ["Transformer", "check_ids", "key_padding"]


class Transformer(nn.Module):
    """Encoder–decoder Transformer for sequence-to-sequence tasks.

    Embeddings are scaled by ``sqrt(d_model)`` (as in the paper); both stacks end with a norm,
    like ``nn.Transformer``, so its weights load one to one. Weights are initialised with
    Xavier-uniform, as ``nn.Transformer`` does. The config's ``scale_embeddings``,
    ``embed_norm``, ``final_norm``, ``share_positions``, ``head_bias``, ``output_scale`` and
    ``attn_scale`` change that to fit BART, Marian (:mod:`qkv.convert.hf_seq2seq`) and T5
    (:mod:`qkv.convert.hf_t5`) checkpoints.

    Args:
        config: the architecture.

    Raises:
        TypeError: ``config`` is not a :class:`TransformerConfig`.
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        if not isinstance(config, TransformerConfig):
            raise TypeError(f"config must be a TransformerConfig, got {type(config).__name__}")
        c = config
        self.config = c
        D = c.d_model
        self.embed_scale = math.sqrt(D) if c.scale_embeddings else 1.0
        self.src_embed = nn.Embedding(c.src_vocab_size, D)
        self.tgt_embed = nn.Embedding(c.tgt_vocab_size, D)
        self.positional = make_positional(**c.positional_kwargs())
        # the decoder's own positions (BART), or None: it shares ``positional``
        self.tgt_positional = (
            None if c.share_positions else make_positional(**c.positional_kwargs())
        )
        self.src_embed_norm = make_norm(c.norm, D, c.layer_norm_eps) if c.embed_norm else None
        self.tgt_embed_norm = make_norm(c.norm, D, c.layer_norm_eps) if c.embed_norm else None
        self.embed_dropout = Dropout(c.dropout)
        layer_kw = c.layer_kwargs()
        self.encoder = Encoder(
            [EncoderLayer(**layer_kw) for _ in range(c.num_encoder_layers)],
            make_norm(c.norm, D, c.layer_norm_eps) if c.final_norm else None,
        )
        self.decoder = Decoder(
            [DecoderLayer(**layer_kw) for _ in range(c.num_decoder_layers)],
            make_norm(c.norm, D, c.layer_norm_eps) if c.final_norm else None,
        )
        self.lm_head = nn.Linear(D, c.tgt_vocab_size, bias=c.head_bias)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)
        if self.lm_head.bias is not None:
            nn.init.zeros_(self.lm_head.bias)
        if c.tie_embeddings:
            self.lm_head.weight = self.tgt_embed.weight

    def new_cache(self, capacity: int | None = None) -> KVCache:
        """An empty :class:`KVCache` for the decoder.

        Args:
            capacity: target tokens it holds (default ``config.max_positions``).

        Returns:
            The cache, to pass as ``kv_cache=`` to :meth:`decode`.
        """
        c = self.config
        return KVCache(c.num_decoder_layers, c.max_positions if capacity is None else capacity)

    def source_padding(
        self, src: Tensor, src_padding_mask: Tensor | None = None, *, validate: bool = True
    ) -> Tensor | None:
        """Check ``src`` and give its padding: the caller's mask, else ``src == pad_id``.

        The one place the source padding is computed; :meth:`forward` and
        :mod:`qkv.models.generate` both call it.

        Args:
            src: source ids ``[B, S]``.
            src_padding_mask: bool ``[B, S]``, True = padding, or None.
            validate: check the id values (a host sync per call); False, or tracing /
                compiling, skips it (see :func:`qkv._checks.checks_values`).

        Returns:
            bool ``[B, S]``, or None when nothing is padding.

        Raises:
            TypeError / ValueError: bad ids or mask.
        """
        c = self.config
        check_ids("src", src, c.src_vocab_size, field="src_vocab_size", validate=validate)
        return padding_from_ids(src, src_padding_mask, c.pad_id, "src_padding_mask", validate)

    def encode(
        self, src: Tensor, src_padding_mask: Tensor | None = None, *, validate: bool = True
    ) -> Tensor:
        """Run the encoder.

        Args:
            src: source ids ``[B, S]``.
            src_padding_mask: bool ``[B, S]``, True = padding; None: ``src == config.pad_id``.
            validate: as :meth:`source_padding`.

        Returns:
            memory ``[B, S, D]``.

        Raises:
            TypeError / ValueError: bad ids or mask.
        """
        is_pad = self.source_padding(src, src_padding_mask, validate=validate)
        with share_plans(validate=validate):  # the layers share one attention plan
            return self.encode_padded(src, is_pad)

    def encode_padded(self, src: Tensor, is_pad: Tensor | None) -> Tensor:
        """Run the encoder on ids whose padding :meth:`source_padding` already gave.

        Args:
            src: source ids ``[B, S]``, checked.
            is_pad: bool ``[B, S]``, True = padding, or None for no padding.

        Returns:
            memory ``[B, S, D]``.
        """
        mask = None if is_pad is None else padding_mask(is_pad)  # [B, 1, 1, S]
        x = self.src_embed(src) * self.embed_scale  # [B, S, D]
        x, pos = position_inputs(self.positional, x, 0, causal=False)
        if self.src_embed_norm is not None:
            x = self.src_embed_norm(x)  # [B, S, D]
        x = self.embed_dropout(x)  # [B, S, D]
        return self.encoder(x, mask, attn_bias=pos.attn_bias, rope=pos.rope)

    def decode(
        self,
        tgt: Tensor,
        memory: Tensor,
        src_padding_mask: Tensor | None = None,
        tgt_padding_mask: Tensor | None = None,
        kv_cache: KVCache | None = None,
        *,
        cache: KVCache | None = None,
        validate: bool = True,
    ) -> Tensor:
        """Run the decoder and the head.

        Args:
            tgt: target ids ``[B, T]``; with a cache only the new tokens, whose positions
                continue from ``cache.length``.
            memory: encoder output ``[B, S, D]``.
            src_padding_mask: bool ``[B, S]``, True = padding; None: no source padding (the
                source ids are not at hand here; :meth:`forward` passes the derived mask).
            tgt_padding_mask: bool ``[B, T]``, True = padding; None: ``tgt == config.pad_id``.
            kv_cache: a :class:`KVCache` from :meth:`new_cache` for incremental decoding.
            cache: deprecated spelling of ``kv_cache`` (one release).
            validate: as :meth:`source_padding`.

        Returns:
            logits ``[B, T, V]``.

        Raises:
            TypeError / ValueError: bad ids, masks or memory shape; both ``kv_cache`` and
                ``cache``.
        """
        c = self.config
        cache = resolve_kv_cache(kv_cache, cache)
        check_ids("tgt", tgt, c.tgt_vocab_size, field="tgt_vocab_size", validate=validate)
        memory_mask = self._memory_mask(tgt, memory, src_padding_mask, validate)  # [B,1,1,S]
        tgt_pad = self._target_padding(tgt, tgt_padding_mask, cache)  # [B, T] or None
        self_mask, offset, positions = self_attention_padding(
            tgt, tgt_pad, c.pad_id, "tgt_padding_mask", cache, validate
        )  # [B, 1, 1, S_cached + T] or None
        x = self.tgt_embed(tgt) * self.embed_scale  # [B, T, D]
        positional = self.positional if self.tgt_positional is None else self.tgt_positional
        x, pos = position_inputs(positional, x, offset, causal=True, positions=positions)
        if self.tgt_embed_norm is not None:
            x = self.tgt_embed_norm(x)  # [B, T, D]
        x = self.embed_dropout(x)  # [B, T, D]
        with share_plans(validate=validate):  # the layers share one plan per attention
            h = self.decoder(
                x,
                memory,
                self_mask,
                memory_mask,
                tgt_is_causal=True,
                self_attn_bias=pos.attn_bias,
                rope=pos.rope,
                kv_cache=cache,
            )  # [B, T, D]
        if c.output_scale != 1.0:
            h = h * c.output_scale  # [B, T, D]
        return self.lm_head(h)  # [B, T, V]

    def _memory_mask(
        self, tgt: Tensor, memory: Tensor, src_padding_mask: Tensor | None, validate: bool
    ) -> Tensor | None:
        """The cross-attention mask ``[B, 1, 1, S]`` of :meth:`decode`'s source padding (None:
        no padding), ``memory`` checked against ``tgt``. Raises as :meth:`decode`."""
        if (
            memory.dim() != 3
            or memory.shape[0] != tgt.shape[0]
            or memory.shape[2] != (self.config.d_model)
        ):
            raise ValueError(
                f"memory must be [B, S, D] = [{tgt.shape[0]}, S, {self.config.d_model}], "
                f"got {tuple(memory.shape)}"
            )
        if src_padding_mask is None:
            return None
        if src_padding_mask.shape != memory.shape[:2]:
            raise ValueError(
                f"src_padding_mask must be [B, S] = {list(memory.shape[:2])}, "
                f"got {tuple(src_padding_mask.shape)}"
            )
        src_pad = key_padding(src_padding_mask, src_padding_mask, "src_padding_mask", validate)
        return None if src_pad is None else padding_mask(src_pad)  # [B, 1, 1, S]

    def _target_padding(
        self, tgt: Tensor, tgt_padding_mask: Tensor | None, cache: KVCache | None
    ) -> Tensor | None:
        """The caller's target padding; when the start token is the pad token (Marian, T5) and
        none is given, ``tgt == pad_id`` except the start token, which is never padding."""
        c = self.config
        if tgt_padding_mask is None and c.bos_id == c.pad_id and not _continues(cache):
            tgt_padding_mask = tgt == c.pad_id  # [B, T]
            tgt_padding_mask[:, 0] = False
        return tgt_padding_mask

    def forward(
        self,
        src: Tensor,
        tgt: Tensor,
        src_padding_mask: Tensor | None = None,
        tgt_padding_mask: Tensor | None = None,
        *,
        validate: bool = True,
        context_parallel: ContextParallel | None = None,
    ) -> Tensor:
        """Teacher-forced logits: ``decode(tgt, encode(src))``.

        Args:
            src: ``[B, S]`` ids.
            tgt: ``[B, T]`` ids (starting with ``bos_id``).
            src_padding_mask: bool ``[B, S]``, True = padding; None: derived from ``pad_id``.
            tgt_padding_mask: bool ``[B, T]``, True = padding; None: derived from ``pad_id``.
            validate: as :meth:`source_padding`.
            context_parallel: both sequences are cut across the ranks of this group and layout:
                ``src``, ``tgt`` and their masks are this rank's shards, and so are the logits;
                every rank of the group calls it. See :mod:`qkv.distributed`.

        Returns:
            logits ``[B, T, V]``.

        Raises:
            ValueError: under ``context_parallel``, ALiBi or relative positions (score biases
                the context-parallel attention does not take).
        """
        if context_parallel is not None:
            return self._forward_sharded(
                src, tgt, src_padding_mask, tgt_padding_mask, context_parallel, validate
            )
        is_pad = self.source_padding(src, src_padding_mask, validate=validate)
        with share_plans(validate=validate):  # the encoder's layers share one attention plan
            memory = self.encode_padded(src, is_pad)  # [B, S, D]
        return self.decode(tgt, memory, is_pad, tgt_padding_mask, validate=validate)

    def _forward_sharded(
        self,
        src: Tensor,
        tgt: Tensor,
        src_padding_mask: Tensor | None,
        tgt_padding_mask: Tensor | None,
        setting: ContextParallel,
        validate: bool,
    ) -> Tensor:
        """:meth:`forward` on this rank's shards of both sequences."""
        c = self.config
        if c.positional in ("alibi", "relative"):
            raise ValueError(
                "context_parallel runs absolute or rotary positions, got "
                f"positional={c.positional!r}"
            )
        is_pad = self.source_padding(src, src_padding_mask, validate=validate)  # [B, S] or None
        src_pad = global_padding(is_pad, src.shape[0], src.shape[1], setting, src.device)
        memory = self._encode_sharded(src, src_pad, setting)  # [B, S, D]
        check_ids("tgt", tgt, c.tgt_vocab_size, field="tgt_vocab_size", validate=validate)
        if tgt_padding_mask is None and c.bos_id == c.pad_id:
            # the first target token (global position 0, on one rank) is bos, not padding
            first = local_positions(
                global_length(tgt.shape[1], group=setting.group)[0],
                setting.world, setting.rank, setting.layout, tgt.device,
            ) == 0  # fmt: skip
            tgt_padding_mask = (tgt == c.pad_id) & ~first  # [B, T]
        tgt_is_pad = padding_from_ids(tgt, tgt_padding_mask, c.pad_id, "tgt_padding_mask", validate)
        tgt_pad = global_padding(tgt_is_pad, tgt.shape[0], tgt.shape[1], setting, tgt.device)
        positions = sharded_positions(
            tgt_pad, tgt.shape[0], setting, from_padding=True, device=tgt.device
        )
        x = self.tgt_embed(tgt) * self.embed_scale  # [B, T, D]
        positional = self.positional if self.tgt_positional is None else self.tgt_positional
        x, pos = position_inputs(positional, x, 0, causal=True, positions=positions)
        if self.tgt_embed_norm is not None:
            x = self.tgt_embed_norm(x)  # [B, T, D]
        x = self.embed_dropout(x)  # [B, T, D]
        masks = {
            "self_mask": sharded_rule(tgt_pad, causal=True),
            "cross_mask": sharded_rule(src_pad, causal=False, queries=tgt_pad),
        }
        with parallel_scope(setting, **masks):
            h = self.decoder(x, memory, rope=pos.rope)  # [B, T, D]
        if c.output_scale != 1.0:
            h = h * c.output_scale  # [B, T, D]
        return self.lm_head(h)  # [B, T, V]

    def _encode_sharded(self, src: Tensor, pad: GlobalPadding, setting: ContextParallel) -> Tensor:
        """The encoder on this rank's shard of ``src``: memory ``[B, S_local, D]``."""
        positions = sharded_positions(
            pad, src.shape[0], setting, from_padding=False, device=src.device
        )
        x = self.src_embed(src) * self.embed_scale  # [B, S, D]
        x, pos = position_inputs(self.positional, x, 0, causal=False, positions=positions)
        if self.src_embed_norm is not None:
            x = self.src_embed_norm(x)  # [B, S, D]
        x = self.embed_dropout(x)  # [B, S, D]
        with parallel_scope(setting, self_mask=sharded_rule(pad, causal=False)):
            return self.encoder(x, rope=pos.rope)  # [B, S, D]

    @torch.no_grad()
    def generate(
        self,
        src: Tensor,
        max_new_tokens: int,
        *,
        src_padding_mask: Tensor | None = None,
        beam_size: int = 1,
        length_penalty: float = 1.0,
    ) -> Tensor:
        """Decode target sequences with the KV cache: greedy (``beam_size=1``) or beam search.

        Args:
            src: ``[B, S]`` ids.
            max_new_tokens: the most tokens generated after ``bos_id``.
            src_padding_mask: bool ``[B, S]``, True = padding; None: derived from ``pad_id``.
            beam_size: beams per source; 1 is greedy.
            length_penalty: beam search ranks finished hypotheses by
                ``sum log p / length ** length_penalty``.

        The config's ``forced_bos_id`` / ``forced_eos_id`` (read from a checkpoint by
        :func:`qkv.convert.load_hf`) force the first / the last of ``max_new_tokens`` tokens, as
        ``transformers`` does.

        Returns:
            long ``[B, L]``, ``L <= 1 + max_new_tokens``: ``bos_id``, the tokens, ``eos_id`` (kept)
            when produced; rows that finished early are right-padded with ``pad_id``.

        Raises:
            ValueError: ``max_new_tokens`` < 1 or beyond ``max_positions - 1``, ``beam_size`` < 1,
                a non-finite ``length_penalty``.
            TypeError: a ``beam_size`` that is not an int (``True`` included).
        """
        check_beam_options(beam_size, length_penalty)  # before `== 1`: True is not a width
        if beam_size == 1:
            return greedy_encoder_decoder(self, src, max_new_tokens, src_padding_mask)
        return beam_search(self, src, max_new_tokens, src_padding_mask, beam_size, length_penalty)
