"""Context-parallel attention in real processes (torchrun, gloo): equal to one process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

WORKER = Path(__file__).with_name("cp_worker.py")
MODEL_WORKER = Path(__file__).with_name("cp_model_worker.py")


def run_workers(worker: Path, world: int, out: Path, *args: str) -> list[dict[str, Any]]:
    """``worker`` under ``torchrun --standalone`` on ``world`` gloo processes of one thread;
    returns each rank's ``rank{r}.json`` (the worker writes them into ``out``)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={world}",
        str(worker),
        str(out),
        *args,
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.loads(f.read_text()) for f in sorted(out.glob("rank*.json"))]
    assert sorted(r["rank"] for r in ranks) == list(range(world))
    return ranks


@pytest.mark.parametrize("world", [2, 3])
def test_every_rule_and_layout_equals_one_process_in_float64(world: int, tmp_path: Path) -> None:
    # 37: uneven cuts for 2 and 3 ranks (and 4 or 6 zigzag pieces); 5 with 3 ranks: zigzag
    # pieces of 1 and 0 positions, so a rank may hold one segment or none of its second.
    lengths = ["37", "5"] if world == 3 else ["37", "4"]
    for r in run_workers(WORKER, world, tmp_path, *lengths):
        # (9 self-attention + 3 cross-attention rules) x 2 layouts x (output and gradients,
        # unshard) x 2 lengths
        assert len(r["worst"]) == 12 * 2 * 2 * 2
        bad = {k: v for k, v in r["worst"].items() if not v <= 1e-9}
        assert not bad, f"rank {r['rank']}: {bad}"


def test_models_on_a_sharded_sequence_equal_one_process_in_float64(tmp_path: Path) -> None:
    """DecoderOnlyLM (rotary, GQA, left padding) and Transformer (learned positions, source
    and target padding, uneven lengths 19 and 14): logits and the gradients of every parameter
    (summed over the ranks) equal one process on the whole batch, both layouts."""
    for r in run_workers(MODEL_WORKER, 2, tmp_path):
        assert len(r["worst"]) == 2 * 2
        bad = {k: v for k, v in r["worst"].items() if not v <= 1e-9}
        assert not bad, f"rank {r['rank']}: {bad}"
