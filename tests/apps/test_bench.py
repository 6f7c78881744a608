"""The benchmark table runs end to end (tiny sizes; speed is measured only in benchmarks/)."""

from qkv.apps.bench import CASES, SDPA_BACKWARD, format_table, run_benchmarks
from qkv.apps.cli import build_parser


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


def test_cli_has_bench() -> None:
    args = build_parser().parse_args(["bench", "--quick", "--repeats", "1", "--cases", "none"])
    assert args.quick and args.repeats == 1 and args.cases == ["none"]
