"""A stand-in for :meth:`qkv.apps.embed_one.OneSentenceProgram._compile` that generates no code.

Tests that check which program runs, and what the embedder sends to it, do not need
AOTInductor's tens of seconds: the stand-in runs :func:`~qkv.apps.embed_one.encode_one` eagerly
on the same inputs. Imported as a plain module (tests/ is put on ``sys.path`` by
``tests/conftest.py``): ``from one_sentence_stand_in import eager_program``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from torch import Tensor

from qkv.apps.embed_one import OneSentenceProgram, Span, encode_one


def eager_program(
    program: OneSentenceProgram,
    ids: Tensor,
    types: Tensor,
    weights: list[Tensor],
    *,
    frozen: bool,
    span: Span | None = None,
) -> Callable[[list[Tensor]], list[Tensor]]:
    """``program._compile``'s result, run eagerly: a frozen program on copies of the weights
    it was given (as a compiled one holds them), the other on the weights of each call. Like
    a compiled one, it refuses a sentence outside its ``span`` of token counts.

    Args:
        program: the program it stands in for (its ``compiled`` count goes up by one).
        ids: ``[1, N]`` an example sentence's ids (unused, as the real one only traces with
            them).
        types: ``[1, N]`` its token types (unused).
        weights: the weight list, frozen or not.
        frozen: as :meth:`OneSentenceProgram._compile`.
        span: as :meth:`OneSentenceProgram._compile`.

    Returns:
        ``[ids, types]`` (frozen) or ``[ids, types, *weights]`` -> ``[[1, D]]``.
    """
    program.compiled += 1
    plan = dataclasses.replace(program.plan(), frozen=frozen)
    low, high, _ = span or (2, program.model.config.max_position_embeddings, None)
    baked = [w.clone() for w in weights] if frozen else None

    def run(flat: list[Tensor]) -> list[Tensor]:
        n = flat[0].shape[1]
        if not low <= n <= high:
            raise RuntimeError(f"a program for {low}..{high} tokens got {n}")
        return [encode_one(baked or flat[2:], flat[0][0], flat[1][0], plan)]

    return run
