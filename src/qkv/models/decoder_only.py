"""A GPT-style decoder-only language model: embeddings, positions, causal blocks, head.

The blocks are the shared :class:`~qkv.nn.stacks.Encoder` stack of
:class:`~qkv.nn.layers.EncoderLayer` s run with ``is_causal=True`` (a decoder-only block is
self-attention + feed-forward with no cross-attention), under the attribute ``blocks``.
qkv 0.1 kept its own layer loop (state-dict keys ``layers.N.*`` and ``norm.*``);
:func:`upgrade_state_dict` maps those keys, and ``load_state_dict`` applies it by itself.

Shapes: B batch, T new tokens, S cached + new tokens, D model width, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar, Unpack

import torch
from torch import Tensor, nn

from qkv._checks import check_nonnegative_int
from qkv.backends.shared import share_plans
from qkv.distributed import ContextParallel
from qkv.distributed import context_parallel as parallel_scope
from qkv.dropout import Dropout
from qkv.models.beam import check_beam_options
from qkv.models.config import DecoderOnlyConfig
from qkv.models.generate import (
    GenerateOptions,
    beam_decoder_only,
    generate_decoder_only,
    generate_options,
    stream_decoder_only,
)
from qkv.models.inputs import (
    check_ids,
    padding_from_ids,
    resolve_kv_cache,
    self_attention_padding,
)
from qkv.models.sharded import global_padding, sharded_positions, sharded_rule
from qkv.nn.kv_cache import KVCache
from qkv.nn.layers import EncoderLayer
from qkv.nn.norms import make_norm
from qkv.nn.positions import make_positional, position_inputs
from qkv.nn.stacks import Encoder
from qkv.nn.static_kv_cache import StaticKVCache

__all__ = ["LEGACY_PREFIXES", "DecoderOnlyLM", "upgrade_state_dict"]

_V = TypeVar("_V")

LEGACY_PREFIXES: dict[str, str] = {"layers.": "blocks.layers.", "norm.": "blocks.norm."}
"""State-dict key prefixes of qkv 0.1's ``DecoderOnlyLM`` and what they became."""


def upgrade_state_dict(state_dict: Mapping[str, _V], prefix: str = "") -> dict[str, _V]:
    """Rename qkv 0.1 ``DecoderOnlyLM`` keys (``layers.N.*``, ``norm.*``) to today's.

    Keys already in today's form are kept, so upgrading twice changes nothing.

    Args:
        state_dict: keys to values (tensors, or shapes for a check before loading).
        prefix: the model's own prefix inside a larger state dict.

    Returns:
        A new dict with the same values in the same order.
    """
    out: dict[str, _V] = {}
    for key, value in state_dict.items():
        for old, new in LEGACY_PREFIXES.items():
            if key.startswith(prefix + old):
                key = prefix + new + key[len(prefix + old) :]
                break
        out[key] = value
    return out


def _upgrade_on_load(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any
) -> None:
    upgraded = upgrade_state_dict(state_dict, prefix)
    if list(upgraded) != list(state_dict):
        state_dict.clear()
        state_dict.update(upgraded)


class DecoderOnlyLM(nn.Module):
    """Causal language model.

    Weights: normal(0, 0.02) for linear layers and embeddings (GPT-2), zero biases; with
    ``tie_embeddings`` the head shares the token embedding matrix. A pre-norm model ends with a
    final norm (``blocks.norm``); a post-norm one has none (each block already ends in one).

    Args:
        config: the architecture.

    Raises:
        TypeError: ``config`` is not a :class:`DecoderOnlyConfig`.
    """

    def __init__(self, config: DecoderOnlyConfig) -> None:
        super().__init__()
        if not isinstance(config, DecoderOnlyConfig):
            raise TypeError(f"config must be a DecoderOnlyConfig, got {type(config).__name__}")
        c = config
        self.config = c
        D = c.d_model
        self.embed = nn.Embedding(c.vocab_size, D)
        self.positional = make_positional(**c.positional_kwargs())
        self.embed_dropout = Dropout(c.dropout)
        self.blocks = Encoder(
            [EncoderLayer(**c.layer_kwargs()) for _ in range(c.num_layers)],
            make_norm(c.norm, D, c.layer_norm_eps) if c.norm_first else None,
        )
        self.lm_head = nn.Linear(D, c.vocab_size, bias=False)
        for m in self.modules():
            if isinstance(m, nn.Linear | nn.Embedding):
                nn.init.normal_(m.weight, std=0.02)
                if isinstance(m, nn.Linear) and m.bias is not None:
                    nn.init.zeros_(m.bias)
        if c.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.register_load_state_dict_pre_hook(_upgrade_on_load)

    def new_cache(self, capacity: int | None = None) -> KVCache:
        """An empty :class:`KVCache`.

        Args:
            capacity: tokens it holds, prompt included (default ``config.max_positions``).

        Returns:
            The cache, to pass as ``kv_cache=`` to :meth:`forward`.
        """
        c = self.config
        return KVCache(c.num_layers, c.max_positions if capacity is None else capacity)

    def new_static_cache(self, batch_size: int, capacity: int) -> StaticKVCache:
        """An empty :class:`~qkv.nn.static_kv_cache.StaticKVCache` on this model's device and
        dtype, for :meth:`forward_static`.

        Args:
            batch_size: B.
            capacity: C, the slots (prompt + generated tokens).

        Returns:
            The cache.
        """
        c = self.config
        w = self.lm_head.weight
        return StaticKVCache(
            c.num_layers,
            capacity,
            batch_size=batch_size,
            num_kv_heads=c.num_heads if c.num_kv_heads is None else c.num_kv_heads,
            head_dim=c.head_dim,
            dtype=w.dtype,
            device=w.device,
        )

    def forward_static(
        self,
        ids: Tensor,
        kv_cache: StaticKVCache,
        cache_position: Tensor,
        *,
        logits_to_keep: int = 0,
        window: Tensor | None = None,
    ) -> Tensor:
        """Next-token logits with a fixed-shape cache: the step :func:`torch.compile` compiles
        once (no Python int depends on the step, no value is read on the host).

        Each token attends over all ``C`` slots of ``kv_cache`` (or the ``n`` of ``window``),
        those after its own and the prompt's padding (recorded by :meth:`StaticKVCache.start`)
        blocked; its position is its slot minus its row's left padding, as in :meth:`forward`.

        Args:
            ids: ``[B, T]`` new token ids (not checked: check them before, outside the graph).
            kv_cache: from :meth:`new_static_cache`, started with the prompt's padding.
            cache_position: long ``[T]``, the slots of ``ids`` (``arange(T0)`` for the prompt,
                then ``[T0 + step]``).
            logits_to_keep: as :meth:`forward`.
            window: ``kv_cache.window(n)``: attend over the first ``n`` slots only, which
                must hold every slot of ``cache_position`` (:meth:`StaticKVCache.prepare`);
                None: all ``C``. ``T`` tokens (``T > 1``) given a window of ``T`` slots are a
                prompt at slots ``0 .. T-1`` and attend causally over their own keys, as
                :meth:`forward` does: no ``[T, T]`` mask (a 512-token prompt of GPT-2 small
                took 0.92x the time on 1 thread, 0.95x on 2, than with the mask of its slots).

        Returns:
            logits ``[B, T, V]`` (``[B, logits_to_keep, V]``).

        Raises:
            ValueError: ALiBi or relative positions (their biases are built for the cached keys
                only; use :meth:`forward` with a :class:`KVCache`); a ``window`` that is not
                bool ``[B, n <= C]``.
        """
        c = self.config
        if c.positional in ("alibi", "relative"):
            raise ValueError(
                f"forward_static supports absolute and rotary positions, got "
                f"positional={c.positional!r}; use forward with a KVCache"
            )
        mask, positions = kv_cache.prepare(cache_position, window)  # [B, 1, T, n], [B, T]
        x = self.embed(ids)  # [B, T, D]
        x, pos = position_inputs(self.positional, x, 0, causal=True, positions=positions)
        x = self.embed_dropout(x)  # [B, T, D]
        T = ids.shape[1]
        if T == mask.shape[-1] > 1:  # a prompt filling its window: causal over its own keys
            pad = kv_cache.padding[:, None, None, :T] if kv_cache.has_padding else None
            x = self.blocks(x, pad, is_causal=True, rope=pos.rope, kv_cache=kv_cache)  # [B, T, D]
        else:
            x = self.blocks(x, mask, is_causal=False, rope=pos.rope, kv_cache=kv_cache)  # [B, T, D]
        return self.lm_head(x[:, -logits_to_keep:])  # [B, T, V]

    def forward(
        self,
        ids: Tensor,
        padding_mask: Tensor | None = None,
        kv_cache: KVCache | None = None,
        *,
        cache: KVCache | None = None,
        validate: bool = True,
        logits_to_keep: int = 0,
        context_parallel: ContextParallel | None = None,
    ) -> Tensor:
        """Next-token logits at every position.

        Args:
            ids: ``[B, T]`` token ids; with a cache only the new tokens, whose positions continue
                from ``cache.length``.
            padding_mask: bool ``[B, T]``, True = padding; None: ``ids == config.pad_id`` when
                ``pad_id`` is set, else no padding. Padding keys stay blocked in the cache.
            kv_cache: a :class:`KVCache` from :meth:`new_cache` for incremental decoding.
            cache: deprecated spelling of ``kv_cache`` (one release).
            validate: check the id values (a host sync per call) and each attention output
                for a float32 overflow (see :func:`qkv.backends.shared.share_plans`); False,
                or tracing / compiling, skips both (see :func:`qkv._checks.checks_values`).
            logits_to_keep: the logits of the last this many positions only (``transformers``'
                argument of that name; 0: all). A prompt's prefill needs the last one: the head
                over every position would cost ``T * D * V`` multiply-adds for nothing.
            context_parallel: the sequence is cut across the ranks of this group and layout:
                ``ids`` and ``padding_mask`` are this rank's shards (e.g. from
                :func:`qkv.distributed.shard`), and so are the logits; every rank of the group
                calls it. See :mod:`qkv.distributed`.

        Returns:
            logits ``[B, T, V]`` (``[B, logits_to_keep, V]``).

        Raises:
            TypeError / ValueError: bad ids or mask, positions beyond ``max_positions``, both
                ``kv_cache`` and ``cache``; under ``context_parallel``, a cache or positions
                the context-parallel attention cannot run (ALiBi, relative).
        """
        c = self.config
        cache = resolve_kv_cache(kv_cache, cache)
        if context_parallel is not None:
            return self._forward_sharded(
                ids, padding_mask, cache, context_parallel, validate, logits_to_keep
            )
        if isinstance(cache, StaticKVCache):
            raise TypeError("a StaticKVCache is used with forward_static(ids, kv_cache, positions)")
        check_nonnegative_int("logits_to_keep", logits_to_keep)
        check_ids("ids", ids, c.vocab_size, field="vocab_size", validate=validate)
        mask, offset, positions = self_attention_padding(
            ids, padding_mask, c.pad_id, "padding_mask", cache, validate
        )  # [B, 1, 1, S] or None
        x = self.embed(ids)  # [B, T, D]
        x, pos = position_inputs(self.positional, x, offset, causal=True, positions=positions)
        x = self.embed_dropout(x)  # [B, T, D]
        with share_plans(validate=validate):  # the layers share one attention plan
            x = self.blocks(
                x, mask, is_causal=True, attn_bias=pos.attn_bias, rope=pos.rope, kv_cache=cache
            )  # [B, T, D]
        return self.lm_head(x[:, -logits_to_keep:])  # [B, T, V]

    def _forward_sharded(
        self,
        ids: Tensor,
        padding_mask: Tensor | None,
        cache: KVCache | None,
        setting: ContextParallel,
        validate: bool,
        logits_to_keep: int,
    ) -> Tensor:
        """:meth:`forward` on this rank's shard of the sequence (see ``context_parallel``)."""
        c = self.config
        if cache is not None or c.positional in ("alibi", "relative"):
            raise ValueError(
                "context_parallel runs a whole sequence without a kv_cache, with absolute or "
                f"rotary positions; got kv_cache={cache is not None}, "
                f"positional={c.positional!r}"
            )
        check_nonnegative_int("logits_to_keep", logits_to_keep)
        check_ids("ids", ids, c.vocab_size, field="vocab_size", validate=validate)
        is_pad = padding_from_ids(ids, padding_mask, c.pad_id, "padding_mask", validate)
        B, T = ids.shape
        pad = global_padding(is_pad, B, T, setting, ids.device)  # [B, n] or None
        positions = sharded_positions(pad, B, setting, from_padding=True, device=ids.device)
        x = self.embed(ids)  # [B, T, D]
        x, pos = position_inputs(self.positional, x, 0, causal=True, positions=positions)
        x = self.embed_dropout(x)  # [B, T, D]
        with parallel_scope(setting, self_mask=sharded_rule(pad, causal=True)):
            x = self.blocks(x, None, is_causal=False, rope=pos.rope)  # [B, T, D]
        return self.lm_head(x[:, -logits_to_keep:])  # [B, T, V]

    @torch.no_grad()
    def generate(
        self,
        ids: Tensor,
        max_new_tokens: int,
        *,
        beam_size: int = 1,
        length_penalty: float = 1.0,
        streamer: Callable[[Tensor], object] | None = None,
        **options: Unpack[GenerateOptions],
    ) -> Tensor:
        """Continue the prompts with the KV cache: greedy, sampling or beam search.

        Args:
            ids: prompts ``[B, T0]``; prompts of different lengths are left-padded.
            max_new_tokens: n, the most tokens appended.
            beam_size: K > 1: beam search (deterministic, as ``transformers``' ``num_beams``
                with ``do_sample=False``; :mod:`qkv.models.beam`); it takes ``padding_mask``,
                ``eos_id`` and ``length_penalty`` only, and refuses the other options.
            length_penalty: beam search ranks finished hypotheses by
                ``sum log p / length ** length_penalty`` (``length``: generated tokens).
            streamer: called with each step's tokens, long ``[B]``, as soon as they are chosen.
            **options: ``padding_mask``, ``greedy``, ``temperature``, ``top_k``, ``top_p``,
                ``min_p``, ``repetition_penalty``, ``eos_id``, ``min_new_tokens``,
                ``generator``, ``static_cache``, ``compile``: see
                :class:`~qkv.models.generate.GenerateOptions`.

        Returns:
            long ``[B, T0 + n]`` (shorter when every row has stopped; beam search: each row's
            best hypothesis, right-padded).

        Raises:
            TypeError / ValueError: each bad value, before any step runs: n < 1,
                ``T0 + n > max_positions``, the options' ranges (see
                :meth:`DecodingOptions.check`), a stop id outside the vocabulary, a
                right-padded prompt, a row of padding only, ``pad_id`` in a prompt without a
                ``padding_mask``, a keyword that is no option.
        """
        opts = generate_options(options, self.config.eos_id)
        K, _ = check_beam_options(beam_size, length_penalty)
        if K > 1:
            return beam_decoder_only(
                self, ids, max_new_tokens, beam_size=K, length_penalty=length_penalty,
                streamer=streamer, **opts,
            )  # fmt: skip
        return generate_decoder_only(self, ids, max_new_tokens, streamer=streamer, **opts)

    def stream(
        self, ids: Tensor, max_new_tokens: int, **options: Unpack[GenerateOptions]
    ) -> Iterator[Tensor]:
        """:meth:`generate`, one step at a time: yields each step's tokens as they come.

        The arguments are checked when ``stream`` is called, not at the first step.

        Args:
            ids, max_new_tokens: as :meth:`generate`.
            **options: see :class:`~qkv.models.generate.GenerateOptions`.

        Returns:
            An iterator of long ``[B]`` tensors, one per generated position; it ends after n
            steps or once every row has produced a stop id.

        Raises:
            TypeError / ValueError: as :meth:`generate`.
        """
        opts = generate_options(options, self.config.eos_id)
        return stream_decoder_only(self, ids, max_new_tokens, **opts)
