"""The training loop: AdamW, warmup + schedule, gradient clipping, label smoothing, periodic
exact-match evaluation by decoding, a tqdm bar, checkpoints and exact resume, optionally on
several processes, data-parallel and context-parallel (see :mod:`qkv.train.distributed`).

Reproducibility: the weights come from ``torch.manual_seed(seed)``, every batch is a function of
``(seed, step)``, and the torch RNG state (dropout) is saved with each checkpoint, so a run with
the same config on the same machine is bit-for-bit the same, resumed or not.

Stopping: SIGINT (Ctrl-C) or SIGTERM lets the current step finish, saves a resumable checkpoint
and returns with :attr:`TrainResult.stopped_by` set; a second signal stops at once. The output
directory is checked, created and locked (:func:`qkv.train.checkpoint.directory_lock`) before the
model is built, so a bad ``out`` or a concurrent writer is refused before any training.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from qkv._checks import check_bool, check_nonnegative_int, check_positive_int, check_probability
from qkv.distributed import Layout
from qkv.distributed.layout import check_layout
from qkv.models.registry import load_weights, model_from_config
from qkv.train.checkpoint import (
    CheckpointError,
    directory_lock,
    load_checkpoint,
    restore_optimizer,
    save_checkpoint,
)
from qkv.train.config import TrainConfig, build_optimizer, lr_at
from qkv.train.context import check_context_parallel, context_shard
from qkv.train.distributed import (
    DistContext,
    ProcessSplit,
    all_reduce_sum,
    barrier,
    init_from_env,
    shutdown,
    split_processes,
    wrap_model,
)
from qkv.train.task import PAD_ID, Batch, Task, loss_sum
from qkv.train.tasks import build_task

# loss_sum lives with the Batch protocol it reads; it is re-exported here, where it is used.
__all__ = ["RunOptions", "TrainResult", "evaluate", "loss_sum", "train"]


@dataclass(frozen=True)
class RunOptions:
    """How to run (these do not change the resulting weights).

    Attributes:
        out: checkpoint directory (``None``: no checkpoints).
        resume: continue from the checkpoint in ``out``.
        overwrite: start afresh even if ``out`` holds a checkpoint.
        save_every: also checkpoint every this many steps (0: only at the end).
        stop_after: stop once this step is reached (saving first), although the schedule spans
            ``TrainConfig.steps``; resume later with ``resume=True``.
        target_accuracy: stop at the first evaluation reaching this held-out accuracy, in
            ``(0, 1]``.
        progress: show the tqdm bar (rank 0 only) when stderr is a terminal; elsewhere (a
            log file) a line per evaluation instead, with the training loss and speed.
        log_evals: print a line per evaluation (rank 0 only).
        context_parallel: processes that share each sequence (under torchrun; it must divide
            their number): each holds a shard of every sequence of its rows, and the step is
            still that of one process on the whole batch. Needs ``dropout=0`` and absolute or
            rotary positions. 1: each process holds whole sequences (data parallelism only).
        context_layout: how a sequence is cut among them, ``"zigzag"`` (balances causal work)
            or ``"contiguous"``.

    Raises:
        ValueError: a negative ``save_every``, a ``stop_after`` below 1, a ``target_accuracy``
            outside ``(0, 1]``, a ``context_parallel`` below 1, an unknown ``context_layout``.
        TypeError: a count that is not an int, a flag that is not a bool.
    """

    out: str | Path | None = None
    resume: bool = False
    overwrite: bool = False
    save_every: int = 0
    stop_after: int | None = None
    target_accuracy: float | None = None
    progress: bool = True
    log_evals: bool = True
    context_parallel: int = 1
    context_layout: Layout = "zigzag"

    def __post_init__(self) -> None:
        for name in ("resume", "overwrite", "progress", "log_evals"):
            check_bool(name, getattr(self, name))
        check_nonnegative_int("save_every", self.save_every)
        check_positive_int("context_parallel", self.context_parallel)
        check_layout(self.context_layout)
        if self.stop_after is not None:
            check_positive_int("stop_after", self.stop_after)
        if self.target_accuracy is not None:
            check_probability("target_accuracy", self.target_accuracy)
            if self.target_accuracy == 0:
                raise ValueError("target_accuracy must lie in (0, 1], got 0")


@dataclass
class TrainResult:
    """What a run did.

    Attributes:
        model: the trained model (unwrapped from DDP).
        step: steps taken in total (including those before a resume).
        losses: the global mean training loss of each step of this invocation.
        evals: ``{"step", "accuracy", "loss", "seconds"}`` per evaluation; ``seconds`` is wall
            time since this invocation started.
        tokens_per_s: training tokens (non-padding source + target) per second, all processes.
        seconds: wall time of this invocation.
        checkpoint: the manifest written last, or None.
        stopped_by: the signal (``signal.SIGINT`` / ``SIGTERM``) that stopped the run early,
            after saving; None when it ran to its end.
    """

    model: nn.Module
    step: int
    losses: list[float] = field(default_factory=list)
    evals: list[dict[str, float]] = field(default_factory=list)
    tokens_per_s: float = 0.0
    seconds: float = 0.0
    checkpoint: Path | None = None
    stopped_by: int | None = None


class Interrupted(KeyboardInterrupt):
    """A second SIGINT / SIGTERM during training: stop at once, without saving.

    A ``KeyboardInterrupt`` (what Ctrl-C raises elsewhere) that knows its signal, so that the
    command exits ``128 + signum``: 143 after two SIGTERMs, 130 after two Ctrl-C.

    Attributes:
        signum: the signal's number.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(f"second signal {signal.Signals(signum).name}")
        self.signum = signum


class _StopOnSignal:
    """SIGINT / SIGTERM handlers that ask the loop to stop after the current step.

    Installed only in the main thread (Python allows no other); the previous handlers come back
    on exit. A second signal raises ``KeyboardInterrupt`` at once.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.received: int | None = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None:
            raise Interrupted(signum)
        self.received = signum

    @contextmanager
    def installed(self) -> Iterator[_StopOnSignal]:
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        try:
            yield self
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


@torch.no_grad()
def evaluate(
    model: nn.Module,
    task: Task,
    cfg: TrainConfig,
    ctx: DistContext | None = None,
) -> tuple[float, float]:
    """Held-out ``(accuracy, loss)`` by the task's own metric, each process evaluating its share
    (:meth:`~qkv.train.task.Task.held_out_sums`) and the sums added over processes.

    Built-in sequence tasks: exact-sequence accuracy of greedy decoding (the output must equal
    the target and end with ``<eos>``), and the teacher-forced loss. Text: next-character
    accuracy.
    """
    ctx = ctx or DistContext()
    was_training = model.training
    model.eval()
    sums = task.held_out_sums(model, cfg.eval_size, cfg.seed, ctx.rank, ctx.world_size)
    stats = torch.tensor([sums.correct, sums.count, sums.loss, sums.tokens], dtype=torch.float64)
    stats = all_reduce_sum(stats, ctx)
    model.train(was_training)
    return float(stats[0] / stats[1]), float(stats[2] / stats[3])


def _check_resumable(cfg: TrainConfig, stored: dict[str, Any] | None, where: Path) -> None:
    if stored is None:
        raise CheckpointError(f"{where} holds no training config; it cannot be resumed")
    old = TrainConfig.from_dict(stored)
    diff = [
        f"{k}: checkpoint {v!r}, now {getattr(cfg, k)!r}"
        for k, v in old.to_dict().items()
        if getattr(cfg, k) != v
    ]
    if diff:
        raise ValueError(
            f"--resume needs the same training config as {where}; differs in " + "; ".join(diff)
        )


def train(
    cfg: TrainConfig, opts: RunOptions | None = None, task: Task | None = None
) -> TrainResult:
    """Train ``cfg``'s task; under torchrun, on every process of the group.

    Args:
        cfg: the run's config.
        opts: run options (checkpoint directory, resume, stopping, progress bar).
        task: any :class:`~qkv.train.task.Task` to train instead of the built-in
            ``cfg.task`` (whose task fields are then unused).

    Returns:
        The :class:`TrainResult` (on every process).

    Raises:
        ValueError: bad options, an existing checkpoint without ``resume``/``overwrite``, or a
            ``resume`` whose config differs from the checkpoint's (the differing fields named).
        CheckpointError: a checkpoint that cannot be trusted or does not fit, an ``out`` that
            is a file or not writable, or one that another process is writing (locked).
    """
    opts = opts or RunOptions()
    out = None if opts.out is None else Path(opts.out)
    if opts.resume and out is None:
        raise ValueError("resume needs a checkpoint directory (--out)")
    ctx = init_from_env()
    try:
        with ExitStack() as stack:
            if out is not None and ctx.is_main:  # before anything is built or trained
                stack.enter_context(directory_lock(out))
            stop = stack.enter_context(_StopOnSignal().installed())
            return _train(cfg, opts, out, ctx, build_task(cfg) if task is None else task, stop)
    finally:
        shutdown(ctx)


def _start_step(
    cfg: TrainConfig,
    opts: RunOptions,
    out: Path | None,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
) -> int:
    """0 for a fresh run; for ``resume``, the checkpoint's step after loading its weights,
    optimizer and RNG state into ``model``/``optimizer``."""
    if opts.resume:
        assert out is not None  # train() refuses resume without out
        ckpt = load_checkpoint(out)
        _check_resumable(cfg, ckpt.train_config, out)
        try:
            load_weights(model, ckpt.weights, str(out))  # maps qkv 0.1 keys, then strict
        except ValueError as err:
            raise CheckpointError(str(err)) from None
        restore_optimizer(optimizer, ckpt)
        if ckpt.rng_state is not None:
            torch.set_rng_state(ckpt.rng_state)
        return ckpt.step
    if out is not None and (out / "config.json").exists() and not opts.overwrite:
        raise ValueError(
            f"{out} already holds a checkpoint; pass --resume to continue it or "
            f"--overwrite to start over"
        )
    return 0


def _update(
    net: nn.Module,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    global_batch: Batch,
    lr: float,
    cfg: TrainConfig,
    ctx: DistContext,
    split: ProcessSplit,
) -> float:
    """One optimizer step on this process's shard of ``global_batch``; the global mean loss."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    local = global_batch.shard(split.data_rank, split.data_parallel)
    if split.context is not None:  # and this rank's shard of each of its rows' sequences
        local = context_shard(local, split)
    n_global = int((global_batch.targets != PAD_ID).sum())
    total, _ = loss_sum(net, local, cfg.label_smoothing)
    loss = total * (ctx.world_size / n_global)  # DDP averages: see qkv.train.distributed
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if cfg.grad_clip > 0:
        nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    optimizer.step()
    return float(all_reduce_sum(total.detach(), ctx)) / n_global


def _stop_requested(stop: _StopOnSignal, ctx: DistContext) -> int | None:
    """The signal that asked to stop, agreed by every process (the first rank's signal wins)."""
    if not ctx.enabled:
        return stop.received
    got = torch.tensor([float(stop.received or 0)], dtype=torch.float64)  # [1]
    seen = all_reduce_sum((got > 0).double(), ctx)
    if float(seen[0]) == 0:
        return None
    return stop.received or int(signal.SIGTERM)


def _train(
    cfg: TrainConfig,
    opts: RunOptions,
    out: Path | None,
    ctx: DistContext,
    task: Task,
    stop: _StopOnSignal,
) -> TrainResult:
    check_context_parallel(cfg, opts.context_parallel, ctx.world_size)
    split = split_processes(ctx, opts.context_parallel, opts.context_layout)
    torch.manual_seed(cfg.seed)
    model_config = task.model_config(cfg)
    model = model_from_config(task.model_type, model_config)
    optimizer = build_optimizer(model, cfg)
    start = _start_step(cfg, opts, out, model, optimizer)
    if opts.stop_after is not None and opts.stop_after <= start:
        raise ValueError(
            f"stop_after={opts.stop_after} is not beyond the checkpoint's step {start}: "
            f"nothing would be trained"
        )
    net = wrap_model(model, ctx)
    net.train()
    end = cfg.steps if opts.stop_after is None else min(cfg.steps, opts.stop_after)
    result = TrainResult(model=model, step=start)

    def save() -> None:
        if out is not None and ctx.is_main:
            result.checkpoint = save_checkpoint(
                out,
                model=model,
                model_type=task.model_type,
                model_config=model_config,
                task=task.spec(),
                step=result.step,
                train_config=cfg.to_dict(),
                optimizer=optimizer,
                rng_state=torch.get_rng_state(),
            )
        barrier(ctx)

    # A bar redrawn with carriage returns is for a terminal; into a log (stderr not a
    # terminal) it wrote hundreds of kB, so there the progress is a line per evaluation.
    show_bar = opts.progress and ctx.is_main and sys.stderr.isatty()
    line_per_eval = ctx.is_main and (opts.log_evals or (opts.progress and not show_bar))
    bar = tqdm(
        total=cfg.steps,
        initial=start,
        disable=not show_bar,
        desc=f"train {task.name}",
        dynamic_ncols=True,
    )
    t0 = time.perf_counter()
    train_time, tokens = 0.0, 0
    for step in range(start, end):
        ts = time.perf_counter()
        lr = lr_at(step, cfg)
        global_batch = task.train_batch(cfg.seed, step, cfg.batch_size)
        mean_loss = _update(net, model, optimizer, global_batch, lr, cfg, ctx, split)
        result.step = step + 1
        result.losses.append(mean_loss)
        train_time += time.perf_counter() - ts
        tokens += global_batch.num_tokens
        bar.update(1)
        bar.set_postfix(
            loss=f"{mean_loss:.4f}", tok_s=f"{tokens / train_time:,.0f}", lr=f"{lr:.2e}"
        )
        if result.step % cfg.eval_every == 0 or result.step == cfg.steps:
            acc, eval_loss = evaluate(model, task, cfg, ctx)
            seconds = time.perf_counter() - t0
            result.evals.append(
                {"step": result.step, "accuracy": acc, "loss": eval_loss, "seconds": seconds}
            )
            if line_per_eval:
                what = (
                    ""
                    if show_bar
                    else (f" (train loss {mean_loss:.4f}, {tokens / train_time:,.0f} tokens/s)")
                )
                bar.write(
                    f"step {result.step}: held-out {task.metric} {acc:.2%}, "
                    f"loss {eval_loss:.4f}, {seconds:.1f} s{what}"
                )
            if opts.target_accuracy is not None and acc >= opts.target_accuracy:
                break
        result.stopped_by = _stop_requested(stop, ctx)
        if result.stopped_by is not None:
            break
        if opts.save_every and result.step % opts.save_every == 0 and result.step != end:
            save()
    bar.close()
    result.tokens_per_s = tokens / train_time if train_time > 0 else 0.0
    result.seconds = time.perf_counter() - t0
    save()
    return result
