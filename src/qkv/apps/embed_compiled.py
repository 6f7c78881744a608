"""Sentence embeddings through one compiled graph: ids to unit vectors, no Python per op.

:class:`CompiledEmbedder` runs a :class:`~qkv.models.bert.BertEncoder` with ``torch.compile``
(inductor) on the real tokens only, as the eager ``unpad=True`` path does (see
:mod:`qkv.models.unpadded`): the tokens of a batch are packed into ``[N, D]`` rows on the host
(ids, positions, where each row sits in the ``[B, T']`` attention grid), and one graph runs the
embeddings, every layer's submodules on the rows (attention on the grid, the padding keys as a
float bias), mean pooling and L2 normalization. It is compiled with dynamic shapes, so new batch
sizes and lengths reuse it (a batch of one sentence gets a graph of its own: dynamo specializes
sizes of 1). The eager path's checks run once per batch on the host ids, not in the graph.
A short batch is mostly the cost of calling the kernels, so batches of at most
:data:`FEW_TOKENS` real tokens run graphs whose wrapper inductor writes in C++ (no Python
between kernels), compiled separately. A batch of one sentence (a search query) on the CPU runs
:class:`~qkv.apps.embed_one.OneSentenceProgram` instead: the encoder compiled ahead of time by
AOTInductor, called without guards, its weights frozen into it and packed for oneDNN (off
Intel CPUs, until they change) or read as column-major copies (remade when they change).
(Column-major copies of the weights, which speed
compiled decoding, did not help the packed graph: 1.05x the time for one sentence.)

Shapes: B batch, T padded length, N real tokens, T' longest sentence, D embedding width,
H heads, Dh head width.
"""

from __future__ import annotations

import functools
import time

import torch
from torch import Tensor

from qkv.apps.embed_one import OneSentenceProgram
from qkv.apps.pooling import l2_normalize
from qkv.functional import attention
from qkv.models.bert import BertEncoder
from qkv.models.unpadded import layer_on_rows, runs_unpadded
from qkv.nn.multihead import MultiHeadAttention

__all__ = ["FEW_TOKENS", "CompiledEmbedder"]

FEW_TOKENS = 256
"""Batches of at most this many real tokens run graphs whose wrapper inductor writes in C++
(``cpp_wrapper``): measured on all-MiniLM-L6-v2, 2 threads, against the Python wrapper, 0.88x
the time for one sentence (5 tokens), 0.93x for 4 and 0.98x for 16, but 1.04x for 32 sentences
(496 tokens) and 1.05x for 128; a C++ wrapper also takes about twice as long to compile."""


class CompiledEmbedder:
    """``model``'s mean-pooled, unit-length sentence embeddings through ``torch.compile``.

    Args:
        model: the encoder, in eval mode, its layers plain (:func:`runs_unpadded`); its
            weights are read at each call (the one-sentence program's copies are remade when
            they changed).
        compiler: the ``torch.compile`` backend (``"eager"`` traces without generating code:
            quick, for tests; it also leaves out the one-sentence program).

    Attributes:
        graphs: graphs and programs compiled so far (each is paid once: see
            :attr:`compile_seconds`).
        compile_seconds: wall time of the calls that compiled a graph.

    Raises:
        TypeError: a ``model`` that is not a :class:`BertEncoder`.
        ValueError: a layer that the packed rows would not reproduce (hooks, recorded weights).
    """

    def __init__(self, model: BertEncoder, *, compiler: str = "inductor") -> None:
        if not isinstance(model, BertEncoder):
            raise TypeError(f"model must be a BertEncoder, got {type(model).__name__}")
        if not all(runs_unpadded(layer) for layer in model._layers()):
            raise ValueError("model has hooks or records attention weights; compile without them")
        self.model = model
        self.graphs = 0
        self.compile_seconds = 0.0
        compile_ = functools.partial(torch.compile, backend=compiler, dynamic=True, fullgraph=True)
        self._compiled = compile_(self._pooled)
        self._compiled_few = self._compiled
        self._one: OneSentenceProgram | None = None
        if compiler == "inductor":  # few tokens: inductor's C++ wrapper, no Python per kernel
            self._compiled_few = compile_(self._pooled, options={"cpp_wrapper": True})
            if OneSentenceProgram.supports(model):
                self._one = OneSentenceProgram(model)

    def _pooled(
        self, rows: tuple[Tensor, Tensor, Tensor], grid_index: Tensor, bias: Tensor
    ) -> Tensor:
        """The graph: packed ``(ids, positions, types)`` ``[N]`` each, each row's flat place in
        the grid ``[N]`` and the grid's padding bias ``[B, 1, 1, T']`` -> ``[B, D]``."""
        emb = self.model.embeddings
        ids, positions, types = rows
        x = emb.word_embeddings(ids) + emb.position_embeddings(positions)  # [N, D]
        x = emb.dropout(emb.norm(x + emb.token_type_embeddings(types)))  # [N, D]
        grid = _Grid(grid_index, bias)
        for layer in self.model._layers():
            x = layer_on_rows(layer, x, grid.attend_with(layer.self_attn))  # [N, D]
        lengths = (bias == 0).sum(dim=-1).view(-1, 1)  # [B, 1]
        return l2_normalize(grid.place(x).sum(dim=1) / lengths)  # [B, D]

    def __call__(self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor) -> Tensor:
        """Embed one tokenized batch.

        Args:
            input_ids: ``[B, T]`` int64 ids, padded on the right.
            attention_mask: ``[B, T]``, 1 = token, 0 = padding.
            token_type_ids: ``[B, T]`` segment ids.

        Returns:
            ``[B, D]`` unit-length embeddings (0 for a sentence without any token), on the
            model's device.

        Raises:
            ValueError: tensors of other shapes, a mask that is not 1s then 0s, ids outside
                the vocabulary or the token types, a batch longer than
                ``max_position_embeddings``.
            RuntimeError: the model is in training mode.
        """
        if self.model.training:
            raise RuntimeError("CompiledEmbedder is for inference: call model.eval() first")
        if self._one is not None and input_ids.dim() == 2 and input_ids.shape[0] == 1:
            one = self._one_sentence(input_ids, attention_mask, token_type_ids)
            if one is not None:
                return one  # [1, D]
        self._check(input_ids, attention_mask, token_type_ids)
        device = next(self.model.parameters()).device
        out = torch.zeros(input_ids.shape[0], self.model.config.hidden_size, device=device)
        lengths = attention_mask.sum(dim=1)  # [B]
        live = lengths > 0  # [B]: sentences with a token
        if not bool(live.any()):
            return out  # [B, D]
        keep = attention_mask[live, : int(lengths.max())].bool()  # [B', T']
        real = keep.nonzero(as_tuple=True)  # [N] each: sentence, position
        positions = real[1]  # [N]
        grid_index = real[0] * keep.shape[1] + positions  # [N]
        bias = torch.zeros(keep.shape).masked_fill(~keep, -torch.inf)[:, None, None, :]
        ids, types = input_ids[live][real], token_type_ids[live][real]  # [N] each
        packed = (ids.to(device), positions.to(device), types.to(device))
        out[live.to(device)] = self._run(packed, grid_index.to(device), bias.to(device))
        return out  # [B, D]

    def _run(self, rows: tuple[Tensor, Tensor, Tensor], grid_index: Tensor, bias: Tensor) -> Tensor:
        """The compiled graph, counting the graphs it compiles and their time."""
        counters = torch._dynamo.utils.counters  # (torch imports dynamo on first access)
        before = counters["stats"]["unique_graphs"]
        start = time.perf_counter()
        few = rows[0].shape[0] <= FEW_TOKENS
        pooled = (self._compiled_few if few else self._compiled)(rows, grid_index, bias)  # [B', D]
        if counters["stats"]["unique_graphs"] != before:
            self.graphs += counters["stats"]["unique_graphs"] - before
            self.compile_seconds += time.perf_counter() - start
        return pooled

    def _one_sentence(
        self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor
    ) -> Tensor | None:
        """A batch of one sentence through :class:`OneSentenceProgram`, checked on the host.

        The one-sentence path is there for its small per-call cost: the checks of
        :meth:`_check` run here on Python lists of the ``[1, T]`` row (three ``tolist``
        calls), not as ~10 small torch operations (measured in the benchmark's loop, where
        the program has just evicted the caches: ~150 us of a 1.8 ms call). A sentence without
        padding goes to the program as the caller's own ``[1, T]`` tensors (copied there only if
        they are not int64 and contiguous): two new tensors made from the lists took ~100 us.

        Returns:
            ``[1, D]``, or ``None`` where the general path must take the batch: a model off
            the CPU, fewer than 2 tokens, or anything :meth:`_check` would refuse (it then
            raises its error there).
        """
        assert self._one is not None
        cfg = self.model.config
        T = input_ids.shape[1]
        if (
            attention_mask.shape != input_ids.shape
            or token_type_ids.shape != input_ids.shape
            or not 2 <= T <= cfg.max_position_embeddings
            or input_ids.dtype.is_floating_point
            or token_type_ids.dtype.is_floating_point
            or self.model.embeddings.word_embeddings.weight.device.type != "cpu"
        ):
            return None
        # [1, T] -> [[T]]: no indexing of the tensors (a cold `t[0]` took ~15 us here)
        mask, ids, types = (t.tolist()[0] for t in (attention_mask, input_ids, token_type_ids))
        n = mask.count(1)  # 1, 1.0 and True alike
        if (
            n < 2
            or mask != [1] * n + [0] * (T - n)
            or not (min(ids) >= 0 and max(ids) < cfg.vocab_size)
            or not (min(types) >= 0 and max(types) < cfg.type_vocab_size)
        ):
            return None
        if n < T:
            return self._run_one(torch.tensor([ids[:n]]), torch.tensor([types[:n]]))  # [1, D]
        return self._run_one(input_ids, token_type_ids)  # [1, D]

    def _run_one(self, ids: Tensor, types: Tensor) -> Tensor:
        """One sentence of ``N >= 2`` tokens, ``[1, N]`` each, through
        :class:`OneSentenceProgram`."""
        assert self._one is not None
        before = self._one.compiled, self._one.compile_seconds
        pooled = self._one(ids, types)  # [1, D]
        self.graphs += self._one.compiled - before[0]
        self.compile_seconds += self._one.compile_seconds - before[1]
        return pooled

    def _check(self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor) -> None:
        """The eager path's value checks, on the host ids, once per batch (see ``__call__``).

        :meth:`_one_sentence` states the same rules on Python lists for a batch of one sentence
        (and leaves to this one whatever they refuse): change the two together.
        """
        cfg = self.model.config
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got {list(input_ids.shape)}")
        for name, t in (("attention_mask", attention_mask), ("token_type_ids", token_type_ids)):
            if t.shape != input_ids.shape:
                raise ValueError(
                    f"{name} must be [B, T] = {list(input_ids.shape)}, got {list(t.shape)}"
                )
        if input_ids.shape[1] > cfg.max_position_embeddings:
            raise ValueError(
                f"input_ids has T={input_ids.shape[1]} tokens but max_position_embeddings="
                f"{cfg.max_position_embeddings}; truncate the input"
            )
        lengths = attention_mask.sum(dim=1, keepdim=True)  # [B, 1]
        if not torch.equal(attention_mask, torch.arange(input_ids.shape[1]) < lengths):
            raise ValueError("attention_mask must be 1s then 0s (padding on the right)")
        for name, t, size in (
            ("input_ids", input_ids, cfg.vocab_size),
            ("token_type_ids", token_type_ids, cfg.type_vocab_size),
        ):
            if t.numel() and not (int(t.min()) >= 0 and int(t.max()) < size):
                raise ValueError(f"{name} must lie in [0, {size}), got [{t.min()}, {t.max()}]")


class _Grid:
    """Packed rows ``[N, C]`` to and from the ``[B, T', C]`` attention grid, and attention there.

    Args:
        grid_index: int64 ``[N]``, each row's flat place ``b * T' + t`` in the grid.
        bias: ``[B, 1, 1, T']`` float, ``-inf`` at the grid's padding keys.
    """

    def __init__(self, grid_index: Tensor, bias: Tensor) -> None:
        self.grid_index, self.bias = grid_index, bias
        self.B, self.T = bias.shape[0], bias.shape[-1]

    def place(self, rows: Tensor) -> Tensor:
        """``[N, C]`` -> ``[B, T', C]``, zeros at padding."""
        C = rows.shape[-1]
        flat = rows.new_zeros(self.B * self.T, C)  # [B * T', C]
        return flat.index_copy(0, self.grid_index, rows).view(self.B, self.T, C)  # [B, T', C]

    def attend_with(self, attn: MultiHeadAttention) -> _Attend:
        """The attention core of ``attn`` on this grid, for :func:`layer_on_rows`."""
        return _Attend(self, attn)


class _Attend:
    """``q, k, v`` rows ``[N, *]`` -> ``[N, D]``: ``attn``'s heads attend on the grid."""

    def __init__(self, grid: _Grid, attn: MultiHeadAttention) -> None:
        self.grid, self.attn = grid, attn

    def _heads(self, rows: Tensor, heads: int) -> Tensor:
        g = self.grid.place(rows)  # [B, T', heads * Dh]
        return g.view(g.shape[0], g.shape[1], heads, self.attn.head_dim).transpose(1, 2)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        attn = self.attn
        out, _ = attention(
            self._heads(q, attn.num_heads),
            self._heads(k, attn.num_kv_heads),
            self._heads(v, attn.num_kv_heads),
            attn_bias=self.grid.bias,
            scale=attn.scale,
            backend=attn.backend,
        )  # [B, H, T', Dh]
        flat = out.transpose(1, 2).reshape(-1, attn.embed_dim)  # [B * T', D]
        return flat.index_select(0, self.grid.grid_index)  # [N, D]
