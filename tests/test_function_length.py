"""No function over 60 lines (its whole ``def``, docstring included) where the library's policy
and layers live: ``backends/``, ``distributed/``, ``nn/``, ``models/``, and
:func:`qkv.functional.attention`.

A longer function does several things; split it into helpers that each do one (see issue 26).
"""

from __future__ import annotations

import ast
from pathlib import Path

import qkv

PACKAGE_DIR = Path(qkv.__file__).parent
MAX_LINES = 60
FOLDERS = ("backends", "distributed", "nn", "models")
SINGLE = (("functional.py", "attention"),)


def _functions(path: Path) -> list[tuple[str, int, int]]:
    """(qualified name, first line, lines) of every function and method in ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: list[tuple[str, int, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{prefix}{child.name}"
                assert child.end_lineno is not None
                found.append((name, child.lineno, child.end_lineno - child.lineno + 1))
                visit(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return found


def _too_long() -> list[str]:
    places = [(p, None) for folder in FOLDERS for p in sorted((PACKAGE_DIR / folder).rglob("*.py"))]
    places += [(PACKAGE_DIR / file, name) for file, name in SINGLE]
    long = []
    for path, only in places:
        for name, line, lines in _functions(path):
            if lines > MAX_LINES and (only is None or name == only):
                rel = path.relative_to(PACKAGE_DIR)
                long.append(f"{rel}:{line} {name} ({lines} lines)")
    return long


def test_no_function_over_60_lines() -> None:
    long = _too_long()
    assert long == [], f"functions over {MAX_LINES} lines:\n" + "\n".join(long)


def test_the_counter_counts_the_whole_def(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    body = "\n".join(f"    x{i} = {i}" for i in range(3))
    method = '    def f(self):\n        """Doc."""\n        return 1\n'
    src.write_text(f"class A:\n{method}\ndef g():\n{body}\n")
    assert _functions(src) == [("A.f", 2, 3), ("g", 6, 4)]
