"""Reading and writing Hugging Face ``save_pretrained`` directories, shared by every HF converter.

A directory holds ``config.json`` and the weights as ``model.safetensors`` or as shards
``model-0000x-of-0000y.safetensors`` listed in ``model.safetensors.index.json``. Only
safetensors are read: a pickle (``pytorch_model.bin``) can run arbitrary code when loaded, so it
is refused, never opened. Headers (names, shapes, dtypes) are read first and checked against
what the config implies; tensors are allocated only once everything fits.

A converter describes its weights as :class:`~qkv.convert.hf_rules.Rule` s (in
:mod:`qkv.convert.hf_rules`, whose names are importable from here too).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

from qkv.convert.hf_rules import (
    Header,
    Rule,
    check_against,
    check_layers,
    expand_rules,
    from_qkv,
    held_layers,
    listing,
    to_qkv,
)
from qkv.models.config import DecoderOnlyConfig

__all__ = [
    "INDEX_FILE",
    "MAX_JSON_BYTES",
    "WEIGHTS_FILE",
    "Header",
    "Rule",
    "check_against",
    "check_layers",
    "decoder_config",
    "expand_rules",
    "from_qkv",
    "held_layers",
    "inside",
    "listing",
    "read_config",
    "read_headers",
    "read_json",
    "read_tensors",
    "require_keys",
    "to_qkv",
    "weight_files",
    "write_dir",
]

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_JSON_BYTES = 64 * 2**20
"""The largest ``config.json`` or index read (a real one is a few kB, an index a few MB)."""


def _allowed_roots(root: Path) -> list[Path]:
    """Where a file of ``root`` may resolve to: ``root`` itself and, for a snapshot of the
    Hugging Face hub cache (``models--org--name/snapshots/<rev>``, whose files are links to
    ``../../blobs/<hash>``), that model's ``blobs`` folder."""
    real = root.resolve()
    allowed = [real]
    if real.parent.name == "snapshots" and (real.parent.parent / "blobs").is_dir():
        allowed.append(real.parent.parent / "blobs")
    return allowed


def inside(root: Path, name: str, what: str) -> Path:
    """``root / name``, checked to resolve (links followed) inside the checkpoint directory.

    A checkpoint directory is data someone else wrote: an index naming ``../../x`` or
    ``/etc/passwd``, or a link to a file elsewhere, must not make qkv read outside it.

    Args:
        root: the checkpoint directory.
        name: a file name relative to ``root``, as the directory gives it.
        what: what named it, for the message (e.g. ``"weight_map['lm_head.weight']"``).

    Returns:
        ``root / name``.

    Raises:
        ValueError: an absolute name, or one that resolves outside ``root`` (see
            :func:`_allowed_roots` for the hub cache's blobs).
    """
    path = Path(name)
    if path.is_absolute() or path.drive:
        raise ValueError(
            f"{what} names {name!r}, an absolute path: a checkpoint's files must lie inside "
            f"its directory {str(root)!r}"
        )
    real = (root / path).resolve()
    if not any(real.is_relative_to(a) for a in _allowed_roots(root)):
        raise ValueError(
            f"{what} names {name!r}, which resolves to {str(real)!r}, outside the checkpoint "
            f"directory {str(root.resolve())!r}; refused (a checkpoint may not make qkv read "
            "other files)"
        )
    return root / path


def read_json(path: Path, root: Path, *, limit: int = MAX_JSON_BYTES) -> Any:
    """The parsed JSON of ``path`` (a file of ``root``), within ``limit`` bytes.

    Args:
        path: a JSON file directly in ``root`` (``config.json``, the index,
            ``generation_config.json``).
        root: the checkpoint directory, which ``path`` must resolve inside (:func:`inside`).
        limit: the largest size read.

    Returns:
        The parsed value (any JSON type).

    Raises:
        ValueError: outside ``root``, too large, not UTF-8, not JSON, or nested too deep.
    """
    inside(root, path.name, path.name)
    size = path.stat().st_size
    if size > limit:
        raise ValueError(f"{path} is {size} bytes, more than the {limit} read")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except RecursionError:
        raise ValueError(f"{path} is not valid JSON: nested too deep") from None
    except (ValueError, UnicodeDecodeError) as err:  # JSONDecodeError, a too long int
        raise ValueError(f"{path} is not valid JSON: {err}") from None


def read_config(root: Path) -> dict[str, Any]:
    """The parsed ``config.json`` of ``root``.

    Raises:
        FileNotFoundError: no ``config.json``.
        ValueError: not valid JSON (nested too deep, too large), not a JSON object, or a link
            outside ``root``.
    """
    path = root / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{str(root)!r} has no config.json (not a save_pretrained dir)")
    hf = read_json(path, root)
    if not isinstance(hf, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(hf).__name__}")
    return hf


def require_keys(hf: Mapping[str, Any], keys: Iterable[str], source: str) -> None:
    """Raise ``ValueError`` naming every key of ``keys`` that ``hf`` lacks."""
    absent = [k for k in keys if k not in hf]
    if absent:
        raise ValueError(f"{source} lacks {', '.join(absent)}")


def decoder_config(
    hf: Mapping[str, Any], source: str, problems: list[str], **fields: Any
) -> DecoderOnlyConfig:
    """A pre-norm, dropout-free :class:`DecoderOnlyConfig` from a HF config's ``fields``.

    Args:
        hf: the parsed ``config.json`` (its ``model_type``, ``eos_token_id``).
        source: where it came from, for the messages.
        problems: the unsupported options found, each named with its value.
        fields: the :class:`DecoderOnlyConfig` fields, ``vocab_size`` among them, each already
            read with :mod:`qkv.convert.hf_values`.

    Raises:
        ValueError: ``problems`` is not empty, or the config rejects a value.
    """
    if problems:
        raise ValueError(
            f"{source}: unsupported {hf.get('model_type')} options: " + "; ".join(problems)
        )
    V, eos = fields.pop("vocab_size"), hf.get("eos_token_id")
    try:
        return DecoderOnlyConfig(
            V,
            dropout=0.0,
            norm_first=True,
            eos_id=eos if isinstance(eos, int) and 0 <= eos < V else None,
            **fields,
        )
    except (TypeError, ValueError) as err:
        raise ValueError(f"{source}: {err}") from None


def weight_files(root: Path) -> list[Path]:
    """The safetensors file(s) of ``root``: ``model.safetensors``, or the shards of the index.

    Raises:
        FileNotFoundError: neither is there (the message says why a pickle found instead is not
            read), or the index names a shard that is missing.
        ValueError: an index that is not ``{"weight_map": {key: file}}``, or a file that lies
            outside ``root`` (an absolute or ``..`` shard name, a link elsewhere), named with
            the key that names it.
    """
    if (root / WEIGHTS_FILE).is_file():
        return [inside(root, WEIGHTS_FILE, WEIGHTS_FILE)]
    index = root / INDEX_FILE
    if index.is_file():
        return _shards(root, index)
    hint = ""
    if any(root.glob("*.bin")) or any(root.glob("*.pt")):
        hint = (
            "; a pickle checkpoint (*.bin / *.pt) is there, but qkv reads safetensors only, since "
            "unpickling can run arbitrary code"
        )
    raise FileNotFoundError(f"{str(root)!r} has neither {WEIGHTS_FILE} nor {INDEX_FILE}{hint}")


def _shards(root: Path, index: Path) -> list[Path]:
    """The shard files an index names, each checked to lie inside ``root``."""
    parsed = read_json(index, root)
    weight_map = parsed.get("weight_map") if isinstance(parsed, dict) else None
    if not isinstance(weight_map, dict):
        raise ValueError(
            f"{index} is not a safetensors index: it needs a JSON object with a "
            '"weight_map" object {key: shard file}'
        )
    first_key: dict[str, str] = {}  # shard -> the first key naming it, for the messages
    for key, name in weight_map.items():
        if not isinstance(name, str) or not name:
            raise ValueError(
                f"{index}: weight_map[{key!r}] must be a shard file name, got {name!r}"
            )
        first_key.setdefault(name, key)
    paths = {n: inside(root, n, f"{index} weight_map[{k!r}]") for n, k in first_key.items()}
    missing = [n for n in sorted(paths) if not paths[n].is_file()]
    if missing:
        raise FileNotFoundError(f"{index} names shards that are missing: {missing}")
    return [paths[n] for n in sorted(paths)]


def read_headers(files: Iterable[Path]) -> dict[str, Header]:
    """Every tensor's name, shape and dtype, read from the headers without loading data.

    Raises:
        ValueError: an unreadable file, or one key in two shards.
    """
    out: dict[str, Header] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as handle:
                for key in handle.keys():  # noqa: SIM118 (a safe_open handle is no dict)
                    if key in out:
                        raise ValueError(f"{key} is in both {out[key].file} and {f}")
                    part = handle.get_slice(key)
                    out[key] = Header(tuple(part.get_shape()), str(part.get_dtype()), f)
        except (SafetensorError, OSError) as err:
            raise ValueError(f"{f} is not a readable safetensors file: {err}") from None
    return out


def read_tensors(headers: Mapping[str, Header], keys: Iterable[str]) -> dict[str, Tensor]:
    """Load the tensors ``keys`` (each file opened once)."""
    by_file: dict[Path, list[str]] = {}
    for k in keys:
        by_file.setdefault(headers[k].file, []).append(k)
    out: dict[str, Tensor] = {}
    for f, names in by_file.items():
        with safe_open(str(f), framework="pt") as handle:
            for k in names:
                out[k] = handle.get_tensor(k)
    return out


def write_dir(root: Path, config: Mapping[str, Any], tensors: Mapping[str, Tensor]) -> Path:
    """Write ``config.json`` and ``model.safetensors`` into ``root`` (created if needed)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(dict(config), indent=2) + "\n", encoding="utf-8")
    save_file(
        {k: v.contiguous() for k, v in tensors.items()},
        str(root / WEIGHTS_FILE),
        metadata={"format": "pt"},
    )
    return root
