"""``qkv train`` -> ``qkv generate`` -> ``qkv plot`` end to end on a tiny model."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import matplotlib.image as mpimg
import pytest
import torch

from qkv.apps.cli import main
from qkv.apps.viz import checkpoint_attention, plot_attention, save_figure

TRAIN = [
    "train",
    "--task",
    "reverse",
    "--max-len",
    "5",
    "--d-model",
    "16",
    "--num-heads",
    "2",
    "--num-layers",
    "1",
    "--dim-feedforward",
    "32",
    "--steps",
    "12",
    "--batch-size",
    "8",
    "--warmup-steps",
    "2",
    "--eval-every",
    "6",
    "--eval-size",
    "10",
    "--no-progress",
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("run") / "reverse"
    assert main([*TRAIN, "--out", str(out)]) == 0
    return out


def test_train_prints_a_summary_and_writes_a_checkpoint(
    checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (checkpoint / "config.json").is_file()
    assert len(list(checkpoint.glob("*.safetensors"))) == 2
    assert main([*TRAIN, "--out", str(checkpoint)]) == 2  # refuses to overwrite silently
    assert "--resume" in capsys.readouterr().err


@pytest.mark.parametrize("beam", ["1", "3"])
def test_generate_prints_output_and_speed(
    checkpoint: Path, beam: str, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.set_num_threads(2)  # (the conftest fixture restores the worker's count)
    assert main(["generate", str(checkpoint), "abcd", "--beam", beam]) == 0
    output, speed = capsys.readouterr().out.strip().splitlines()
    assert set(output) <= set("abcdefghij") and len(output) <= 6
    assert "tokens/s" in speed and ("beam 3" in speed if beam == "3" else "greedy" in speed)
    assert ", 1 thread)" in speed and torch.get_num_threads() == 1  # a qkv checkpoint's default


def test_plot_writes_a_png_with_the_layer_by_head_grid(checkpoint: Path, tmp_path: Path) -> None:
    png = tmp_path / "attn.png"
    assert main(["plot", str(checkpoint), "abcd", "-o", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    maps, _ = checkpoint_attention(checkpoint, "abcd")
    assert set(maps.weights) == {"encoder self", "decoder self", "cross"}
    assert maps.queries["cross"][0] == "<bos>" and maps.keys["cross"] == list("abcd")
    for kind, layers in maps.weights.items():
        assert len(layers) == 1, kind  # one layer each
        H, T, S = layers[0].shape
        assert H == 2 and len(maps.queries[kind]) == T and len(maps.keys[kind]) == S
        torch_sums = layers[0].sum(-1)
        assert torch_sums.allclose(torch_sums.new_ones(())), "rows of attention weights sum to 1"
    fig = plot_attention(maps, title="x")
    assert len(fig.axes) == 3 * 2 + 1  # rows: 3 kinds x 1 layer; columns: 2 heads; colour bar
    width, height = fig.get_size_inches() * fig.dpi
    image = mpimg.imread(png)
    assert image.shape[:2] == (round(height), round(width))
    save_figure(fig, tmp_path / "again.png")
    assert mpimg.imread(tmp_path / "again.png").shape == image.shape


def test_plot_positional(checkpoint: Path, tmp_path: Path) -> None:
    png = tmp_path / "pos.png"
    assert main(["plot", str(checkpoint), "--positional", "-o", str(png)]) == 0
    assert mpimg.imread(png).shape[:2] == (500, 800)  # figsize (8, 5) at 100 dpi


def test_cli_refuses_pickles_and_mismatched_configs(
    checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    evil = tmp_path / "model.pt"
    evil.write_bytes(pickle.dumps({"x": 1}))
    assert main(["generate", str(evil), "abc"]) == 2
    assert "pickle" in capsys.readouterr().err
    edited = tmp_path / "edited"
    edited.mkdir()
    for f in checkpoint.iterdir():
        (edited / f.name).write_bytes(f.read_bytes())
    manifest = json.loads((edited / "config.json").read_text())
    manifest["model_config"]["dim_feedforward"] = 48
    (edited / "config.json").write_text(json.dumps(manifest))
    assert main(["generate", str(edited), "abc"]) == 2
    message = capsys.readouterr().err
    assert "config/weights mismatch" in message and "ffn.fc1.weight" in message
    assert "(32, 16)" in message and "(48, 16)" in message
    assert main(["generate", str(checkpoint), "xyz"]) == 2
    assert "'x' at position 0" in capsys.readouterr().err


FIXTURES = Path(__file__).parents[1] / "fixtures" / "qkv_0_1"
EXPECTED = json.loads((FIXTURES / "expected.json").read_text())
CASES = [
    ("reverse", [], "reverse_greedy"),
    ("reverse", ["--beam", "3"], "reverse_beam3"),
    ("text", ["--max-new-tokens", "8"], "text_greedy"),
]


@pytest.mark.parametrize(("name", "flags", "key"), CASES)
def test_generate_decodes_qkv_0_1_checkpoints_as_they_did(
    name: str, flags: list[str], key: str, capsys: pytest.CaptureFixture[str]
) -> None:
    for text, expected in EXPECTED[key].items():
        assert main(["generate", str(FIXTURES / name), text, *flags]) == 0
        assert capsys.readouterr().out.splitlines()[0] == expected, text
