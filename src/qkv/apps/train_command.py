"""The ``qkv train``, ``qkv generate`` and ``qkv plot`` subcommands: arguments and printing.

Each ``run_*`` function takes the parsed ``argparse.Namespace`` and returns an exit code; the
work itself lives in importable functions (:func:`qkv.train.loop.train`,
:func:`qkv.train.inference.generate_text`, :func:`qkv.apps.plots.plot_checkpoint`).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import fields
from pathlib import Path

import torch

from qkv.train.config import SCHEDULES, TrainConfig
from qkv.train.tasks import TASKS

__all__ = [
    "add_generate_arguments",
    "add_plot_arguments",
    "add_train_arguments",
    "run_generate",
    "run_plot",
    "run_train",
]

_HELP = {
    "task": "built-in task",
    "steps": "optimizer steps of the whole run",
    "batch_size": "global batch (split across torchrun processes)",
    "lr": "peak learning rate",
    "schedule": "after warmup: " + " | ".join(SCHEDULES),
    "eval_every": "held-out evaluation every N steps",
    "seed": "seeds weights, data and dropout (bit-for-bit reproducible)",
    "label_smoothing": "cross-entropy label smoothing",
    "grad_clip": "clip the gradient norm (0: off)",
}

# Measured on the 2-core machine shared with other jobs: the default reverse model trains 7-15x
# faster on 1 thread than on 2 (tiny matmuls gain nothing from intra-op threads and lose to
# their synchronisation). Scale out with torchrun processes instead.
_THREADS_HELP = "torch CPU threads per process (default 1: fastest for these small models)"


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    """One ``--flag`` per :class:`TrainConfig` field, plus the run options."""
    for f in fields(TrainConfig):
        if f.name == "text_path":
            p.add_argument(
                "--text",
                dest="text_path",
                metavar="FILE",
                default=None,
                help="UTF-8 file: character-level language model (implies --task text)",
            )
            continue
        flag = "--" + f.name.replace("_", "-")
        kwargs: dict[str, object] = {"default": f.default, "type": type(f.default)}
        if f.name == "task":
            kwargs["choices"] = TASKS
        if f.name == "schedule":
            kwargs["choices"] = SCHEDULES
        help_text = _HELP.get(f.name, f.name.replace("_", " "))
        p.add_argument(flag, dest=f.name, help=f"{help_text} (default {f.default})", **kwargs)  # type: ignore[arg-type]
    p.add_argument("--out", default=None, help="checkpoint directory (default runs/TASK)")
    p.add_argument("--resume", action="store_true", help="continue the checkpoint in --out")
    p.add_argument("--overwrite", action="store_true", help="replace a checkpoint in --out")
    p.add_argument("--save-every", type=int, default=0, help="also checkpoint every N steps")
    p.add_argument(
        "--stop-after",
        type=int,
        default=None,
        help="stop (and save) at this step; the schedule still spans --steps",
    )
    p.add_argument(
        "--target-accuracy",
        type=float,
        default=None,
        help="stop at the first evaluation reaching this held-out accuracy (0-1)",
    )
    p.add_argument("--threads", type=int, default=1, help=_THREADS_HELP)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run_train(args: argparse.Namespace) -> int:
    """``qkv train``: train, checkpoint, print a summary (rank 0 only)."""
    from qkv.train.loop import RunOptions, train

    values = {f.name: getattr(args, f.name) for f in fields(TrainConfig)}
    if values["text_path"] is not None:
        values["task"] = "text"
    cfg = TrainConfig(**values)
    torch.set_num_threads(args.threads)
    out = Path(args.out) if args.out is not None else Path("runs") / cfg.task
    opts = RunOptions(
        out=out,
        resume=args.resume,
        overwrite=args.overwrite,
        save_every=args.save_every,
        stop_after=args.stop_after,
        target_accuracy=args.target_accuracy,
        progress=not args.no_progress,
    )
    result = train(cfg, opts)
    if int(os.environ.get("RANK", "0")) != 0:
        return 0
    world = int(os.environ.get("WORLD_SIZE", "1"))
    counted = "non-padding tokens" if cfg.task == "text" else "non-padding source + target"
    print(
        f"trained to step {result.step}/{cfg.steps} in {result.seconds:.1f} s on {world} "
        f"process(es), {result.tokens_per_s:,.0f} tokens/s ({counted})"
    )
    if result.evals:
        last = result.evals[-1]
        print(f"held-out accuracy {last['accuracy']:.2%} at step {int(last['step'])}")
        for threshold in (0.99,):
            hit = next((e for e in result.evals if e["accuracy"] >= threshold), None)
            if hit is not None:
                print(
                    f"first >= {threshold:.0%}: step {int(hit['step'])}, "
                    f"{hit['seconds']:.1f} s after start of this run"
                )
    if result.checkpoint is not None:
        print(f"checkpoint: {result.checkpoint.parent}")
    return 0


def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    """``qkv generate CHECKPOINT INPUT [--beam N] ...``."""
    p.add_argument("checkpoint", help="checkpoint directory (from qkv train)")
    p.add_argument("input", help="the input sequence (or the prompt of a text model)")
    p.add_argument("--beam", type=int, default=1, help="beam width (1: greedy)")
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--sample", action="store_true", help="text models: sample, not argmax")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help=_THREADS_HELP)


def run_generate(args: argparse.Namespace) -> int:
    """``qkv generate``: print the decoded output and tokens/s (timed after one untimed warm-up
    decode, so the speed is the steady state rather than one-off first-call costs)."""
    from qkv.train.inference import generate_text, load_trained

    torch.set_num_threads(args.threads)
    model, task, _ = load_trained(args.checkpoint)
    generate_text(model, task, args.input, beam_size=args.beam, max_new_tokens=args.max_new_tokens)
    gen = generate_text(
        model,
        task,
        args.input,
        beam_size=args.beam,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        greedy=not args.sample,
        seed=args.seed,
    )
    print(gen.text)
    mode = f"beam {args.beam}" if args.beam > 1 else ("sampled" if args.sample else "greedy")
    print(
        f"{len(gen.ids)} tokens in {gen.seconds * 1e3:.1f} ms ({gen.tokens_per_s:,.0f} tokens/s,"
        f" {mode}, KV cache, timed after a warm-up run)"
    )
    return 0


def add_plot_arguments(p: argparse.ArgumentParser) -> None:
    """``qkv plot CHECKPOINT INPUT -o attn.png`` or ``qkv plot CHECKPOINT --positional``."""
    p.add_argument("checkpoint", help="checkpoint directory (from qkv train)")
    p.add_argument("input", nargs="?", default=None, help="the input to decode and look at")
    p.add_argument("-o", "--output", default="attn.png", help="PNG path (default attn.png)")
    p.add_argument(
        "--kind",
        action="append",
        choices=("encoder self", "decoder self", "cross"),
        help="only these attention kinds (repeatable; default all)",
    )
    p.add_argument(
        "--positional", action="store_true", help="plot the sinusoidal positional encoding instead"
    )
    p.add_argument(
        "--length",
        type=int,
        default=None,
        help="--positional: positions to draw (default: the model's max_len)",
    )
    p.add_argument("--threads", type=int, default=1, help=_THREADS_HELP)


def run_plot(args: argparse.Namespace) -> int:
    """``qkv plot``: write the PNG and say where it is."""
    from qkv.apps.plots import plot_checkpoint, plot_checkpoint_positional

    torch.set_num_threads(args.threads)
    if args.positional:
        path = plot_checkpoint_positional(args.checkpoint, args.output, args.length)
        print(f"positional encoding written to {path}")
        return 0
    if args.input is None:
        raise ValueError("qkv plot needs an INPUT to decode (or --positional)")
    kinds = None if args.kind is None else tuple(args.kind)
    path, output, (rows, cols) = plot_checkpoint(args.checkpoint, args.input, args.output, kinds)
    print(f"{args.input!r} -> {output!r}")
    print(f"attention grid ({rows} rows: kind x layer, {cols} columns: heads) written to {path}")
    return 0
