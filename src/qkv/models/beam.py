"""Beam search over any cached decoder: the search itself, apart from the model that scores.

The caller gives one step function (new tokens of every beam -> their next-token logits, the
cache advanced) and the cache's reorder; :func:`beam_decode` keeps, per source, the ``K`` best
live beams by summed log-probability and the best finished hypothesis scored
``sum log p / length ** length_penalty`` (``length`` counts the generated tokens, the stop id
included), as ``transformers``' beam search does. The encoder–decoder
(:func:`qkv.models.generate.beam_search`) and the decoder-only LM
(:func:`qkv.models.generate.beam_decoder_only`) both run it.

Shapes: B sources, K beams, L0 prefix length (``bos`` or the prompt), V vocabulary.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from qkv._checks import check_positive_int

__all__ = ["beam_decode", "check_beam_options", "forced_token"]


def check_beam_options(beam_size: object, length_penalty: object) -> tuple[int, float]:
    """Accept a beam width (an int >= 1, not a bool) and a finite length penalty.

    Returns:
        ``(beam_size, float(length_penalty))``.

    Raises:
        TypeError: ``beam_size`` not an int (``True`` included), ``length_penalty`` not a number.
        ValueError: ``beam_size < 1``, a NaN or infinite ``length_penalty``.
    """
    k = check_positive_int("beam_size", beam_size)
    if isinstance(length_penalty, bool) or not isinstance(length_penalty, int | float):
        raise TypeError(
            f"length_penalty must be a float, got {length_penalty!r} "
            f"({type(length_penalty).__name__})"
        )
    if not math.isfinite(length_penalty):
        raise ValueError(f"length_penalty must be finite, got {length_penalty}")
    return k, float(length_penalty)


def forced_token(scores: Tensor, step: int, n: int, bos: int | None, eos: int | None) -> Tensor:
    """``transformers``' forced BOS (the first generated token) and forced EOS (the last of
    ``n``; it wins when both apply): every other token's score becomes ``-inf``, the forced one's
    0, as ``ForcedBOSTokenLogitsProcessor`` / ``ForcedEOSTokenLogitsProcessor`` set them.

    Args:
        scores: ``[B, V]`` logits (greedy) or log-probabilities (beam search).
        step: the 0-based index of the token being chosen.
        n: ``max_new_tokens``.
        bos: the forced first token, or None.
        eos: the forced last token, or None.

    Returns:
        ``[B, V]``, ``scores`` itself when nothing is forced at this step.
    """
    tok = eos if step == n - 1 and eos is not None else bos if step == 0 else None
    if tok is None:
        return scores
    out = torch.full_like(scores, float("-inf"))  # [B, V]
    out[:, tok] = 0.0
    return out


@dataclass
class _Finished:
    """Each source's best finished hypothesis (score, tokens) and whether its search is over.

    Args:
        sources: B.
        length_penalty: the exponent of the length normalisation.
    """

    sources: int
    length_penalty: float
    best: list[tuple[float, Tensor] | None] = field(init=False)
    done: list[bool] = field(init=False)

    def __post_init__(self) -> None:
        self.best = [None] * self.sources
        self.done = [False] * self.sources

    def offer(self, b: int, score: float, length: int, prefix: Tensor, tok: int) -> None:
        """Source ``b``'s hypothesis ``prefix + [tok]`` of ``length`` generated tokens, whose
        summed log-probability is ``score``, kept if it is the best so far (and ``b`` is open)."""
        if self.done[b]:
            return
        score = score / length**self.length_penalty
        entry = self.best[b]
        if entry is None or score > entry[0]:
            self.best[b] = (score, torch.cat([prefix, prefix.new_tensor([tok])]))

    def settle(self, scores: Tensor, s: int, n: int) -> bool:
        """Close the sources whose best finished score no live beam (``scores`` ``[B, K]``
        after step ``s`` of ``n``) can still beat; whether all are closed."""
        lp = self.length_penalty
        for b in range(self.sources):
            top_live = float(scores[b].max())
            entry = self.best[b]
            # a live beam ends with length in [s + 1, n] and score <= top_live <= 0
            reach = top_live / (n**lp if lp >= 0 else (s + 1) ** lp)
            if entry is not None and (top_live == float("-inf") or entry[0] >= reach):
                self.done[b] = True
        return all(self.done)

    def padded(self, pad_id: int, device: torch.device) -> Tensor:
        """The best hypotheses, long ``[B, L]``, right-padded with ``pad_id``."""
        rows = [entry[1] for entry in self.best if entry is not None]
        assert len(rows) == self.sources, "every source has a hypothesis after the first step"
        L = max(r.shape[0] for r in rows)
        out = torch.full((self.sources, L), pad_id, dtype=torch.long, device=device)  # [B, L]
        for b, r in enumerate(rows):
            out[b, : r.shape[0]] = r
        return out


def _select(
    cand: Tensor, seqs: Tensor, s: int, K: int, stop: set[int], finished: _Finished, pad_id: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Step ``s``'s ``K`` best live continuations per source from the candidates ``cand``
    ``[B, K*V]`` (summed log-probabilities); those ending in a stop id go to ``finished``.

    Returns:
        ``(scores, beam, token)``, each ``[B, K]``: the kept continuations' scores (``-inf``
        where fewer than ``K`` are left), the beams they extend and their tokens.
    """
    B, dev = cand.shape[0], cand.device
    V = cand.shape[1] // K
    top_s, top_i = cand.topk(min(2 * K, K * V), dim=-1)  # [B, 2K]
    new_scores = torch.full((B, K), float("-inf"), device=dev)  # [B, K]
    new_beam = torch.zeros((B, K), dtype=torch.long, device=dev)  # [B, K]
    new_tok = torch.full((B, K), pad_id, dtype=torch.long, device=dev)  # [B, K]
    for b in range(B):
        j = 0
        for sc, idx in zip(top_s[b].tolist(), top_i[b].tolist(), strict=True):
            if sc == float("-inf") or j == K:
                break
            beam, tok = divmod(idx, V)
            if tok in stop:
                finished.offer(b, sc, s, seqs[b * K + beam], tok)
                continue
            new_scores[b, j], new_beam[b, j], new_tok[b, j] = sc, beam, tok
            j += 1
    return new_scores, new_beam, new_tok


def beam_decode(
    step: Callable[[Tensor], Tensor],
    reorder: Callable[[Tensor], None],
    prefix: Tensor,
    *,
    beam_size: int,
    max_new_tokens: int,
    length_penalty: float,
    stop_ids: Sequence[int],
    pad_id: int,
    forced: tuple[int | None, int | None] = (None, None),
) -> Tensor:
    """Beam search from ``prefix``; returns each source's best hypothesis.

    Each step keeps the ``K`` best continuations of the live beams that do not end in a stop
    id; one that does is a finished hypothesis, and so is each beam still open after ``n``
    steps. A source stops once its best finished score beats what a live beam can still reach.

    Args:
        step: ``[B*K, L]`` new tokens -> ``[B*K, V]`` logits of the next token; called first
            with ``prefix``, then with each step's ``[B*K, 1]`` chosen tokens.
        reorder: selects cache rows: row ``i`` becomes old row ``index[i]`` (long ``[B*K]``).
        prefix: long ``[B*K, L0]``, each source's prefix repeated ``K`` times.
        beam_size, max_new_tokens: K and n.
        length_penalty: the exponent of the length normalisation.
        stop_ids: tokens that finish a hypothesis (may be empty).
        pad_id: fills rows shorter than the longest.
        forced: ``(forced_bos, forced_eos)`` (see :func:`forced_token`).

    Returns:
        long ``[B, L0 + l]``, ``l <= n``: prefix, tokens, the stop id when produced, then
        ``pad_id``.
    """
    K, n = beam_size, max_new_tokens
    B = prefix.shape[0] // K
    dev = prefix.device
    seqs = prefix  # [B*K, L]
    scores = torch.full((B, K), float("-inf"), device=dev)  # [B, K]
    scores[:, 0] = 0.0
    finished = _Finished(B, length_penalty)
    stop = set(stop_ids)
    step_in = prefix
    for s in range(1, n + 1):
        logp = torch.log_softmax(step(step_in).float(), dim=-1)  # [B*K, V]
        logp = forced_token(logp, s - 1, n, *forced)  # [B*K, V]
        cand = (scores.reshape(B * K, 1) + logp).reshape(B, -1)  # [B, K*V]
        scores, beam, tok = _select(cand, seqs, s, K, stop, finished, pad_id)
        flat = (torch.arange(B, device=dev)[:, None] * K + beam).reshape(-1)  # [B*K]
        reorder(flat)
        seqs = torch.cat([seqs[flat], tok.reshape(-1, 1)], dim=1)  # [B*K, L + 1]
        if s == n:  # the beams still open finish here
            for b, j in itertools.product(range(B), range(K)):
                if float(scores[b, j]) > float("-inf"):
                    row = seqs[b * K + j]  # [L + 1]
                    finished.offer(b, float(scores[b, j]), n, row[:-1], int(row[-1]))
            break
        if finished.settle(scores, s, n):
            break
        step_in = tok.reshape(-1, 1)  # [B*K, 1]
    return finished.padded(pad_id, dev)
