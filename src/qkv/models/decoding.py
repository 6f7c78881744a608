"""How the next token is chosen from a step's logits: the decoding options of ``transformers``.

Each processor is a pure function of ``[B, V]`` logits with the semantics of its
``transformers`` counterpart in ``generation/logits_process.py`` (the tests compare them on the
same inputs), applied in ``transformers``' order: repetition penalty, the ban on stop ids before
``min_new_tokens``, then, when sampling, temperature, top-k, top-p, min-p. Greedy decoding takes
the argmax after the first two; sampling draws from the softmax after all of them.

:class:`DecodingOptions` holds and checks the options once, before a loop starts, so that a bad
value is a clear error rather than a wrong distribution.

Shapes: B batch (rows), V vocabulary, T tokens so far.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from qkv._checks import check_bool, check_nonnegative_int, check_positive_int

__all__ = [
    "DecodingOptions",
    "apply_min_p",
    "apply_repetition_penalty",
    "apply_top_k",
    "apply_top_p",
    "ban_tokens",
    "check_stop_ids",
    "seen_tokens",
]

_NEG_INF = float("-inf")


def _number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a float, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return float(value)


def check_stop_ids(eos_id: object, vocab_size: int) -> tuple[int, ...]:
    """Accept ``eos_id``: None, a token id, or a non-empty list / tuple of token ids.

    Args:
        eos_id: the stop id(s).
        vocab_size: ids must lie in ``[0, vocab_size)``.

    Returns:
        The stop ids as a tuple (empty for None).

    Raises:
        TypeError: not an int or a sequence of ints (``True`` included).
        ValueError: an empty sequence, or an id outside ``[0, vocab_size)``.
    """
    if eos_id is None:
        return ()
    ids = list(eos_id) if isinstance(eos_id, list | tuple) else [eos_id]
    if not ids:
        raise ValueError("eos_id must be a token id or a non-empty list of them, got []")
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int):
            raise TypeError(
                f"eos_id must be an int or a list of ints, got {eos_id!r} (holding "
                f"{type(i).__name__})"
            )
        if not 0 <= i < vocab_size:
            among = f" (among {eos_id!r})" if isinstance(eos_id, list | tuple) else ""
            raise ValueError(f"eos_id must lie in [0, vocab_size={vocab_size}), got {i}{among}")
    return tuple(dict.fromkeys(i for i in ids if isinstance(i, int)))  # each an int by now


def _sampling(
    temperature: object, top_k: object, top_p: object, min_p: object
) -> tuple[float, int | None, float | None, float | None]:
    """The sampling options checked (see :meth:`DecodingOptions.check`), in that order."""
    t = _number("temperature", temperature)
    if not t > 0:
        raise ValueError(f"temperature must be > 0, got {t}")
    k = None if top_k is None else check_positive_int("top_k", top_k)
    p = None if top_p is None else _number("top_p", top_p)
    if p is not None and not 0 < p <= 1:
        raise ValueError(f"top_p must lie in (0, 1], got {p}")
    m = None if min_p is None else _number("min_p", min_p)
    if m is not None and not 0 <= m <= 1:
        raise ValueError(f"min_p must lie in [0, 1], got {m}")
    return t, k, p, m


def _refuse_sampling(t: float, k: int | None, p: float | None, m: float | None) -> None:
    """A ValueError naming each sampling option given for greedy decoding, which would ignore
    it (the values of ``temperature``, ``top_k``, ``top_p``, ``min_p``)."""
    given = [
        f"{name}={value!r}"
        for name, value, neutral in (
            ("temperature", t, 1.0),
            ("top_k", k, None),
            ("top_p", p, None),
            ("min_p", m, None),
        )
        if value != neutral
    ]
    if given:
        raise ValueError(
            f"{', '.join(given)} only shape sampling; greedy decoding would ignore "
            "them (pass greedy=False to sample)"
        )


@dataclass(frozen=True)
class DecodingOptions:
    """Checked decoding options (build with :meth:`check`).

    Attributes:
        greedy: argmax (after the penalty and the stop-id ban) instead of sampling.
        temperature: sampling only; divides the logits.
        top_k: sampling only; keep the k likeliest tokens (ties with the k-th kept).
        top_p: sampling only; keep the smallest set of likeliest tokens whose probability
            reaches ``top_p`` (nucleus sampling).
        min_p: sampling only; keep tokens at least ``min_p`` times as likely as the likeliest.
        repetition_penalty: a token already in the row (prompt or generated) has its logit
            divided by it when positive, multiplied when negative (CTRL's rule); 1 = none.
        stop_ids: a row ends at the first of these it produces.
        min_new_tokens: the stop ids are banned until this many tokens were generated.
    """

    greedy: bool = True
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float = 1.0
    stop_ids: tuple[int, ...] = ()
    min_new_tokens: int = 0

    @classmethod
    def check(
        cls,
        *,
        vocab_size: int,
        max_new_tokens: int,
        greedy: object = True,
        temperature: object = 1.0,
        top_k: object = None,
        top_p: object = None,
        min_p: object = None,
        repetition_penalty: object = 1.0,
        eos_id: object = None,
        min_new_tokens: object = 0,
    ) -> DecodingOptions:
        """Check every option and return them.

        Raises:
            TypeError: an option of the wrong type (``True`` is no int or float here).
            ValueError: ``temperature <= 0``, ``top_k < 1``, ``top_p`` outside ``(0, 1]``,
                ``min_p`` outside ``[0, 1]``, ``repetition_penalty <= 0``, a stop id outside
                the vocabulary, ``min_new_tokens`` outside ``[0, max_new_tokens]``, or a
                sampling option (temperature, top-k, top-p, min-p) given for greedy decoding,
                where it would be ignored.
        """
        check_bool("greedy", greedy)
        t, k, p, m = _sampling(temperature, top_k, top_p, min_p)
        r = _number("repetition_penalty", repetition_penalty)
        if not r > 0:
            raise ValueError(f"repetition_penalty must be > 0 (1 = no penalty), got {r}")
        n_min = check_nonnegative_int("min_new_tokens", min_new_tokens)
        if n_min > max_new_tokens:
            raise ValueError(
                f"min_new_tokens={n_min} exceeds max_new_tokens={max_new_tokens}: no generation "
                "could satisfy both"
            )
        if greedy:
            _refuse_sampling(t, k, p, m)
        return cls(
            greedy=bool(greedy),
            temperature=t,
            top_k=k,
            top_p=p,
            min_p=m,
            repetition_penalty=r,
            stop_ids=check_stop_ids(eos_id, vocab_size),
            min_new_tokens=n_min,
        )

    @property
    def tracks_seen(self) -> bool:
        """Whether the loop must keep :func:`seen_tokens` up to date (a penalty other than 1)."""
        return self.repetition_penalty != 1.0

    def process(self, logits: Tensor, seen: Tensor | None, step: int) -> Tensor:
        """The logits after every processor that applies, in ``transformers``' order.

        Args:
            logits: ``[B, V]`` scores of the next token.
            seen: bool ``[B, V]`` tokens already in each row (needed when :attr:`tracks_seen`).
            step: tokens generated so far (0 for the first new token).

        Returns:
            float ``[B, V]``; ``-inf`` marks a token that cannot be chosen.
        """
        x = logits.float()  # [B, V]
        if self.repetition_penalty != 1.0:
            assert seen is not None, "tracks_seen: the loop keeps seen_tokens"
            x = apply_repetition_penalty(x, seen, self.repetition_penalty)
        if self.stop_ids and step < self.min_new_tokens:
            x = ban_tokens(x, self.stop_ids)
        if self.greedy:
            return x
        if self.temperature != 1.0:
            x = x / self.temperature  # [B, V]
        if self.top_k is not None:
            x = apply_top_k(x, self.top_k)
        if self.top_p is not None and self.top_p < 1.0:
            x = apply_top_p(x, self.top_p)
        if self.min_p is not None:
            x = apply_min_p(x, self.min_p)
        return x

    def choose(
        self, logits: Tensor, seen: Tensor | None, step: int, generator: torch.Generator | None
    ) -> Tensor:
        """The next token of every row: the argmax, or a draw from the processed softmax.

        Args:
            logits, seen, step: as :meth:`process`.
            generator: the random generator of the draws (sampling only).

        Returns:
            long ``[B]``.
        """
        x = self.process(logits, seen, step)  # [B, V]
        if self.greedy:
            return x.argmax(dim=-1)  # [B]
        probs = torch.softmax(x, dim=-1)  # [B, V]
        return torch.multinomial(probs, 1, generator=generator)[:, 0]  # [B]


def seen_tokens(ids: Tensor, is_pad: Tensor | None, vocab_size: int) -> Tensor:
    """Which tokens each row already holds (its padding left out), for the repetition penalty.

    Args:
        ids: ``[B, T]`` token ids.
        is_pad: bool ``[B, T]``, True = padding, or None.
        vocab_size: V.

    Returns:
        bool ``[B, V]``; update it with ``seen.scatter_(1, new[:, None], True)``.
    """
    B = ids.shape[0]
    idx = ids if is_pad is None else ids.masked_fill(is_pad, vocab_size)  # [B, T]
    seen = torch.zeros(B, vocab_size + 1, dtype=torch.bool, device=ids.device)  # [B, V + 1]
    seen.scatter_(1, idx.long(), True)
    return seen[:, :vocab_size]  # [B, V]


def apply_repetition_penalty(logits: Tensor, seen: Tensor, penalty: float) -> Tensor:
    """``RepetitionPenaltyLogitsProcessor``: a seen token's logit ``/ penalty`` if positive,
    ``* penalty`` if negative (so a penalty > 1 always makes it less likely).

    Args:
        logits: ``[B, V]``.
        seen: bool ``[B, V]`` from :func:`seen_tokens`.
        penalty: > 0.

    Returns:
        ``[B, V]``.
    """
    penalised = torch.where(logits < 0, logits * penalty, logits / penalty)  # [B, V]
    return torch.where(seen, penalised, logits)  # [B, V]


def ban_tokens(logits: Tensor, ids: Sequence[int]) -> Tensor:
    """``MinNewTokensLengthLogitsProcessor`` while it applies: the ``ids`` get ``-inf``.

    Args:
        logits: ``[B, V]``.
        ids: token ids.

    Returns:
        ``[B, V]``.
    """
    out = logits.clone()  # [B, V]
    out[:, list(ids)] = _NEG_INF
    return out


def apply_top_k(logits: Tensor, k: int) -> Tensor:
    """``TopKLogitsWarper``: tokens below the k-th largest logit get ``-inf`` (ties kept).

    Args:
        logits: ``[B, V]``.
        k: >= 1 (more than V keeps everything).

    Returns:
        ``[B, V]``.
    """
    k = min(k, logits.shape[-1])
    kth = logits.topk(k, dim=-1).values[:, -1:]  # [B, 1]
    return logits.masked_fill(logits < kth, _NEG_INF)  # [B, V]


def apply_top_p(logits: Tensor, p: float) -> Tensor:
    """``TopPLogitsWarper``: keep the likeliest tokens whose probabilities sum to at least ``p``.

    Sorted ascending, a token is dropped when the cumulative probability up to it is at most
    ``1 - p``; the likeliest token is always kept.

    Args:
        logits: ``[B, V]``.
        p: in ``(0, 1]``.

    Returns:
        ``[B, V]``.
    """
    sorted_logits, order = torch.sort(logits, descending=False)  # [B, V] x 2
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [B, V]
    drop_sorted = cumulative <= (1 - p)  # [B, V]
    drop_sorted[:, -1:] = False
    drop = drop_sorted.scatter(1, order, drop_sorted)  # [B, V] back in vocabulary order
    return logits.masked_fill(drop, _NEG_INF)  # [B, V]


def apply_min_p(logits: Tensor, min_p: float) -> Tensor:
    """``MinPLogitsWarper``: drop tokens less likely than ``min_p`` times the likeliest.

    Args:
        logits: ``[B, V]``.
        min_p: in ``[0, 1]``.

    Returns:
        ``[B, V]``; the likeliest token is always kept.
    """
    probs = torch.softmax(logits, dim=-1)  # [B, V]
    top = probs.amax(dim=-1, keepdim=True)  # [B, 1]
    drop = probs < min_p * top  # [B, V]
    drop.scatter_(1, probs.argmax(dim=-1, keepdim=True), False)
    return logits.masked_fill(drop, _NEG_INF)  # [B, V]
