"""What ``qkv train`` and ``qkv generate`` run: set up, call the library, print.

Each ``run_*`` function takes the ``argparse.Namespace`` that :mod:`qkv.apps.cli` parsed and
returns an exit code; the work itself lives in importable functions
(:func:`qkv.train.loop.train`, :func:`qkv.train.inference.generate_text`).
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path

import torch

from qkv.train.config import TrainConfig
from qkv.train.inference import (
    Generation,
    checkpoint_kind,
    generate_hf,
    generate_text,
    load_hf_decoder,
    load_trained,
)
from qkv.train.loop import RunOptions, train
from qkv.train.task import SamplingKwargs

__all__ = ["resume_command", "run_generate", "run_train"]


def resume_command(cfg: TrainConfig, out: Path) -> str:
    """The ``qkv train`` command line that continues ``cfg``'s run from ``out``: every field
    that differs from its default as a flag, then ``--out OUT --resume``."""
    flags = []
    for f in fields(TrainConfig):
        value = getattr(cfg, f.name)
        if value == f.default or (f.name == "task" and cfg.text_path is not None):
            continue
        flag = "--text" if f.name == "text_path" else "--" + f.name.replace("_", "-")
        flags += [flag, str(value)]
    return shlex.join(["qkv", "train", *flags, "--out", str(out), "--resume"])


def run_train(args: argparse.Namespace) -> int:
    """``qkv train``: train, checkpoint, print a summary (rank 0 only)."""
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
        context_parallel=args.context_parallel,
        context_layout=args.context_layout,
    )
    result = train(cfg, opts)
    # the shell's convention: 130 after SIGINT, 143 after SIGTERM
    code = 0 if result.stopped_by is None else 128 + result.stopped_by
    if int(os.environ.get("RANK", "0")) != 0:
        return code
    world = int(os.environ.get("WORLD_SIZE", "1"))
    counted = "non-padding tokens" if cfg.task == "text" else "non-padding source + target"
    shared = "" if opts.context_parallel == 1 else f", {opts.context_parallel} per sequence"
    print(
        f"trained to step {result.step}/{cfg.steps} in {result.seconds:.1f} s on {world} "
        f"process(es){shared}, {result.tokens_per_s:,.0f} tokens/s ({counted})"
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
    if result.stopped_by is not None:
        name = signal.Signals(result.stopped_by).name
        saved = (
            f"checkpoint of step {result.step} saved in {out}; continue with: "
            f"{resume_command(cfg, out)}"
            if result.checkpoint is not None
            else "nothing was saved"
        )
        print(f"qkv train: stopped by {name} after step {result.step}; {saved}", file=sys.stderr)
    return code


def _sampling(args: argparse.Namespace) -> SamplingKwargs:
    """The decoding options ``qkv generate`` was given, for either kind of checkpoint."""
    return {
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "greedy": not args.sample,
        "seed": args.seed,
        "top_p": args.top_p,
        "min_p": args.min_p,
        "repetition_penalty": args.repetition_penalty,
        "eos_ids": None if args.eos_id is None else tuple(args.eos_id),
        "min_new_tokens": args.min_new_tokens,
    }


def _print_piece(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _warm_then_time(run: Callable[[], Generation]) -> Generation:
    run()  # warm-up: one-off first-call costs stay out of the timed run
    return run()


def _generate_qkv(args: argparse.Namespace) -> Generation:
    model, task, _ = load_trained(args.checkpoint)
    sampling = _sampling(args)
    return _warm_then_time(
        lambda: generate_text(model, task, args.input, beam_size=args.beam, **sampling)
    )


def _generate_hf(args: argparse.Namespace) -> Generation:
    """Decode once unprinted (the one-off first-call costs: 2 new tokens, or all of them with
    ``--compile``, whose step is compiled for the cache's capacity), then the timed run: its
    tokens streamed to the terminal as they come (beam search: its text at the end)."""
    model, tokenizer = load_hf_decoder(args.checkpoint)
    sampling = _sampling(args)
    how = {"beam_size": args.beam, "compile": args.compile}
    # the compiled step is specialised to the cache capacity: warm it up at the real length
    warm: SamplingKwargs = {**sampling, "min_new_tokens": 0}
    if not args.compile:
        warm["max_new_tokens"] = 2
    generate_hf(model, tokenizer, args.input, **how, **warm)
    gen = generate_hf(model, tokenizer, args.input, on_text=_print_piece, **how, **sampling)
    print()
    return gen


def run_generate(args: argparse.Namespace) -> int:
    """``qkv generate``: print the decoded output and tokens/s (timed after one untimed warm-up
    decode, so the speed is the steady state rather than one-off first-call costs). The
    checkpoint is a qkv checkpoint or a Hugging Face decoder directory (:func:`checkpoint_kind`).
    Without ``--threads`` a qkv checkpoint decodes on one thread and a Hugging Face directory on
    torch's own count (see ``cli_args``)."""
    hf = checkpoint_kind(args.checkpoint) == "hf"
    if args.threads is not None or not hf:
        torch.set_num_threads(1 if args.threads is None else args.threads)
    if hf:
        gen = _generate_hf(args)  # streamed as it came
    elif args.compile:
        raise ValueError(
            "--compile decodes a Hugging Face decoder directory (a static KV cache); "
            f"{args.checkpoint!r} is a qkv checkpoint"
        )
    else:
        gen = _generate_qkv(args)
        print(gen.text)
    mode = f"beam {args.beam}" if args.beam > 1 else ("sampled" if args.sample else "greedy")
    cache = "static KV cache, compiled step" if args.compile else "KV cache"
    if not hf:
        how = "timed after a warm-up run"
    elif args.compile:
        how = "streamed, timed after a warm-up run of the same length that compiled the step"
    elif args.beam > 1:
        how = "printed at the end, timed after a 2-token warm-up run"
    else:
        how = "streamed, timed after a 2-token warm-up run"
    threads = torch.get_num_threads()
    print(
        f"{len(gen.ids)} tokens in {gen.seconds * 1e3:.1f} ms ({gen.tokens_per_s:,.0f} tokens/s,"
        f" {mode}, {cache}, {how}, {threads} thread{'s' * (threads > 1)})"
    )
    return 0
