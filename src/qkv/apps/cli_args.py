"""The options of each ``qkv`` subcommand: one ``add_*_arguments`` function per subcommand
(the parser and the dispatch are in :mod:`qkv.apps.cli`, the value types in
:mod:`qkv.apps.cli_types`)."""

from __future__ import annotations

import argparse
import re
from dataclasses import fields

from qkv.apps.cli_types import (
    accuracy,
    int_at_least,
    nonnegative,
    plot_kind,
    positive,
    positive_float,
    text_file,
    unit_interval,
)
from qkv.apps.viz import DEFAULT_PNG, KINDS
from qkv.distributed import LAYOUTS
from qkv.functional import BACKENDS
from qkv.train.config import POSITIONALS, SCHEDULES, TASKS, TrainConfig

__all__ = [
    "MAX_PLOT_POSITIONS",
    "add_demo_arguments",
    "add_doctor_arguments",
    "add_embed_arguments",
    "add_generate_arguments",
    "add_plot_arguments",
    "add_shapes_arguments",
    "add_train_arguments",
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
# A Hugging Face checkpoint is another matter: decoding reads every weight once a token, and one
# core reads memory slower than all of them. GPT-2 small through `qkv generate DIR --compile` on
# the 2-core Zen 4 EPYC (2026-12-08, 64 tokens, three runs each in turns): 55 / 55 / 53 tokens/s
# on 2 threads against 50 / 47 / 41 on 1 (eagerly 23-24 on both).
_GENERATE_THREADS_HELP = (
    "torch CPU threads per process (default: 1 for a qkv checkpoint, whose small models are "
    "fastest on one; torch's own, one a core, for a Hugging Face directory)"
)


def _hidden_alias(p: argparse.ArgumentParser, flag: str, dest: str, **kwargs: object) -> None:
    """An old spelling that still parses but is not shown in ``--help``."""
    p.add_argument(flag, dest=dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kwargs)  # type: ignore[arg-type]


def _add_threads(p: argparse.ArgumentParser, default: int | None = 1, text: str = "") -> None:
    p.add_argument("--threads", type=positive, default=default, help=text or _THREADS_HELP)


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
        p.add_argument(flag, dest=dest, type=positive, default=default, help=help_text)
        _hidden_alias(p, old, dest, type=positive)
    p.add_argument(
        "--model", action="store_true", help="trace a small encoder-decoder Transformer instead"
    )
    p.add_argument("--layers", type=positive, default=2, help="layers per stack with --model")


def add_embed_arguments(p: argparse.ArgumentParser) -> None:
    """``qkv embed [SENTENCE...] [--input FILE|-] [--top-k K | --embeddings] [--model DIR]
    [--backend NAME] [--batch-size N] [--compile]``."""
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
        type=positive,
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
    p.add_argument("--batch-size", type=positive, default=32, help="sentences per forward pass")
    p.add_argument(
        "--compile",
        action="store_true",
        help="run one torch.compile graph (faster per call; the first calls compile, ~20-40 s)",
    )


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
                type=text_file,
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
        type=nonnegative,
        default=0,
        help="also checkpoint every N steps (0: only at the end)",
    )
    p.add_argument(
        "--stop-after",
        type=positive,
        help="stop (and save) at this step; the schedule spans --steps",
    )
    p.add_argument(
        "--target-accuracy",
        type=accuracy,
        help="stop at the first evaluation reaching this held-out accuracy, in (0, 1]",
    )
    p.add_argument(
        "--context-parallel",
        type=positive,
        default=1,
        metavar="N",
        help="under torchrun: N processes share each sequence, each holding a shard of it "
        "(N must divide the processes; the rest is data parallelism); the step equals one "
        "process on the whole batch. Needs --dropout 0 and absolute or rotary positions",
    )
    p.add_argument(
        "--context-layout",
        default="zigzag",
        choices=LAYOUTS,
        help="how --context-parallel cuts a sequence: zigzag (balances causal work) or contiguous",
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
    p.add_argument(
        "--beam",
        type=positive,
        default=1,
        help="beam width (1: greedy; a Hugging Face directory: with --max-new-tokens and "
        "--eos-id only)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="Hugging Face directory: decode on a static KV cache with the step compiled "
        "(torch.compile; the untimed warm-up run pays the compilation, tens of seconds on a CPU)",
    )
    p.add_argument(
        "--max-new-tokens",
        type=positive,
        default=None,
        help="most tokens to generate (default: the task's longest output; 32 for a Hugging "
        "Face directory)",
    )
    p.add_argument("--sample", action="store_true", help="text models: sample, not argmax")
    p.add_argument("--temperature", type=positive_float, default=1.0, help="--sample: temperature")
    p.add_argument(
        "--top-k", type=positive, default=None, help="--sample: only the k likeliest tokens"
    )
    p.add_argument("--seed", type=int, default=0, help="--sample: seed of the sampler")
    p.add_argument(
        "--top-p",
        type=unit_interval,
        default=None,
        help="--sample: only the likeliest tokens whose probabilities sum to P, in (0, 1]",
    )
    p.add_argument(
        "--min-p",
        type=unit_interval,
        default=None,
        help="--sample: only tokens at least P times as likely as the likeliest, in (0, 1]",
    )
    p.add_argument(
        "--repetition-penalty",
        type=positive_float,
        default=1.0,
        help="text models: divide (or, when negative, multiply) the logit of every token "
        "already in the text by this (> 0; 1: none)",
    )
    p.add_argument(
        "--eos-id",
        type=int_at_least(0),
        action="append",
        default=None,
        metavar="ID",
        help="text models: stop at this token id (repeatable; default: the model's own)",
    )
    p.add_argument(
        "--min-new-tokens",
        type=int_at_least(0),
        default=0,
        help="text models: do not stop before this many tokens",
    )
    _add_threads(p, default=None, text=_GENERATE_THREADS_HELP)  # None: by the checkpoint's kind


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
        type=plot_kind,
        metavar="{" + ",".join(k.replace(" ", "-") for k in KINDS) + "}",
        help="only these attention kinds (repeatable; default: all)",
    )
    p.add_argument(
        "--positional", action="store_true", help="plot the sinusoidal positional encoding instead"
    )
    p.add_argument(
        "--length",
        type=int_at_least(1, MAX_PLOT_POSITIONS),
        help="--positional: positions to draw (default: the model's max_positions)",
    )
    _add_threads(p)
