"""Every README code block meant to run is run, so the README cannot drift from the code.

``python`` blocks run in a fresh interpreter and ``bash`` blocks in ``bash -e``, each in a temp
directory of its own that holds a copy of README.md and nothing else, so that a block stands
alone, as a reader may copy it alone, and the blocks may run in any order on any pytest-xdist
worker. ``console`` blocks are output, not commands; their first ``$`` line is run and must
succeed.

A ``python`` block may show what it prints: each comment line ``# -> TEXT`` is one printed line,
in order (other lines may come between), ``...`` standing for any text; the test compares them
with what the block printed, so a shown output cannot go stale.

A block the test must not run is preceded by an HTML comment the reader never sees::

    <!-- readme-test: skip (why) -->

and the reason is part of the marker; the test fails on a skip marker without a reason. A block
that trains for minutes runs with smaller sizes instead, by substitutions in its marker::

    <!-- readme-test: quick (--steps 2000 -> --steps 30; steps=800 -> steps=30) -->

each ``A -> B`` replacing every ``A`` in the block (and failing the test if there is none), so
the command the reader sees is the command that runs, only shorter.
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
    r"(?P<marker><!-- readme-test: (?P<kind>skip|quick)(?P<why>[^\n]*?)-->\s*\n)?"
    r"^```(?P<lang>\w*)\n(?P<body>.*?)^```",
    re.M | re.S,
)
_RUN = ("python", "bash", "console")


def _quick(body: str, subs: str, line: int) -> str:
    """``body`` with each ``A -> B`` of ``subs`` (``;``-separated) applied."""
    for sub in subs.strip()[1:-1].split(";"):
        old, new = (part.strip() for part in sub.split("->"))
        assert old in body, f"README line {line}: quick substitution {old!r} matches nothing"
        body = body.replace(old, new)
    return body


def _blocks() -> list[tuple[int, str, str, str | None]]:
    """(line, language, body to run, skip reason or None) of every fenced block."""
    text = README.read_text(encoding="utf-8")
    out = []
    for m in _BLOCK.finditer(text):
        line = text.count("\n", 0, m.start("lang")) + 1
        body, why = m.group("body"), None
        if m.group("kind") == "skip":
            why = m.group("why").strip()
        elif m.group("kind") == "quick":
            body = _quick(body, m.group("why"), line)
        out.append((line, m.group("lang"), body, why))
    return out


BLOCKS = [b for b in _blocks() if b[1] in _RUN]


def test_every_skip_has_a_reason() -> None:
    for line, _, _, why in _blocks():
        assert why is None or re.fullmatch(r"\(.+\)", why), f"README line {line}: {why!r}"


def test_quick_substitutions_apply() -> None:
    body = "qkv train --steps 2000\nqkv generate runs/text"
    assert _quick(body, "(--steps 2000 -> --steps 30)", 1) == body.replace("2000", "30")
    with pytest.raises(AssertionError, match="matches nothing"):
        _quick(body, "(--nothing -> --steps 1)", 1)


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    (tmp_path / "README.md").write_text(README.read_text(encoding="utf-8"))
    return tmp_path


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
    missing = _unshown(_shown(body), run.stdout.splitlines())
    assert missing is None, (
        f"README line {line} shows {missing!r}, but the block printed:\n{run.stdout[-3000:]}"
    )


def _shown(body: str) -> list[str]:
    """The ``# -> TEXT`` lines of a block: what it says it prints."""
    return [ln.strip()[5:] for ln in body.splitlines() if ln.strip().startswith("# -> ")]


def _unshown(shown: list[str], printed: list[str]) -> str | None:
    """The first shown line that no printed line matches, in order (``...`` = any text)."""
    rest = iter(printed)
    for want in shown:
        pattern = re.compile(".*".join(re.escape(part) for part in want.split("...")))
        if not any(pattern.fullmatch(got.strip()) for got in rest):
            return want
    return None


def test_shown_output_is_compared() -> None:
    """The comparison is not blind: the stale line the README once showed does not match."""
    printed = [
        "fused: Causal(align='bottom_right') | Padding(lengths=[6000]) reduced exactly to 1 "
        "SDPA call(s) on 46% of the query-key pairs"
    ]
    assert _unshown(["fused: ... reduced exactly to 1 SDPA call(s) ..."], printed) is None
    stale = "blockwise: materializing the mask for SDPA would take about 320.0 MB ..."
    assert _unshown([stale], printed) == stale
    assert _shown("x = 1\n# -> a ... b\nprint(x)  # -> not a shown line\n") == ["a ... b"]
