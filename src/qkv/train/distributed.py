"""Multi-process data-parallel training with PyTorch's own engine (gloo on CPU).

``torchrun --nproc_per_node=N -m qkv train ...`` starts N processes and sets ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``; :func:`init_from_env` joins them into one
process group. The model is wrapped in ``DistributedDataParallel``, which averages gradients over
the processes during ``backward``.

How the result equals single-process training with the same global batch: every process builds
the same global batch from ``(seed, step)`` and keeps its own contiguous shard of rows; its loss
is the *sum* over its tokens divided by the global token count, times ``world_size`` (because DDP
averages rather than sums). The averaged gradient is then the gradient of the global token-mean
loss, as in one process; only the order of the floating-point additions differs. Dropout draws
differ per process, so that equality holds for ``dropout=0``.

Context parallelism (:func:`split_processes`): with ``context_parallel = C``, the ``W`` processes
form ``W / C`` data-parallel replicas of ``C`` consecutive ranks each. The ranks of one group take
the same rows and each holds its shard of every sequence (:mod:`qkv.distributed`); a rank's
parameter gradients after ``backward`` are its share of its group's, so DDP's average over all
``W`` processes, with the loss scaled as above, is again the gradient of the global mean loss.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from qkv._checks import check_positive_int
from qkv.distributed import ContextParallel, Layout
from qkv.distributed.layout import check_layout

__all__ = [
    "DistContext",
    "ProcessSplit",
    "all_reduce_sum",
    "barrier",
    "init_from_env",
    "shutdown",
    "split_processes",
    "wrap_model",
]


@dataclass(frozen=True)
class DistContext:
    """Where this process stands: ``rank`` of ``world_size`` (1 and 0 when not distributed)."""

    rank: int = 0
    world_size: int = 1

    @property
    def enabled(self) -> bool:
        """Whether a process group is in use."""
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the process that prints and writes checkpoints."""
        return self.rank == 0


@dataclass(frozen=True)
class ProcessSplit:
    """How the processes share a step: data-parallel replicas, each a context-parallel group.

    Attributes:
        data_rank: this process's replica, in ``[0, data_parallel)``: the rows it takes.
        data_parallel: replicas (``world_size / context_parallel``): the row shards.
        context: the group and layout this process's sequences are cut in, or None when each
            process holds whole sequences (``context_parallel = 1``).
    """

    data_rank: int = 0
    data_parallel: int = 1
    context: ContextParallel | None = None


def split_processes(
    ctx: DistContext, context_parallel: int = 1, layout: Layout = "zigzag"
) -> ProcessSplit:
    """Cut the ``W`` processes into ``W / C`` groups of ``C = context_parallel`` consecutive ranks.

    Every process calls it (each creates every group, in the same order, as
    ``torch.distributed.new_group`` requires).

    Args:
        ctx: this process's place in the world.
        context_parallel: processes that share one sequence.
        layout: how a sequence is cut among them (``"zigzag"`` or ``"contiguous"``).

    Returns:
        This process's replica and context-parallel group.

    Raises:
        TypeError: ``context_parallel`` not an int.
        ValueError: ``context_parallel`` below 1 or not dividing the number of processes, an
            unknown layout.
    """
    check_positive_int("context_parallel", context_parallel)
    check_layout(layout)
    W, C = ctx.world_size, context_parallel
    if W % C != 0:
        raise ValueError(
            f"context_parallel={C} must divide the number of processes, got {W} "
            f"(start a multiple of {C} under torchrun, e.g. torchrun --nproc_per_node={C})"
        )
    if C == 1:
        return ProcessSplit(data_rank=ctx.rank, data_parallel=W)
    mine = None
    for first in range(0, W, C):
        group = dist.new_group(list(range(first, first + C)))
        if first <= ctx.rank < first + C:
            mine = group
    return ProcessSplit(ctx.rank // C, W // C, ContextParallel(mine, layout))


def init_from_env(backend: str = "gloo") -> DistContext:
    """Join the process group described by torchrun's environment variables, if any.

    With ``WORLD_SIZE`` unset or 1 nothing is initialised. Each process keeps its share of the
    cores (``torch.get_num_threads()`` is left as torchrun's ``OMP_NUM_THREADS`` set it).

    Raises:
        ValueError: ``RANK`` outside ``[0, WORLD_SIZE)``.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return DistContext()
    rank = int(os.environ.get("RANK", "0"))
    if not 0 <= rank < world_size:
        raise ValueError(f"RANK={rank} must lie in [0, WORLD_SIZE={world_size})")
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, rank=rank, world_size=world_size)
    return DistContext(rank=rank, world_size=world_size)


def wrap_model(model: nn.Module, ctx: DistContext) -> nn.Module:
    """``DistributedDataParallel(model)`` when distributed, else ``model`` itself.

    DDP broadcasts rank 0's parameters at construction, so all replicas start equal.
    """
    if not ctx.enabled:
        return model
    return DistributedDataParallel(model)


def all_reduce_sum(x: Tensor, ctx: DistContext) -> Tensor:
    """Sum of ``x`` over all processes (``x`` itself when not distributed)."""
    if ctx.enabled:
        x = x.clone()
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
    return x


def barrier(ctx: DistContext) -> None:
    """Wait for every process (no-op when not distributed)."""
    if ctx.enabled:
        dist.barrier()


def shutdown(ctx: DistContext) -> None:
    """Leave the process group (no-op when not distributed)."""
    if ctx.enabled and dist.is_initialized():
        dist.destroy_process_group()
