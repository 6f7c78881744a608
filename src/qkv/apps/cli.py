"""``qkv`` command line: the parser, its subcommands and the dispatch to their handlers, each of
which calls an importable function. Every argparse definition of the package is here or in
:mod:`qkv.apps.cli_args` (each subcommand's options) with :mod:`qkv.apps.cli_types` (their value
types)."""

from __future__ import annotations

import argparse
import importlib.metadata
import itertools
import os
import signal
import sys
from collections.abc import Callable, Iterable, Sequence

from qkv.apps.cli_args import (
    MAX_PLOT_POSITIONS,
    add_demo_arguments,
    add_doctor_arguments,
    add_embed_arguments,
    add_generate_arguments,
    add_plot_arguments,
    add_shapes_arguments,
    add_train_arguments,
)
from qkv.apps.demo import print_demo, run_demo
from qkv.apps.doctor import run_doctor
from qkv.apps.embed import SentenceEmbedder, embed, format_embed
from qkv.apps.embed_many import (
    MAX_MATRIX,
    check_text,
    read_lines,
    write_embeddings,
    write_neighbours,
)
from qkv.apps.shapes import trace_attention_shapes, trace_model_shapes
from qkv.apps.training import run_generate, run_train
from qkv.apps.viz import run_plot

__all__ = [
    "MAX_PLOT_POSITIONS",
    "add_demo_arguments",
    "add_doctor_arguments",
    "add_embed_arguments",
    "add_generate_arguments",
    "add_plot_arguments",
    "add_shapes_arguments",
    "add_train_arguments",
    "build_parser",
    "main",
]


class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line on stderr (exit 2), no usage dump."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Defaults shown after every help line that has one; the epilog's examples as written."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default is None or action.default is False or action.default == argparse.SUPPRESS:
            return text
        if "%(default)" in text:
            return text
        return f"{text} (default: %(default)s)"


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
    if args.sentences and args.input is not None:
        raise ValueError("give sentences as arguments or --input FILE, not both")
    if not args.sentences and args.input is None:
        raise ValueError("give sentences as arguments, or --input FILE ('-': standard input)")
    for i, text in enumerate(args.sentences):
        check_text(text, f"sentence argument {i + 1}")
    sentences: Iterable[str] = args.sentences or read_lines(args.input)
    total = len(args.sentences) or None
    if args.embeddings or args.top_k is not None:
        embedder = SentenceEmbedder(
            args.model, backend=args.backend, batch_size=args.batch_size, compile=args.compile
        )
        if args.embeddings:
            write_embeddings(embedder, sentences, sys.stdout, total)
        else:
            write_neighbours(embedder, sentences, args.top_k, sys.stdout, total)
        return 0
    items = list(itertools.islice(sentences, MAX_MATRIX + 1))
    if len(items) > MAX_MATRIX:
        raise ValueError(
            f"more than {MAX_MATRIX} sentences: their similarity matrix would be N x N numbers; "
            "print each one's nearest with --top-k K, or the vectors with --embeddings"
        )
    print(format_embed(embed(items, args.model, backend=args.backend, compile=args.compile)))
    return 0


_Adder = Callable[[argparse.ArgumentParser], None]
_Handler = Callable[[argparse.Namespace], int]

# name, one-line description, an example, the arguments, the handler
_COMMANDS: tuple[tuple[str, str, str, _Adder, _Handler], ...] = (
    (
        "demo",
        "masked multi-head attention, checked against PyTorch",
        "qkv demo --seed 1",
        add_demo_arguments,
        _cmd_demo,
    ),
    (
        "shapes",
        "print the shape of every attention intermediate",
        "qkv shapes --batch 2 --heads 4 --query-len 3 --key-len 5\n  qkv shapes --model",
        add_shapes_arguments,
        _cmd_shapes,
    ),
    (
        "embed",
        "sentence embeddings: their cosine similarities, nearest neighbours or values",
        'qkv embed "A cat sits." "A dog runs." --backend blockwise\n'
        "  qkv embed --input sentences.txt --top-k 5\n"
        "  cat sentences.txt | qkv embed --input - --embeddings > vectors.txt",
        add_embed_arguments,
        _cmd_embed,
    ),
    (
        "doctor",
        "find silent attention bugs in a Hugging Face model (exit 1 on an error)",
        'qkv doctor path/to/save_pretrained_model --text "Hello there" --text "Hi"',
        add_doctor_arguments,
        run_doctor,
    ),
    (
        "train",
        "train a model on a built-in task (torchrun-ready; Ctrl-C saves a resumable checkpoint)",
        "qkv train --task reverse --steps 300 --out runs/reverse\n"
        "  qkv train --task reverse --steps 600 --out runs/reverse --resume",
        add_train_arguments,
        run_train,
    ),
    (
        "generate",
        "decode an input with a checkpoint (or a Hugging Face decoder directory)",
        'qkv generate runs/reverse "abcdefg" --beam 3\n'
        '  qkv generate path/to/save_pretrained_llama "Once upon a time"',
        add_generate_arguments,
        run_generate,
    ),
    (
        "plot",
        "attention heatmaps (or --positional) of a checkpoint",
        'qkv plot runs/reverse "abcdefgh" -o attention.png --kind cross\n'
        '  qkv plot runs/reverse "abcdefgh" --html attention.html',
        add_plot_arguments,
        run_plot,
    ),
)


_MOVED = {
    "bench": "the attention benchmark is a script of the repository now, not a subcommand: "
    "run python benchmarks/attention.py (same options)",
}
"""Subcommands that left the package -> where they went (one line, exit 2)."""


def _version() -> str:
    try:
        return importlib.metadata.version("qkv")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - not installed
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    """The parser for every subcommand."""
    parser = _Parser(
        prog="qkv",
        description="Transformer attention you can trust",
        epilog="Run `qkv COMMAND --help` for a command's flags and an example.",
    )
    parser.add_argument("--version", action="version", version=f"qkv {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, help_text, example, add_arguments, handler in _COMMANDS:
        command = sub.add_parser(
            name,
            help=help_text,
            description=help_text,
            epilog=f"example:\n  {example}",
            formatter_class=_Formatter,
        )
        add_arguments(command)
        command.set_defaults(func=handler)
    return parser


def _fail(command: str, message: str, code: int = 2) -> int:
    print(f"qkv {command}: error: {' '.join(message.split())}", file=sys.stderr)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``qkv`` script.

    Returns:
        The exit code: 0; 2 after printing an error (bad input, a file that cannot be read or
        written, a checkpoint that cannot be trusted, a subcommand that left the package such as
        ``bench``) as one line ``qkv CMD: error: ...`` on
        stderr, never a traceback; 130 / 143 after a training run stopped by SIGINT / SIGTERM
        (it saves first, or not after a second signal, which exits 128 + that signal too);
        130 for Ctrl-C elsewhere; 141 when stdout is a closed pipe
        (``qkv ... | head``).
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] and argv[0] in _MOVED:
        return _fail(argv[0], _MOVED[argv[0]])
    args = build_parser().parse_args(argv)
    try:
        code = int(args.func(args))
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
        return code
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # nothing more to flush at exit
        return 141
    except KeyboardInterrupt as err:
        # 128 + the signal: a training run's second SIGTERM is 143, Ctrl-C 130
        signum = int(getattr(err, "signum", signal.SIGINT))
        return _fail(args.command, f"interrupted ({signal.Signals(signum).name})", 128 + signum)
    except (ValueError, TypeError) as err:
        return _fail(args.command, str(err))
    except OSError as err:
        return _fail(args.command, f"{err.strerror or err}: {err.filename or ''}".rstrip(": "))
