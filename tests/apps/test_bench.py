"""The benchmark table runs end to end (tiny sizes; speed is measured only in benchmarks/)."""

from qkv.apps.bench import format_table, run_benchmarks
from qkv.apps.cli import build_parser


def test_table_has_every_case_side_by_side() -> None:
    rows, mm, mem = run_benchmarks(repeats=1, shrink=64)
    assert mm > 0
    cases = {r.case for r in rows}
    assert cases == {"dense", "causal", "padding+causal", "sliding window 4"}
    for r in rows:
        assert r.seconds > 0 and r.gflops > 0
        assert (r.ratio is None) == (r.backend == "torch SDPA")
    table = format_table(rows, mm, mem)
    assert "qkv blockwise" in table and "peak memory" in table
    # the memory line never claims less than the output itself holds (it said 0.0 MB before)
    L = 16384 // 64
    line = next(m for m in mem if "qkv blockwise" in m)
    assert f"at least {8 * L * 64 * 4 / 2**20:.1f} MB (the output alone)" in line
    assert "lower bound" in "\n".join(mem)


def test_cli_has_bench() -> None:
    args = build_parser().parse_args(["bench", "--quick", "--repeats", "1"])
    assert args.quick and args.repeats == 1
