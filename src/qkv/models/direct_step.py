"""A compiled decoding step called straight, without dynamo, once its first call was checked.

Under ``torch.compile`` every call of a step goes through dynamo: it looks the frame up in its
cache, checks (or, with ``skip_guard_eval_unsafe``, mostly skips) its guards, and runs the
bytecode that collects the graph's ~200 inputs (every weight, every cache tensor) from the
frame before it calls the compiled graph. On GPT-2 small's B = 1 CPU step (an AMD EPYC, Zen 3,
2 threads, guards already skipped) ``torch.profiler`` put that at ~0.65 ms of an ~18 ms step
(the cache lookup 0.35 ms, the bytecode before the graph 0.12 ms, the compiled region's own
time 0.18 ms); calling the graph directly instead, two decoders stepped in turn in one process,
made each step 0.95x the time (paired median over 5 x 62 steps; ~1 ms a step).

Within one generation only three of those inputs change from step to step: the ``[1, 1]``
tokens, the ``[1]`` cache position and the ``[1, n]`` window of written slots (with ``n``, a
dynamic size, and the window's row stride, the capacity, another); the weights, the cache
tensors and the model are the same objects at every step
(:class:`~qkv.models.static_decode.StaticDecoder` with ``skip_guards`` relies on that already).
So :class:`RecordingBackend` compiles each graph as usual and records the one call made after
:meth:`~RecordingBackend.arm`: the compiled function and its inputs. After a generation's first
step, whose guards dynamo checked in full, :meth:`DirectCall.of` finds where in those inputs
the three tensors of that step sit and which tensor size or stride each dynamic size was read
from, and later steps call the compiled function with the same list, those three tensors and
the sizes read from them replaced. What dynamo would have done after the graph, set the
attributes of :meth:`~qkv.nn.static_kv_cache.StaticKVCache.prepare` (the step's position and
window length, which only the step itself reads, and which the next generation's ``start``
resets), is left undone: they keep the first step's values.

Shapes: V vocabulary, n slots attended over.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import torch
from torch import Tensor

__all__ = ["CompileGraph", "DirectCall", "Record", "RecordingBackend"]

CompileGraph = Callable[[torch.fx.GraphModule, list[object]], Callable[..., object]]
"""A ``torch.compile`` backend: a dynamo graph and its example inputs -> the compiled function."""


@dataclass(frozen=True)
class Record:
    """One call of a compiled graph: its function, its inputs, its output and where each dynamic
    size among the inputs can be read (``(input, tensor input, d)``, see :func:`_size_sources`;
    None where one cannot be)."""

    fn: Callable[..., object]
    args: tuple[object, ...]
    out: object
    sizes: tuple[tuple[int, int, int], ...] | None


def _size_sources(gm: torch.fx.GraphModule) -> tuple[tuple[int, int, int], ...] | None:
    """For each input of ``gm`` that is a dynamic size: ``(its index, the index of a tensor
    input, d)``, where it is that tensor's size ``d`` (``d >= 0``) or its stride ``-1 - d``
    (``d < 0``: a window of slots is a view whose row stride is the capacity); None when one is
    in no tensor's shape or strides (the graph cannot then be called with sizes read from its
    tensors)."""
    values = [p.meta.get("example_value") for p in gm.graph.find_nodes(op="placeholder")]
    found: list[tuple[int, int, int]] = []
    for i, value in enumerate(values):
        if not isinstance(value, torch.SymInt):
            continue
        where = next(
            (
                (t, d)
                for t, tensor in enumerate(values)
                if isinstance(tensor, Tensor)
                for d, size in [*enumerate(tensor.shape), *_strides(tensor)]
                if isinstance(size, torch.SymInt) and size.node.expr == value.node.expr
            ),
            None,
        )
        if where is None:
            return None
        found.append((i, *where))
    return tuple(found)


def _strides(tensor: Tensor) -> list[tuple[int, int | torch.SymInt]]:
    """``(-1 - d, stride d)`` for each dim ``d`` of ``tensor``."""
    return [(-1 - d, stride) for d, stride in enumerate(tensor.stride())]


def _size(tensor: Tensor, d: int) -> int:
    """``tensor``'s size ``d`` (``d >= 0``) or its stride ``-1 - d``."""
    return tensor.shape[d] if d >= 0 else tensor.stride(-1 - d)


class RecordingBackend:
    """A ``torch.compile`` backend that compiles each graph with inductor (dynamo's
    ``"inductor"`` backend with ``options``), or with ``compile`` where given, and records the
    first call of any of its graphs after :meth:`arm`, for :meth:`DirectCall.of`.

    Only an armed call is recorded: a record holds its inputs (the weights, the cache), which
    must not outlive the generation that asked for them.

    Args:
        options: inductor's config patches (``torch.compile``'s ``options``).
        compile: another backend doing the work (tests: dynamo's ``"eager"``, the graph itself).
    """

    def __init__(
        self, options: dict[str, object] | None = None, *, compile: CompileGraph | None = None
    ) -> None:
        self.options = options
        self._compile = compile
        self._armed = False
        self._last: Record | None = None

    def __call__(
        self, gm: torch.fx.GraphModule, example_inputs: list[object]
    ) -> Callable[..., object]:
        """Compile ``gm``; return its function, which records a call made while armed."""
        fn: Callable[..., object]
        if self._compile is not None:
            fn = self._compile(gm, example_inputs)
        else:  # dynamo's "inductor" (torch imports dynamo and inductor on first access)
            backend = torch._dynamo.lookup_backend("inductor")
            inductor = cast(Callable[..., Callable[..., object]], backend)
            fn = inductor(gm, example_inputs, config_patches=self.options)
        sizes = _size_sources(gm)

        def recorded(*args: object) -> object:
            out = fn(*args)
            if self._armed:
                self._armed = False
                self._last = Record(fn, args, out, sizes)
            return out

        return recorded

    def arm(self) -> None:
        """Record the next call (and only that one)."""
        self._armed, self._last = True, None

    def take(self) -> Record | None:
        """The call recorded since :meth:`arm`, or None; disarms and forgets it here."""
        last, self._last, self._armed = self._last, None, False
        return last


class DirectCall:
    """One generation's compiled step, called without dynamo (see the module docstring).

    Made by :meth:`of` from the record of the generation's first step; call it with each
    later step's tokens, position and window.
    """

    def __init__(
        self,
        record: Record,
        slots: tuple[int, int, int],
        moving: tuple[tuple[int, int, int], ...],
    ) -> None:
        """``slots``: where the tokens, position and window sit among the record's inputs;
        ``moving``: the sizes read from those three (the others, each cache tensor's capacity,
        stay as recorded: the same tensors at every step)."""
        self._fn = record.fn
        self._args = list(record.args)
        self._slots = slots
        self._moving = moving

    @classmethod
    def of(
        cls,
        record: Record,
        step: Sequence[Tensor],
        logits: Tensor,
    ) -> DirectCall | None:
        """The step just run through dynamo, as a direct call, or None where it cannot be one.

        Args:
            record: :meth:`RecordingBackend.take` after the step.
            step: the step's ``(tokens, position, window)``, the very tensors passed to it.
            logits: what the step returned.

        Returns:
            None unless the record's inputs hold each of ``step`` exactly once, its dynamic
            sizes can each be read from a tensor input, and its output is ``logits`` followed
            by sizes only (dynamo returned the graph's one tensor as it is; the sizes are what
            it sets the cache's attributes to, see the module docstring).
        """
        if record.sizes is None:
            return None
        out = record.out
        if not isinstance(out, (list, tuple)) or not out or out[0] is not logits:
            return None
        if any(isinstance(o, Tensor) for o in out[1:]):
            return None  # a second tensor out: dynamo would have done something with it
        found = [[i for i, a in enumerate(record.args) if a is t] for t in step]
        if any(len(f) != 1 for f in found):
            return None
        tokens, position, window = (f[0] for f in found)
        for i, t, d in record.sizes:  # each size is what its tensor says (a self-check)
            tensor = record.args[t]
            if not isinstance(tensor, Tensor) or _size(tensor, d) != record.args[i]:
                return None
        moving = tuple(size for size in record.sizes if size[1] in (tokens, position, window))
        return cls(record, (tokens, position, window), moving)

    def __call__(self, tokens: Tensor, position: Tensor, window: Tensor) -> Tensor:
        """The step for ``[1, 1]`` tokens at ``[1]`` position over the ``[1, n]`` window ->
        logits ``[1, V]``, in the grad mode of the first step (in another, dynamo would have
        compiled another graph)."""
        args = self._args
        t, p, w = self._slots
        args[t], args[p], args[w] = tokens, position, window
        for i, tensor, d in self._moving:
            args[i] = _size(args[tensor], d)  # type: ignore[arg-type]
        out = self._fn(*args)
        return out[0]  # type: ignore[index]  # [1, V]
