"""The checkpoint directory on disk: files written atomically, created with a clear error, locked.

Each file is written under a temp name in the same directory, fsynced, then put in place with
``os.replace`` (the directory fsynced after), so a reader sees the old file or the new one, never
half of one. Files are created with the permissions the umask allows (as ``open`` would), not
mkstemp's 0600. Writers are serialised by an exclusive lock (``fcntl.flock``) on ``.qkv.lock``
in the directory: a second process writing the same directory is refused with a clear error
instead of racing the first.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["LOCK_NAME", "CheckpointError", "atomic_write", "directory_lock", "prepare_directory"]

LOCK_NAME = ".qkv.lock"


class CheckpointError(ValueError):
    """A checkpoint that cannot be trusted or does not fit: the message says which file and why."""


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


def atomic_write(path: Path, data: bytes) -> None:
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
