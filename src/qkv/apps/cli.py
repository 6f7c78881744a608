"""``qkv`` command line: every argparse definition of the package is in this file; each
subcommand's handler calls an importable function (``benchmarks/attention.py`` runs ``qkv bench``
through :func:`main` too)."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import fields

from qkv.apps.bench import CASES, format_table, run_benchmarks
from qkv.apps.demo import print_demo, run_demo
from qkv.apps.embed import embed, format_embed
from qkv.apps.shapes import trace_attention_shapes, trace_model_shapes
from qkv.apps.training import run_generate, run_train
from qkv.apps.viz import KINDS, run_plot
from qkv.train.config import SCHEDULES, TASKS, TrainConfig

__all__ = [
    "add_bench_arguments",
    "add_generate_arguments",
    "add_plot_arguments",
    "add_train_arguments",
    "build_parser",
    "main",
]

_TRAIN_HELP = {
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
_CHOICES: dict[str, tuple[str, ...]] = {"task": TASKS, "schedule": SCHEDULES}

# Measured on the 2-core machine shared with other jobs: the default reverse model trains 7-15x
# faster on 1 thread than on 2 (tiny matmuls gain nothing from intra-op threads and lose to
# their synchronisation). Scale out with torchrun processes instead.
_THREADS_HELP = "torch CPU threads per process (default 1: fastest for these small models)"


def _add_threads(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, default=1, help=_THREADS_HELP)


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    """``qkv demo [--seed N]``."""
    p.add_argument("--seed", type=int, default=0)


def add_shapes_arguments(p: argparse.ArgumentParser) -> None:
    """``qkv shapes [--B N] ... [--model [--layers N]]``."""
    for name, default in (("B", 2), ("H", 4), ("T", 3), ("S", 5), ("Dh", 8), ("Dv", 6)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument(
        "--model", action="store_true", help="trace a small encoder-decoder Transformer instead"
    )
    p.add_argument("--layers", type=int, default=2, help="layers per stack with --model")


def add_embed_arguments(p: argparse.ArgumentParser) -> None:
    """``qkv embed SENTENCE... [--model DIR] [--backend NAME]``."""
    p.add_argument("sentences", nargs="+", help="the sentences to embed")
    p.add_argument("--model", default=None, help="BERT checkpoint directory (default MiniLM)")
    p.add_argument("--backend", default="auto", help="attention backend")


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    """One ``--flag`` per :class:`~qkv.train.config.TrainConfig` field, plus the run options."""
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
        help_text = _TRAIN_HELP.get(f.name, f.name.replace("_", " "))
        p.add_argument(
            "--" + f.name.replace("_", "-"),
            dest=f.name,
            default=f.default,
            type=type(f.default),
            choices=_CHOICES.get(f.name),
            help=f"{help_text} (default {f.default})",
        )
    p.add_argument("--out", default=None, help="checkpoint directory (default runs/TASK)")
    p.add_argument("--resume", action="store_true", help="continue the checkpoint in --out")
    p.add_argument("--overwrite", action="store_true", help="replace a checkpoint in --out")
    p.add_argument("--save-every", type=int, default=0, help="also checkpoint every N steps")
    p.add_argument(
        "--stop-after", type=int, help="stop (and save) at this step; the schedule spans --steps"
    )
    p.add_argument(
        "--target-accuracy",
        type=float,
        help="stop at the first evaluation reaching this held-out accuracy (0-1)",
    )
    _add_threads(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


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
    _add_threads(p)


def add_plot_arguments(p: argparse.ArgumentParser) -> None:
    """``qkv plot CHECKPOINT INPUT -o attn.png`` or ``qkv plot CHECKPOINT --positional``."""
    p.add_argument("checkpoint", help="checkpoint directory (from qkv train)")
    p.add_argument("input", nargs="?", default=None, help="the input to decode and look at")
    p.add_argument("-o", "--output", default="attn.png", help="PNG path (default attn.png)")
    p.add_argument(
        "--kind",
        action="append",
        choices=KINDS,
        help="only these attention kinds (repeatable; default all)",
    )
    p.add_argument(
        "--positional", action="store_true", help="plot the sinusoidal positional encoding instead"
    )
    p.add_argument(
        "--length",
        type=int,
        help="--positional: positions to draw (default: the model's max_positions)",
    )
    _add_threads(p)


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    """``qkv bench [--quick] [--repeats N] [--device cuda] [--threads N] [--cases ...]
    [--lengths ...]``."""
    p.add_argument("--quick", action="store_true", help="small sizes, a smoke run")
    p.add_argument("--cases", nargs="+", default=None, help=f"masks to run, of {list(CASES)}")
    p.add_argument("--lengths", nargs="+", type=int, default=None, help="L values")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per entry")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")


def _cmd_demo(args: argparse.Namespace) -> int:
    print_demo(run_demo(seed=args.seed))
    return 0


def _print_model_shapes(args: argparse.Namespace) -> int:
    rows = trace_model_shapes(args.B, args.S, args.T, args.H, args.Dh, num_layers=args.layers)
    width = max(len(name) for name, _, _ in rows)
    for name, inputs, out in rows:
        ins = "  ".join(f"{k} {list(v)}" for k, v in inputs)
        print(f"{name:<{width}}  {ins}  ->  {list(out)}")
    return 0


def _cmd_shapes(args: argparse.Namespace) -> int:
    if args.model:
        return _print_model_shapes(args)
    rows = trace_attention_shapes(args.B, args.H, args.T, args.S, args.Dh, args.Dv)
    width = max(len(name) for name, _ in rows)
    for name, shape in rows:
        print(f"{name:<{width}}  {list(shape)}")
    return 0


def _cmd_embed(args: argparse.Namespace) -> int:
    try:
        result = embed(args.sentences, args.model, backend=args.backend)
    except FileNotFoundError as err:
        print(f"qkv embed: error: {err}")
        return 2
    print(format_embed(result))
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    rows, mm, mem = run_benchmarks(
        quick=args.quick,
        repeats=args.repeats,
        device=args.device,
        threads=args.threads,
        cases=args.cases,
        lengths=args.lengths,
    )
    print(format_table(rows, mm, mem))
    return 0


_Adder = Callable[[argparse.ArgumentParser], None]
_Handler = Callable[[argparse.Namespace], int]

# name, help, the arguments, the handler
_COMMANDS: tuple[tuple[str, str, _Adder, _Handler], ...] = (
    ("demo", "masked multi-head attention, checked against PyTorch", add_demo_arguments, _cmd_demo),
    (
        "shapes",
        "print the shape of every attention intermediate",
        add_shapes_arguments,
        _cmd_shapes,
    ),
    ("embed", "sentence embeddings and their cosine similarities", add_embed_arguments, _cmd_embed),
    ("train", "train a model on a built-in task (torchrun-ready)", add_train_arguments, run_train),
    ("generate", "decode an input with a checkpoint", add_generate_arguments, run_generate),
    ("plot", "attention heatmaps (or --positional) of a checkpoint", add_plot_arguments, run_plot),
    ("bench", "time qkv's attention backends against torch SDPA", add_bench_arguments, _cmd_bench),
)


def build_parser() -> argparse.ArgumentParser:
    """The parser for every subcommand."""
    parser = argparse.ArgumentParser(prog="qkv", description="Transformer attention you can trust")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text, add_arguments, handler in _COMMANDS:
        command = sub.add_parser(name, help=help_text)
        add_arguments(command)
        command.set_defaults(func=handler)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``qkv`` script.

    Returns:
        The exit code: 0, or 2 after printing a ``ValueError``/``TypeError`` as ``qkv CMD:
        error: ...``.
    """
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (ValueError, TypeError) as err:
        print(f"qkv {args.command}: error: {err}")
        return 2
