"""Checkpoints: safetensors tensors plus a JSON manifest, written atomically, loaded without pickle.

A checkpoint is a directory::

    config.json                          the manifest: model type and config, task, step,
                                         training config and scalar optimizer state, and the
                                         names and SHA-256 of the two tensor files below
    model-<step>-<hash>.safetensors      the weights (a plain safetensors file)
    train_state-<step>-<hash>.safetensors  AdamW moments and the torch RNG state (for --resume)

Why a manifest and content-named tensor files: a checkpoint spans several files, and only one
file can be replaced atomically. Each tensor file is written under a new name (temp file, fsync,
``os.replace``), then ``config.json`` is replaced the same way; that last rename is the commit.
A process killed at any moment leaves the previous ``config.json`` pointing at files that still
exist, because superseded files are deleted only after the commit.

Loading never unpickles: tensors come from safetensors, everything else from JSON. A pickle
(``torch.save``'s ``.pt``) is refused, and a tensor file whose SHA-256 differs from the manifest
(tampered or truncated) is refused before it is parsed.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import Tensor, nn

from qkv.models.registry import check_weights

__all__ = [
    "FORMAT",
    "Checkpoint",
    "CheckpointError",
    "check_weights_match",
    "load_checkpoint",
    "restore_optimizer",
    "save_checkpoint",
]

FORMAT = "qkv-checkpoint"
VERSION = 1
MANIFEST = "config.json"
_PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".pkl", ".pickle", ".ckpt")


class CheckpointError(ValueError):
    """A checkpoint that cannot be trusted or does not fit: the message says which file and why."""


@dataclass
class Checkpoint:
    """What :func:`load_checkpoint` returns (every tensor file already verified).

    Attributes:
        path: the checkpoint directory.
        model_type: ``"transformer"`` or ``"decoder_only"``.
        model_config: the model config's ``to_dict()``.
        task: the task's ``spec()``.
        step: optimizer steps taken.
        weights: the model's state dict.
        train_config: the training config (JSON), or None.
        optimizer_tensors: AdamW state tensors keyed ``"<param index>.<name>"`` (empty if absent).
        optimizer_json: scalar optimizer state (``param_groups`` and non-tensor state).
        rng_state: ``torch.get_rng_state()`` at the time of saving, or None.
    """

    path: Path
    model_type: str
    model_config: dict[str, Any]
    task: dict[str, Any]
    step: int
    weights: dict[str, Tensor]
    train_config: dict[str, Any] | None = None
    optimizer_tensors: dict[str, Tensor] = field(default_factory=dict)
    optimizer_json: dict[str, Any] | None = None
    rng_state: Tensor | None = None


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temp file in the same directory, fsync, ``os.replace``."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _to_json(value: Any) -> Any:
    if isinstance(value, tuple | list):
        return [_to_json(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _to_json(v) for k, v in value.items()}
    if isinstance(value, Tensor):
        raise TypeError("tensors go to safetensors, not JSON")
    return value


def _split_optimizer(optimizer: torch.optim.Optimizer) -> tuple[dict[str, Tensor], dict[str, Any]]:
    sd = optimizer.state_dict()
    tensors: dict[str, Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for idx, state in sd["state"].items():
        for name, value in state.items():
            if isinstance(value, Tensor):
                tensors[f"optim.{idx}.{name}"] = value.detach().clone().contiguous()
            else:
                scalars.setdefault(str(idx), {})[name] = _to_json(value)
    return tensors, {"param_groups": _to_json(sd["param_groups"]), "state_scalars": scalars}


def _tensor_file(directory: Path, stem: str, step: int, tensors: dict[str, Tensor]) -> str:
    data = st_save(tensors, metadata={"format": FORMAT})
    name = f"{stem}-{step:08d}-{_sha256(data)[:12]}.safetensors"
    _atomic_write(directory / name, data)
    return name


def save_checkpoint(
    directory: str | Path,
    *,
    model: nn.Module,
    model_type: str,
    model_config: dict[str, Any],
    task: dict[str, Any],
    step: int,
    train_config: dict[str, Any] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    rng_state: Tensor | None = None,
) -> Path:
    """Write a checkpoint atomically into ``directory`` (created if needed).

    Args:
        directory: the checkpoint directory.
        model: the model (its ``state_dict`` is saved; a DDP wrapper must be unwrapped first).
        model_type: ``"transformer"`` or ``"decoder_only"``.
        model_config: the model config as a dict.
        task: the task spec.
        step: optimizer steps taken so far.
        train_config: the training config, stored for ``--resume``.
        optimizer: its state is saved in ``train_state-*.safetensors`` + the manifest.
        rng_state: ``torch.get_rng_state()`` to restore on resume.

    Returns:
        The path of the manifest ``config.json``.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    # clone: tied parameters share storage, which safetensors refuses to write twice
    weights = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "model_type": model_type,
        "model_config": _to_json(model_config),
        "task": _to_json(task),
        "train_config": None if train_config is None else _to_json(train_config),
        "files": {"weights": _tensor_file(directory, "model", step, weights)},
    }
    state: dict[str, Tensor] = {}
    if optimizer is not None:
        state, manifest["optimizer"] = _split_optimizer(optimizer)
    if rng_state is not None:
        state["rng.torch"] = rng_state.clone()
    if state:
        manifest["files"]["train_state"] = _tensor_file(directory, "train_state", step, state)
    for key, name in manifest["files"].items():
        manifest.setdefault("sha256", {})[key] = _sha256((directory / name).read_bytes())
    path = directory / MANIFEST
    _atomic_write(path, (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode())
    keep = set(manifest["files"].values()) | {MANIFEST}
    for old in directory.iterdir():  # superseded tensor files and stray temp files
        stale = old.suffix == ".safetensors" and old.name.startswith(("model-", "train_state-"))
        if old.name not in keep and (stale or old.name.endswith(".tmp")):
            old.unlink(missing_ok=True)
    return path


def _refuse_pickle(path: Path) -> None:
    head = b""
    if path.is_file():
        with path.open("rb") as f:
            head = f.read(4)
    pickled = head[:1] == b"\x80" or head == b"PK\x03\x04"  # raw pickle, or torch.save's zip
    if path.suffix in _PICKLE_SUFFIXES or pickled:
        raise CheckpointError(
            f"refusing to load {path}: it is (or is named like) a pickle file, e.g. from "
            f"torch.save. Unpickling can run arbitrary code, so qkv loads only its own "
            f"checkpoint directories (config.json + .safetensors)."
        )


def _read_verified(directory: Path, manifest: dict[str, Any], key: str) -> dict[str, Tensor]:
    name = manifest["files"][key]
    if Path(name).name != name or not name.endswith(".safetensors"):
        raise CheckpointError(
            f"{directory / MANIFEST}: files.{key} = {name!r} is not a plain "
            f"'.safetensors' name in the checkpoint directory"
        )
    path = directory / name
    if not path.is_file():
        raise CheckpointError(f"{path} is missing (named by {directory / MANIFEST})")
    data = path.read_bytes()
    expected = manifest.get("sha256", {}).get(key)
    if _sha256(data) != expected:
        raise CheckpointError(
            f"{path} is tampered or truncated: its SHA-256 is {_sha256(data)[:16]}..., "
            f"config.json records {str(expected)[:16]}... ({len(data)} bytes read)"
        )
    try:
        return st_load(data)
    except SafetensorError as err:
        raise CheckpointError(f"{path} is not a valid safetensors file: {err}") from err


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Read and verify a checkpoint directory (or its ``config.json``).

    Raises:
        CheckpointError: a pickle file, a missing/invalid manifest, a tensor file whose hash does
            not match the manifest (tampered or truncated) or that safetensors cannot parse.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    _refuse_pickle(path)
    directory = path.parent if path.is_file() else path
    if path.is_file() and path.name != MANIFEST:
        raise CheckpointError(
            f"{path} is not a checkpoint: pass the checkpoint directory (holding {MANIFEST})"
        )
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        pickles = sorted(p.name for p in directory.glob("*") if p.suffix in _PICKLE_SUFFIXES)
        hint = f"; it holds pickle files {pickles}, which qkv refuses to load" if pickles else ""
        raise CheckpointError(f"{directory} is not a qkv checkpoint: no {MANIFEST}{hint}")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{manifest_path} is not valid JSON: {err}") from err
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(
            f"{manifest_path} is not a qkv checkpoint manifest (format must be {FORMAT!r})"
        )
    if manifest.get("version") != VERSION:
        raise CheckpointError(
            f"{manifest_path}: version {manifest.get('version')!r}, this qkv reads {VERSION}"
        )
    weights = _read_verified(directory, manifest, "weights")
    ckpt = Checkpoint(
        path=directory,
        model_type=str(manifest["model_type"]),
        model_config=dict(manifest["model_config"]),
        task=dict(manifest["task"]),
        step=int(manifest["step"]),
        weights=weights,
        train_config=manifest.get("train_config"),
        optimizer_json=manifest.get("optimizer"),
    )
    if "train_state" in manifest["files"]:
        state = _read_verified(directory, manifest, "train_state")
        ckpt.rng_state = state.pop("rng.torch", None)
        ckpt.optimizer_tensors = state
    return ckpt


def check_weights_match(model: nn.Module, weights: dict[str, Tensor], where: str) -> None:
    """Load-time check that ``weights`` fit ``model`` exactly, before copying anything.

    The check itself is :func:`qkv.models.registry.check_weights`; here its error becomes a
    :class:`CheckpointError`.

    Raises:
        CheckpointError: names every missing, unexpected or differently shaped/typed key, with
            both shapes.
    """
    try:
        check_weights(model, weights, where)
    except ValueError as err:
        raise CheckpointError(str(err)) from None


def restore_optimizer(optimizer: torch.optim.Optimizer, ckpt: Checkpoint) -> None:
    """Load the AdamW state saved in ``ckpt`` into ``optimizer`` (built for the same model).

    Raises:
        CheckpointError: no optimizer state in the checkpoint, or a moment whose shape does not
            match its parameter.
    """
    if ckpt.optimizer_json is None:
        raise CheckpointError(f"{ckpt.path} holds no optimizer state (it cannot be resumed)")
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state: dict[int, dict[str, Any]] = {}
    for key, tensor in ckpt.optimizer_tensors.items():
        _, idx, name = key.split(".", 2)
        i = int(idx)
        if i >= len(params) or (name != "step" and tensor.shape != params[i].shape):
            shape = tuple(params[i].shape) if i < len(params) else "no such parameter"
            raise CheckpointError(
                f"optimizer state mismatch in {ckpt.path}: {key!r} has shape "
                f"{tuple(tensor.shape)}, parameter {i} is {shape}"
            )
        state.setdefault(i, {})[name] = tensor
    for idx, scalars in ckpt.optimizer_json.get("state_scalars", {}).items():
        state.setdefault(int(idx), {}).update(scalars)
    groups = []
    for g in ckpt.optimizer_json["param_groups"]:
        g = dict(g)
        if "betas" in g:
            g["betas"] = tuple(g["betas"])
        groups.append(g)
    try:
        optimizer.load_state_dict({"state": state, "param_groups": groups})
    except ValueError as err:
        raise CheckpointError(f"optimizer state in {ckpt.path} does not fit: {err}") from err
