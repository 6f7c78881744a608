"""Every README code block meant to run is run, so the README cannot drift from the code.

``python`` blocks run in a fresh interpreter and ``bash`` blocks in ``bash -e``, each in its own
temp directory, in README order (a bash block may use what an earlier bash block wrote there: the
blocks of one section share a directory). ``console`` blocks are output, not commands; their first
``$`` line is run and must succeed.

A block the test must not run is preceded by an HTML comment the reader never sees::

    <!-- readme-test: skip (why) -->

and the reason is part of the marker; the test fails on a skip marker without a reason.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).parents[1] / "README.md"
_BLOCK = re.compile(
    r"(?P<marker><!-- readme-test: skip(?P<why>[^>]*)-->\s*\n)?"
    r"^```(?P<lang>\w*)\n(?P<body>.*?)^```",
    re.M | re.S,
)
_RUN = ("python", "bash", "console")


def _blocks() -> list[tuple[int, str, str, str | None]]:
    text = README.read_text(encoding="utf-8")
    out = []
    for m in _BLOCK.finditer(text):
        line = text.count("\n", 0, m.start("lang")) + 1
        why = None if m.group("marker") is None else m.group("why").strip()
        out.append((line, m.group("lang"), m.group("body"), why))
    return out


BLOCKS = [b for b in _blocks() if b[1] in _RUN]


def test_every_skip_has_a_reason() -> None:
    for line, _, _, why in _blocks():
        assert why is None or re.fullmatch(r"\(.+\)", why), f"README line {line}: {why!r}"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("readme")
    (directory / "README.md").write_text(README.read_text(encoding="utf-8"))
    return directory


@pytest.mark.parametrize(("line", "lang", "body", "why"), BLOCKS, ids=[f"L{b[0]}" for b in BLOCKS])
def test_readme_block_runs(line: int, lang: str, body: str, why: str | None, workdir: Path) -> None:
    if why is not None:
        pytest.skip(f"README line {line}: {why}")
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }
    if lang == "python":
        cmd = [sys.executable, "-c", body]
    elif lang == "bash":
        cmd = ["bash", "-e", "-c", body]
    else:
        commands = [ln[2:] for ln in body.splitlines() if ln.startswith("$ ")]
        cmd = ["bash", "-e", "-c", commands[0]]
    run = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"README line {line}:\n{run.stdout[-2000:]}\n{run.stderr[-3000:]}"
