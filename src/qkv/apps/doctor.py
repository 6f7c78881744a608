"""``qkv doctor DIR --text ...``: watch a saved ``transformers`` model's attention on some texts.

With ``--examine`` the model's invariances are examined on the same texts too
(:func:`qkv.doctor.examine_texts`).

The directory is loaded with ``transformers`` (its tokenizer too); the texts run as a
left-padded and a right-padded batch, and causal LMs and encoder-decoders take one cached step
after each, all inside :func:`qkv.doctor.watch`. The table (or ``--json``) is printed; the exit
code is 1 when an error was found, else 0.
"""

from __future__ import annotations

import argparse
import inspect
import json
from pathlib import Path
from typing import Any

import torch

from qkv.doctor import Report, examine_texts, watch

__all__ = ["load_for_doctor", "run_doctor", "run_texts"]


def load_for_doctor(directory: str, attn_implementation: str | None = None) -> tuple[Any, Any]:
    """A ``save_pretrained`` directory as ``(model in eval mode, tokenizer)``.

    Raises:
        ValueError: not a directory, no ``config.json``, or ``transformers`` cannot load it
            (the message says which).
    """
    path = Path(directory)
    if not path.is_dir():
        raise ValueError(f"{directory!r} is not a directory")
    if not (path / "config.json").is_file():
        raise ValueError(f"{directory!r} holds no config.json: not a save_pretrained model")
    # transformers is a dev dependency of qkv: loaded only by this command
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(path)
        kwargs: dict[str, Any] = {}
        if attn_implementation is not None:
            kwargs["attn_implementation"] = attn_implementation
        if getattr(config, "is_encoder_decoder", False):
            auto: Any = transformers.AutoModelForSeq2SeqLM
        elif any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in config.architectures or []):
            auto = transformers.AutoModelForCausalLM
        else:
            auto = transformers.AutoModel
        model = auto.from_pretrained(path, **kwargs).eval()
        tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, KeyError) as err:
        raise ValueError(f"transformers cannot load {directory!r}: {err}") from err
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    return model, tokenizer


def _forward(model: Any, inputs: dict[str, torch.Tensor]) -> None:
    """One forward of the padded batch, then one cached step where the model has a cache."""
    config = model.config
    B = inputs["input_ids"].shape[0]
    if getattr(config, "is_encoder_decoder", False):
        start = config.decoder_start_token_id
        start = config.pad_token_id if start is None else start
        dec = torch.full((B, 1), int(start), dtype=torch.long)
        out = model(**inputs, decoder_input_ids=dec, use_cache=True)
        model(
            **inputs,
            decoder_input_ids=out.logits[:, -1:].argmax(-1),
            past_key_values=out.past_key_values,
            use_cache=True,
        )
        return
    takes_cache = "use_cache" in inspect.signature(model.forward).parameters
    out = model(**inputs, use_cache=True) if takes_cache else model(**inputs)
    past = getattr(out, "past_key_values", None)
    logits = getattr(out, "logits", None)
    if past is None or logits is None:
        return
    step_mask = torch.cat([inputs["attention_mask"], inputs["attention_mask"].new_ones(B, 1)], 1)
    model(
        input_ids=logits[:, -1:].argmax(-1),
        attention_mask=step_mask,
        past_key_values=past,
        use_cache=True,
    )


def run_texts(
    model: Any, tokenizer: Any, texts: list[str], capture: str | None = None
) -> tuple[Report, list[str]]:
    """Watch the model on the texts, left- and right-padded.

    Returns:
        ``(report, tokens of the first text as left-padded)``; the capture, if any, records
        the left-padded run only.
    """
    takes_token_types = "token_type_ids" in inspect.signature(model.forward).parameters
    tokens: list[str] = []
    reports = []
    for side in ("left", "right"):
        tokenizer.padding_side = side
        inputs = dict(tokenizer(texts, return_tensors="pt", padding=True))
        if not takes_token_types:
            inputs.pop("token_type_ids", None)
        if side == "left":
            tokens = list(tokenizer.convert_ids_to_tokens(inputs["input_ids"][0]))
        with torch.no_grad(), watch(model, capture=capture if side == "left" else None) as r:
            _forward(model, inputs)
        reports.append(r)
    report = reports[0]
    report.extend(reports[1])
    return report, tokens


def run_doctor(args: argparse.Namespace) -> int:
    """``qkv doctor``: print the findings (and, with ``--examine``, the properties); 1 when a
    finding is an error or a property fails, else 0.

    Raises:
        ValueError: a bad directory, no text, or ``--html`` without ``--capture``.
    """
    if not args.text:
        raise ValueError("give at least one --text to run the model on")
    if args.html and not args.capture:
        raise ValueError("--html needs --capture PATTERN (the module paths to record)")
    model, tokenizer = load_for_doctor(args.directory, args.attn_implementation)
    report, tokens = run_texts(model, tokenizer, list(args.text), args.capture)
    exam = examine_texts(model, tokenizer, list(args.text)) if args.examine else None
    if args.json:
        data = report.to_dict()
        if exam is not None:
            data["examination"] = exam.to_dict()
        print(json.dumps(data, indent=2, default=str))
    else:
        print(report)
        if exam is not None:
            print()
            print(exam)
    if args.html:
        report.save_html(args.html, tokens=tokens)
        if not args.json:
            print(f"attention written to {args.html}")
    failed = any(f.severity == "error" for f in report.findings)
    return 1 if failed or (exam is not None and not exam.passed) else 0
