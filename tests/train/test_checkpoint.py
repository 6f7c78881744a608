"""Checkpoints: exact round trip, atomic saves, refusal of pickles and tampered files."""

from __future__ import annotations

import json
import os
import pickle
import zipfile
from pathlib import Path

import pytest
import torch
from torch import nn

from qkv import DecoderOnlyConfig, DecoderOnlyLM
from qkv.train.checkpoint import (
    LOCK_NAME,
    CheckpointError,
    build_model,
    load_checkpoint,
    restore_optimizer,
    save_checkpoint,
)


def _trained(steps: int = 3) -> tuple[nn.Module, torch.optim.AdamW]:
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(5, 4)).square().mean().backward()
        opt.step()
    return model, opt


def _save(directory: Path, model: nn.Module, opt: torch.optim.Optimizer, step: int) -> Path:
    return save_checkpoint(
        directory,
        model=model,
        model_type="test",
        model_config={"width": 8},
        task={"name": "none"},
        step=step,
        train_config={"seed": 0},
        optimizer=opt,
        rng_state=torch.get_rng_state(),
    )


def test_round_trip_is_exact(tmp_path: Path) -> None:
    model, opt = _trained()
    rng = torch.get_rng_state()
    _save(tmp_path, model, opt, step=3)
    ckpt = load_checkpoint(tmp_path)
    assert ckpt.step == 3 and ckpt.model_config == {"width": 8} and ckpt.task == {"name": "none"}
    assert ckpt.rng_state is not None and ckpt.rng_state.equal(rng)
    for k, v in model.state_dict().items():
        assert ckpt.weights[k].equal(v), k
    fresh, fresh_opt = _trained(0)
    fresh.load_state_dict(ckpt.weights)
    restore_optimizer(fresh_opt, ckpt)
    a, b = opt.state_dict(), fresh_opt.state_dict()
    assert a["param_groups"] == b["param_groups"]
    for idx, state in a["state"].items():
        for name, value in state.items():
            assert b["state"][idx][name].equal(value), (idx, name)
    # one more identical step on both: still identical
    x = torch.randn(5, 4)
    for m, o in ((model, opt), (fresh, fresh_opt)):
        o.zero_grad()
        m(x).square().mean().backward()
        o.step()
    for k, v in model.state_dict().items():
        assert fresh.state_dict()[k].equal(v), k


def test_only_safetensors_and_json_are_written(tmp_path: Path) -> None:
    model, opt = _trained()
    _save(tmp_path, model, opt, 1)
    _save(tmp_path, model, opt, 2)
    names = sorted(p.name for p in tmp_path.iterdir() if p.name != LOCK_NAME)
    assert names[0] == "config.json" and len(names) == 3, names
    assert all(n.endswith(".safetensors") and "-00000002-" in n for n in names[1:]), names


def test_kill_during_save_keeps_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, opt = _trained()
    _save(tmp_path, model, opt, step=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    real_replace = os.replace
    calls = []

    def dying_replace(src: str, dst: str) -> None:
        calls.append(dst)
        if str(dst).endswith("config.json"):  # killed just before the commit
            raise KeyboardInterrupt("simulated kill")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", dying_replace)
    with pytest.raises(KeyboardInterrupt):
        _save(tmp_path, model, opt, step=2)
    monkeypatch.setattr(os, "replace", real_replace)
    assert len(calls) == 3  # weights, train state, then the manifest that never landed
    ckpt = load_checkpoint(tmp_path)
    assert ckpt.step == 1
    for k, v in before.items():
        assert ckpt.weights[k].equal(v), k
    assert not list(tmp_path.glob("*.tmp")), "the temp file is removed"


def test_pickles_are_refused(tmp_path: Path) -> None:
    evil = tmp_path / "model.pt"
    evil.write_bytes(pickle.dumps({"weights": [1.0, 2.0]}))
    with pytest.raises(CheckpointError, match="pickle"):
        load_checkpoint(evil)
    disguised = tmp_path / "config.json"
    disguised.write_bytes(pickle.dumps({"format": "qkv-checkpoint"}))
    with pytest.raises(CheckpointError, match="pickle"):
        load_checkpoint(disguised)
    zipped = tmp_path / "zip" / "config.json"  # torch.save's default format is a zip archive
    zipped.parent.mkdir()
    with zipfile.ZipFile(zipped, "w") as z:
        z.writestr("archive/data.pkl", pickle.dumps([1]))
    with pytest.raises(CheckpointError, match="pickle"):
        load_checkpoint(zipped)
    only_pt = tmp_path / "old"
    only_pt.mkdir()
    (only_pt / "model.pt").write_bytes(pickle.dumps([1]))
    with pytest.raises(CheckpointError, match=r"no config\.json.*pickle"):
        load_checkpoint(only_pt)


@pytest.mark.parametrize("damage", ["flip", "truncate", "append"])
def test_tampered_or_truncated_weights_are_refused(tmp_path: Path, damage: str) -> None:
    model, opt = _trained()
    _save(tmp_path, model, opt, 1)
    weights = next(tmp_path.glob("model-*.safetensors"))
    data = bytearray(weights.read_bytes())
    if damage == "flip":
        data[-3] ^= 0x01
    elif damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data += b"\x00"
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="tampered or truncated"):
        load_checkpoint(tmp_path)


def test_broken_manifest_is_refused(tmp_path: Path) -> None:
    model, opt = _trained()
    _save(tmp_path, model, opt, 1)
    manifest = tmp_path / "config.json"
    manifest.write_text(manifest.read_text()[:40])
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_checkpoint(tmp_path)
    manifest.write_text(json.dumps({"format": "something else"}))
    with pytest.raises(CheckpointError, match="format"):
        load_checkpoint(tmp_path)


def test_mismatch_names_key_and_shapes(tmp_path: Path) -> None:
    # weights of a model with 12 hidden units under the config of one with 16: build_model refuses
    small = {"vocab_size": 11, "max_positions": 16, "d_model": 8, "num_layers": 1, "num_heads": 2}
    model = DecoderOnlyLM(DecoderOnlyConfig(dim_feedforward=12, **small))
    config = DecoderOnlyConfig(dim_feedforward=16, **small).to_dict()
    save_checkpoint(
        tmp_path,
        model=model,
        model_type="decoder_only",
        model_config=config,
        task={"name": "none"},
        step=0,
    )
    fc1 = r"'blocks\.layers\.0\.ffn\.fc1\.weight' has shape \(12, 8\).*\(16, 8\)"
    with pytest.raises(CheckpointError, match=fc1):
        build_model(load_checkpoint(tmp_path))
    # the right config, but one key missing and one unexpected: both named
    ckpt = load_checkpoint(tmp_path)
    ckpt.model_config = model.config.to_dict()
    assert build_model(ckpt).state_dict().keys() == model.state_dict().keys()
    ckpt.weights.pop("blocks.norm.bias")
    ckpt.weights["extra"] = torch.zeros(2)
    with pytest.raises(CheckpointError, match=r"'blocks\.norm\.bias' is missing.*'extra'"):
        build_model(ckpt)
