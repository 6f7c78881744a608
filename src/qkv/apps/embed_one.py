"""One sentence to its unit embedding through an AOTInductor program: no guards, no Python per op.

A search query is one short sentence: all-MiniLM-L6-v2 spends about 1.5 ms on it, and
``torch.compile``'s per-call costs are a large share of that (dynamo's guards over ~100 weights,
the Python side of the call). :class:`OneSentenceProgram` runs the whole encoder for one
sentence (no padding, so no attention mask and no packing) as a program compiled ahead of time
by AOTInductor (``torch.export``, then ``torch._inductor.aoti_compile_and_package``), its token
count a dynamic dimension, and calls it through the package loader's ``boxed_run``. Measured on
all-MiniLM-L6-v2, 2 threads, a 5-token sentence (one process, against ONNX Runtime): the same
function under ``torch.compile`` took 1.72-1.89 ms, through AOTInductor's ``__call__`` 1.60 ms
(it re-reads its call spec each call), through ``boxed_run`` 1.28-1.40 ms, and 1.20 ms with
the biases added apart from the matrix products (below); ONNX Runtime 1.37-1.54 ms.

Off Intel CPUs the first program is **frozen**: the weights of the first call are its
constants, inductor's freezing packs every matrix for oneDNN's product (a ``[N]`` token count
is dynamic, so freezing picks oneDNN over MKL), and on AVX2 and AVX-512 CPUs each product
runs the faster, timed while compiling, of oneDNN's and inductor's C++ GEMM template
(:func:`~qkv.models.cpu_products.frozen_configs`), the template in register blocks for few
rows (:func:`~qkv.models.template_blocks.few_row_blocks`): first 8x8 (on a Zen 1 EPYC the 24
products took 3.48 / 5.53 / 9.46 ms at 5 / 12 / 22 rows against 4.46 / 8.23 / 13.85 in its own
4x24), now 6x16 (:data:`~qkv.models.template_blocks.SENTENCE_BLOCK`: on a Zen 3 EPYC 3.33 /
4.79 / 7.23 ms against 3.76 / 5.02 / 7.94 in 8x8; on AVX-512 8x16,
:data:`~qkv.models.template_blocks.WIDE_BLOCK`), each kernel prefetching the next weight
panel while it multiplies one (``prefetch=True``; 2.15 / 3.43 / 5.43 ms against 2.83 / 4.10 /
6.11 without, the same Zen 3 in another run).
A few rows then read each weight about once at memory speed: on a 2-core AMD EPYC with AVX-512
(Zen 4), the 24 products of a 5-token sentence took 1.62 ms packed for oneDNN against 3.79 ms
through MKL on column-major weights (ONNX Runtime's MatMuls: 1.54 ms), and the whole sentence
1.76-1.98 ms frozen, 4.0-5.5 ms with weights as inputs, ONNX Runtime 2.09-2.22 ms, side by
side; on one with AVX2 only (Zen 3) oneDNN took 4.3-4.9 ms and the template 2.3-2.5 ms. On
that Zen 4, 5-, 12- and 22-token sentences took 2.13 / 2.99 / 4.10 ms through oneDNN alone
against ONNX Runtime's 1.97 / 3.02 / 4.20, and 1.60 / 2.84 / 4.41 in the template's 8x16
blocks with the prefetch against 2.44 / 3.16 / 5.12 (two runs, the machine slower in the
second).
Those timings depend on the row count, so there short sentences (under :data:`LONG_TOKENS`
tokens) and long ones run two frozen programs, each timed at a length of its own. A frozen
program cannot follow new weights (runtime constant folding does not keep the unpacked ones),
so the first call whose weights differ from the frozen ones compiles the program that reads
them once, for good: its weights are inputs, remade when they change, so a model being trained
does not compile again at each step.
Each call compares a fingerprint of every source tensor's identity, storage address and version
counter (in-place writes, ``load_state_dict``, ``.data =`` and replaced parameters are all
seen): ~25 us with warm caches, 160-185 us right after the program has streamed its weights.

That program's weights are laid out for products on few rows: each ``Linear`` weight as a
column-major copy (``x @ W.t()`` then reads a contiguous ``[K, N]``: 24 products on 5 rows took
0.73x the time of the row-major weights on an Intel Xeon) and each layer's query, key and value
projections packed into one (the frozen program packs them too). Each bias is added to its
product outside the product (``(x @ W.t())[None] + b``): inductor then adds it inside the next
fused kernel, where a fused ``addmm`` first copies the bias into its output (~3 us a product).
The frozen program uses ``F.linear``, whose bias oneDNN adds inside its product.

Shapes: N tokens of the sentence, D embedding width, H heads, Dh head width, F feed-forward
width.
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import cast

import torch
from torch import Tensor, nn

from qkv.apps.embed_one_function import (
    OnePlan,
    _Exported,
    _Frozen,
    _laid_out,
    encode_one,
)
from qkv.models.bert import BertEncoder
from qkv.models.cpu_products import frozen_configs, mkl_reads_fast
from qkv.models.template_blocks import SENTENCE_BLOCK, WIDE_BLOCK, few_row_blocks
from qkv.models.unpadded import runs_unpadded

__all__ = ["OnePlan", "OneSentenceProgram", "encode_one"]

_VERSION = operator.attrgetter("_version")

Fingerprint = tuple[list[int], list[int], list[int]]
"""Identities, storage addresses and versions of the source tensors."""

LONG_TOKENS = 8
"""Where the frozen program's products are timed while compiling (AVX2 or AVX-512:
:func:`~qkv.models.cpu_products.frozen_configs`), sentences of fewer tokens than this and the
others run two frozen programs, each timed at a typical length of its own
(:data:`SIZE_HINTS`), each compiled on the first sentence of its span. The product chosen for
5 rows is not the one for 16: on a 2-core Zen 1 EPYC, all-MiniLM-L6-v2's 24 products took,
through inductor's C++ GEMM template timed at 5 rows against oneDNN's, 3.74 / 3.94 / 5.45 /
7.82 / 10.03 / 14.47 ms at 5 / 6 / 8 / 12 / 16 / 24 rows, and 4.23 / 4.48 / 5.11 / 6.40 /
8.03 / 9.79 ms through oneDNN alone. (Measured before the template's 8x8 blocks
(:func:`~qkv.models.template_blocks.few_row_blocks`), with which the length it is timed at
matters less: 7.15 / 9.50 ms at 16 / 22 rows timed at 5, 6.93 / 9.13 timed at 16, each
program in a process of its own.)"""

SIZE_HINTS = (5, 16)
"""The token counts at which the short and the long program are compiled and their products
timed (the example sentence of each export)."""

FROZEN_MAX_BYTES = 1 << 30
"""Weights (every source tensor, the embedding tables included) of more bytes than this are
never frozen into a program: its shared library holds them as data, and past ~2 GB that needs
other linking; a copy of them also stays in memory beside the model's own."""


def _program_input(t: Tensor, device: torch.device) -> Tensor:
    """``t`` as the program takes it: int64, contiguous, on the weights' ``device`` (``t``
    itself where it is so: no copy for a tokenizer's row on the CPU)."""
    if t.dtype is torch.int64 and t.device == device and t.is_contiguous():
        return t
    return t.to(device, torch.int64).contiguous()


Span = tuple[int, int, int | None]
"""A frozen program's token counts: the least, the most, and the count it is compiled at
(``None``: the first sentence's)."""


def _spans(limit: int) -> list[Span]:
    """The frozen programs' spans of token counts, ``2..limit`` in all: two where their
    products are timed while compiling (see :data:`LONG_TOKENS`), else one."""
    timed = "max_autotune_gemm" in frozen_configs(mkl=False)
    if not timed or limit < max(LONG_TOKENS, SIZE_HINTS[1]):
        return [(2, limit, None)]
    return [(2, LONG_TOKENS - 1, SIZE_HINTS[0]), (LONG_TOKENS, limit, SIZE_HINTS[1])]


def _example(t: Tensor, n: int | None) -> Tensor:
    """``t`` (``[1, N]``) cycled or cut to ``n`` tokens (itself for ``None``): an example
    sentence of that length for ``torch.export``, its values only traced."""
    if n is None or n == t.shape[1]:
        return t
    return t[:, torch.arange(n, device=t.device) % t.shape[1]].contiguous()  # [1, n]


def _freezes(sources: list[Tensor]) -> bool:
    """Whether the first program freezes these weights: where MKL does not read fast
    (:func:`~qkv.models.cpu_products.mkl_reads_fast`) and they hold at most
    :data:`FROZEN_MAX_BYTES`."""
    size = sum(t.numel() * t.element_size() for t in sources)
    return size <= FROZEN_MAX_BYTES and not mkl_reads_fast()


class OneSentenceProgram:
    """``model``'s embedding of one sentence through an AOTInductor program (see the module
    docstring): compiled on the first call with that call's weights frozen into it (where the
    products are timed while compiling, one program for sentences of fewer than
    :data:`LONG_TOKENS` tokens and one for the others, each compiled on the first sentence of
    its span with the same weights), and once more, with the weights as inputs, on the first
    call whose weights changed. Where MKL reads
    column-major weights at memory speed (:func:`~qkv.models.cpu_products.mkl_reads_fast`: an
    Intel CPU, or ``QKV_CPU_PRODUCTS=mkl``), the program reads the weights from the first call
    (on an Intel Xeon freezing gained nothing over it), and so it does for weights of more than
    :data:`FROZEN_MAX_BYTES`.

    Args:
        model: a :class:`BertEncoder` in eval mode whose layers run plain
            (:func:`~qkv.models.unpadded.runs_unpadded`), with biases on every ``Linear``.

    Attributes:
        compiled: programs compiled so far: the frozen ones (one per span of token counts
            that has run), then one that reads the weights (another only when their dtype or
            device changes).
        compile_seconds: wall time spent compiling them.
        reads_weights: whether the program reading the weights as inputs runs (for good): the
            weights changed after the frozen program was compiled, MKL reads fast here, or
            the weights are too large to freeze.

    Raises:
        ValueError: a model this program does not reproduce (see :meth:`supports`).
    """

    def __init__(self, model: BertEncoder) -> None:
        if not self.supports(model):
            raise ValueError(
                "OneSentenceProgram needs a BertEncoder whose layers run plain "
                "(no hooks, no recorded weights) and whose Linear layers all have biases"
            )
        self.model = model
        self.compiled = 0
        self.compile_seconds = 0.0
        self.reads_weights = False
        self._fingerprint: Fingerprint = ([], [], [])  # of the weights in self._weights
        self._frozen_at: Fingerprint | None = None  # of the weights frozen into the programs
        self._frozen: dict[Span, Callable[[list[Tensor]], list[Tensor]]] = {}  # by span
        self._spans: list[Span] | None = None  # read on the first frozen call (_spans)
        self._known: list[int] = []  # identities of the sources in self._tensors
        self._tensors: list[Tensor] = []  # the sources found last (none of them None)
        self._weights: list[Tensor] = []
        self._run: Callable[[list[Tensor]], list[Tensor]] | None = None  # reads the weights
        # the dtype and device of self._weights, and of the weights self._run was compiled for
        self._weights_key: tuple[torch.dtype, torch.device] | None = None
        self._run_key: tuple[torch.dtype, torch.device] | None = None
        # (dictionaries, keys) for map(dict.get, ...): the model's submodule slots, the sources'
        self._tree: tuple[list[dict[str, nn.Module | None]], list[str]] = ([], [])
        self._submodules: list[nn.Module | None] = []
        self._slots: tuple[list[dict[str, nn.Parameter | None]], list[str]] | None = None

    @staticmethod
    def supports(model: nn.Module) -> bool:
        """Whether :func:`encode_one` reproduces ``model``'s pooled embeddings."""
        if not isinstance(model, BertEncoder):
            return False
        layers = model._layers()
        if not all(runs_unpadded(layer) and not layer.norm_first for layer in layers):
            return False
        linears = [m for layer in layers for m in layer.modules() if isinstance(m, nn.Linear)]
        return all(m.bias is not None for m in linears)

    def plan(self) -> OnePlan:
        """The model's sizes."""
        cfg = self.model.config
        attn = self.model._layers()[0].self_attn
        scale = attn.scale if attn.scale is not None else attn.head_dim**-0.5
        return OnePlan(
            layers=cfg.num_hidden_layers,
            heads=cfg.num_attention_heads,
            width=cfg.hidden_size,
            eps=cfg.layer_norm_eps,
            scale=float(scale),
            activation=cfg.hidden_act,
        )

    def _sources(self) -> list[Tensor | None]:
        """Every tensor the weight list is made from, in a fixed order (``None`` where a
        parameter was set to ``None``: :meth:`weights` refuses it).

        Read through the modules' own dictionaries with C-level ``map`` over slots found once,
        walked again only when a submodule was replaced: reading ~100 parameters as attributes
        took ~120 us a call here, a Python loop over the dictionaries ~15 us.
        """
        if self._slots is None or list(map(dict.get, *self._tree)) != self._submodules:
            tree = [(m._modules, name) for m in self.model.modules() for name in m._modules]
            self._tree = ([d for d, _ in tree], [name for _, name in tree])
            self._submodules = list(map(dict.get, *self._tree))  # compared by identity
            emb = self.model.embeddings
            slots = [
                (emb.word_embeddings, "weight"),
                (emb.position_embeddings, "weight"),
                (emb.token_type_embeddings, "weight"),
                (emb.norm, "weight"),
                (emb.norm, "bias"),
            ]
            for layer in self.model._layers():
                a, ffn = layer.self_attn, layer.ffn
                for m in (a.q_proj, a.k_proj, a.v_proj, a.out_proj, layer.norm1, ffn.fc1, ffn.fc2):
                    slots += [(m, "weight"), (m, "bias")]
                slots += [(layer.norm2, "weight"), (layer.norm2, "bias")]
            self._slots = ([m._parameters for m, _ in slots], [name for _, name in slots])
        return list(map(dict.get, *self._slots))

    def _fingerprinted(self) -> tuple[list[Tensor], Fingerprint]:
        """The source tensors and their fingerprint: identities, storage addresses and versions.

        A source changed when it is another object (a replaced parameter), has another storage
        address (``.to()``, ``.data =``) or another version (an in-place write). The sources
        found last stand while the modules still hold those very objects (two C-level passes
        of ``is``: ~20 us a call less than making the lists anew on cold caches); otherwise
        :meth:`_sources` reads them again and a ``None`` (a removed parameter) is refused.

        Raises:
            ValueError: a weight or bias of the model was set to ``None``.
        """
        tensors = self._tensors
        if not (
            tensors
            and self._slots is not None
            and all(map(operator.is_, map(dict.get, *self._tree), self._submodules))
            and all(map(operator.is_, map(dict.get, *self._slots), tensors))
        ):
            sources = self._sources()
            if any(t is None for t in sources):
                raise ValueError("a weight or bias of the model was removed since it was checked")
            tensors = self._tensors = cast(list[Tensor], sources)
            self._known = list(map(id, tensors))
        pointers, versions = list(map(Tensor.data_ptr, tensors)), list(map(_VERSION, tensors))
        return tensors, (self._known, pointers, versions)

    def weights(self) -> list[Tensor]:
        """The weight inputs of the program that reads them, remade when a source tensor
        changed since they were made (see :meth:`_fingerprinted`).

        Returns:
            The embeddings' 5 tensors (word, position, token type, norm weight and bias), then
            per layer 12: the packed query-key-value weight ``[3D, D]`` (column-major) and bias
            ``[3D]``, the output projection's weight (column-major) and bias, the first norm's
            weight and bias, the feed-forward's two weights (column-major) and biases, the
            second norm's weight and bias.

        Raises:
            ValueError: a weight or bias of the model was set to ``None``.
        """
        return self._weights_for(*self._fingerprinted())

    def _weights_for(self, tensors: list[Tensor], now: Fingerprint) -> list[Tensor]:
        """:meth:`weights` from the sources and their fingerprint."""
        if now != self._fingerprint:
            self._weights = _laid_out(tensors, column_major=True)
            self._weights_key = (self._weights[0].dtype, self._weights[0].device)
            self._fingerprint = now
        return self._weights

    def __call__(self, ids: Tensor, types: Tensor) -> Tensor:
        """Embed one sentence.

        Args:
            ids: ``[1, N]`` token ids (a batch of one, as a tokenizer gives it),
                ``2 <= N <= max_position_embeddings``, all real. The program takes int64,
                contiguous, on the weights' device: other ids are copied so first.
            types: ``[1, N]`` token type ids, likewise.

        Returns:
            ``[1, D]`` unit-length embedding.

        Raises:
            ValueError: ``ids`` and ``types`` not both of one shape ``[1, N]``, or ``N``
                outside ``[2, max_position_embeddings]`` (the values are the caller's to
                check).
        """
        limit = self.model.config.max_position_embeddings
        shape = ids.shape
        if len(shape) != 2 or shape[0] != 1 or shape != types.shape or not 2 <= shape[1] <= limit:
            raise ValueError(
                f"ids and types must both be [1, N] with 2 <= N <= {limit}, got "
                f"{list(ids.shape)} and {list(types.shape)}"
            )
        tensors, now = self._fingerprinted()
        device = tensors[0].device
        ids, types = _program_input(ids, device), _program_input(types, device)
        if not self.reads_weights and self._frozen_at is None and not _freezes(tensors):
            self.reads_weights = True  # MKL reads fast here, or the weights are too large
        if not self.reads_weights:
            if self._spans is None:
                self._spans = _spans(limit)
            n = shape[1]
            span = next(s for s in self._spans if s[0] <= n <= s[1])
            run = self._frozen.get(span)
            if run is None and self._frozen_at in (None, now):  # the span's first sentence
                laid_out = _laid_out(tensors, column_major=False)
                run = self._compile(ids, types, laid_out, frozen=True, span=span)
                self._frozen[span], self._frozen_at = run, now
            if run is not None and now == self._frozen_at:
                return run([ids, types])[0]  # [1, D]
            self.reads_weights, self._frozen = True, {}  # changed: read them from now on
        weights = self._weights_for(tensors, now)
        if self._run is None or self._run_key != self._weights_key:
            self._run = self._compile(ids, types, weights, frozen=False)
            self._run_key = self._weights_key
        return self._run([ids, types, *weights])[0]  # [1, D]

    def _compile(
        self,
        ids: Tensor,
        types: Tensor,
        weights: list[Tensor],
        *,
        frozen: bool,
        span: Span | None = None,
    ) -> Callable[[list[Tensor]], list[Tensor]]:
        """Export :func:`encode_one` with a dynamic token count and compile it with AOTInductor.

        Args:
            ids: ``[1, N]`` an example sentence's ids.
            types: ``[1, N]`` its token types.
            weights: the weight list (:meth:`weights`, or its row-major form when ``frozen``).
            frozen: make the weights the program's constants, packed by inductor's freezing,
                instead of its inputs.
            span: the token counts the program takes and the one it is compiled at (the
                example is cycled or cut to it); ``None``: 2 to ``max_position_embeddings``,
                compiled at ``N``.

        Returns:
            The loaded program's ``boxed_run``: ``[ids, types]`` (frozen) or
            ``[ids, types, *weights]`` -> the outputs.
        """
        start = time.perf_counter()
        low, high, hint = span or (2, self.model.config.max_position_embeddings, None)
        ids, types = _example(ids, hint), _example(types, hint)
        n = torch.export.Dim("N", min=low, max=high)
        module: nn.Module
        example: tuple[Tensor, ...]
        dims: tuple[object, ...]
        if frozen:
            module = _Frozen(dataclasses.replace(self.plan(), frozen=True), weights)
            example, dims = (ids, types), ({1: n}, {1: n})
        else:
            module = _Exported(self.plan())
            example, dims = (ids, types, *weights), ({1: n}, {1: n}, (None,) * len(weights))
        with torch.no_grad():
            program = torch.export.export(module, example, dynamic_shapes=dims)
            few_rows = few_row_blocks((SENTENCE_BLOCK,), prefetch=True, wide=(WIDE_BLOCK,))
            blocks = few_rows if frozen else contextlib.nullcontext()
            with tempfile.TemporaryDirectory() as tmp, blocks:
                path = torch._inductor.aoti_compile_and_package(
                    program,
                    package_path=str(Path(tmp) / "embed_one.pt2"),
                    inductor_configs=frozen_configs(mkl=False) if frozen else {},
                )
                loaded = torch._inductor.aoti_load_package(path)
        self.compiled += 1
        self.compile_seconds += time.perf_counter() - start
        run: Callable[[list[Tensor]], list[Tensor]] = loaded.loader.boxed_run
        return run
