"""Context-parallel attention in real processes (torchrun, gloo): equal to one process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("cp_worker.py")


@pytest.mark.parametrize("world", [2, 3])
def test_every_rule_and_layout_equals_one_process_in_float64(world: int, tmp_path: Path) -> None:
    # 37: uneven cuts for 2 and 3 ranks (and 4 or 6 zigzag pieces); 5 with 3 ranks: zigzag
    # pieces of 1 and 0 positions, so a rank may hold one segment or none of its second.
    lengths = ["37", "5"] if world == 3 else ["37", "4"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={world}",
        str(WORKER),
        str(tmp_path),
        *lengths,
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [json.loads(f.read_text()) for f in sorted(tmp_path.glob("rank*.json"))]
    assert sorted(r["rank"] for r in lines) == list(range(world))
    for r in lines:
        # (9 self-attention + 3 cross-attention rules) x 2 layouts x (output and gradients,
        # unshard) x 2 lengths
        assert len(r["worst"]) == 12 * 2 * 2 * 2
        bad = {k: v for k, v in r["worst"].items() if not v <= 1e-9}
        assert not bad, f"rank {r['rank']}: {bad}"
