"""Checkpoints never lose a user's data: only qkv's own files are deleted, ``--out`` is checked
before training, one writer at a time (a real second process), the unhashed config is compared
with the weights before anything is allocated, files get the umask's permissions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import qkv.train.loop as loop
from qkv.train.checkpoint import (
    CheckpointError,
    directory_lock,
    load_checkpoint,
    prepare_directory,
    save_checkpoint,
)
from qkv.train.config import TrainConfig
from qkv.train.inference import load_trained
from qkv.train.loop import RunOptions, train


def _save(directory: Path, step: int) -> Path:
    model = nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    return save_checkpoint(
        directory,
        model=model,
        model_type="test",
        model_config={},
        task={"name": "none"},
        step=step,
        optimizer=opt,
        rng_state=torch.get_rng_state(),
    )


def _named(directory: Path) -> set[str]:
    return set(json.loads((directory / "config.json").read_text())["files"].values())


def test_save_deletes_only_the_files_qkv_wrote(tmp_path: Path) -> None:
    foreign = {
        "notes.tmp": b"a user's notes",
        "model-00001-of-00002.safetensors": b"a Hugging Face shard",
        "train_state-mine.safetensors": b"user",
        # qkv's own name pattern, but no manifest of this directory ever named it
        "model-00000009-0123456789ab.safetensors": b"not written by this directory's saves",
    }
    for name, data in foreign.items():
        (tmp_path / name).write_bytes(data)
    _save(tmp_path, 1)
    first = _named(tmp_path)
    _save(tmp_path, 2)
    second = _named(tmp_path)
    assert first.isdisjoint(second)
    for name, data in foreign.items():
        assert (tmp_path / name).read_bytes() == data, name
    assert not any((tmp_path / n).exists() for n in first), "superseded qkv files are removed"
    assert all((tmp_path / n).is_file() for n in second)


def test_a_crafted_manifest_cannot_make_a_save_delete_a_user_file(tmp_path: Path) -> None:
    _save(tmp_path, 1)
    (tmp_path / "notes.txt").write_text("keep me")
    manifest = json.loads((tmp_path / "config.json").read_text())
    manifest["files"]["weights"] = "notes.txt"
    (tmp_path / "config.json").write_text(json.dumps(manifest))
    _save(tmp_path, 2)
    assert (tmp_path / "notes.txt").read_text() == "keep me"


@pytest.mark.parametrize("where", ["file", "file/sub"])
def test_an_out_that_is_a_file_is_refused_before_training(
    tmp_path: Path,
    where: str,
    monkeypatch: pytest.MonkeyPatch,
    tiny: Callable[..., TrainConfig],
) -> None:
    (tmp_path / "file").write_text("not a directory")

    def no_training(*args: object, **kwargs: object) -> float:
        raise AssertionError("a step was trained before --out was checked")

    monkeypatch.setattr(loop, "_update", no_training)
    with pytest.raises(CheckpointError, match="an existing file, not a directory"):
        train(tiny(), RunOptions(out=tmp_path / where, progress=False))
    assert (tmp_path / "file").read_text() == "not a directory"


def test_prepare_directory_creates_parents(tmp_path: Path) -> None:
    assert prepare_directory(tmp_path / "a" / "b").is_dir()


_HOLDER = """
import sys
from qkv.train.checkpoint import directory_lock
with directory_lock(sys.argv[1]):
    print("held", flush=True)
    sys.stdin.read()
"""


def test_a_second_process_is_refused_while_the_first_writes(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        with pytest.raises(
            CheckpointError, match=rf"in use by another qkv process \(pid {holder.pid}"
        ):
            _save(tmp_path, 1)
        assert not (tmp_path / "config.json").exists(), "nothing was written"
    finally:
        holder.communicate("", timeout=60)
    _save(tmp_path, 1)  # released when the holder exits
    assert load_checkpoint(tmp_path).step == 1


def test_the_lock_is_reentrant_within_a_process(tmp_path: Path) -> None:
    with directory_lock(tmp_path), directory_lock(tmp_path):
        _save(tmp_path, 1)
    with directory_lock(tmp_path):
        pass


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_checkpoint_files_follow_the_umask(tmp_path: Path, umask: int, mode: int) -> None:
    old = os.umask(umask)
    try:
        _save(tmp_path, 1)
    finally:
        os.umask(old)
    for name in ("config.json", *_named(tmp_path)):
        assert (tmp_path / name).stat().st_mode & 0o777 == mode, name


@pytest.fixture
def trained(tmp_path_factory: pytest.TempPathFactory, tiny: Callable[..., TrainConfig]) -> Path:
    out = tmp_path_factory.mktemp("trained")
    train(
        tiny(steps=2, eval_every=2, eval_size=4),
        RunOptions(out=out, progress=False, log_evals=False),
    )
    return out


def _edited(trained: Path, tmp_path: Path, **config: object) -> Path:
    for f in trained.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    manifest = json.loads((tmp_path / "config.json").read_text())
    manifest["model_config"].update(config)
    (tmp_path / "config.json").write_text(json.dumps(manifest))
    return tmp_path


@pytest.mark.parametrize(
    "edit",
    [
        {"tgt_vocab_size": 10**12},  # allocated 4e12 floats (a crash) before the comparison
        {"src_vocab_size": 25_000_000},  # 2.5 GB before the mismatch was noticed
        {"num_encoder_layers": 10**6},  # built a million layers to refuse them
        {"max_positions": 10**12},
    ],
)
def test_an_edited_config_is_refused_before_anything_is_allocated(
    trained: Path, tmp_path: Path, edit: dict[str, int]
) -> None:
    with pytest.raises(CheckpointError, match="config/weights mismatch"):
        load_trained(_edited(trained, tmp_path, **edit))


def test_a_config_that_fits_the_bounds_but_not_the_weights_names_both_shapes(
    trained: Path, tmp_path: Path
) -> None:
    with pytest.raises(CheckpointError, match=r"ffn\.fc1\.weight.*\(32, 16\).*\(48, 16\)"):
        load_trained(_edited(trained, tmp_path, dim_feedforward=48))
    model, _, ckpt = load_trained(trained)
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, ckpt.weights[name], rtol=0, atol=0)


@pytest.mark.parametrize("failing", ["train_state", "config.json"])
def test_a_failed_save_removes_exactly_the_files_it_wrote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    """Issue 27: a save that failed on a full disk left an orphan ``model-<step>-<hash>``
    file that no manifest names. Now the directory is as before: the previous checkpoint's
    files, a user's file, nothing of the failed save."""
    _save(tmp_path, step=1)
    (tmp_path / "notes.txt").write_text("mine")
    before = sorted(p.name for p in tmp_path.iterdir())
    real_replace = os.replace

    def full_disk(src: str, dst: str) -> None:
        if Path(dst).name.startswith(failing):
            raise OSError(28, "No space left on device", str(dst))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", full_disk)
    with pytest.raises(OSError, match="No space left"):
        _save(tmp_path, step=2)
    monkeypatch.setattr(os, "replace", real_replace)
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert load_checkpoint(tmp_path).step == 1
