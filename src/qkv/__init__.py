"""qkv: Transformer attention you can trust.

Public API::

    qkv.attention(q, k, v, mask=..., is_causal=...)           # the attention function
    qkv.attention(q, k, v, mask=qkv.Causal(), backend="blockwise")  # any of qkv.BACKENDS
    qkv.explain_backend(q, k, v, mask=...)                    # which backend, and why
    p = qkv.plan(q, k, v, mask=...); qkv.attention(q, k, v, mask=..., plan=p)  # plan once
    with qkv.use_policy(band_max_share=0.3): ...               # every tuning constant
    with qkv.allow_compile(): ...                             # auto may use compiled flex
    with qkv.allow_sdpa_backward(): ...                       # faster, less exact CPU grads
    qkv.scaled_dot_product_attention(q, k, v, blocked_mask)  # tutorial form: (output, weights)
    qkv.masks                                                 # rules, builders, converters
    qkv.MultiHeadAttention                                    # nn.MultiheadAttention-compatible
    qkv.Transformer(qkv.TransformerConfig(...))               # encoder-decoder model
    qkv.DecoderOnlyLM(qkv.DecoderOnlyConfig(...))             # GPT-style causal LM
    qkv.KVCache                                               # keys/values for decoding
    with qkv.doctor.watch(model) as report: model(...)        # attention bugs in any model
    qkv.doctor.examine(model, input_ids, attention_mask)      # a model's invariances
    qkv.distributed.context_parallel_attention(q, k, v, mask=...)  # one sequence, many ranks

Subpackages load on first use, so ``import qkv`` stays light: ``qkv.nn`` (building blocks),
``qkv.models``, ``qkv.convert`` (torch.nn / Hugging Face weights), ``qkv.distributed``
(context parallelism), ``qkv.doctor`` (other people's attention), ``qkv.train``, ``qkv.apps``
(the command line), ``qkv.backends``.
docs/ARCHITECTURE.md shows the layers.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from qkv import masks
from qkv.backends.policy import Policy, allow_compile, allow_sdpa_backward, use_policy
from qkv.functional import (
    BACKENDS,
    Backend,
    Plan,
    attention,
    explain_backend,
    plan,
    scaled_dot_product_attention,
)
from qkv.masks import AnyOf, Causal, Documents, MaskMod, Padding, SlidingWindow, StructuredMask
from qkv.models import DecoderOnlyConfig, DecoderOnlyLM, Transformer, TransformerConfig
from qkv.nn.kv_cache import KVCache
from qkv.nn.multihead import MultiHeadAttention

__version__ = "0.2.0"

_LAZY_SUBPACKAGES = frozenset(
    {
        "apps",
        "backends",
        "checks",
        "convert",
        "distributed",
        "doctor",
        "integrations",
        "models",
        "nn",
        "train",
    }
)

__all__ = [
    "BACKENDS",
    "AnyOf",
    "Backend",
    "Causal",
    "DecoderOnlyConfig",
    "DecoderOnlyLM",
    "Documents",
    "KVCache",
    "MaskMod",
    "MultiHeadAttention",
    "Padding",
    "Plan",
    "Policy",
    "SlidingWindow",
    "StructuredMask",
    "Transformer",
    "TransformerConfig",
    "__version__",
    "allow_compile",
    "allow_sdpa_backward",
    "attention",
    "explain_backend",
    "masks",
    "plan",
    "scaled_dot_product_attention",
    "use_policy",
]


def __getattr__(name: str) -> ModuleType:
    """Import a subpackage on first access (``qkv.convert``, ``qkv.train``, ...).

    Raises:
        AttributeError: ``name`` is neither a public name nor a subpackage of qkv.
    """
    if name in _LAZY_SUBPACKAGES:
        return importlib.import_module(f"qkv.{name}")
    raise AttributeError(f"module 'qkv' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY_SUBPACKAGES})
