"""``qkv`` command line: a thin argparse front; every subcommand calls an importable function."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

__all__ = ["build_parser", "main"]


def _cmd_demo(args: argparse.Namespace) -> int:
    from qkv.apps.demo import print_demo, run_demo

    print_demo(run_demo(seed=args.seed))
    return 0


def _cmd_shapes_model(args: argparse.Namespace) -> int:
    from qkv.apps.shapes import trace_model_shapes

    rows = trace_model_shapes(args.B, args.S, args.T, args.H, args.Dh, num_layers=args.layers)
    width = max(len(name) for name, _, _ in rows)
    for name, inputs, out in rows:
        ins = "  ".join(f"{k} {list(v)}" for k, v in inputs)
        print(f"{name:<{width}}  {ins}  ->  {list(out)}")
    return 0


def _cmd_shapes(args: argparse.Namespace) -> int:
    from qkv.apps.shapes import trace_attention_shapes

    if args.model:
        return _cmd_shapes_model(args)
    rows = trace_attention_shapes(args.B, args.H, args.T, args.S, args.Dh, args.Dv)
    width = max(len(name) for name, _ in rows)
    for name, shape in rows:
        print(f"{name:<{width}}  {list(shape)}")
    return 0


def _cmd_embed(args: argparse.Namespace) -> int:
    from qkv.apps.embed import embed, format_embed

    try:
        result = embed(args.sentences, args.model, backend=args.backend)
    except FileNotFoundError as err:
        print(f"qkv embed: error: {err}")
        return 2
    print(format_embed(result))
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from qkv.apps.train_command import run_train

    return run_train(args)


def _cmd_generate(args: argparse.Namespace) -> int:
    from qkv.apps.train_command import run_generate

    return run_generate(args)


def _cmd_plot(args: argparse.Namespace) -> int:
    from qkv.apps.train_command import run_plot

    return run_plot(args)


def _cmd_bench(args: argparse.Namespace) -> int:
    from qkv.apps.bench import run_from_args

    return run_from_args(args)


def build_parser() -> argparse.ArgumentParser:
    """The parser for every subcommand."""
    parser = argparse.ArgumentParser(prog="qkv", description="Transformer attention you can trust")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="masked multi-head attention, checked against PyTorch")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=_cmd_demo)

    shapes = sub.add_parser("shapes", help="print the shape of every attention intermediate")
    for name, default in (("B", 2), ("H", 4), ("T", 3), ("S", 5), ("Dh", 8), ("Dv", 6)):
        shapes.add_argument(f"--{name}", type=int, default=default)
    shapes.add_argument(
        "--model", action="store_true", help="trace a small encoder-decoder Transformer instead"
    )
    shapes.add_argument("--layers", type=int, default=2, help="layers per stack with --model")
    shapes.set_defaults(func=_cmd_shapes)

    emb = sub.add_parser("embed", help="sentence embeddings and their cosine similarities")
    emb.add_argument("sentences", nargs="+", help="the sentences to embed")
    emb.add_argument("--model", default=None, help="BERT checkpoint directory (default MiniLM)")
    emb.add_argument("--backend", default="auto", help="attention backend")
    emb.set_defaults(func=_cmd_embed)

    from qkv.apps.train_command import (
        add_generate_arguments,
        add_plot_arguments,
        add_train_arguments,
    )

    train = sub.add_parser("train", help="train a model on a built-in task (torchrun-ready)")
    add_train_arguments(train)
    train.set_defaults(func=_cmd_train)

    generate = sub.add_parser("generate", help="decode an input with a checkpoint")
    add_generate_arguments(generate)
    generate.set_defaults(func=_cmd_generate)

    plot = sub.add_parser("plot", help="attention heatmaps (or --positional) of a checkpoint")
    add_plot_arguments(plot)
    plot.set_defaults(func=_cmd_plot)

    bench = sub.add_parser("bench", help="time qkv's attention backends against torch SDPA")
    from qkv.apps.bench import add_arguments

    add_arguments(bench)
    bench.set_defaults(func=_cmd_bench)

    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``qkv`` script."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (ValueError, TypeError) as err:
        print(f"qkv {args.command}: error: {err}")
        return 2
