"""The package's import graph: no cycles, no function-local imports, and imports only go down.

The graph is read from the source (``ast``), not from ``sys.modules``, so an import that a cycle
would break at run time is seen even where Python happens to tolerate it. Imports under
``if TYPE_CHECKING:`` are for annotations only: they are left out of the run-time graph, but
within one subpackage they may not close a cycle either (a module that names its importer's
classes, even for typing, depends on it: describe what it needs with a Protocol instead).
"""

from __future__ import annotations

import ast
from pathlib import Path

import qkv

PACKAGE_DIR = Path(qkv.__file__).parent

# Layers from the bottom up (docs/ARCHITECTURE.md). A module may import from its own layer and
# the layers below it, never from a layer above. The aliases kept for one release sit on top.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("qkv._deprecation", "qkv._checks", "qkv.dropout"),
    ("qkv.masks",),
    ("qkv.backends",),
    ("qkv.functional",),
    ("qkv.distributed",),
    ("qkv.nn",),
    ("qkv.models",),
    ("qkv.convert",),
    ("qkv.integrations",),
    ("qkv.doctor",),
    ("qkv.train",),
    ("qkv.apps",),
    ("qkv.structured_masks", "qkv.embed", "qkv.checks", "qkv.__main__"),
)


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE_DIR.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _resolve(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _imports(
    path: Path, module: str | None = None, typing: bool = False
) -> tuple[set[str], list[str]]:
    """(qkv modules imported at module level, descriptions of function-local qkv imports).

    ``module`` is the file's dotted name (default: derived from its place in the package);
    ``typing`` counts the imports under ``if TYPE_CHECKING:`` as module-level ones too.
    """
    module = _module_name(path) if module is None else module
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(encoding="utf-8"))
    top: set[str] = set()
    local: list[str] = []

    def targets(node: ast.Import | ast.ImportFrom) -> list[str]:
        if isinstance(node, ast.Import):
            return [a.name for a in node.names]
        base = _resolve(module, node, is_package)
        # `from qkv.x import y` may name a submodule y: count both, resolved later
        return [base, *(f"{base}.{a.name}" for a in node.names)]

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            read(child, in_function)

    def read(node: ast.AST, in_function: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for sub in [*(node.body if typing else ()), *node.orelse]:
                read(sub, in_function)
            return
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [n for n in targets(node) if n == "qkv" or n.startswith("qkv.")]
            if in_function and names:
                local.append(f"{module}:{node.lineno} imports {names[0]}")
            elif not in_function:
                top.update(names)
            return
        visit(
            node,
            in_function or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda),
        )

    visit(tree, False)
    return top, local


def _graph(typing: bool = False) -> tuple[dict[str, set[str]], list[str]]:
    """(module -> the package's modules it imports, function-local imports); ``typing``: the
    ``TYPE_CHECKING`` imports count too."""
    files = {_module_name(p): p for p in PACKAGE_DIR.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    local_all: list[str] = []
    for name, path in files.items():
        top, local = _imports(path, typing=typing)
        local_all.extend(local)
        # keep names that are modules of the package; `from qkv.masks import Causal` adds the
        # non-module "qkv.masks.Causal", dropped here
        graph[name] = {t for t in top if t in files and t != name}
    return graph, local_all


def _layer(module: str) -> int:
    for i, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    raise AssertionError(f"{module} is in no layer of LAYERS; add it there and to ARCHITECTURE.md")


def _first_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of ``graph`` as the path that closes it, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                raise _CycleFoundError([*stack[stack.index(nxt) :], nxt])
            if nxt not in state:
                dfs(nxt)
        stack.pop()
        state[node] = 2

    try:
        for node in sorted(graph):
            if node not in state:
                dfs(node)
    except _CycleFoundError as found:
        return found.path
    return None


class _CycleFoundError(Exception):
    def __init__(self, path: list[str]) -> None:
        super().__init__(" -> ".join(path))
        self.path = path


def test_no_import_cycle() -> None:
    graph, _ = _graph()
    # the package root re-exports the public API and imports everything: leave it out, as
    # no module of the package may import it (checked below)
    graph = {m: {t for t in ts if t != "qkv"} for m, ts in graph.items() if m != "qkv"}
    cycle = _first_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


# Cycles through TYPE_CHECKING imports known and not yet broken, each (importer, imported) edge
# left out of the check below; remove an entry when its cycle is broken.
KNOWN_TYPING_EDGES: set[tuple[str, str]] = set()


def _subpackage(module: str) -> str:
    return ".".join(module.split(".")[:2])


def test_no_cycle_within_a_subpackage_even_for_typing() -> None:
    graph, _ = _graph(typing=True)
    # a subpackage's __init__ re-exports its modules: leave those edges out, as no module may
    # import its own package's __init__ (a run-time cycle, caught above)
    inner = {
        m: {
            t
            for t in ts
            if _subpackage(t) == _subpackage(m)
            and t != _subpackage(m)
            and (m, t) not in KNOWN_TYPING_EDGES
        }
        for m, ts in graph.items()
        if m != "qkv" and m != _subpackage(m)
    }
    cycle = _first_cycle(inner)
    assert cycle is None, "import cycle through TYPE_CHECKING imports: " + " -> ".join(cycle or [])


def test_no_module_imports_the_package_root() -> None:
    graph, _ = _graph()
    offenders = sorted(m for m, ts in graph.items() if "qkv" in ts and m != "qkv.__main__")
    assert offenders == [], f"these modules import the package root `qkv`: {offenders}"


def test_no_function_local_imports() -> None:
    _, local = _graph()
    assert local == [], "function-local imports of qkv modules (hide cycles): " + "; ".join(local)


def test_imports_only_go_down() -> None:
    graph, _ = _graph()
    upward = [
        f"{m} (layer {_layer(m)}) imports {t} (layer {_layer(t)})"
        for m, ts in sorted(graph.items())
        if m != "qkv"
        for t in sorted(ts)
        if t != "qkv" and _layer(t) > _layer(m)
    ]
    assert upward == [], "imports that go up the layers:\n" + "\n".join(upward)


def test_the_reader_sees_local_and_type_checking_imports(tmp_path: Path) -> None:
    """The import reader itself, on a file with each kind of import."""
    src = tmp_path / "a.py"
    src.write_text(
        "from typing import TYPE_CHECKING\n"
        "from qkv.nn import layers\n"
        "from . import sibling\n"
        "if TYPE_CHECKING:\n"
        "    from qkv.train import loop\n"
        "def f():\n"
        "    from qkv.models import bert\n"
    )
    top, local = _imports(src, "qkv.apps.a")
    assert top == {"qkv.nn", "qkv.nn.layers", "qkv.apps", "qkv.apps.sibling"}
    assert local == ["qkv.apps.a:7 imports qkv.models"]
    typed, _ = _imports(src, "qkv.apps.a", typing=True)
    assert typed == top | {"qkv.train", "qkv.train.loop"}


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _first_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert _first_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
