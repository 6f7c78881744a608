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

The parts, one file each (this module re-exports their public names):
:mod:`~qkv.train.checkpoint_dir` (atomic writes, the directory and its lock),
:mod:`~qkv.train.checkpoint_manifest` (the manifest's format and checked reading),
:mod:`~qkv.train.checkpoint_save`, :mod:`~qkv.train.checkpoint_load` (verified, pickle-free) and
:mod:`~qkv.train.checkpoint_optimizer` (AdamW state out and back in, for ``--resume``).
"""

from __future__ import annotations

from qkv.train.checkpoint_dir import LOCK_NAME, CheckpointError, directory_lock, prepare_directory
from qkv.train.checkpoint_load import Checkpoint, build_model, load_checkpoint
from qkv.train.checkpoint_manifest import FORMAT
from qkv.train.checkpoint_manifest import MANIFEST as MANIFEST
from qkv.train.checkpoint_manifest import VERSION as VERSION
from qkv.train.checkpoint_optimizer import restore_optimizer
from qkv.train.checkpoint_save import save_checkpoint

__all__ = [
    "FORMAT",
    "LOCK_NAME",
    "Checkpoint",
    "CheckpointError",
    "build_model",
    "directory_lock",
    "load_checkpoint",
    "prepare_directory",
    "restore_optimizer",
    "save_checkpoint",
]
