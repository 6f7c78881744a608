"""The `qkv` command line: demo and shapes, in-process and through the installed script."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import qkv
from qkv.apps.cli import main
from qkv.apps.demo import run_demo
from qkv.apps.shapes import trace_attention_shapes

EXPECTED_SHAPES = {
    "Q": [2, 4, 3, 8],
    "K": [2, 4, 5, 8],
    "V": [2, 4, 5, 6],
    "K^T": [2, 4, 8, 5],
    "QK^T": [2, 4, 3, 5],
    "mask": [2, 1, 3, 5],
    "weights": [2, 4, 3, 5],
    "output": [2, 4, 3, 6],
}
SHAPES_ARGS = ["shapes", "--B", "2", "--H", "4", "--T", "3", "--S", "5", "--Dh", "8", "--Dv", "6"]


def _parse_shapes(text: str) -> dict[str, list[int]]:
    rows = {}
    for line in text.strip().splitlines():
        name, shape = line.split(maxsplit=1)
        rows[name] = [int(n) for n in shape.strip("[]").split(",")]
    return rows


def test_demo_prints_shapes_weights_and_match(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo"]) == 0
    text = capsys.readouterr().out
    assert "input   (2, 5, 8)" in text
    assert "output  (2, 5, 8)" in text
    assert "weights (2, 2, 5, 5)" in text
    assert "MATCH" in text and "MISMATCH" not in text
    result = run_demo()
    for row in result.weights[0, 0].tolist():  # head 0 of sample 0, rounded to 3 decimals
        assert " ".join(f"{w:.3f}" for w in row) in text
    assert result.max_abs_diff_output < 1e-5 and result.max_abs_diff_weights < 1e-6


def test_demo_leaves_the_global_rng_alone() -> None:
    import torch

    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    run_demo(seed=7)
    assert torch.equal(torch.rand(3), expected)


def test_shapes_prints_every_intermediate(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(SHAPES_ARGS) == 0
    assert _parse_shapes(capsys.readouterr().out) == EXPECTED_SHAPES


def test_shapes_follow_the_computation_for_other_sizes() -> None:
    rows = dict(trace_attention_shapes(1, 2, 17, 1, 3, 4))
    assert rows["K^T"] == (1, 2, 3, 1) and rows["QK^T"] == (1, 2, 17, 1)
    assert rows["mask"] == (1, 1, 17, 1) and rows["output"] == (1, 2, 17, 4)


def test_shapes_rejects_non_positive_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:  # refused by the flag's type, before tracing
        main(["shapes", "--T", "0"])
    assert exit_.value.code == 2
    assert "argument --T: expected an int >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"sizes must be positive, got \{'T': 0\}"):
        trace_attention_shapes(2, 4, 0, 5, 8, 6)


def test_installed_script() -> None:
    script = Path(sys.executable).parent / "qkv"
    exe = str(script) if script.exists() else shutil.which("qkv")
    assert exe is not None, "the qkv console script is not installed"
    proc = subprocess.run([exe, *SHAPES_ARGS], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert _parse_shapes(proc.stdout) == EXPECTED_SHAPES


def test_every_parser_is_defined_in_cli() -> None:
    package = Path(qkv.__file__).parent
    defining = sorted(
        str(path.relative_to(package))
        for path in package.rglob("*.py")
        if re.search(r"ArgumentParser|add_argument\(|add_subparsers", path.read_text("utf-8"))
    )
    assert defining == ["apps/cli.py", "apps/cli_args.py"]
