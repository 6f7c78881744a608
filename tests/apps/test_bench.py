"""The benchmark table runs end to end (tiny sizes; speed is measured only in benchmarks/)."""

from qkv.apps.bench import CASES, format_table, run_benchmarks
from qkv.apps.cli import build_parser


def test_table_has_every_case_side_by_side() -> None:
    rows, mm, notes = run_benchmarks(repeats=1, shrink=64, lengths=(1024,))
    assert mm > 0
    assert {r.case for r in rows} == set(CASES)
    for r in rows:
        assert r.seconds > 0 and r.gflops > 0
        assert (r.ratio is None) == (r.contestant != "qkv auto")
        assert (r.peak_mb is None) == (r.mode != "fwd")
    table = format_table(rows, mm, notes)
    assert "SDPA per document" in table and "SDPA on live keys" in table
    assert len([n for n in notes if " at L=" in n]) == len(CASES)
    assert "one SDPA call per document" in table
    assert "lower bound" in table  # CPU peak memory is labelled as what it is


def test_cli_has_bench() -> None:
    args = build_parser().parse_args(["bench", "--quick", "--repeats", "1", "--cases", "none"])
    assert args.quick and args.repeats == 1 and args.cases == ["none"]
