"""The special token ids of a Hugging Face ``config.json``, as qkv's config fields want them.

``transformers`` allows ``None``, an int, or (for ``eos_token_id``) a list of ints. Some
checkpoints write an id outside the vocabulary (``pad_token_id: -1`` in early Llama
conversions) to say "none"; no id of a prompt can equal it, so it is read as None.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["token_id"]


def token_id(hf: Mapping[str, Any], key: str, source: str) -> int | None:
    """``hf[key]`` as one token id in ``[0, vocab_size)``, or None when absent, null or outside
    the vocabulary.

    A list (``eos_token_id: [128001, 128009]``) gives its first id; pass the list itself to
    ``generate(eos_id=...)`` to stop at any of them.

    Args:
        hf: the parsed ``config.json`` (its ``vocab_size`` bounds the id).
        key: e.g. ``"pad_token_id"``.
        source: where ``hf`` came from, for the message.

    Returns:
        The id, or None.

    Raises:
        ValueError: not an int (or a list of ints).
    """
    value = hf.get(key)
    if isinstance(value, list) and value:
        value = value[0]
    if value is None or value == []:
        return None
    V = hf.get("vocab_size")
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{source}: {key}={hf.get(key)!r} must be a token id (an int)")
    if isinstance(V, int) and not 0 <= value < V:
        return None
    return value
