"""A GPT-style decoder-only language model: embeddings, positions, causal blocks, head.

Each block is an :class:`~qkv.nn.layers.EncoderLayer` run with ``is_causal=True`` (a
decoder-only block is self-attention + feed-forward with no cross-attention).

Shapes: B batch, T new tokens, S cached + new tokens, D model width, V vocabulary.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from qkv import masks
from qkv.models.config import DecoderOnlyConfig, layer_kwargs
from qkv.models.transformer import check_ids, key_padding
from qkv.nn.kv_cache import KVCache
from qkv.nn.layers import EncoderLayer, make_norm
from qkv.nn.positions import make_positional, position_inputs

__all__ = ["DecoderOnlyLM"]


class DecoderOnlyLM(nn.Module):
    """Causal language model.

    Weights: normal(0, 0.02) for linear layers and embeddings (GPT-2), zero biases; with
    ``tie_embeddings`` the head shares the token embedding matrix. A pre-norm model ends with a
    final norm; a post-norm one has ``norm = nn.Identity()`` (each block already ends in one).

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
        self.positional = make_positional(c.positional, D, c.num_heads, c.max_len)
        self.embed_dropout = nn.Dropout(c.dropout)
        layer_kw = layer_kwargs(c)
        self.layers = nn.ModuleList([EncoderLayer(**layer_kw) for _ in range(c.num_layers)])
        self.norm: nn.Module = (
            make_norm(c.norm, D, c.layer_norm_eps)  # type: ignore[arg-type]
            if c.norm_first
            else nn.Identity()
        )
        self.lm_head = nn.Linear(D, c.vocab_size, bias=False)
        for m in self.modules():
            if isinstance(m, nn.Linear | nn.Embedding):
                nn.init.normal_(m.weight, std=0.02)
                if isinstance(m, nn.Linear) and m.bias is not None:
                    nn.init.zeros_(m.bias)
        if c.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def new_cache(self, max_len: int | None = None) -> KVCache:
        """An empty :class:`KVCache` (default capacity ``config.max_len``)."""
        return KVCache(self.config.num_layers, max_len or self.config.max_len)

    def forward(
        self, ids: Tensor, padding_mask: Tensor | None = None, cache: KVCache | None = None
    ) -> Tensor:
        """Next-token logits at every position.

        Args:
            ids: ``[B, T]`` token ids; with a cache only the new tokens, whose positions continue
                from ``cache.length``.
            padding_mask: bool ``[B, T]``, True = padding; None: ``ids == config.pad_id`` when
                ``pad_id`` is set, else no padding. Padding keys stay blocked in the cache.
            cache: a :class:`KVCache` from :meth:`new_cache` for incremental decoding.

        Returns:
            logits ``[B, T, V]``.

        Raises:
            TypeError / ValueError: bad ids or mask, positions beyond ``max_len``.
        """
        c = self.config
        check_ids("ids", ids, c.vocab_size)
        T = ids.shape[1]
        if padding_mask is None and c.pad_id is not None:
            padding_mask = ids == c.pad_id
        is_pad = key_padding(padding_mask, ids, "padding_mask")
        offset = 0
        if cache is not None:
            offset = cache.length
            is_pad = cache.append_padding(is_pad, T)  # [B, S] or None
        mask = None if is_pad is None else masks.padding_mask(is_pad)  # [B, 1, 1, S]
        x = self.embed(ids)  # [B, T, D]
        x, pos = position_inputs(self.positional, x, offset, causal=True)
        x = self.embed_dropout(x)  # [B, T, D]
        for i, layer in enumerate(self.layers):
            x = layer(
                x,
                mask,
                is_causal=True,
                attn_bias=pos.attn_bias,
                rope=pos.rope,
                kv_cache=cache,
                layer_idx=i,
            )  # [B, T, D]
        return self.lm_head(self.norm(x))  # [B, T, V]

    @torch.no_grad()
    def generate(
        self,
        ids: Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        greedy: bool = False,
        eos_id: int | None = None,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Continue the prompts with the KV cache: greedy, or sampling with temperature / top-k.

        Args:
            ids: prompts ``[B, T0]`` (all of one length; padding is not supported here).
            max_new_tokens: n, the most tokens appended.
            temperature: divides the logits before sampling (> 0).
            top_k: sample among the k most likely tokens only.
            greedy: take the most likely token (temperature and top_k are then unused).
            eos_id: stop a row after this token (default ``config.eos_id``); later positions of
                that row hold ``pad_id`` (or ``eos_id`` when no ``pad_id`` is set).
            generator: random generator for reproducible sampling.

        Returns:
            long ``[B, T0 + n]`` (shorter when every row has produced ``eos_id``).

        Raises:
            ValueError: n < 1, ``T0 + n > max_len``, temperature <= 0, top_k < 1.
        """
        from qkv.models.generate import sample_decoder_only

        return sample_decoder_only(
            self,
            ids,
            max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            greedy=greedy,
            eos_id=self.config.eos_id if eos_id is None else eos_id,
            generator=generator,
        )
