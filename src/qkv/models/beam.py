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

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from qkv.checks import check_positive_int

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


def _offer(
    best: list[tuple[float, Tensor] | None], b: int, score: float, prefix: Tensor, tok: int
) -> None:
    entry = best[b]
    if entry is None or score > entry[0]:
        best[b] = (score, torch.cat([prefix, prefix.new_tensor([tok])]))


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

    Each step extends every live beam by every token and keeps the ``K`` best continuations
    that do not end in a stop id; one that does becomes a finished hypothesis. Live beams still
    open after ``n`` steps finish there. A source stops early once its best finished score beats
    an upper bound of what any live beam can still reach (log-probabilities only fall).

    Args:
        step: ``[B*K, L]`` new tokens -> ``[B*K, V]`` logits of the next token; called first
            with ``prefix``, then with each step's ``[B*K, 1]`` chosen tokens.
        reorder: selects cache rows: row ``i`` becomes old row ``index[i]`` (long ``[B*K]``).
        prefix: long ``[B*K, L0]``, each source's prefix repeated ``K`` times.
        beam_size: K.
        max_new_tokens: n.
        length_penalty: the exponent of the length normalisation.
        stop_ids: tokens that finish a hypothesis (may be empty).
        pad_id: fills rows shorter than the longest.
        forced: ``(forced_bos, forced_eos)`` (see :func:`forced_token`).

    Returns:
        long ``[B, L0 + l]``, ``l <= n``: prefix, tokens, the stop id when produced, then
        ``pad_id``.
    """
    K, n, lp = beam_size, max_new_tokens, length_penalty
    B = prefix.shape[0] // K
    dev = prefix.device
    stop = set(stop_ids)
    seqs = prefix  # [B*K, L]
    scores = torch.full((B, K), float("-inf"), device=dev)  # [B, K]
    scores[:, 0] = 0.0
    best: list[tuple[float, Tensor] | None] = [None] * B
    done = [False] * B
    step_in = prefix
    for s in range(1, n + 1):
        logp = torch.log_softmax(step(step_in).float(), dim=-1)  # [B*K, V]
        logp = forced_token(logp, s - 1, n, *forced)  # [B*K, V]
        V = logp.shape[-1]
        cand = (scores.reshape(B * K, 1) + logp).reshape(B, K * V)  # [B, K*V]
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
                    if not done[b]:
                        _offer(best, b, sc / s**lp, seqs[b * K + beam], tok)
                    continue
                new_scores[b, j], new_beam[b, j], new_tok[b, j] = sc, beam, tok
                j += 1
        flat = (torch.arange(B, device=dev)[:, None] * K + new_beam).reshape(-1)  # [B*K]
        reorder(flat)
        seqs = torch.cat([seqs[flat], new_tok.reshape(-1, 1)], dim=1)  # [B*K, L + 1]
        scores = new_scores
        if s == n:
            for b in range(B):
                for j in range(K):
                    sc = float(scores[b, j])
                    if sc > float("-inf") and not done[b]:
                        _offer(best, b, sc / n**lp, seqs[b * K + j, :-1], int(seqs[b * K + j, -1]))
            break
        for b in range(B):
            top_live = float(scores[b].max())
            entry = best[b]
            # a live beam ends with length in [s + 1, n] and score <= top_live <= 0
            reach = top_live / (n**lp if lp >= 0 else (s + 1) ** lp)
            if entry is not None and (top_live == float("-inf") or entry[0] >= reach):
                done[b] = True
        if all(done):
            break
        step_in = new_tok.reshape(-1, 1)  # [B*K, 1]
    rows = [entry[1] for entry in best if entry is not None]
    assert len(rows) == B, "every source has a hypothesis after the first step"
    L = max(r.shape[0] for r in rows)
    out = torch.full((B, L), pad_id, dtype=torch.long, device=dev)  # [B, L]
    for b, r in enumerate(rows):
        out[b, : r.shape[0]] = r
    return out
