"""Optimizer state in a checkpoint: AdamW's moments as tensors, its scalars as JSON, and back.

Saving splits ``optimizer.state_dict()`` into tensors (for safetensors) and JSON (for the
manifest); restoring checks each moment's shape against its parameter and each param group's
hyperparameter types against the optimizer's own before loading anything.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from qkv.train.checkpoint_dir import CheckpointError
from qkv.train.checkpoint_load import Checkpoint
from qkv.train.checkpoint_manifest import to_json

__all__ = ["restore_optimizer", "split_optimizer"]


def split_optimizer(optimizer: torch.optim.Optimizer) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """``optimizer``'s state as tensors keyed ``"optim.<param index>.<name>"`` and JSON scalars.

    Args:
        optimizer: the optimizer whose ``state_dict()`` is split.

    Returns:
        The tensors (cloned, contiguous) and ``{"param_groups", "state_scalars"}`` as JSON.
    """
    sd = optimizer.state_dict()
    tensors: dict[str, Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for idx, state in sd["state"].items():
        for name, value in state.items():
            if isinstance(value, Tensor):
                tensors[f"optim.{idx}.{name}"] = value.detach().clone().contiguous()
            else:
                scalars.setdefault(str(idx), {})[name] = to_json(value)
    return tensors, {"param_groups": to_json(sd["param_groups"]), "state_scalars": scalars}


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
