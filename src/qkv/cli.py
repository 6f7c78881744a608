"""``qkv`` command line: a thin argparse front; every subcommand calls an importable function."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

__all__ = ["build_parser", "main"]


def _cmd_demo(args: argparse.Namespace) -> int:
    from qkv.demo import print_demo, run_demo

    print_demo(run_demo(seed=args.seed))
    return 0


def _cmd_shapes(args: argparse.Namespace) -> int:
    from qkv.shapes import trace_attention_shapes

    rows = trace_attention_shapes(args.B, args.H, args.T, args.S, args.Dh, args.Dv)
    width = max(len(name) for name, _ in rows)
    for name, shape in rows:
        print(f"{name:<{width}}  {list(shape)}")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from qkv.bench import run_from_args

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
    shapes.set_defaults(func=_cmd_shapes)

    bench = sub.add_parser("bench", help="time qkv's attention backends against torch SDPA")
    from qkv.bench import add_arguments

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
