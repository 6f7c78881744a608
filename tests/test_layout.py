"""The package's files stay small: one concept each (docs/ARCHITECTURE.md).

A file past the bound holds two concepts; split it along them (re-exporting what it made public)
rather than raising the bound.
"""

from __future__ import annotations

from pathlib import Path

import qkv

PACKAGE_DIR = Path(qkv.__file__).parent
MAX_LINES = 450


def _line_counts(root: Path) -> dict[str, int]:
    """Lines of every ``.py`` file under ``root``, by path relative to it."""
    return {
        str(path.relative_to(root)): len(path.read_text(encoding="utf-8").splitlines())
        for path in sorted(root.rglob("*.py"))
    }


def test_no_file_over_the_bound() -> None:
    counts = _line_counts(PACKAGE_DIR)
    assert len(counts) > 50  # the package was found, not an empty folder
    over = {name: n for name, n in counts.items() if n > MAX_LINES}
    worst_first = sorted(over.items(), key=lambda item: -item[1])
    listed = ", ".join(f"{name} ({n} lines)" for name, n in worst_first)
    assert not over, f"files of src/qkv over {MAX_LINES} lines: {listed}"


def test_the_count_is_of_lines(tmp_path: Path) -> None:
    """The counter itself: a file of 451 lines is over the bound, one of 450 is not."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "long.py").write_text("x = 1\n" * (MAX_LINES + 1), encoding="utf-8")
    (tmp_path / "sub" / "ok.py").write_text("x = 1\n" * MAX_LINES, encoding="utf-8")
    (tmp_path / "notes.txt").write_text("x\n" * 1000, encoding="utf-8")
    assert _line_counts(tmp_path) == {"long.py": MAX_LINES + 1, "sub/ok.py": MAX_LINES}
