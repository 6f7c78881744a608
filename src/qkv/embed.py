"""Deprecated: sentence embeddings moved to :mod:`qkv.apps.embed`; kept for one release.

``from qkv.embed import SentenceEmbedder`` still works and warns; write
``from qkv.apps.embed import SentenceEmbedder`` instead.
"""

import warnings

import qkv.apps.embed as _embed

warnings.warn(
    "qkv.embed is deprecated: import from qkv.apps.embed (e.g. from qkv.apps.embed import "
    "SentenceEmbedder)",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = list(_embed.__all__)


def __getattr__(name: str) -> object:
    if name in __all__:
        return getattr(_embed, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
