"""``benchmarks/attention.py`` runs end to end (tiny sizes; speed is measured only by running it).

The script and its siblings (``attention_cases.py``, ``attention_timing.py``) are imported from
their paths, as ``python benchmarks/attention.py`` imports them.
"""

import importlib
import runpy
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from qkv.apps import cli

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"


def _script() -> ModuleType:
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(BENCHMARKS))  # the siblings, as when run as a script
        module = importlib.import_module("attention")
    assert Path(module.__file__ or "").parent == BENCHMARKS, module  # not another "attention"
    return module


bench = _script()
CASES, SDPA_BACKWARD, Row = bench.CASES, bench.SDPA_BACKWARD, bench.Row
format_table, run_benchmarks = bench.format_table, bench.run_benchmarks


def test_table_has_every_case_side_by_side() -> None:
    rows, mm, notes = run_benchmarks(repeats=1, shrink=64, lengths=(1024,))
    assert mm > 0
    assert {r.case for r in rows} == set(CASES)
    for r in rows:
        assert r.seconds > 0 and r.gflops > 0
        assert (r.ratio is None) == (not r.contestant.startswith("qkv auto"))
        assert (r.peak_mb is None) == (r.mode != "fwd")
    table = format_table(rows, mm, notes)
    assert "SDPA per document" in table and "SDPA on live keys" in table
    assert len([n for n in notes if " at L=" in n]) == len(CASES)
    assert "one SDPA call per document" in table
    assert "lower bound" in table  # CPU peak memory is labelled as what it is
    # the price of exact CPU gradients is measured too: fwd+bwd rows only
    modes = {r.mode for r in rows if r.contestant == SDPA_BACKWARD}
    assert modes == {"fwd+bwd"}
    # "4 documents | Causal" is escaped: every row has the header's 10 cells
    cells = [
        len(line.replace("\\|", "").split("|")) - 2
        for line in table.splitlines()
        if line[:1] == "|"
    ]
    assert len(cells) == len(rows) + 2 and set(cells) == {10}


def test_compile_adds_flex_peer_forward_only_on_cpu_and_qkv_with_compile_allowed() -> None:
    cases = ("sliding window 256",)
    rows, _, notes = run_benchmarks(repeats=1, shrink=4, lengths=(1024,), cases=cases, compile=True)
    by = {(r.mode, r.contestant): r for r in rows}
    assert ("fwd", "flex_attention (compiled)") in by
    assert ("fwd+bwd", "flex_attention (compiled)") not in by  # torch has no CPU flex backward
    for mode in ("fwd", "fwd+bwd"):
        for name in ("qkv auto", "qkv auto (compile allowed)"):
            assert by[(mode, name)].ratio is not None
    assert any("compiled flex_attention's first call" in n for n in notes)


def test_main_passes_its_options_and_prints_the_table(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    seen: dict[str, Any] = {}

    def tiny(**kwargs: Any) -> tuple[list[Row], float, list[str]]:
        seen.update(kwargs)  # then a real run, shrunk to fit a unit test
        return run_benchmarks(repeats=1, shrink=64, lengths=(1024,), cases=kwargs["cases"])

    monkeypatch.setattr(bench, "run_benchmarks", tiny)
    assert bench.main(["--quick", "--repeats", "3", "--cases", "4-documents-causal"]) == 0
    assert seen["quick"] is True and seen["repeats"] == 3
    assert seen["cases"] == ["4 documents | Causal"]  # the slug names the table's case
    assert seen["lengths"] is None and seen["compile"] is False and seen["device"] == "cpu"
    table = capsys.readouterr().out
    assert "| 4 documents \\| Causal " in table and "qkv auto" in table
    for bad in (["--cases", "nope"], ["--device", "meta"], ["--repeats", "0"]):
        with pytest.raises(SystemExit):  # refused by name, before any run
            bench.build_parser().parse_args(bad)


def test_the_script_runs_from_its_path(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    script = BENCHMARKS / "attention.py"
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.setattr(sys, "argv", [str(script), "--help"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(script), run_name="__main__")
    assert exit_info.value.code == 0
    assert "usage: benchmarks/attention.py" in capsys.readouterr().out


def test_qkv_bench_names_the_script(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["bench"], ["bench", "--quick", "--cases", "none"], ["bench", "--help"]):
        assert cli.main(argv) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1
        assert err.startswith("qkv bench: error:") and "python benchmarks/attention.py" in err
