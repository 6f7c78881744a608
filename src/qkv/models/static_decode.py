"""Decoding with a :class:`~qkv.nn.static_kv_cache.StaticKVCache` and a compiled step.

gpt-fast's recipe: the prompt runs eagerly (its length changes from call to call); each
decoding step is one call of :meth:`DecoderOnlyLM.forward_static` with fixed shapes (``[B, 1]``
tokens, a ``[1]`` cache position tensor, ``C`` cache slots), compiled once with
``torch.compile(fullgraph=True)`` and reused for every step and every later generation of the
same batch size and capacity. The capacity is rounded up to a multiple of :data:`CAPACITY_STEP`
so that prompts of nearby lengths share one compiled step. On CUDA the step is compiled with
``mode="reduce-overhead"`` (CUDA graphs); elsewhere with the default mode.

This module imports no model module (the models import it): a model is a
:class:`~qkv.models.protocols.DecoderOnlyModel`.

Shapes: B batch, T0 prompt length, C capacity, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from qkv.models.protocols import DecoderOnlyModel
from qkv.nn.static_kv_cache import StaticKVCache

__all__ = ["CAPACITY_STEP", "StaticDecoder", "static_capacity"]

CAPACITY_STEP = 64
"""Cache slots are allocated in multiples of this, so nearby prompt lengths share a graph."""

Step = Callable[[DecoderOnlyModel, Tensor, StaticKVCache, Tensor], Tensor]


def _step(model: DecoderOnlyModel, ids: Tensor, cache: StaticKVCache, position: Tensor) -> Tensor:
    """One decoding step: ``[B, 1]`` tokens at slot ``position`` -> ``[B, V]`` logits."""
    return model.forward_static(ids, cache, position)[:, -1]  # [B, V]


_COMPILED: dict[str, Step] = {}


def compiled_step(device: torch.device) -> Step:
    """The compiled :func:`_step` for ``device``'s kind (one per process: dynamo keeps one
    graph per model and shape behind it, guarded, and recompiles only when they change)."""
    mode = "reduce-overhead" if device.type == "cuda" else None
    key = str(mode)
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(_step, fullgraph=True, dynamic=False, mode=mode)
    return _COMPILED[key]


def static_capacity(prompt_len: int, max_new_tokens: int) -> int:
    """Slots for a prompt and its tokens, rounded up to a multiple of :data:`CAPACITY_STEP`."""
    need = prompt_len + max_new_tokens
    return -(-need // CAPACITY_STEP) * CAPACITY_STEP


class StaticDecoder:
    """A model's prefill and decode step on a static cache, eager or compiled.

    Args:
        model: the language model (absolute or rotary positions).
        batch_size: B.
        capacity: C (see :func:`static_capacity`).
        compile: compile the step (``torch.compile(fullgraph=True)``).
    """

    def __init__(
        self, model: DecoderOnlyModel, batch_size: int, capacity: int, *, compile: bool
    ) -> None:
        self.model = model
        self.cache = model.new_static_cache(batch_size, capacity)
        device = self.cache.padding.device
        self._step: Step = compiled_step(device) if compile else _step

    def prefill(self, ids: Tensor, is_pad: Tensor | None) -> Tensor:
        """Run the ``[B, T0]`` prompt (eagerly) into the cache.

        Returns:
            the last column's logits ``[B, V]``.
        """
        self.cache.start(is_pad)
        slots = torch.arange(ids.shape[1], device=ids.device)  # [T0]
        return self.model.forward_static(ids, self.cache, slots, logits_to_keep=1)[:, -1]  # [B, V]

    def step(self, tokens: Tensor, slot: int) -> Tensor:
        """One step: ``[B]`` tokens written at ``slot`` -> logits ``[B, V]``."""
        position = torch.full((1,), slot, dtype=torch.long, device=tokens.device)  # [1]
        logits = self._step(self.model, tokens[:, None], self.cache, position)  # [B, V]
        # CUDA graphs reuse their output buffer: keep this step's logits
        return logits.clone() if logits.device.type == "cuda" else logits
