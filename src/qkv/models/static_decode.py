"""Decoding with a :class:`~qkv.nn.static_kv_cache.StaticKVCache` and a compiled step.

gpt-fast's recipe: the prompt runs eagerly (its length changes from call to call); each
decoding step is one call of :meth:`DecoderOnlyLM.forward_static` with fixed shapes (``[B, 1]``
tokens, a ``[1]`` cache position tensor, ``C`` cache slots), compiled once with
``torch.compile(fullgraph=True)`` and reused for every step and every later generation of the
same batch size and capacity. The capacity is rounded up to a multiple of :data:`CAPACITY_STEP`
so that prompts of nearby lengths share one compiled step. On CUDA the step is compiled with
``mode="reduce-overhead"`` (CUDA graphs). On the CPU two lengths are dynamic instead
(``torch._dynamo.mark_dynamic``): the slots a step attends over (those written so far) and the
capacity, so that one step serves every step and every prompt length (see
:class:`StaticDecoder`).

On the CPU the weights are laid out for reading few rows. MKL's unpacked ``sgemm`` on a few rows
of ``x @ W.t()`` repacks ``W`` on each call; measured on GPT-2 small, one thread, a decoding
step's matrix products took 0.66x the time with weights prepacked at B=8 and 0.9x with
column-major weights at B=1 (where prepacking gains nothing). So:

* **B = 1**: the step runs through ``torch.func.functional_call`` with a column-major copy of
  every ``Linear`` weight (:func:`~qkv.models.weight_copies.linear_weights`; the weights
  stay graph inputs), the query, key and value projections of each self-attention packed
  into one (:func:`~qkv.models.weight_copies.fused_qkv_weights`: one matrix product reads
  them, as CTranslate2 packs them; measured +3.6 % tokens/s on GPT-2 small and +2.4 % on the
  12-layer Llama-style model of ``benchmarks/decode.py``, one thread). The copies lie in
  memory maps on transparent huge pages (:func:`~qkv.models.weight_copies.huge_page_copies`:
  fewer TLB misses while streaming the weights). Its graph's wrapper is written in C++ by
  inductor (``cpp_wrapper``: no Python between the step's ~100 kernels): 0.96x the time of
  64 tokens on GPT-2 small and on the Llama-style model, one thread (at B=8, its products
  through MKL, the C++ wrapper was 1.02x the time, so there B > 1 keeps the Python wrapper;
  off Intel it does not, see below). Each one-row product reaches MKL as
  a contiguous row with its bias added outside it
  (:class:`~qkv.models.cpu_products.LeanRowProducts`: no clone of the row, no copy of the
  bias, ~1.2 ms of a 36 ms GPT-2 small step on an Intel Xeon, 1 thread). After a generation's
  first step, the later ones call its compiled graph without dynamo
  (:mod:`qkv.models.direct_step`: 0.95x the time of a GPT-2 small step on a Zen 3 EPYC, 2
  threads).
* **B > 1**: the step is compiled with inductor's *freezing* (``torch._inductor.config.freezing``):
  parameters and buffers become constants of the graph and inductor packs each ``Linear``
  weight for MKL once.

That is on Intel CPUs. Elsewhere MKL reads weights slowly (:mod:`qkv.models.cpu_products`:
on an AMD EPYC 18.7 GB/s at one row, 8 GB/s prepacked at eight), so off Intel the B = 1 copies
are row-major and inductor computes each one-row product itself, as a vectorized reduction
(:class:`~qkv.models.cpu_products.ProductsAsReductions`, 29.4 GB/s), and the B > 1 step is
traced with a symbolic batch size, for which freezing packs the weights for oneDNN instead
(27.7 GB/s; one graph then serves every batch size above 1). With AVX2 or AVX-512, inductor
also times oneDNN's product against its C++ GEMM template per weight shape while compiling
and keeps the faster (:func:`~qkv.models.cpu_products.frozen_configs`:
GPT-2 small's 49 products at 8 rows took 34.1-36.5 ms through the template against 45.6-46.9
ms through oneDNN on a Zen 3 EPYC, 2 threads). The prompt, which runs eagerly, multiplies
through oneDNN there too when torch runs more than one thread, or one on an AVX-512 CPU
(:mod:`qkv.models.onednn_products`: GPT-2 small's 16-token prompt took 64 ms against 82
through MKL, same Zen 3, 2 threads). Off Intel the B > 1 step's wrapper is written in C++
as well (``cpp_wrapper``): on a Zen 1 EPYC (AVX2, 2 cores), 64 tokens at B=8, a median of 7
generations in one process each, tokens/s: GPT-2 small 104.0-105.0 -> 112.2-114.1 (2 threads)
and 66.7 -> 70.4 (1 thread), the Llama-style model 135.6 -> 143.1 (2 threads); it compiles
~12 s longer. And inductor's template multiplies there in 8x8 register blocks (8x16 on AVX-512;
:func:`~qkv.models.template_blocks.few_row_blocks`) instead of its own choice for 8 rows,
4x24, which streams each weight panel from memory at one 4-row block's pace; and prefetches
the next panel into L2 (Zen 3, GPT-2 small, B=8, 2 threads: 1.04x and 1.08x the tokens/s).

Either way this costs one more copy of the weights in memory. A copy must not outlive the
weights it copies: each is kept with a fingerprint of the model's tensors (storage address and
version counter of every parameter and buffer, which any in-place write, ``load_state_dict`` or
optimizer step advances), and a changed fingerprint gets a fresh copy (B = 1) or a step of its
own, compiled anew (B > 1; the old one, and its frozen weights, are dropped with it).

This module imports no model module (the models import it): a model is a
:class:`~qkv.models.protocols.DecoderOnlyModel`.

Shapes: B batch, T0 prompt length, C capacity, V vocabulary.
"""

from __future__ import annotations

import contextlib
import threading
import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain
from typing import cast

import torch
from torch import Tensor, nn

from qkv.models.cpu_products import (
    LeanRowProducts,
    ProductsAsReductions,
    frozen_configs,
    mkl_reads_fast,
)
from qkv.models.direct_step import DirectCall, RecordingBackend
from qkv.models.onednn_products import OneDnnProducts, onednn_products_fit
from qkv.models.protocols import DecoderOnlyModel
from qkv.models.template_blocks import WIDE_BLOCK, few_row_blocks
from qkv.models.weight_copies import fused_qkv_weights, linear_weights
from qkv.nn.static_kv_cache import StaticKVCache

__all__ = ["CAPACITY_STEP", "StaticDecoder", "static_capacity"]

CAPACITY_STEP = 64
"""Cache slots are allocated in multiples of this, so nearby prompt lengths share a graph
(on CUDA; on the CPU every capacity shares one)."""

Step = Callable[[DecoderOnlyModel, Tensor, StaticKVCache, Tensor, Tensor | None], Tensor]


def _step(
    model: DecoderOnlyModel,
    ids: Tensor,
    cache: StaticKVCache,
    position: Tensor,
    window: Tensor | None,
) -> Tensor:
    """One decoding step: ``[B, 1]`` tokens at slot ``position`` -> ``[B, V]`` logits, attending
    over the slots of ``window`` (all with None)."""
    return model.forward_static(ids, cache, position, window=window)[:, -1]  # [B, V]


_COMPILED: dict[str, Callable[..., Tensor]] = {}
"""The compiled step per device kind (and on the CPU per products policy), for devices whose
graphs read the weights as inputs."""

_BACKENDS: dict[str, RecordingBackend] = {}
"""The backend of each CPU entry of :data:`_COMPILED` (for :class:`DirectCall`)."""

Fingerprint = tuple[tuple[int, int], ...]
_FROZEN: weakref.WeakKeyDictionary[nn.Module, tuple[Fingerprint, Step]] = (
    weakref.WeakKeyDictionary()
)
"""Per model: the fingerprint of its tensors and the step compiled with them frozen (CPU)."""


def fingerprint(model: nn.Module) -> Fingerprint:
    """Storage address and version counter of each of ``model``'s parameters and buffers."""
    return tuple((t.data_ptr(), t._version) for t in chain(model.parameters(), model.buffers()))


def _fresh_step() -> Step:
    """:func:`_step` under a code object of its own: dynamo keeps its graphs on the code object,
    so a fresh one compiles anew and dropping it frees the graphs (and their frozen weights)."""
    code = _step.__code__.replace()
    return types.FunctionType(code, _step.__globals__, _step.__name__)


def _frozen(step: Step) -> Step:
    """``step`` called under inductor freezing (each call: a guard failure recompiles in it),
    with :func:`~qkv.models.cpu_products.frozen_configs` as they are when it is made; off
    MKL's fast path (:func:`~qkv.models.cpu_products.mkl_reads_fast`) its wrapper is written
    in C++ (``cpp_wrapper``, see the module docstring) and inductor's GEMM template multiplies
    in 8x8 (AVX-512: 8x16) blocks, prefetching the next weight panel (``few_row_blocks``)."""
    mkl = mkl_reads_fast()
    configs = frozen_configs(mkl=mkl) | ({} if mkl else {"cpp_wrapper": True})

    def blocks() -> contextlib.AbstractContextManager[object]:
        if mkl:
            return contextlib.nullcontext()
        return few_row_blocks(prefetch=True, wide=(WIDE_BLOCK,))

    def call(
        model: DecoderOnlyModel,
        ids: Tensor,
        cache: StaticKVCache,
        pos: Tensor,
        window: Tensor | None,
    ) -> Tensor:
        with torch._inductor.config.patch(configs), blocks():
            return step(model, ids, cache, pos, window)

    return call


class _Forward(nn.Module):
    """:func:`_step` as a module's ``forward``, so that ``functional_call`` can run it with
    other weights (made for each decoder; it holds no weights of its own)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(
        self,
        ids: Tensor,
        cache: StaticKVCache,
        position: Tensor,
        window: Tensor | None,
        logits_to_keep: int = 0,
    ) -> Tensor:
        """``[B, T]`` tokens at slots ``position`` -> the last column's logits ``[B, V]``."""
        model = cast(DecoderOnlyModel, self.model)
        keep = logits_to_keep
        logits = model.forward_static(ids, cache, position, logits_to_keep=keep, window=window)
        return logits[:, -1]  # [B, V]


def _relaid_step(
    wrapper: _Forward,
    weights: dict[str, Tensor],
    ids: Tensor,
    cache: StaticKVCache,
    pos: Tensor,
    window: Tensor | None,
) -> Tensor:
    """:func:`_step` with ``weights`` (by ``wrapper``'s names) in place of the model's."""
    return torch.func.functional_call(wrapper, weights, (ids, cache, pos, window))  # [B, V]


@dataclass(frozen=True)
class _OneRowStep:
    """The B = 1 CPU step: ``run`` (compiled with ``backend``) on ``weights`` through
    ``wrapper``; called as a :data:`Step`."""

    run: Callable[..., Tensor]
    wrapper: _Forward
    weights: dict[str, Tensor]
    backend: RecordingBackend

    def __call__(
        self,
        _: DecoderOnlyModel,
        ids: Tensor,
        cache: StaticKVCache,
        pos: Tensor,
        window: Tensor | None,
    ) -> Tensor:
        return self.run(self.wrapper, self.weights, ids, cache, pos, window)  # [B, V]


_RELAID: weakref.WeakKeyDictionary[
    nn.Module, tuple[tuple[Fingerprint, bool], dict[str, Tensor]]
] = weakref.WeakKeyDictionary()
"""Per model: the fingerprint of its tensors and whether the copies are column-major, and its
relaid Linear weights (CPU, B=1), named as :class:`_Forward` names them."""


def relaid_weights(model: nn.Module) -> dict[str, Tensor]:
    """``model``'s :func:`linear_weights` and :func:`fused_qkv_weights` as :class:`_Forward`
    names them, column-major where :func:`~qkv.models.cpu_products.mkl_reads_fast`, else
    row-major; made anew only when the model's :func:`fingerprint` changed
    since the last call."""
    now, column_major = fingerprint(model), mkl_reads_fast()
    known = _RELAID.get(model)
    if known is None or known[0] != (now, column_major):
        fused, covered = fused_qkv_weights(model, column_major=column_major)
        copies = {**linear_weights(model, covered, column_major=column_major), **fused}
        named = {f"model.{name}": w for name, w in copies.items()}
        _RELAID[model] = known = ((now, column_major), named)
    return known[1]


def compiled_step(model: DecoderOnlyModel, device: torch.device, batch_size: int) -> Step:
    """The compiled :func:`_step` for ``model`` on ``device`` (see the module docstring).

    On CUDA one step per process (``mode="reduce-overhead"``): dynamo keeps one graph per model
    and shape behind it, guarded, and recompiles only when they change. On the CPU, for
    ``batch_size`` 1, one step per process that runs the model with copies of its ``Linear``
    weights (:func:`relaid_weights`, kept per model and :func:`fingerprint`; off Intel with its
    one-row products as reductions); for larger batches one step per model and fingerprint,
    compiled with its weights frozen.

    Raises:
        TypeError: a ``model`` that is not an ``nn.Module``.
    """
    if device.type == "cuda":
        if "cuda" not in _COMPILED:
            _COMPILED["cuda"] = torch.compile(
                _step, fullgraph=True, dynamic=False, mode="reduce-overhead"
            )
        return _COMPILED["cuda"]
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if batch_size == 1:
        mkl = mkl_reads_fast()
        key = "cpu" if mkl else "cpu, inductor products"  # a step per policy (it may change)
        if key not in _COMPILED:
            options: dict[str, object] = {
                "cpp_wrapper": True,
                "post_grad_custom_post_pass": LeanRowProducts() if mkl else ProductsAsReductions(),
            }
            _BACKENDS[key] = backend = RecordingBackend(options)
            _COMPILED[key] = torch.compile(
                _relaid_step, fullgraph=True, dynamic=False, backend=backend
            )
        weights = relaid_weights(model)
        return _OneRowStep(_COMPILED[key], _Forward(model), weights, _BACKENDS[key])
    now = fingerprint(model)
    known = _FROZEN.get(model)
    if known is None or known[0] != now:
        step = _frozen(torch.compile(_fresh_step(), fullgraph=True, dynamic=False))
        _FROZEN[model] = known = (now, step)
    return known[1]


def _may_skip_guards() -> bool:
    """Whether a step may skip dynamo's guard check (or dynamo itself, :class:`DirectCall`):
    not when the caller has set a stance of its own (``force_eager``, a backend, ...), which a
    ``"default"`` stance would override, nor when another Python thread is alive (the stance is
    the process's, not the thread's: another thread's compiled call, a first step of another
    model, would skip its check too; tqdm's monitor, which ``transformers`` starts and which
    only refreshes progress bars, does not count)."""
    me = threading.current_thread()
    for t in threading.enumerate():
        if t is not me and not type(t).__module__.startswith("tqdm."):
            return False
    now = getattr(torch._dynamo.eval_frame, "_stance", None)
    default = getattr(torch._dynamo.eval_frame, "DynamoStance", None)
    return now is not None and default is not None and now == default()


def _guards_skipped() -> contextlib.AbstractContextManager[object]:
    """``torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)`` where
    :func:`_may_skip_guards`, else nothing."""
    if not _may_skip_guards():
        return contextlib.nullcontext()
    return cast(
        contextlib.AbstractContextManager[object],
        torch.compiler.set_stance("default", skip_guard_eval_unsafe=True),
    )


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
        compile: compile the step (``torch.compile(fullgraph=True)``; on the CPU with the
            weights frozen, see :func:`compiled_step`).
        skip_guards: compiled on the CPU, check dynamo's guards on the first step only; later
            steps run under ``torch.compiler.set_stance(skip_guard_eval_unsafe=True)``. Only
            for a caller that runs no code of its user's between steps (``generate`` without a
            ``streamer``) and only while no other Python thread is alive: the guards check that
            the model, its weights and the cache are what the graph was traced from, and
            nothing else can change them mid-generation. The
            check took 0.5-0.6 ms of a ~17 ms step on GPT-2 small, B=1 (over 4,000 guards,
            most on the modules that ``functional_call`` walks); skipping it, 64 tokens took
            0.966x the time on 2 threads and 0.974x on 1 (B=8: 0.987x). A step that would
            need a recompile is caught by the first step's check, since every step of a
            generation passes the same guards (the compiled-step tests check each step).
            At B = 1 on the CPU the later steps skip dynamo altogether: they call the graph
            the first step ran, with that step's inputs
            (:class:`~qkv.models.direct_step.DirectCall`; while no other thread is alive, in
            the first step's grad mode).

    The prompt attends over its own slots and, on the CPU, each step over the slots written so
    far (:meth:`StaticKVCache.window`, its length marked dynamic so that the step still
    compiles once), not over all ``C``: at 64 new tokens after 16 (``C = 128``) that made
    GPT-2 small's compiled decoding 2-3% faster at B=1 and 9% at B=8 (2 threads). The
    capacity is marked dynamic as well, so on the CPU one compiled step serves every prompt
    length (measured: no slower than a step compiled for its capacity). On CUDA a step reads
    all ``C`` slots and compiles per capacity: CUDA graphs record one graph per shape.
    """

    def __init__(
        self,
        model: DecoderOnlyModel,
        batch_size: int,
        capacity: int,
        *,
        compile: bool,
        skip_guards: bool = False,
    ) -> None:
        self.model = model
        self.cache = model.new_static_cache(batch_size, capacity)
        device = self.cache.padding.device
        self._step: Step = compiled_step(model, device, batch_size) if compile else _step
        self._windowed, self._dynamic = device.type == "cpu", compile and device.type == "cpu"
        self._skip_guards, self._guarded = skip_guards and self._dynamic, False
        if self._dynamic:  # one graph for every capacity too
            for t in (*self.cache.keys, *self.cache.values):
                torch._dynamo.mark_dynamic(t, 2)  # [B, Hkv, C, Dh]
            torch._dynamo.mark_dynamic(self.cache.padding, 1)  # [B, C]
        # B > 1 off Intel: a symbolic batch makes freezing prepack the weights for oneDNN
        self._batch_dynamic = self._dynamic and batch_size > 1 and not mkl_reads_fast()
        if self._batch_dynamic:
            for t in (
                *self.cache.keys,
                *self.cache.values,
                self.cache.padding,
                self.cache.pad_count,
            ):
                torch._dynamo.mark_dynamic(t, 0)  # [B, ...]
        one_row = self._step if isinstance(self._step, _OneRowStep) else None
        self._backend = one_row.backend if one_row is not None and self._skip_guards else None
        self._direct: DirectCall | None = None  # the later steps, called without dynamo
        self._grad: bool | None = None  # grad mode of the first step
        # one row on the CPU: the prompt too reads the column-major copies the step reads
        relaid = compile and device.type == "cpu" and batch_size == 1
        self._prefill_weights = relaid_weights(model) if relaid else None  # type: ignore[arg-type]
        self._eager_prompt_on_cpu = compile and device.type == "cpu"  # (see prefill)

    def prefill(self, ids: Tensor, is_pad: Tensor | None) -> Tensor:
        """Run the ``[B, T0]`` prompt (eagerly) into the cache.

        Returns:
            the last column's logits ``[B, V]``.
        """
        self.cache.start(is_pad)
        slots = torch.arange(ids.shape[1], device=ids.device)  # [T0]
        window = self.cache.window(ids.shape[1])  # [B, T0]
        # a compiled CPU decoder's eager prompt multiplies through oneDNN where it reads faster
        onednn = self._eager_prompt_on_cpu and onednn_products_fit()
        with OneDnnProducts() if onednn else contextlib.nullcontext():
            if self._prefill_weights is not None:
                forward = _Forward(self.model)  # type: ignore[arg-type]
                args = (ids, self.cache, slots, window, 1)
                return torch.func.functional_call(forward, self._prefill_weights, args)  # [B, V]
            logits = self.model.forward_static(
                ids, self.cache, slots, logits_to_keep=1, window=window
            )  # [B, 1, V]
        return logits[:, -1]  # [B, V]

    def step(self, tokens: Tensor, slot: int) -> Tensor:
        """One step: ``[B]`` tokens written at ``slot`` -> logits ``[B, V]``."""
        position = torch.full((1,), slot, dtype=torch.long, device=tokens.device)  # [1]
        window = self.cache.window(slot + 1) if self._windowed else None  # [B, slot + 1]
        ids = tokens[:, None]  # [B, 1]
        same_mode = torch.is_grad_enabled() == self._grad  # as the first step's
        direct = self._direct
        if direct is not None and window is not None and same_mode and _may_skip_guards():
            return direct(ids, position, window)  # [B, V]
        if window is not None and self._dynamic:
            torch._dynamo.mark_dynamic(window, 1)  # one graph for every step's length
        if self._batch_dynamic and window is not None:
            for t in (ids, window):
                torch._dynamo.mark_dynamic(t, 0)
        skip = self._guarded and self._skip_guards and same_mode  # the first step was checked
        backend = None if self._guarded else self._backend  # (set only with skip_guards)
        if backend is not None:
            backend.arm()  # record the first step, to call the graph directly after it
        try:
            with _guards_skipped() if skip else contextlib.nullcontext():
                logits = self._step(self.model, ids, self.cache, position, window)  # [B, V]
        finally:
            record = backend.take() if backend is not None else None  # (disarmed either way)
        if record is not None and window is not None:
            self._direct = DirectCall.of(record, (ids, position, window), logits)
        if not self._guarded:
            self._guarded, self._grad = True, torch.is_grad_enabled()
        # CUDA graphs reuse their output buffer: keep this step's logits
        return logits.clone() if logits.device.type == "cuda" else logits
