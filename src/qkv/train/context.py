"""Training under context parallelism: what a run must satisfy, and each batch's shard.

With ``RunOptions(context_parallel=C)`` under torchrun, ``C`` consecutive ranks share every
row's sequences (:func:`qkv.train.distributed.split_processes`); each takes its rows, then its
shard of every sequence (a batch's ``context_shard``), and runs the model context-parallel
(:mod:`qkv.distributed`).
"""

from __future__ import annotations

from qkv.train.config import TrainConfig
from qkv.train.distributed import ProcessSplit
from qkv.train.task import Batch

__all__ = ["check_context_parallel", "context_shard"]


def context_shard(local: Batch, split: ProcessSplit) -> Batch:
    """``local.context_shard(...)``, or a TypeError naming a batch type that has none."""
    assert split.context is not None
    cut = getattr(local, "context_shard", None)
    if cut is None:
        raise TypeError(
            f"context_parallel needs batches with a context_shard(setting) method; "
            f"{type(local).__name__} has none"
        )
    out: Batch = cut(split.context)
    return out


def check_context_parallel(cfg: TrainConfig, context_parallel: int, world_size: int) -> None:
    """Refuse, before anything is built, a ``context_parallel`` the run cannot take.

    Args:
        cfg: the run's configuration.
        context_parallel: ranks per sequence (``RunOptions.context_parallel``).
        world_size: processes in the run.

    Raises:
        ValueError: ``context_parallel`` not dividing ``world_size``; above 1 with
            ``cfg.dropout > 0`` (attention dropout does not run on a sharded sequence) or
            ALiBi / relative positions (score biases the context-parallel attention does not
            take); a ``batch_size`` the data-parallel replicas cannot split evenly.
    """
    C = context_parallel
    if world_size % C != 0:
        raise ValueError(
            f"context_parallel={C} must divide the number of processes, got {world_size} "
            f"(start a multiple of {C} under torchrun, e.g. torchrun --nproc_per_node={C})"
        )
    if C > 1 and cfg.dropout > 0:
        raise ValueError(
            f"context_parallel={C} needs dropout=0 (attention dropout does not run on a "
            f"sharded sequence), got dropout={cfg.dropout}"
        )
    if C > 1 and cfg.positional in ("alibi", "relative"):
        raise ValueError(
            f"context_parallel={C} needs absolute or rotary positions (sinusoidal, learned, "
            f"rotary, none), got positional={cfg.positional!r}"
        )
    replicas = world_size // C
    if cfg.batch_size % replicas != 0:
        what = "processes" if C == 1 else f"data-parallel replicas ({world_size} processes / {C})"
        raise ValueError(
            f"batch_size={cfg.batch_size} must be divisible by the number of {what} ({replicas})"
        )
