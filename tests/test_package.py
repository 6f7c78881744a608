"""The package root: its public names, lazily loaded subpackages and the 0.1 aliases."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import qkv


def _fresh(code: str) -> str:
    """Run ``code`` in a new interpreter (nothing of qkv imported yet); return its stdout."""
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    return proc.stdout.strip()


def test_subpackages_load_on_first_use_only() -> None:
    out = _fresh(
        "import sys, qkv\n"
        "lazy = ['qkv.convert', 'qkv.train', 'qkv.apps']\n"
        "print([m for m in lazy if m in sys.modules])\n"
        "qkv.convert.from_torch_mha, qkv.train.train, qkv.apps.__name__\n"
        "print([m for m in lazy if m in sys.modules])\n"
    )
    assert out.splitlines() == ["[]", "['qkv.convert', 'qkv.train', 'qkv.apps']"]


def test_the_command_line_imports_no_compiler() -> None:
    """Importing dynamo and inductor took ~2 s of the 5.3 s the command line took to start
    (a 2-core EPYC): qkv reaches them as ``torch._dynamo`` / ``torch._inductor`` attributes,
    which torch imports on first access, when something compiles. Matplotlib (0.7 s) is
    imported by the first figure ``qkv plot`` draws."""
    out = _fresh(
        "import sys, qkv, qkv.apps.cli, qkv.models, qkv.convert, qkv.doctor\n"
        "heavy = ('torch._dynamo', 'torch._inductor', 'matplotlib')\n"
        "print([m for m in heavy if m in sys.modules])\n"
    )
    assert out == "[]"


def test_every_public_name_resolves() -> None:
    for name in qkv.__all__:
        assert getattr(qkv, name) is not None, name
    for name in ("convert", "train", "apps", "nn", "models", "backends", "checks"):
        assert getattr(qkv, name).__name__ == f"qkv.{name}"
        assert name in dir(qkv)


def test_unknown_attribute_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match=r"module 'qkv' has no attribute 'bogus'"):
        _ = qkv.bogus  # type: ignore[attr-defined]


def test_version_matches_the_installed_distribution() -> None:
    from importlib.metadata import version

    assert qkv.__version__ == version("qkv")


def test_embed_alias_reexports_and_warns() -> None:
    sys.modules.pop("qkv.embed", None)
    with pytest.warns(DeprecationWarning, match=r"use qkv\.apps\.embed"):
        old = importlib.import_module("qkv.embed")
    new = importlib.import_module("qkv.apps.embed")
    for name in new.__all__:
        assert getattr(old, name) is getattr(new, name), name
    with pytest.raises(AttributeError):
        _ = old.nothing_here


def test_runtime_dependencies_are_ranges_and_exact_versions_live_in_constraints() -> None:
    from importlib.metadata import requires
    from pathlib import Path

    runtime = [r for r in requires("qkv") or [] if "extra ==" not in r]
    assert runtime, "qkv declares its runtime dependencies"
    assert not [r for r in runtime if "==" in r], f"exact pins in the runtime ranges: {runtime}"
    constraints = Path(__file__).parents[1] / "constraints.txt"
    pinned = {
        line.split("==")[0].lower()
        for line in constraints.read_text().splitlines()
        if "==" in line and not line.startswith("#")
    }
    for r in runtime:
        name = r.split(">")[0].split("<")[0].split("=")[0].split(";")[0].strip().lower()
        assert name in pinned, f"{name} has no exact version in constraints.txt"


def test_the_package_is_typed() -> None:
    from importlib.resources import files

    assert files("qkv").joinpath("py.typed").is_file()
