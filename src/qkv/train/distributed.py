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
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

__all__ = [
    "DistContext",
    "all_reduce_sum",
    "barrier",
    "init_from_env",
    "shutdown",
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
