"""``train(..., RunOptions(context_parallel=C))`` under torchrun (gloo, CPU): C processes share
each sequence, and the run equals one process training on the same global batch; bad settings
are refused before anything is built."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from qkv.apps.cli import main
from qkv.distributed import ContextParallel
from qkv.train.config import TrainConfig
from qkv.train.context import check_context_parallel, context_shard
from qkv.train.distributed import DistContext, ProcessSplit, split_processes
from qkv.train.loop import RunOptions, train
from qkv.train.task import PAD_ID, sequence_shard
from qkv.train.tasks import build_task
from qkv.train.text import LMBatch

WORKER = """
import json, os, sys
from safetensors.torch import save_file
from qkv.train.config import TrainConfig
from qkv.train.loop import RunOptions, train

cfg = TrainConfig(**json.loads(sys.argv[1]))
opts = RunOptions(progress=False, log_evals=False, **json.loads(sys.argv[2]))
result = train(cfg, opts)
rank = os.environ["RANK"]
weights = {k: v.clone() for k, v in result.model.state_dict().items()}  # tied: own copies
save_file(weights, os.path.join(sys.argv[3], f"rank{rank}.safetensors"))
with open(os.path.join(sys.argv[3], f"losses{rank}.json"), "w") as f:
    json.dump({"losses": result.losses, "evals": result.evals}, f)
"""

QUIET = RunOptions(progress=False, log_evals=False)
# Float32, same global batch and the same math: only the order of the additions differs (each
# rank sums its share of the tokens, the shards' attention merges by log-sum-exp, DDP adds the
# gradients), so the tolerances are those of the data-parallel test (tests/train/
# test_distributed.py), float32 rounding after a few Adam steps.
TOL: dict[str, Any] = {"atol": 1e-5, "rtol": 1.3e-6}


def _run(tmp_path: Path, n: int, cfg: TrainConfig, **opts: Any) -> list[dict[str, Any]]:
    """Train ``cfg`` on ``n`` processes under torchrun; each rank's weights and log."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={n}",
        str(script),
        json.dumps(cfg.to_dict()),
        json.dumps(opts),
        str(tmp_path),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return [
        {
            "weights": load_file(tmp_path / f"rank{r}.safetensors"),
            **json.loads((tmp_path / f"losses{r}.json").read_text()),
        }
        for r in range(n)
    ]


def _assert_equals_one_process(ranks: list[dict[str, Any]], cfg: TrainConfig) -> None:
    """Every rank holds the same replica, and it equals one process's run of ``cfg``."""
    for other in ranks[1:]:
        for k, v in ranks[0]["weights"].items():
            assert torch.equal(v, other["weights"][k]), f"replicas differ at {k}"
        assert other["losses"] == ranks[0]["losses"], "every rank logs the same global loss"
    single = train(cfg, QUIET)
    torch.testing.assert_close(ranks[0]["losses"], single.losses, **TOL)
    # The key bias adds q.b_k to every score of a query, which softmax ignores: its true
    # gradient is 0 and both runs move it by rounding noise alone, which Adam rescales to
    # steps of lr (measured here: up to 5e-4 apart; see test_distributed.py); every other
    # weight must agree, and the difference must change no output.
    for k, v in single.model.state_dict().items():
        if not k.endswith("k_proj.bias"):
            torch.testing.assert_close(
                ranks[0]["weights"][k], v, msg=lambda m, k=k: f"{k}: {m}", **TOL
            )
    replica = copy.deepcopy(single.model)
    replica.load_state_dict(ranks[0]["weights"])
    batch = build_task(cfg).train_batch(seed=99, step=0, batch_size=4)
    with torch.no_grad():
        torch.testing.assert_close(
            batch.logits(replica.eval()), batch.logits(single.model.eval()), **TOL
        )  # [B, T, V]
    ours = [{k: v for k, v in e.items() if k != "seconds"} for e in ranks[0]["evals"]]
    theirs = [{k: v for k, v in e.items() if k != "seconds"} for e in single.evals]
    assert [e["accuracy"] for e in ours] == [e["accuracy"] for e in theirs]
    torch.testing.assert_close([e["loss"] for e in ours], [e["loss"] for e in theirs], **TOL)


def test_two_processes_sharing_each_sequence_match_one(
    tmp_path: Path, tiny: Callable[..., TrainConfig]
) -> None:
    # the language model (rotary positions, causal + padding masks), cut zigzag
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the cat sat on the mat. " * 20, encoding="utf-8")
    cfg = tiny(
        task="text",
        text_path=str(corpus),
        block_size=12,
        positional="rotary",
        steps=4,
        eval_every=2,
        eval_size=8,
        batch_size=4,
    )
    ranks = _run(tmp_path, 2, cfg, context_parallel=2, context_layout="zigzag")
    _assert_equals_one_process(ranks, cfg)


def test_data_parallel_times_context_parallel_matches_one_process(
    tmp_path: Path, tiny: Callable[..., TrainConfig]
) -> None:
    # 4 processes: 2 replicas x 2 ranks per sequence, the encoder-decoder cut contiguously,
    # sources of 3-6 characters (uneven cuts). One-character sources would make each
    # attention see a single key, whose query and key projections then have a true gradient
    # of 0 that Adam turns into lr-sized steps of rounding noise: no weight comparison holds.
    cfg = tiny(task="copy", min_len=3, max_len=6, steps=3, eval_every=3, eval_size=8, batch_size=4)
    ranks = _run(tmp_path, 4, cfg, context_parallel=2, context_layout="contiguous")
    _assert_equals_one_process(ranks, cfg)


def test_a_batch_narrower_than_the_group_is_padded_to_one_column_per_rank() -> None:
    # The models need at least one position per rank: a one-column batch on a 2-rank group is
    # right-padded with PAD_ID first (padding keys are masked and carry no loss). Outside
    # torchrun shard() keeps the whole tensor, which shows the padding itself.
    two_ranks = SimpleNamespace(world=2, group=None, layout="zigzag")
    x = torch.tensor([[7], [9]])
    padded = sequence_shard(x, two_ranks)  # type: ignore[arg-type]
    assert torch.equal(padded, torch.tensor([[7, PAD_ID], [9, PAD_ID]]))
    assert torch.equal(
        sequence_shard(torch.tensor([[1, 2, 3]]), two_ranks), torch.tensor([[1, 2, 3]])
    )  # type: ignore[arg-type]


def test_bad_context_parallel_settings_are_refused(tiny: Callable[..., TrainConfig]) -> None:
    cfg = tiny()
    with pytest.raises(ValueError, match=r"context_parallel=3 must divide .* got 2"):
        check_context_parallel(cfg, 3, world_size=2)
    with pytest.raises(ValueError, match=r"needs dropout=0 .* got dropout=0.1"):
        check_context_parallel(tiny(dropout=0.1), 2, 2)
    for positional in ("alibi", "relative"):
        with pytest.raises(ValueError, match=f"got positional='{positional}'"):
            check_context_parallel(tiny(positional=positional), 2, 2)
    with pytest.raises(ValueError, match=r"batch_size=6 .* data-parallel replicas .* \(4\)"):
        check_context_parallel(tiny(batch_size=6), 2, 8)
    check_context_parallel(tiny(dropout=0.1), 1, 2)  # no context parallelism: fine
    with pytest.raises(ValueError, match="context_parallel must be"):
        RunOptions(context_parallel=0)
    with pytest.raises(ValueError, match="layout must be one of"):
        RunOptions(context_parallel=2, context_layout="diagonal")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="context_parallel=2 must divide"):
        split_processes(DistContext(), 2)
    assert split_processes(DistContext(), 1) == ProcessSplit()
    # a task's batch without context_shard (the Batch protocol's method) is named
    with pytest.raises(TypeError, match=r"context_shard.* object has none"):
        context_shard(object(), ProcessSplit(context=ContextParallel()))  # type: ignore[arg-type]
    # one process (no torchrun): refused before any training
    with pytest.raises(ValueError, match=r"context_parallel=2 must divide .* got 1"):
        train(cfg, RunOptions(progress=False, context_parallel=2))


def test_cli_refuses_context_parallel_without_enough_processes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["train", "--steps", "1", "--out", str(tmp_path / "run"), "--context-parallel", "2"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "context_parallel=2 must divide the number of processes, got 1" in err
    assert not (tmp_path / "run" / "config.json").exists()
    with pytest.raises(SystemExit):
        main(["train", "--context-parallel", "0"])


def test_context_shard_of_one_process_is_the_whole_batch() -> None:
    # the batch method the loop calls; outside torchrun the group is this process alone
    batch = LMBatch(torch.tensor([[3, 4, 5]]), torch.tensor([[4, 5, 0]]))
    setting = ContextParallel(None, "zigzag")
    cut = batch.context_shard(setting)
    assert torch.equal(cut.inputs, batch.inputs) and torch.equal(cut.targets, batch.targets)
    assert cut.context_parallel is setting and cut.shard(0, 1).context_parallel is setting
