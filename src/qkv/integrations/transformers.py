"""``attn_implementation="qkv"``: every attention call of a ``transformers`` model through qkv.

After :func:`register`, ``AutoModel.from_pretrained(d, attn_implementation="qkv")`` and
``model.set_attn_implementation("qkv")`` route each attention layer's call to
:func:`qkv.attention`. Two registrations are needed: the attention function with
``AttentionInterface`` and a mask function with ``AttentionMaskInterface`` (without the second,
``transformers`` builds no mask for an unknown implementation and padding is silently ignored).
The mask function is ``transformers``' own ``sdpa_mask`` (bool, True = attend, or None when the
pattern is purely causal), so each call means exactly what it means on the ``"sdpa"`` path:

* a mask is given: it is the whole pattern (causal, padding, sliding window); it is converted at
  the edge with :func:`qkv.masks.from_sdpa_bool` (or :func:`qkv.masks.from_additive` for a float
  mask) and no ``is_causal`` is added;
* no mask, more than one query, and a causal module (``module.is_causal``, default True, or the
  ``is_causal`` keyword): causal with **top-left** alignment, PyTorch SDPA's. That is the case of
  a prefill into an empty ``StaticCache`` (measured in transformers 5.24: T=6 queries, S=15 keys,
  no mask), where keys ``T..S-1`` are empty slots; qkv's own bottom-right ``is_causal`` would let
  the queries see them. The keys are cut to the first T (what the sdpa path does too), after
  which both alignments agree;
* no mask otherwise (one query, or a bidirectional module): every key is attended.

T5's ``position_bias`` (its relative positions, a float ``[1|B, H, T, S]`` score bias added
before the mask) is qkv's ``attn_bias``; it is cut with the keys in the top-left case above.

A query row whose keys are all blocked (a fully padded sequence) gets output 0, where ``"sdpa"``
and ``"eager"`` give NaN or an average of the padding; see :func:`qkv.attention`.

Shapes: B batch, H query heads, Hkv key/value heads, T queries, S keys, Dh head width.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from qkv.functional import BACKENDS, Backend, attention
from qkv.masks import from_additive, from_sdpa_bool

__all__ = ["IGNORED_KWARGS", "UNSUPPORTED_KWARGS", "make_attention_forward", "register"]

IGNORED_KWARGS: frozenset[str] = frozenset(
    {
        "position_ids",  # positions are already applied to q/k (RoPE) or the embeddings
        "cache_position",
        "use_cache",
        "past_key_values",
        "output_hidden_states",
        "return_dict",
        "layer_idx",
    }
)
"""Keywords ``transformers`` passes along that do not change the attention itself."""

UNSUPPORTED_KWARGS: dict[str, str] = {
    "softcap": "tanh soft-capping of the scores (Gemma 2)",
    "s_aux": "attention sinks (an extra per-head logit)",
    "sinks": "attention sinks (an extra per-head logit)",
    "cu_seq_lens_q": "packed variable-length sequences (flash-attention varlen)",
    "cu_seq_lens_k": "packed variable-length sequences (flash-attention varlen)",
    "max_length_q": "packed variable-length sequences (flash-attention varlen)",
    "max_length_k": "packed variable-length sequences (flash-attention varlen)",
}
"""Keywords whose meaning qkv's attention does not implement: a value other than None raises."""


def _blocked(mask: Tensor) -> Tensor:
    """A ``transformers`` 4-D mask (bool True = attend, or additive float) to qkv's sense."""
    if mask.dtype == torch.bool:
        return from_sdpa_bool(mask)  # [B|1, 1|H, T, S]
    return from_additive(mask)  # [B|1, 1|H, T, S]


def _check_kwargs(kwargs: dict[str, Any], mask: Tensor | None, S: int) -> None:
    for name, value in kwargs.items():
        if value is None or name in IGNORED_KWARGS or name == "position_bias":
            continue
        if name in UNSUPPORTED_KWARGS:
            raise ValueError(
                f"attn_implementation='qkv' does not support {name}={value!r} "
                f"({UNSUPPORTED_KWARGS[name]}); use attn_implementation='eager' for this model"
            )
        if name == "sliding_window":
            # the mask function already applied the window; without a mask it must not matter
            if mask is None and value < S:
                raise ValueError(
                    f"sliding_window={value} with no mask and S={S} keys: qkv cannot honour a "
                    "window the mask does not carry"
                )
            continue
        raise TypeError(
            f"attn_implementation='qkv' got the keyword {name}={type(value).__name__}, which it "
            f"does not know; known: is_causal, output_attentions, sliding_window, position_bias, "
            f"{sorted(IGNORED_KWARGS)}"
        )


def make_attention_forward(backend: Backend = "auto") -> Any:
    """The attention function ``transformers`` calls, running :func:`qkv.attention`.

    Args:
        backend: the qkv backend for calls that do not ask for weights (one of
            :data:`qkv.functional.BACKENDS`); ``output_attentions=True`` always takes
            ``"reference"``, the backend that returns weights.

    Returns:
        ``forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
        is_causal=None, output_attentions=False, **kwargs) -> (output [B, T, H, Dh], weights
        [B, H, T, S] or None)`` with query ``[B, H, T, Dh]`` and key/value ``[B, Hkv, S, Dh]``.

    Raises:
        ValueError: an unknown backend.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")

    def qkv_attention_forward(
        module: nn.Module,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        dropout: float = 0.0,
        scaling: float | None = None,
        is_causal: bool | None = None,
        output_attentions: bool = False,
        **kwargs: Any,
    ) -> tuple[Tensor, Tensor | None]:
        T, S = query.shape[2], key.shape[2]
        _check_kwargs(kwargs, attention_mask, S)
        causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
        causal = bool(causal) and T > 1 and attention_mask is None
        mask = None if attention_mask is None else _blocked(attention_mask)
        bias = kwargs.get("position_bias")  # [1|B, H, T, S] or None (T5)
        if causal and S > T:
            # top-left alignment (SDPA's): queries 0..T-1 never see keys T..S-1 (empty slots of a
            # StaticCache), and on the first T keys top-left equals qkv's bottom-right
            key, value = key[:, :, :T], value[:, :, :T]  # [B, Hkv, T, Dh]
            bias = None if bias is None else bias[..., :T]  # [1|B, H, T, T]
        elif causal and S < T:
            raise ValueError(f"a causal call without a mask needs S >= T keys, got T={T}, S={S}")
        out, weights = attention(
            query,
            key,
            value,
            mask=mask,
            attn_bias=bias,
            is_causal=causal,
            scale=scaling,
            need_weights=bool(output_attentions),
            dropout_p=dropout,
            training=dropout > 0,
            backend="reference" if output_attentions else backend,
        )  # [B, H, T, Dh], [B, H, T, S] or None
        return out.transpose(1, 2).contiguous(), weights  # [B, T, H, Dh]

    return qkv_attention_forward


def register(name: str = "qkv", backend: Backend = "auto") -> None:
    """Register qkv's attention and its mask function under ``name`` in ``transformers``.

    Args:
        name: the ``attn_implementation`` string to register.
        backend: the qkv backend (see :func:`make_attention_forward`).

    Raises:
        TypeError: ``name`` is not a non-empty string.
        ValueError: an unknown backend, or a ``name`` that ``transformers`` already uses for
            one of its own implementations (``"sdpa"``, ``"eager"``, ...).
        ImportError: ``transformers`` is not installed.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty string, got {name!r}")
    forward = make_attention_forward(backend)
    # transformers is optional (a dev dependency): imported only when registering
    from transformers import AttentionInterface
    from transformers.masking_utils import (
        AttentionMaskInterface,
        sdpa_mask,
    )

    builtin = {"sdpa", "eager", "flex_attention", "paged|eager"} | {
        k for k in AttentionInterface._global_mapping if k.startswith("flash_attention")
    }
    if name in builtin:
        raise ValueError(f"name={name!r} is one of transformers' own implementations {builtin}")
    AttentionInterface.register(name, forward)
    AttentionMaskInterface.register(name, sdpa_mask)
