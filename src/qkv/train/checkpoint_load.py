"""Loading a checkpoint without pickle: manifest checked, tensor files verified, model built.

Loading never unpickles: tensors come from safetensors, everything else from JSON. A pickle
(``torch.save``'s ``.pt``) is refused, and a tensor file whose SHA-256 differs from the manifest
(tampered or truncated) is refused before it is parsed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from safetensors import SafetensorError
from safetensors.torch import load as st_load
from torch import Tensor, nn

from qkv.models.registry import check_weights, model_from_config, upgrade_weights
from qkv.nn.meta import on_meta
from qkv.train.checkpoint_dir import CheckpointError
from qkv.train.checkpoint_manifest import MANIFEST, parse_manifest, sha256

__all__ = ["Checkpoint", "build_model", "load_checkpoint"]

_PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".pkl", ".pickle", ".ckpt")


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
    if sha256(data) != expected:
        raise CheckpointError(
            f"{path} is tampered or truncated: its SHA-256 is {sha256(data)[:16]}..., "
            f"config.json records {str(expected)[:16]}... ({len(data)} bytes read)"
        )
    try:
        return st_load(data)
    except SafetensorError as err:
        raise CheckpointError(f"{path} is not a valid safetensors file: {err}") from err


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
    manifest = parse_manifest(manifest_path)
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
        with on_meta():
            skeleton = model_from_config(ckpt.model_type, ckpt.model_config)
        check_weights(skeleton, upgrade_weights(skeleton, ckpt.weights), where)
        model = model_from_config(ckpt.model_type, ckpt.model_config)
    except (ValueError, TypeError) as err:
        raise CheckpointError(f"{where}: {err}") from None
    model.load_state_dict(upgrade_weights(model, ckpt.weights), strict=True)
    return model
