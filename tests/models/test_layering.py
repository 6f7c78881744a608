"""nn/, models/ and convert/ import at module level only: no import hidden in a function to dodge
a cycle (``if TYPE_CHECKING:`` blocks are the one exception, they never run)."""

import ast
from pathlib import Path

import pytest

import qkv

SRC = Path(qkv.__file__).parent
PACKAGES = ("nn", "models", "convert")


def _nested_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            for inner in ast.walk(node):
                if isinstance(inner, ast.Import | ast.ImportFrom):
                    found.append(f"{path.relative_to(SRC)}:{inner.lineno} in {node.name}")
    return found


@pytest.mark.parametrize("package", PACKAGES)
def test_no_function_local_imports(package: str) -> None:
    files = sorted((SRC / package).glob("*.py"))
    assert files
    assert [hit for f in files for hit in _nested_imports(f)] == []


def test_generate_imports_no_model_module_at_run_time() -> None:
    tree = ast.parse((SRC / "models" / "generate.py").read_text())
    top_level = [
        node.module
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and node.module is not None
    ]
    assert "qkv.models.inputs" in top_level
    assert not {"qkv.models.transformer", "qkv.models.decoder_only"} & set(top_level)
