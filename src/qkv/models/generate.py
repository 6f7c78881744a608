"""Decoding with the KV cache: greedy and beam search (encoder–decoder); greedy or sampled
decoding of left-padded prompts, streamed step by step (decoder-only), with the options of
:mod:`qkv.models.decoding`.

Every loop feeds only the newest token(s) to the model; the cache supplies the rest, so a step
costs the same at position 10 as at position 1000 (up to the attention over the cache).

This module imports no model module (the models import it): what it needs from a model is the
Protocols of :mod:`qkv.models.protocols`; the models reach it through
:meth:`Transformer.generate` / :meth:`DecoderOnlyLM.generate`.

Shapes: B batch, K beams, S source length, V vocabulary, n ``max_new_tokens``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TypedDict, cast

import torch
from torch import Tensor

from qkv._checks import check_bool, check_positive_int
from qkv.models.beam import beam_decode, check_beam_options, forced_token
from qkv.models.decoding import DecodingOptions, check_stop_ids, seen_tokens
from qkv.models.inputs import check_ids, key_padding
from qkv.models.protocols import DecoderOnlyModel, EncoderDecoderModel
from qkv.models.static_decode import StaticDecoder, static_capacity

__all__ = [
    "GenerateOptions",
    "beam_decoder_only",
    "beam_search",
    "check_beam_options",
    "generate_decoder_only",
    "generate_options",
    "greedy_encoder_decoder",
    "prompt_padding",
    "stream_decoder_only",
]


class GenerateOptions(TypedDict, total=False):
    """The keyword options of :meth:`DecoderOnlyLM.generate` and :meth:`DecoderOnlyLM.stream`,
    documented once; each is optional (the defaults in :data:`DEFAULTS`). The decoding options
    and their order are those of ``transformers``' ``generate`` (see :mod:`qkv.models.decoding`).

    Keys:
        padding_mask: bool ``[B, T0]``, True = padding, on the left of each row (each row is
            then decoded as if alone: positions start at its first real token, and its padding
            is never attended to). None: no padding, and a prompt holding ``config.pad_id`` is
            refused (say which tokens are padding).
        greedy: take the likeliest token instead of sampling (the sampling options
            temperature, top_k, top_p, min_p are then refused, not ignored).
        temperature: divides the logits before sampling (> 0).
        top_k: sample among the k likeliest tokens only.
        top_p: sample among the likeliest tokens whose probabilities sum to ``top_p``, in
            ``(0, 1]``.
        min_p: sample among tokens at least ``min_p`` times as likely as the likeliest.
        repetition_penalty: > 0; a token already in the row (prompt or generated, padding left
            out) has its logit divided by it when positive, multiplied when negative.
        eos_id: stop id(s), an int or a list (default ``config.eos_id``); a row ends at the
            first it produces, and its later positions hold ``pad_id`` (or the first stop id
            when no ``pad_id`` is set).
        min_new_tokens: the stop ids are banned until this many tokens are generated.
        generator: random generator for reproducible sampling.
        static_cache: decode with a fixed-shape :class:`~qkv.nn.static_kv_cache.StaticKVCache`
            (:meth:`DecoderOnlyLM.forward_static`); the same tokens as the default growing
            :class:`~qkv.nn.kv_cache.KVCache`.
        compile: also compile the decoding step with ``torch.compile(fullgraph=True)`` (implies
            ``static_cache``): it compiles once per batch size and cache capacity
            (:mod:`qkv.models.static_decode`), then every step reuses the graph. The eager path
            stays the default. On the CPU, ``generate`` without a ``streamer`` checks dynamo's
            guards on a generation's first step only: no code of the caller's runs between
            its steps, so nothing can change what the guards check (``stream`` and a
            ``streamer`` keep the check on every step).
    """

    padding_mask: Tensor | None
    greedy: bool
    temperature: float
    top_k: int | None
    top_p: float | None
    min_p: float | None
    repetition_penalty: float
    eos_id: int | Sequence[int] | None
    min_new_tokens: int
    generator: torch.Generator | None
    static_cache: bool
    compile: bool


DEFAULTS: dict[str, object] = {
    "padding_mask": None,
    "greedy": False,
    "temperature": 1.0,
    "top_k": None,
    "top_p": None,
    "min_p": None,
    "repetition_penalty": 1.0,
    "eos_id": None,
    "min_new_tokens": 0,
    "generator": None,
    "static_cache": False,
    "compile": False,
}
"""Each :class:`GenerateOptions` key's default: the value that changes nothing."""


def generate_options(options: Mapping[str, object], eos_id: int | None) -> GenerateOptions:
    """Every :class:`GenerateOptions` key: the caller's, else its default.

    Args:
        options: the caller's keywords.
        eos_id: the model's stop id, the default of ``eos_id``.

    Returns:
        The options, each key of :data:`DEFAULTS` set.

    Raises:
        TypeError: a keyword that is no option.
    """
    unknown = sorted(set(options) - set(DEFAULTS))
    if unknown:
        raise TypeError(f"unexpected keyword(s) {unknown}; the options are {sorted(DEFAULTS)}")
    out = {**DEFAULTS, **options}
    if out["eos_id"] is None:
        out["eos_id"] = eos_id
    return cast(GenerateOptions, out)


def _check_steps(max_new_tokens: object, start: int, max_positions: int) -> int:
    n = check_positive_int("max_new_tokens", max_new_tokens)
    if start + n > max_positions:
        raise ValueError(
            f"{start} prompt tokens + max_new_tokens={n} exceed the model's "
            f"max_positions={max_positions}"
        )
    return n


def greedy_encoder_decoder(
    model: EncoderDecoderModel, src: Tensor, max_new_tokens: int, src_padding_mask: Tensor | None
) -> Tensor:
    """Greedy decoding; see :meth:`Transformer.generate`."""
    c = model.config
    n = _check_steps(max_new_tokens, 1, c.max_positions)
    is_pad = model.source_padding(src, src_padding_mask)  # [B, S] or None
    memory = model.encode_padded(src, is_pad)  # [B, S, D]
    B = src.shape[0]
    cache = model.new_cache(1 + n)
    out = torch.full((B, 1), c.bos_id, dtype=torch.long, device=src.device)  # [B, 1]
    finished = torch.zeros(B, dtype=torch.bool, device=src.device)  # [B]
    step_in = out
    for step in range(n):
        logits = model.decode(step_in, memory, is_pad, kv_cache=cache)[:, -1]  # [B, V]
        logits = forced_token(logits, step, n, c.forced_bos_id, c.forced_eos_id)  # [B, V]
        nxt = logits.argmax(dim=-1)  # [B]
        nxt = torch.where(finished, torch.full_like(nxt, c.pad_id), nxt)  # [B]
        out = torch.cat([out, nxt[:, None]], dim=1)  # [B, L]
        finished = finished | (nxt == c.eos_id)
        if bool(finished.all()):
            break
        step_in = nxt[:, None]  # [B, 1]
    return out


def beam_search(
    model: EncoderDecoderModel,
    src: Tensor,
    max_new_tokens: int,
    src_padding_mask: Tensor | None,
    beam_size: int,
    length_penalty: float,
) -> Tensor:
    """Beam search from ``bos_id`` (:func:`qkv.models.beam.beam_decode`); see
    :meth:`Transformer.generate`.

    Raises:
        ValueError: ``beam_size < 1``, a non-finite ``length_penalty`` or bad ``max_new_tokens``.
        TypeError: see :func:`check_beam_options`.
    """
    c = model.config
    K, lp = check_beam_options(beam_size, length_penalty)
    n = _check_steps(max_new_tokens, 1, c.max_positions)
    src_pad = model.source_padding(src, src_padding_mask)  # [B, S] or None
    B = src.shape[0]
    memory = model.encode_padded(src, src_pad).repeat_interleave(K, dim=0)  # [B*K, S, D]
    is_pad = None if src_pad is None else src_pad.repeat_interleave(K, dim=0)  # [B*K, S]
    cache = model.new_cache(1 + n)
    start = torch.full((B * K, 1), c.bos_id, dtype=torch.long, device=src.device)  # [B*K, 1]
    return beam_decode(
        lambda tgt: model.decode(tgt, memory, is_pad, kv_cache=cache)[:, -1],
        cache.reorder,
        start,
        beam_size=K,
        max_new_tokens=n,
        length_penalty=lp,
        stop_ids=(c.eos_id,),
        pad_id=c.pad_id,
        forced=(c.forced_bos_id, c.forced_eos_id),
    )


def beam_decoder_only(
    model: DecoderOnlyModel,
    ids: Tensor,
    max_new_tokens: int,
    *,
    padding_mask: Tensor | None,
    beam_size: int,
    length_penalty: float,
    eos_id: int | Sequence[int] | None,
    **others: object,
) -> Tensor:
    """Beam search continuing left-padded prompts; see :meth:`DecoderOnlyLM.generate`.

    Args:
        model: the language model.
        ids, max_new_tokens, beam_size, length_penalty: as :meth:`DecoderOnlyLM.generate`.
        padding_mask, eos_id: as :class:`GenerateOptions`.
        others: the other options (:class:`GenerateOptions`, ``streamer``): refused unless
            they hold their defaults.

    Returns:
        long ``[B, T0 + l]``: the prompts, then each one's best continuation (its stop id
        kept), right-padded with ``pad_id`` (else the first stop id, else 0).

    Raises:
        TypeError / ValueError: the beam options, the prompt and its padding, the stop ids;
            ValueError: another option given.
    """
    c = model.config
    K, lp = check_beam_options(beam_size, length_penalty)
    _refuse_for_beams(K, others)
    check_ids("ids", ids, c.vocab_size, field="vocab_size")
    n = _check_steps(max_new_tokens, ids.shape[1], c.max_positions)
    stop = check_stop_ids(eos_id, c.vocab_size)
    is_pad = prompt_padding(ids, padding_mask, c.pad_id)  # [B, T0] or None
    prompts = ids.repeat_interleave(K, dim=0)  # [B*K, T0]
    pad = (
        torch.zeros_like(prompts, dtype=torch.bool)
        if is_pad is None
        else is_pad.repeat_interleave(K, dim=0)
    )  # [B*K, T0]
    no_pad = torch.zeros(prompts.shape[0], 1, dtype=torch.bool, device=ids.device)  # [B*K, 1]
    cache = model.new_cache(ids.shape[1] + n)

    def step(new: Tensor) -> Tensor:
        mask = pad if new.shape[1] > 1 else no_pad
        return model(new, mask, kv_cache=cache, logits_to_keep=1)[:, -1]  # [B*K, V]

    fill = c.pad_id if c.pad_id is not None else (stop or (0,))[0]
    return beam_decode(
        step,
        cache.reorder,
        prompts,
        beam_size=K,
        max_new_tokens=n,
        length_penalty=lp,
        stop_ids=stop,
        pad_id=fill,
    )


def _refuse_for_beams(beam_size: int, others: Mapping[str, object]) -> None:
    """Beam search takes no option but ``padding_mask``, ``eos_id`` and ``length_penalty``:
    a ValueError names each of ``others`` set to other than its default (None for
    ``streamer``)."""
    given = [name for name, value in others.items() if value != DEFAULTS.get(name)]
    if given:
        raise ValueError(
            f"beam_size={beam_size} takes padding_mask, eos_id and length_penalty only; got "
            f"{', '.join(given)}"
        )


def prompt_padding(ids: Tensor, padding_mask: Tensor | None, pad_id: int | None) -> Tensor | None:
    """The padding of a decoder prompt, which must be on the left.

    A decoder continues each row from its last column, so padding may only precede a row's real
    tokens. Without a mask, a prompt holding ``pad_id`` is refused rather than guessed at: the
    same id may be a real token (GPT-2 pads with its end-of-text token).

    Args:
        ids: ``[B, T0]`` prompts (checked).
        padding_mask: bool ``[B, T0]``, True = padding, or None.
        pad_id: the model's padding token, or None.

    Returns:
        bool ``[B, T0]``, or None when nothing is padding.

    Raises:
        TypeError: a mask that is not bool.
        ValueError: a mask of another shape, a row of padding only, padding after a real token
            (right padding), or ``pad_id`` in the prompt with no mask.
    """
    if padding_mask is None:
        if pad_id is not None and bool((ids == pad_id).any()):
            row, col = (ids == pad_id).nonzero()[0].tolist()
            raise ValueError(
                f"ids hold pad_id={pad_id} (first at row {row}, column {col}) and no padding_mask "
                "was given: pass padding_mask= (bool [B, T0], True = padding, on the left), all "
                "False if those tokens are real"
            )
        return None
    is_pad = key_padding(padding_mask, ids, "padding_mask")  # [B, T0] or None
    if is_pad is None:
        return None
    empty = is_pad.all(dim=1)  # [B]
    if bool(empty.any()):
        raise ValueError(
            f"padding_mask marks every token of row {int(empty.nonzero()[0])} as padding; each "
            "prompt needs at least one real token"
        )
    after_real = is_pad[:, 1:] & ~is_pad[:, :-1]  # [B, T0 - 1] padding right of a real token
    if bool(after_real.any()):
        row, col = after_real.nonzero()[0].tolist()
        raise ValueError(
            f"padding_mask has padding after a real token (row {row}, column {col + 1}): a "
            "decoder prompt must be left-padded, since generation continues from the last column"
        )
    return is_pad


def stream_decoder_only(
    model: DecoderOnlyModel,
    ids: Tensor,
    max_new_tokens: int,
    *,
    padding_mask: Tensor | None,
    generator: torch.Generator | None,
    static_cache: bool = False,
    compile: bool = False,
    unattended: bool = False,
    **options: object,
) -> Iterator[Tensor]:
    """Check everything, then return the loop that yields each step's tokens; see
    :meth:`DecoderOnlyLM.stream`.

    Args:
        model: the language model.
        ids, max_new_tokens, padding_mask, generator, static_cache, compile: as
            :meth:`DecoderOnlyLM.stream`.
        unattended: the caller runs none of its user's code between steps (``generate``
            without a streamer), so a compiled step checks dynamo's guards on its first call
            only (``StaticDecoder``'s ``skip_guards``).
        options: the keywords of :meth:`DecodingOptions.check` (``eos_id`` already defaulted).

    Returns:
        An iterator of long ``[B]`` tensors, one per generated position.

    Raises:
        TypeError / ValueError: every bad argument, before the first step runs.
    """
    c = model.config
    check_ids("ids", ids, c.vocab_size, field="vocab_size")
    n = _check_steps(max_new_tokens, ids.shape[1], c.max_positions)
    opts = DecodingOptions.check(vocab_size=c.vocab_size, max_new_tokens=n, **options)
    is_pad = prompt_padding(ids, padding_mask, c.pad_id)  # [B, T0] or None
    static = check_bool("static_cache", static_cache) | check_bool("compile", compile)
    if static and c.positional in ("alibi", "relative"):
        raise ValueError(
            f"static_cache / compile support absolute and rotary positions, got "
            f"positional={c.positional!r}"
        )
    capacity = static_capacity(ids.shape[1], n)
    skip = check_bool("unattended", unattended)
    decoder = (
        StaticDecoder(model, ids.shape[0], capacity, compile=compile, skip_guards=skip)
        if static
        else None
    )
    return _decoder_only_steps(model, ids, n, is_pad, opts, generator, decoder)


def _decoder_only_steps(
    model: DecoderOnlyModel,
    ids: Tensor,
    n: int,
    is_pad: Tensor | None,
    opts: DecodingOptions,
    generator: torch.Generator | None,
    decoder: StaticDecoder | None,
) -> Iterator[Tensor]:
    c = model.config
    B = ids.shape[0]
    stop = torch.tensor(opts.stop_ids, dtype=torch.long, device=ids.device)  # [n_stop]
    fill = c.pad_id if c.pad_id is not None else (opts.stop_ids or (0,))[0]
    no_pad = torch.zeros(B, 1, dtype=torch.bool, device=ids.device)  # [B, 1]
    T0 = ids.shape[1]
    cache = model.new_cache(T0 + n) if decoder is None else None
    prompt_pad = torch.zeros_like(ids, dtype=torch.bool) if is_pad is None else is_pad
    seen = seen_tokens(ids, is_pad, c.vocab_size) if opts.tracks_seen else None  # [B, V]
    with torch.no_grad():
        if decoder is None:
            logits = model(ids, prompt_pad, kv_cache=cache, logits_to_keep=1)[:, -1]  # [B, V]
        else:
            logits = decoder.prefill(ids, is_pad)  # [B, V]
    finished = torch.zeros(B, dtype=torch.bool, device=ids.device)  # [B]
    for step in range(n):
        nxt = opts.choose(logits, seen, step, generator)  # [B]
        if opts.stop_ids:
            nxt = torch.where(finished, torch.full_like(nxt, fill), nxt)  # [B]
            finished = finished | torch.isin(nxt, stop)  # [B]
        if seen is not None:
            seen.scatter_(1, nxt[:, None], True)
        yield nxt
        if step == n - 1 or (opts.stop_ids and bool(finished.all())):
            return
        with torch.no_grad():
            if decoder is None:
                logits = model(nxt[:, None], no_pad, kv_cache=cache)[:, -1]  # [B, V]
            else:
                logits = decoder.step(nxt, T0 + step)  # [B, V]


def generate_decoder_only(
    model: DecoderOnlyModel,
    ids: Tensor,
    max_new_tokens: int,
    *,
    streamer: Callable[[Tensor], object] | None,
    **kwargs: object,
) -> Tensor:
    """The prompts followed by every step of :func:`stream_decoder_only`; see
    :meth:`DecoderOnlyLM.generate`.

    Raises:
        TypeError: a ``streamer`` that is not callable; see :func:`stream_decoder_only`.
    """
    if streamer is not None and not callable(streamer):
        raise TypeError(f"streamer must be a callable taking a [B] tensor, got {streamer!r}")
    steps = stream_decoder_only(
        model,
        ids,
        max_new_tokens,
        unattended=streamer is None,
        **kwargs,  # type: ignore[arg-type]
    )
    out = [ids]
    for nxt in steps:
        if streamer is not None:
            streamer(nxt)
        out.append(nxt[:, None])
    return torch.cat(out, dim=1)  # [B, T0 + steps]
