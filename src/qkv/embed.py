"""Deprecated: sentence embeddings moved to :mod:`qkv.apps.embed`; kept for one release.

``from qkv.embed import SentenceEmbedder`` still works and warns; write
``from qkv.apps.embed import SentenceEmbedder`` instead.
"""

import qkv.apps.embed as _embed
from qkv._deprecation import warn_deprecated

warn_deprecated(
    "qkv.embed", "qkv.apps.embed", hint="e.g. from qkv.apps.embed import SentenceEmbedder"
)

__all__ = list(_embed.__all__)


def __getattr__(name: str) -> object:
    if name in __all__:
        return getattr(_embed, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
