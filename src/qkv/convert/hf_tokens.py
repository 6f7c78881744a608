"""The special token ids of a Hugging Face ``config.json``, as qkv's config fields want them.

``transformers`` allows ``None``, an int, or (for ``eos_token_id``) a list of ints. Some
checkpoints write an id outside the vocabulary (``pad_token_id: -1`` in early Llama
conversions) to say "none"; no id of a prompt can equal it, so it is read as None.

The ids ``generate`` forces (``forced_bos_token_id``, ``forced_eos_token_id``) are generation
settings: ``transformers`` reads them from ``generation_config.json`` when the directory has
one, else from ``config.json``; :func:`forced_token_ids` does the same.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from qkv.convert.hf_files import read_json

__all__ = ["GENERATION_FILE", "forced_token_ids", "required_ids", "token_id"]

GENERATION_FILE = "generation_config.json"
_MAX_GENERATION_BYTES = 1 << 20  # a generation config is a few hundred bytes


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


def forced_token_ids(
    root: Path, hf: Mapping[str, Any], source: str
) -> tuple[int | None, int | None]:
    """``(forced_bos_token_id, forced_eos_token_id)`` as ``transformers.generate`` reads them.

    From ``generation_config.json`` when ``root`` has one (``save_pretrained`` writes it, and
    ``transformers`` then ignores ``config.json``'s values), else from ``hf``. A list of forced
    eos ids gives its first (qkv forces one token).

    Args:
        root: the checkpoint directory.
        hf: its parsed ``config.json`` (whose ``vocab_size`` bounds the ids).
        source: ``config.json``'s path, for the messages.

    Returns:
        The two ids, each None when absent.

    Raises:
        ValueError: a ``generation_config.json`` that resolves outside ``root``, is too large,
            not JSON (or nested too deep), or not an object; an id that is not an int.
    """
    path = root / GENERATION_FILE
    settings: Mapping[str, Any] = hf
    if path.is_file():
        parsed = read_json(path, root, limit=_MAX_GENERATION_BYTES)
        if not isinstance(parsed, dict):
            raise ValueError(f"{path} must hold a JSON object, got {type(parsed).__name__}")
        settings = {**parsed, "vocab_size": hf.get("vocab_size")}
        source = str(path)
    return (
        token_id(settings, "forced_bos_token_id", source),
        token_id(settings, "forced_eos_token_id", source),
    )


def required_ids(source: str, vocab_size: int, **ids: int | None) -> tuple[int, ...]:
    """The token ids a model cannot do without, in the order given, or an error naming each one
    that is missing.

    Args:
        source: where the config came from, for the message.
        vocab_size: V, the range the ids must lie in (for the message).
        ids: name (``pad``, ``eos``, ``decoder_start``, ...) to id or None.

    Returns:
        The ids, in the order of ``ids``.

    Raises:
        ValueError: one or more are None, e.g. "needs pad_token_id, eos_token_id in [0, V)".
    """
    missing = [name for name, value in ids.items() if value is None]
    if missing:
        names = ", ".join(m + "_token_id" for m in missing)
        raise ValueError(f"{source}: needs {names} in [0, {vocab_size})")
    return tuple(v for v in ids.values() if v is not None)
