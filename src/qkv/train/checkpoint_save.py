"""Saving a checkpoint: content-named safetensors files, then the manifest, which commits.

Why a manifest and content-named tensor files: a checkpoint spans several files, and only one
file can be replaced atomically. Each tensor file is written under a new name (temp file, fsync,
``os.replace``), then ``config.json`` is replaced the same way; that last rename is the commit.
A process killed at any moment leaves the previous ``config.json`` pointing at files that still
exist, because superseded files are deleted only after the commit.

What qkv deletes: only the tensor files that the previous manifest named (files qkv itself
wrote, with qkv's own name pattern), never anything else in the directory.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as st_save
from torch import Tensor, nn

from qkv.train.checkpoint_dir import atomic_write, directory_lock
from qkv.train.checkpoint_manifest import (
    FORMAT,
    MANIFEST,
    VERSION,
    previous_files,
    sha256,
    to_json,
)
from qkv.train.checkpoint_optimizer import split_optimizer

__all__ = ["save_checkpoint"]


def _tensor_file(directory: Path, stem: str, step: int, tensors: dict[str, Tensor]) -> str:
    data = st_save(tensors, metadata={"format": FORMAT})
    name = f"{stem}-{step:08d}-{sha256(data)[:12]}.safetensors"
    atomic_write(directory / name, data)
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
        previous = previous_files(directory)
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
        "model_config": to_json(model_config),
        "task": to_json(task),
        "train_config": None if train_config is None else to_json(train_config),
        "files": files,
    }
    state: dict[str, Tensor] = {}
    if optimizer is not None:
        state, manifest["optimizer"] = split_optimizer(optimizer)
    if rng_state is not None:
        state["rng.torch"] = rng_state.clone()
    if state:
        files["train_state"] = _tensor_file(directory, "train_state", step, state)
        written.append(files["train_state"])
    for key, name in files.items():
        manifest.setdefault("sha256", {})[key] = sha256((directory / name).read_bytes())
    path = directory / MANIFEST
    atomic_write(path, (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode())
    return path
