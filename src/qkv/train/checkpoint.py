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

What qkv deletes: only the tensor files that the previous manifest named (files qkv itself
wrote, with qkv's own name pattern), never anything else in the directory; a user's
``notes.tmp`` or a Hugging Face shard ``model-00001-of-00002.safetensors`` is never touched.
Writers are serialised by an exclusive lock (``fcntl.flock``) on ``.qkv.lock`` in the
directory: a second process writing the same directory is refused with a clear error instead
of racing the first. Files are created with the permissions the umask allows (as ``open``
would), not mkstemp's 0600.

Loading never unpickles: tensors come from safetensors, everything else from JSON. A pickle
(``torch.save``'s ``.pt``) is refused, and a tensor file whose SHA-256 differs from the manifest
(tampered or truncated) is refused before it is parsed.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import re
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import Tensor, nn

from qkv.models.registry import check_weights, model_from_config, upgrade_weights

__all__ = [
    "FORMAT",
    "LOCK_NAME",
    "Checkpoint",
    "CheckpointError",
    "build_model",
    "check_weights_match",
    "directory_lock",
    "load_checkpoint",
    "prepare_directory",
    "restore_optimizer",
    "save_checkpoint",
]

FORMAT = "qkv-checkpoint"
VERSION = 1
MANIFEST = "config.json"
LOCK_NAME = ".qkv.lock"
_PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".pkl", ".pickle", ".ckpt")
# The names _tensor_file gives: the only files a save may delete (when the old manifest names them).
_OWN_TENSOR_FILE = re.compile(r"(model|train_state)-\d{8,}-[0-9a-f]{12}\.safetensors")
_FILE_KEYS = ("weights", "train_state")


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


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temp file in the same directory, fsync, ``os.replace``."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp's 0600 would hide checkpoints from the group
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def prepare_directory(directory: str | Path) -> Path:
    """Create ``directory`` (and its parents) for checkpoints, or say why it cannot be one.

    Called before training starts, so that a bad ``--out`` is found in a second, not after the
    run when the trained weights would be lost.

    Args:
        directory: the checkpoint directory.

    Returns:
        ``directory`` as a ``Path``.

    Raises:
        CheckpointError: ``directory`` (or a parent) is an existing file, or it cannot be
            created or written.
    """
    path = Path(directory)
    for parent in (path, *path.parents):
        if parent.exists() and not parent.is_dir():
            what = "is" if parent == path else f"lies inside {parent}, which is"
            raise CheckpointError(
                f"checkpoint directory {path} {what} an existing file, not a directory; "
                f"pass another --out"
            )
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise CheckpointError(f"cannot create checkpoint directory {path}: {err}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise CheckpointError(f"checkpoint directory {path} is not writable")
    return path


_HELD_LOCKS: dict[str, tuple[int, int]] = {}  # real path -> (lock fd, nesting depth)


@contextmanager
def directory_lock(directory: str | Path) -> Iterator[Path]:
    """Hold an exclusive lock on a checkpoint directory (``fcntl.flock`` on ``.qkv.lock``).

    Re-entrant within a process (``train`` holds it for the whole run and every
    :func:`save_checkpoint` inside takes it again); another process is refused at once. The lock
    file records the holder's pid and is left in place (removing it would race a new holder);
    the operating system releases the lock when the holder exits, however it exits.

    Args:
        directory: the checkpoint directory (created if needed, see :func:`prepare_directory`).

    Yields:
        The directory as a ``Path``.

    Raises:
        CheckpointError: another process holds the lock, or the directory is unusable.
    """
    path = prepare_directory(directory)
    key = os.path.realpath(path)
    if key in _HELD_LOCKS:
        fd, depth = _HELD_LOCKS[key]
        _HELD_LOCKS[key] = (fd, depth + 1)
        try:
            yield path
        finally:
            fd, depth = _HELD_LOCKS[key]
            _HELD_LOCKS[key] = (fd, depth - 1)
        return
    lock_path = path / LOCK_NAME
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as err:
        raise CheckpointError(f"cannot create the lock file {lock_path}: {err}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise CheckpointError(
            f"{path} is in use by another qkv process (pid {holder}, holding {lock_path}); "
            f"wait for it to finish or pass another --out"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _HELD_LOCKS[key] = (fd, 1)
    try:
        yield path
    finally:
        del _HELD_LOCKS[key]
        os.close(fd)  # releases the flock


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

    Raises:
        CheckpointError: ``directory`` is a file or not writable, or another process holds its
            lock (see :func:`directory_lock`).
    """
    with directory_lock(directory) as directory:
        previous = _previous_files(directory)
        written: list[str] = []  # this save's new tensor files, removed again if it fails
        try:
            path = _save(
                directory,
                written,
                model=model,
                model_type=model_type,
                model_config=model_config,
                task=task,
                step=step,
                train_config=train_config,
                optimizer=optimizer,
                rng_state=rng_state,
            )
        except BaseException:
            # A failed save (a full disk, a signal) leaves the directory as it was: no tensor
            # file that no manifest names. Only files this save wrote, never a previous one
            # (the same weights at the same step have the same name).
            for name in set(written) - previous:
                (directory / name).unlink(missing_ok=True)
            raise
        for name in previous - set(written):  # superseded, written by qkv
            (directory / name).unlink(missing_ok=True)
        return path


def _save(
    directory: Path,
    written: list[str],
    *,
    model: nn.Module,
    model_type: str,
    model_config: dict[str, Any],
    task: dict[str, Any],
    step: int,
    train_config: dict[str, Any] | None,
    optimizer: torch.optim.Optimizer | None,
    rng_state: Tensor | None,
) -> Path:
    """The tensor files (each name appended to ``written`` once on disk), then the manifest."""
    # clone: tied parameters share storage, which safetensors refuses to write twice
    weights = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    files = {"weights": _tensor_file(directory, "model", step, weights)}
    written.append(files["weights"])
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "model_type": model_type,
        "model_config": _to_json(model_config),
        "task": _to_json(task),
        "train_config": None if train_config is None else _to_json(train_config),
        "files": files,
    }
    state: dict[str, Tensor] = {}
    if optimizer is not None:
        state, manifest["optimizer"] = _split_optimizer(optimizer)
    if rng_state is not None:
        state["rng.torch"] = rng_state.clone()
    if state:
        files["train_state"] = _tensor_file(directory, "train_state", step, state)
        written.append(files["train_state"])
    for key, name in files.items():
        manifest.setdefault("sha256", {})[key] = _sha256((directory / name).read_bytes())
    path = directory / MANIFEST
    _atomic_write(path, (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode())
    return path


def _previous_files(directory: Path) -> set[str]:
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
    path = directory / name
    if not path.is_file():
        raise CheckpointError(f"{path} is missing (named by {directory / MANIFEST})")
    data = path.read_bytes()
    expected = manifest["sha256"].get(key)
    if _sha256(data) != expected:
        raise CheckpointError(
            f"{path} is tampered or truncated: its SHA-256 is {_sha256(data)[:16]}..., "
            f"config.json records {str(expected)[:16]}... ({len(data)} bytes read)"
        )
    try:
        return st_load(data)
    except SafetensorError as err:
        raise CheckpointError(f"{path} is not a valid safetensors file: {err}") from err


def _json_number_ok(value: Any) -> bool:
    """False for the NaN / infinities JSON numbers like ``1e400`` turn into."""
    return not isinstance(value, float) or math.isfinite(value)


def _walk_finite(value: Any) -> bool:
    if isinstance(value, dict):
        return all(_walk_finite(v) for v in value.values())
    if isinstance(value, list):
        return all(_walk_finite(v) for v in value)
    return _json_number_ok(value)


def _parse_manifest(manifest_path: Path) -> dict[str, Any]:
    """The manifest, its structure checked field by field.

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
    files, hashes = manifest.get("files"), manifest.get("sha256")
    if not isinstance(files, dict) or not isinstance(hashes, dict) or "weights" not in files:
        raise bad("files and sha256 must be objects and files must name the weights")
    for key, name in files.items():
        if key not in _FILE_KEYS:
            raise bad(f"files.{key} is not one of {_FILE_KEYS}")
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
    optimizer = manifest.get("optimizer")
    if optimizer is not None:
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
    return manifest


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Read and verify a checkpoint directory (or its ``config.json``).

    Raises:
        CheckpointError: a pickle file, a missing or malformed manifest (every malformed field
            is reported this way, never as a KeyError or OverflowError), a tensor file whose
            hash does not match the manifest (tampered or truncated) or that safetensors cannot
            parse.
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
    manifest = _parse_manifest(manifest_path)
    weights = _read_verified(directory, manifest, "weights")
    ckpt = Checkpoint(
        path=directory,
        model_type=manifest["model_type"],
        model_config=manifest["model_config"],
        task=manifest["task"],
        step=manifest["step"],
        weights=weights,
        train_config=manifest.get("train_config"),
        optimizer_json=manifest.get("optimizer"),
    )
    if "train_state" in manifest["files"]:
        state = _read_verified(directory, manifest, "train_state")
        ckpt.rng_state = state.pop("rng.torch", None)
        ckpt.optimizer_tensors = state
    return ckpt


def build_model(ckpt: Checkpoint) -> nn.Module:
    """The model a checkpoint describes, its verified weights loaded.

    The config (``config.json`` is not hashed, so it may have been edited) is checked against
    the weights before anything is allocated: no int field may exceed the weights' total
    element count (no field counting layers their number of tensors), then the model is built
    on the meta device, where it costs no memory, and compared key by key, shape and dtype; only
    a config that fits is built for real.

    Raises:
        CheckpointError: an unknown model type, an invalid config, or a config that does not
            match the weights (the key and both shapes named).
    """
    where = str(ckpt.path)
    elements = sum(t.numel() for t in ckpt.weights.values())
    for key, value in ckpt.model_config.items():
        if type(value) is not int:
            continue
        bound, what = (
            (len(ckpt.weights), "tensors")
            if "layers" in key
            else (max(elements, 1), "weight elements")
        )
        if value > bound:
            raise CheckpointError(
                f"config/weights mismatch in {where}: model_config.{key} = {value} exceeds "
                f"the {bound} {what} in the weights file"
            )
    try:
        with torch.device("meta"):
            skeleton = model_from_config(ckpt.model_type, ckpt.model_config)
        check_weights(skeleton, upgrade_weights(skeleton, ckpt.weights), where)
        model = model_from_config(ckpt.model_type, ckpt.model_config)
    except (ValueError, TypeError) as err:
        raise CheckpointError(f"{where}: {err}") from None
    model.load_state_dict(upgrade_weights(model, ckpt.weights), strict=True)
    return model


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
        if not idx.isdigit():
            raise CheckpointError(f"optimizer state in {ckpt.path}: state index {idx!r}")
        state.setdefault(int(idx), {}).update(scalars)
    saved = ckpt.optimizer_json["param_groups"]
    if len(saved) != len(optimizer.param_groups):
        raise CheckpointError(
            f"optimizer state in {ckpt.path}: {len(saved)} param groups, the optimizer has "
            f"{len(optimizer.param_groups)}"
        )
    groups = [
        _group_like(g, now, ckpt.path) for g, now in zip(saved, optimizer.param_groups, strict=True)
    ]
    try:
        optimizer.load_state_dict({"state": state, "param_groups": groups})
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"optimizer state in {ckpt.path} does not fit: {err!r}") from None


def _group_like(saved: dict[str, Any], current: dict[str, Any], where: Path) -> dict[str, Any]:
    """A saved param group whose hyperparameters have the types of the optimizer's own (JSON
    turns tuples into lists), so that a malformed one fails here, not in the first step."""

    def kind(v: Any) -> str:
        if isinstance(v, bool) or v is None or isinstance(v, str):
            return type(v).__name__
        if isinstance(v, int | float):
            return "number"
        if isinstance(v, tuple | list):
            return f"sequence of {len(v)} " + ",".join(kind(x) for x in v)
        return type(v).__name__

    group = dict(saved)
    if set(group) != set(current):
        raise CheckpointError(
            f"optimizer state in {where}: param group keys {sorted(group)}, the optimizer "
            f"has {sorted(current)}"
        )
    for key, now in current.items():
        if key == "params":
            continue
        if kind(group[key]) != kind(now):
            raise CheckpointError(
                f"optimizer state in {where}: param group {key!r} is {group[key]!r}, expected "
                f"a {kind(now)}"
            )
        if isinstance(now, tuple):
            group[key] = tuple(group[key])
    return group
