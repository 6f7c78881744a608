"""``qkv`` command line: every argparse definition of the package is in this file; each
subcommand's handler calls an importable function."""

from __future__ import annotations

import argparse
import importlib.metadata
import itertools
import os
import re
import signal
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import fields
from pathlib import Path

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
from qkv.apps.viz import DEFAULT_PNG, KINDS, run_plot
from qkv.functional import BACKENDS
from qkv.train.config import POSITIONALS, SCHEDULES, TASKS, TrainConfig

__all__ = [
    "add_generate_arguments",
    "add_plot_arguments",
    "add_train_arguments",
    "build_parser",
    "main",
]

# The help of each TrainConfig field is its line in TrainConfig's docstring (one source).
_FIELD_DOC = re.compile(r"^ {8}(\w+): (.+?)(?=^ {8}\w+: |^\s*$)", re.M | re.S)
_TRAIN_HELP = {
    name: " ".join(text.split()).rstrip(".").replace("``", "")
    for name, text in _FIELD_DOC.findall((TrainConfig.__doc__ or "").split("Attributes:")[1])
}
_CHOICES: dict[str, tuple[str, ...]] = {
    "task": TASKS,
    "schedule": SCHEDULES,
    "positional": POSITIONALS,
}
# The largest --length of `qkv plot --positional`: a table of more rows is no picture.
MAX_PLOT_POSITIONS = 100_000

# Measured on the 2-core machine shared with other jobs: the default reverse model trains 7-15x
# faster on 1 thread than on 2 (tiny matmuls gain nothing from intra-op threads and lose to
# their synchronisation). Scale out with torchrun processes instead.
_THREADS_HELP = "torch CPU threads per process (1 is fastest for these small models)"


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


def _int_at_least(lowest: int, highest: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an int, got {text!r}") from None
        if value < lowest or (highest is not None and value > highest):
            bound = f">= {lowest}" if highest is None else f"in [{lowest}, {highest}]"
            raise argparse.ArgumentTypeError(f"expected an int {bound}, got {value}")
        return value

    parse.__name__ = f"int >= {lowest}"
    return parse


_positive = _int_at_least(1)
_nonnegative = _int_at_least(0)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text}")
    return value


def _unit_interval(text: str) -> float:
    value = _positive_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text}")
    return value


def _accuracy(text: str) -> float:
    value = _positive_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {text}")
    return value


def _text_file(text: str) -> str:
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory, expected a UTF-8 text file")
    if path.is_symlink() and not path.exists():
        raise argparse.ArgumentTypeError(f"{text} is a dangling symbolic link")
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"no such file: {text}")
    return text


def _kind(text: str) -> str:
    """``encoder-self`` (or the old ``"encoder self"``) -> the plot's kind name."""
    for kind in KINDS:
        if text in (kind, kind.replace(" ", "-")):
            return kind
    raise argparse.ArgumentTypeError(
        f"expected one of {', '.join(k.replace(' ', '-') for k in KINDS)}, got {text!r}"
    )


def _hidden_alias(p: argparse.ArgumentParser, flag: str, dest: str, **kwargs: object) -> None:
    """An old spelling that still parses but is not shown in ``--help``."""
    p.add_argument(flag, dest=dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kwargs)  # type: ignore[arg-type]


def _add_threads(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=_positive, default=1, help=_THREADS_HELP)


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    """``qkv demo [--seed N]``."""
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")


# new flag, old (hidden) spelling, dest, default, help
_SHAPE_FLAGS = (
    ("--batch", "--B", "B", 2, "batch size B"),
    ("--heads", "--H", "H", 4, "attention heads H"),
    ("--query-len", "--T", "T", 3, "query length T"),
    ("--key-len", "--S", "S", 5, "key length S"),
    ("--head-dim", "--Dh", "Dh", 8, "query/key width per head Dh"),
    ("--value-dim", "--Dv", "Dv", 6, "value width per head Dv (attention only)"),
)


def add_shapes_arguments(p: argparse.ArgumentParser) -> None:
    """``qkv shapes [--batch N] [--heads N] ... [--model [--layers N]]``."""
    for flag, old, dest, default, help_text in _SHAPE_FLAGS:
        p.add_argument(flag, dest=dest, type=_positive, default=default, help=help_text)
        _hidden_alias(p, old, dest, type=_positive)
    p.add_argument(
        "--model", action="store_true", help="trace a small encoder-decoder Transformer instead"
    )
    p.add_argument("--layers", type=_positive, default=2, help="layers per stack with --model")


def add_embed_arguments(p: argparse.ArgumentParser) -> None:
    """``qkv embed [SENTENCE...] [--input FILE|-] [--top-k K | --embeddings] [--model DIR]
    [--backend NAME] [--batch-size N]``."""
    p.add_argument("sentences", nargs="*", help="the sentences to embed")
    p.add_argument(
        "-i",
        "--input",
        metavar="FILE",
        default=None,
        help="read the sentences from FILE, one per line (UTF-8; '-' for standard input)",
    )
    shown = p.add_mutually_exclusive_group()
    shown.add_argument(
        "--top-k",
        metavar="K",
        type=_positive,
        default=None,
        help="print each sentence's K most similar others instead of the similarity matrix",
    )
    shown.add_argument(
        "--embeddings",
        action="store_true",
        help="print one line of embedding values per sentence (memory of one batch)",
    )
    p.add_argument(
        "--model", default=None, help="BERT checkpoint directory (default: all-MiniLM-L6-v2)"
    )
    p.add_argument("--backend", default="auto", choices=BACKENDS, help="attention backend")
    p.add_argument("--batch-size", type=_positive, default=32, help="sentences per forward pass")


def add_doctor_arguments(p: argparse.ArgumentParser) -> None:
    """``qkv doctor DIR --text TEXT... [--examine] [--json] [--html OUT --capture PATTERN]``."""
    p.add_argument("directory", help="a Hugging Face save_pretrained directory")
    p.add_argument("--text", action="append", default=[], help="a text to run (repeatable)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument(
        "--examine",
        action="store_true",
        help="also examine the model's invariances on the texts (exit 1 on a failure)",
    )
    p.add_argument("--html", default=None, metavar="OUT", help="write captured attention here")
    p.add_argument(
        "--capture",
        default=None,
        metavar="PATTERN",
        help="regular expression of module paths whose attention to record",
    )
    p.add_argument(
        "--attn-implementation",
        default=None,
        help="transformers attention implementation (default: the model's)",
    )


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    """One ``--flag`` per :class:`~qkv.train.config.TrainConfig` field, plus the run options."""
    for f in fields(TrainConfig):
        if f.name == "text_path":
            p.add_argument(
                "--text",
                dest="text_path",
                metavar="FILE",
                type=_text_file,
                default=None,
                help="UTF-8 file: character-level language model (implies --task text)",
            )
            continue
        p.add_argument(
            "--" + f.name.replace("_", "-"),
            dest=f.name,
            default=f.default,
            type=type(f.default),
            choices=_CHOICES.get(f.name),
            help=_TRAIN_HELP[f.name],
        )
    p.add_argument("--out", default=None, help="checkpoint directory (default: runs/TASK)")
    p.add_argument("--resume", action="store_true", help="continue the checkpoint in --out")
    p.add_argument("--overwrite", action="store_true", help="replace a checkpoint in --out")
    p.add_argument(
        "--save-every",
        type=_nonnegative,
        default=0,
        help="also checkpoint every N steps (0: only at the end)",
    )
    p.add_argument(
        "--stop-after",
        type=_positive,
        help="stop (and save) at this step; the schedule spans --steps",
    )
    p.add_argument(
        "--target-accuracy",
        type=_accuracy,
        help="stop at the first evaluation reaching this held-out accuracy, in (0, 1]",
    )
    _add_threads(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    """``qkv generate CHECKPOINT INPUT [--beam N] ...``."""
    p.add_argument(
        "checkpoint",
        help="checkpoint directory (from qkv train), or a Hugging Face save_pretrained directory "
        "of a llama / qwen2 / mistral / gpt2 decoder (config.json + safetensors)",
    )
    p.add_argument(
        "input",
        help="the input sequence (or the prompt of a text model); for a Hugging Face directory "
        "the prompt text, encoded with its tokenizer.json, or space-separated token ids when it "
        'has none ("1 15 7")',
    )
    p.add_argument("--beam", type=_positive, default=1, help="beam width (1: greedy)")
    p.add_argument(
        "--max-new-tokens",
        type=_positive,
        default=None,
        help="most tokens to generate (default: the task's longest output; 32 for a Hugging "
        "Face directory)",
    )
    p.add_argument("--sample", action="store_true", help="text models: sample, not argmax")
    p.add_argument("--temperature", type=_positive_float, default=1.0, help="--sample: temperature")
    p.add_argument(
        "--top-k", type=_positive, default=None, help="--sample: only the k likeliest tokens"
    )
    p.add_argument("--seed", type=int, default=0, help="--sample: seed of the sampler")
    p.add_argument(
        "--top-p",
        type=_unit_interval,
        default=None,
        help="--sample: only the likeliest tokens whose probabilities sum to P, in (0, 1]",
    )
    p.add_argument(
        "--min-p",
        type=_unit_interval,
        default=None,
        help="--sample: only tokens at least P times as likely as the likeliest, in (0, 1]",
    )
    p.add_argument(
        "--repetition-penalty",
        type=_positive_float,
        default=1.0,
        help="text models: divide (or, when negative, multiply) the logit of every token "
        "already in the text by this (> 0; 1: none)",
    )
    p.add_argument(
        "--eos-id",
        type=_int_at_least(0),
        action="append",
        default=None,
        metavar="ID",
        help="text models: stop at this token id (repeatable; default: the model's own)",
    )
    p.add_argument(
        "--min-new-tokens",
        type=_int_at_least(0),
        default=0,
        help="text models: do not stop before this many tokens",
    )
    _add_threads(p)


def add_plot_arguments(p: argparse.ArgumentParser) -> None:
    """``qkv plot CHECKPOINT INPUT [-o attn.png] [--html attn.html]`` or
    ``qkv plot CHECKPOINT --positional``."""
    p.add_argument("checkpoint", help="checkpoint directory (from qkv train)")
    p.add_argument("input", nargs="?", default=None, help="the input to decode and look at")
    p.add_argument(
        "-o",
        "--output",
        default=None,
        help=f"PNG path (default: {DEFAULT_PNG}; with --html, a PNG only when -o is given)",
    )
    p.add_argument(
        "--html",
        metavar="FILE",
        default=None,
        help="write one self-contained interactive page (no server, no network): pick kind, "
        "layer and head, hover a cell for its query token, key token and weight",
    )
    p.add_argument(
        "--kind",
        action="append",
        type=_kind,
        metavar="{" + ",".join(k.replace(" ", "-") for k in KINDS) + "}",
        help="only these attention kinds (repeatable; default: all)",
    )
    p.add_argument(
        "--positional", action="store_true", help="plot the sinusoidal positional encoding instead"
    )
    p.add_argument(
        "--length",
        type=_int_at_least(1, MAX_PLOT_POSITIONS),
        help="--positional: positions to draw (default: the model's max_positions)",
    )
    _add_threads(p)


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
        embedder = SentenceEmbedder(args.model, backend=args.backend, batch_size=args.batch_size)
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
    print(format_embed(embed(items, args.model, backend=args.backend)))
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
