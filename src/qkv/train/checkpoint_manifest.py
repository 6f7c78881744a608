"""The checkpoint manifest ``config.json``: its format, JSON conversion, and its checked reading.

The manifest names the model type and config, the task, the step, the training config and the
scalar optimizer state, and the names and SHA-256 of the tensor files. Reading it checks every
field's type (and that no number is NaN or infinite), so that a malformed manifest is refused
with the field named, never a KeyError later.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import Tensor

from qkv.train.checkpoint_dir import CheckpointError

__all__ = [
    "FILE_KEYS",
    "FORMAT",
    "MANIFEST",
    "VERSION",
    "parse_manifest",
    "previous_files",
    "sha256",
    "to_json",
]

FORMAT = "qkv-checkpoint"
VERSION = 1
MANIFEST = "config.json"
# The names checkpoint_save._tensor_file gives: the only files a save may delete (when the old
# manifest names them).
_OWN_TENSOR_FILE = re.compile(r"(model|train_state)-\d{8,}-[0-9a-f]{12}\.safetensors")
FILE_KEYS = ("weights", "train_state")


def sha256(data: bytes) -> str:
    """The SHA-256 of ``data`` as hex: what the manifest records for each tensor file."""
    return hashlib.sha256(data).hexdigest()


def to_json(value: Any) -> Any:
    """``value`` as JSON-ready data (tuples become lists, keys strings).

    Raises:
        TypeError: ``value`` holds a tensor (tensors go to safetensors).
    """
    if isinstance(value, tuple | list):
        return [to_json(v) for v in value]
    if isinstance(value, dict):
        return {str(k): to_json(v) for k, v in value.items()}
    if isinstance(value, Tensor):
        raise TypeError("tensors go to safetensors, not JSON")
    return value


def previous_files(directory: Path) -> set[str]:
    """The tensor files the current manifest names: the only files a save may delete.

    A name counts only if it has the shape of the names qkv gives, so that a crafted manifest
    cannot make a save delete a user's file; an unreadable manifest names nothing.
    """
    try:
        files = json.loads((directory / MANIFEST).read_text(encoding="utf-8")).get("files")
    except (OSError, ValueError, RecursionError, AttributeError):
        return set()
    if not isinstance(files, dict):
        return set()
    return {n for n in files.values() if isinstance(n, str) and _OWN_TENSOR_FILE.fullmatch(n)}


def _json_number_ok(value: Any) -> bool:
    """False for the NaN / infinities JSON numbers like ``1e400`` turn into."""
    return not isinstance(value, float) or math.isfinite(value)


def _walk_finite(value: Any) -> bool:
    if isinstance(value, dict):
        return all(_walk_finite(v) for v in value.values())
    if isinstance(value, list):
        return all(_walk_finite(v) for v in value)
    return _json_number_ok(value)


def parse_manifest(manifest_path: Path) -> dict[str, Any]:
    """The manifest, its structure checked field by field.

    Args:
        manifest_path: the ``config.json`` to read.

    Returns:
        The manifest as a dict, every field checked.

    Raises:
        CheckpointError: anything but a well-formed manifest (the field and value named).
    """

    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{manifest_path} is malformed: {what}")

    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as err:
        raise CheckpointError(f"{manifest_path} is not valid JSON: {err}") from None
    except RecursionError:
        raise bad("its JSON is nested too deeply") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(
            f"{manifest_path} is not a qkv checkpoint manifest (format must be {FORMAT!r})"
        )
    version = manifest.get("version")
    if type(version) is not int or version != VERSION:
        raise CheckpointError(f"{manifest_path}: version {version!r}, this qkv reads {VERSION}")
    _check_fields(manifest, bad)
    _check_files(manifest, bad)
    _check_optimizer(manifest, bad)
    return manifest


def _check_fields(manifest: dict[str, Any], bad: Callable[[str], CheckpointError]) -> None:
    """The step, the model type and the three config objects (finite numbers only)."""
    step = manifest.get("step")
    if type(step) is not int or step < 0:
        raise bad(f"step must be a non-negative int, got {str(step)[:40]}")
    if not isinstance(manifest.get("model_type"), str):
        raise bad(f"model_type must be a string, got {str(manifest.get('model_type'))[:40]}")
    for key, optional in (("model_config", False), ("task", False), ("train_config", True)):
        value = manifest.get(key)
        if not (isinstance(value, dict) or (optional and value is None)):
            raise bad(f"{key} must be an object, got {type(value).__name__}")
        if not _walk_finite(value):
            raise bad(f"{key} holds a non-finite number")


def _check_files(manifest: dict[str, Any], bad: Callable[[str], CheckpointError]) -> None:
    """``files`` names plain ``.safetensors`` files in the directory, each with a ``sha256``."""
    files, hashes = manifest.get("files"), manifest.get("sha256")
    if not isinstance(files, dict) or not isinstance(hashes, dict) or "weights" not in files:
        raise bad("files and sha256 must be objects and files must name the weights")
    for key, name in files.items():
        if key not in FILE_KEYS:
            raise bad(f"files.{key} is not one of {FILE_KEYS}")
        if (
            not isinstance(name, str)
            or Path(name).name != name
            or not name.endswith(".safetensors")
        ):
            raise bad(
                f"files.{key} = {str(name)[:60]!r} is not a plain '.safetensors' name in the "
                f"checkpoint directory"
            )
        if not isinstance(hashes.get(key), str):
            raise bad(f"sha256.{key} must be a string")


def _check_optimizer(manifest: dict[str, Any], bad: Callable[[str], CheckpointError]) -> None:
    """The scalar optimizer state, if any: param groups with their ``params``, state scalars."""
    optimizer = manifest.get("optimizer")
    if optimizer is None:
        return
    groups = optimizer.get("param_groups") if isinstance(optimizer, dict) else None
    scalars = optimizer.get("state_scalars", {}) if isinstance(optimizer, dict) else None
    if not (
        isinstance(groups, list)
        and all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups)
        and isinstance(scalars, dict)
        and all(isinstance(v, dict) for v in scalars.values())
        and _walk_finite(optimizer)
    ):
        raise bad("optimizer must hold a list of param_groups and a state_scalars object")
