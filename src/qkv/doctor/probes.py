"""How an examination calls a model: one adapter per family, one interface for the properties.

An :class:`Adapter` runs a :class:`~qkv.doctor.batches.Batch` through its model and returns the
main output ``[B, T, ...]`` (logits, else the last hidden state), runs prefill plus cached steps
when the model has a cache, and names the modules to cast to float64 and differentiate. The
families: ``transformers`` models (causal LM, encoder, encoder–decoder), qkv's
:class:`~qkv.models.DecoderOnlyLM`, :class:`~qkv.models.Transformer` and
:class:`~qkv.models.bert.BertEncoder`, and any callable ``model(input_ids, attention_mask=...)``.

Shapes: B batch, W padded width, K decoder tokens, V vocabulary.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, get_args

import torch
from torch import Tensor, nn

from qkv.doctor.batches import Batch
from qkv.models.bert import BertEncoder
from qkv.models.decoder_only import DecoderOnlyLM
from qkv.models.transformer import Transformer

__all__ = ["KINDS", "Adapter", "Kind", "adapter_for", "main_output"]

Kind = Literal["causal-lm", "encoder", "seq2seq"]
KINDS: tuple[Kind, ...] = get_args(Kind)


def main_output(out: object) -> Tensor:
    """A model's main output: a tensor itself, else ``logits``, else ``last_hidden_state``, else
    the first tensor of a tuple.

    Raises:
        TypeError: no floating tensor found.
    """
    if isinstance(out, Mapping):  # transformers' ModelOutput is an OrderedDict
        for key in ("logits", "last_hidden_state"):
            if isinstance(out.get(key), Tensor):
                out = out[key]
                break
        else:
            out = next((v for v in out.values() if isinstance(v, Tensor)), out)
    elif isinstance(out, tuple | list) and out and isinstance(out[0], Tensor):
        out = out[0]
    if not isinstance(out, Tensor) or not out.is_floating_point():
        raise TypeError(
            f"the model must return a floating tensor [B, T, ...] or a ModelOutput with logits or "
            f"last_hidden_state, got {type(out).__name__}"
        )
    return out


class Adapter:
    """Calls one model for the properties; subclasses know its family.

    Attributes:
        model: what is examined.
        kind: ``"causal-lm"``, ``"encoder"`` or ``"seq2seq"``.
        description: the model in words.
        vocab_size: the input vocabulary, or None when unknown.
        pad_id: the model's padding id, or None.
        decoder_vocab_size: the decoder's vocabulary (seq2seq).
        decoder_start: the first decoder token (seq2seq).
        takes_positions: the model is given the positions of a left-padded batch (position ids),
            so that left padding can be compared for every kind, not only causal LMs.
        cache: why prefill plus cached steps cannot run, or None when they can.
    """

    kind: Kind
    description: str
    vocab_size: int | None = None
    pad_id: int | None = None
    decoder_vocab_size: int | None = None
    decoder_start: int = 0
    takes_positions: bool = False
    cache: str | None = "the model has no KV cache qkv.doctor knows how to drive"

    def __init__(self, model: Any, kind: Kind) -> None:
        self.model = model
        self.kind = kind

    def modules(self) -> list[nn.Module]:
        """The modules whose parameters the model uses (cast to float64, differentiated)."""
        return [self.model] if isinstance(self.model, nn.Module) else []

    def forward(self, batch: Batch) -> Tensor:
        """The main output ``[B, W, ...]`` (seq2seq: ``[B, K, ...]``)."""
        raise NotImplementedError

    def cached(self, batch: Batch, sizes: Sequence[int]) -> Tensor:
        """Prefill ``sizes[0]`` tokens (decoder tokens for seq2seq), then steps of the next sizes
        through the model's cache; the outputs of all calls joined along the positions."""
        raise RuntimeError(self.cache or "no cache")

    def live(self, batch: Batch, out: Tensor) -> list[Tensor]:
        """Each sample's live outputs ``[L_i, ...]`` (seq2seq: all ``K`` decoder positions).

        Raises:
            ValueError: an output that is not ``[B, T, ...]`` for this batch.
        """
        B = batch.ids.shape[0]
        T = batch.ids.shape[1] if batch.decoder_ids is None else batch.decoder_ids.shape[1]
        if out.dim() < 2 or tuple(out.shape[:2]) != (B, T):
            raise ValueError(
                f"the model returned {list(out.shape)} for the {batch.name} of {B} samples and "
                f"{T} positions; expected [B, T, ...] = [{B}, {T}, ...]"
            )
        if batch.decoder_ids is not None:
            return [out[i] for i in range(B)]
        return [out[i][batch.live(i)] for i in range(B)]


def _takes(fn: Callable[..., Any], name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


class HFAdapter(Adapter):
    """A ``transformers`` ``PreTrainedModel``: called as ``generate`` calls it (position ids of
    the padding, ``past_key_values`` for the cache)."""

    def __init__(self, model: nn.Module, kind: Kind) -> None:
        super().__init__(model, kind)
        cfg: Any = model.config
        self.description = f"transformers {type(model).__name__} ({kind})"
        emb = model.get_input_embeddings()  # type: ignore[operator]
        self.vocab_size = getattr(emb, "num_embeddings", None) or getattr(cfg, "vocab_size", None)
        self.pad_id = getattr(cfg, "pad_token_id", None)
        self.decoder_vocab_size = self.vocab_size
        start = getattr(cfg, "decoder_start_token_id", None)
        self.decoder_start = start if start is not None else (self.pad_id or 0)
        self.takes_positions = kind != "seq2seq" and _takes(model.forward, "position_ids")
        self.cache = None if kind != "encoder" else "an encoder has no KV cache"
        # transformers 5.24 renamed past_key_values (kept until 5.40) to cache
        self.cache_kw = "cache" if _takes(model.forward, "cache") else "past_key_values"

    def forward(self, batch: Batch) -> Tensor:
        kw: dict[str, Any] = {}
        if self.kind == "seq2seq":
            kw.update(decoder_input_ids=batch.decoder_ids, use_cache=False)
        elif self.kind == "causal-lm":
            kw["use_cache"] = False
        if self.takes_positions:
            kw["position_ids"] = batch.positions
        return main_output(self.model(input_ids=batch.ids, attention_mask=batch.mask, **kw))

    def cached(self, batch: Batch, sizes: Sequence[int]) -> Tensor:
        outs, past, start = [], None, 0
        for n in sizes:
            end = start + n
            if self.kind == "seq2seq":
                assert batch.decoder_ids is not None
                out = self.model(
                    input_ids=batch.ids,
                    attention_mask=batch.mask,
                    decoder_input_ids=batch.decoder_ids[:, start:end],
                    use_cache=True,
                    **{self.cache_kw: past},
                )
            else:
                kw = {"position_ids": batch.positions[:, start:end]} if self.takes_positions else {}
                out = self.model(
                    input_ids=batch.ids[:, start:end],
                    attention_mask=batch.mask[:, :end],
                    use_cache=True,
                    **{self.cache_kw: past},
                    **kw,
                )
            past = out.cache if self.cache_kw == "cache" else out.past_key_values
            outs.append(main_output(out))
            start = end
        return torch.cat(outs, dim=1)  # [B, T, ...]

    @property
    def implementation(self) -> str:
        """The model's ``attn_implementation``."""
        return str(self.model.config._attn_implementation)

    def set_implementation(self, name: str) -> None:
        """Switch every attention layer to ``name``.

        Raises:
            ValueError: the model refuses ``name`` (or ignores the request).
        """
        self.model.set_attn_implementation(name)
        if self.implementation != name:
            raise ValueError(f"{type(self.model).__name__} kept {self.implementation!r}")


class DecoderOnlyAdapter(Adapter):
    """qkv's :class:`~qkv.models.DecoderOnlyLM`: ``padding_mask`` and :class:`~qkv.KVCache`."""

    cache = None

    def __init__(self, model: DecoderOnlyLM, kind: Kind) -> None:
        super().__init__(model, kind)
        self.description = f"qkv DecoderOnlyLM ({kind})"
        self.vocab_size = model.config.vocab_size
        self.pad_id = model.config.pad_id

    def forward(self, batch: Batch) -> Tensor:
        return self.model(batch.ids, padding_mask=batch.mask == 0)  # [B, W, V]

    def cached(self, batch: Batch, sizes: Sequence[int]) -> Tensor:
        cache = self.model.new_cache(sum(sizes))
        outs, start = [], 0
        for n in sizes:
            end = start + n
            pad = batch.mask[:, start:end] == 0  # [B, n]
            outs.append(self.model(batch.ids[:, start:end], padding_mask=pad, kv_cache=cache))
            start = end
        return torch.cat(outs, dim=1)  # [B, W, V]


class TransformerAdapter(Adapter):
    """qkv's encoder–decoder :class:`~qkv.models.Transformer` (``encode`` then ``decode``)."""

    cache = None

    def __init__(self, model: Transformer, kind: Kind) -> None:
        super().__init__(model, kind)
        self.description = f"qkv Transformer ({kind})"
        c = model.config
        self.vocab_size, self.pad_id = c.src_vocab_size, c.pad_id
        self.decoder_vocab_size, self.decoder_start = c.tgt_vocab_size, c.bos_id

    def forward(self, batch: Batch) -> Tensor:
        assert batch.decoder_ids is not None
        no_pad = torch.zeros_like(batch.decoder_ids, dtype=torch.bool)  # [B, K]
        return self.model(batch.ids, batch.decoder_ids, batch.mask == 0, no_pad)  # [B, K, V]

    def cached(self, batch: Batch, sizes: Sequence[int]) -> Tensor:
        assert batch.decoder_ids is not None
        src_pad = batch.mask == 0  # [B, S]
        memory = self.model.encode(batch.ids, src_pad)  # [B, S, D]
        cache = self.model.new_cache(sum(sizes))
        outs, start = [], 0
        for n in sizes:
            tgt = batch.decoder_ids[:, start : start + n]  # [B, n]
            no_pad = torch.zeros_like(tgt, dtype=torch.bool)
            outs.append(self.model.decode(tgt, memory, src_pad, no_pad, kv_cache=cache))
            start += n
        return torch.cat(outs, dim=1)  # [B, K, V]


class BertAdapter(Adapter):
    """qkv's :class:`~qkv.models.bert.BertEncoder` (Hugging Face ``attention_mask``)."""

    cache = "an encoder has no KV cache"

    def __init__(self, model: BertEncoder, kind: Kind) -> None:
        super().__init__(model, kind)
        self.description = f"qkv BertEncoder ({kind})"
        self.vocab_size = model.config.vocab_size
        self.pad_id = model.config.pad_token_id

    def forward(self, batch: Batch) -> Tensor:
        return self.model(batch.ids, attention_mask=batch.mask)  # [B, W, D]


class CallableAdapter(Adapter):
    """Any ``model(input_ids, attention_mask=...)`` returning ``[B, T, ...]`` or a ModelOutput.

    Its modules (for the float64 reference and the gradients) are the model itself when it is an
    ``nn.Module``, else those found behind a bound method, a ``functools.partial`` or a closure.
    """

    def __init__(self, model: Callable[..., Any], kind: Kind) -> None:
        super().__init__(model, kind)
        if isinstance(model, nn.Module):
            self.description = f"torch module {type(model).__name__} ({kind})"
        else:
            name = getattr(model, "__qualname__", None) or type(model).__name__
            self.description = f"callable {name} ({kind})"
        self.cache = (
            "an encoder has no KV cache" if kind == "encoder" else "a plain callable takes no cache"
        )
        emb = [m for m in self.modules() for m in m.modules() if isinstance(m, nn.Embedding)]
        self.vocab_size = emb[0].num_embeddings if len(emb) == 1 else None

    def modules(self) -> list[nn.Module]:
        return _modules_behind(self.model)

    def forward(self, batch: Batch) -> Tensor:
        return main_output(self.model(batch.ids, attention_mask=batch.mask))


def _modules_behind(fn: object, depth: int = 0) -> list[nn.Module]:
    if isinstance(fn, nn.Module):
        return [fn]
    if depth > 3:
        return []
    found: list[object] = []
    if inspect.ismethod(fn):
        found.append(fn.__self__)
    if isinstance(fn, functools.partial):
        found += [fn.func, *fn.args, *fn.keywords.values()]
    found.append(getattr(fn, "__wrapped__", None))
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            found.append(cell.cell_contents)
        except ValueError:  # an empty cell
            continue
    out: list[nn.Module] = []
    for obj in found:
        if obj is not None and (isinstance(obj, nn.Module) or callable(obj)):
            out += [m for m in _modules_behind(obj, depth + 1) if all(m is not o for o in out)]
    return out


def _is_transformers(model: object) -> bool:
    cfg = getattr(model, "config", None)
    return (
        isinstance(model, nn.Module)
        and hasattr(cfg, "_attn_implementation")
        and hasattr(model, "set_attn_implementation")
    )


def _hf_kind(model: nn.Module) -> Kind | None:
    cfg: Any = model.config
    if getattr(cfg, "is_encoder_decoder", False):
        return "seq2seq"
    if getattr(cfg, "is_decoder", False):
        return "causal-lm"
    # transformers is optional: imported only to read its model mappings for a model of its own
    from transformers.models.auto import modeling_auto

    causal = cfg.model_type in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    masked = cfg.model_type in modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES
    if masked:
        return "encoder"
    return "causal-lm" if causal else None


def adapter_for(model: Any, kind: str | None) -> Adapter:
    """The adapter of ``model``, its kind inferred when ``kind`` is None.

    Raises:
        TypeError: ``model`` is not callable.
        ValueError: an unknown ``kind``, a kind that cannot be inferred, or one that contradicts
            the model (an encoder–decoder model examined as another kind, or the reverse).
    """
    if kind is not None and kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS} or None, got {kind!r}")
    if not callable(model):
        raise TypeError(f"model must be callable as model(input_ids, ...), got {type(model)}")
    inferred: Kind | None
    cls: type[Adapter]
    if isinstance(model, DecoderOnlyLM):
        inferred, cls = "causal-lm", DecoderOnlyAdapter
    elif isinstance(model, Transformer):
        inferred, cls = "seq2seq", TransformerAdapter
    elif isinstance(model, BertEncoder):
        inferred, cls = "encoder", BertAdapter
    elif _is_transformers(model):
        assert isinstance(model, nn.Module)
        inferred, cls = _hf_kind(model), HFAdapter
    else:
        inferred, cls = None, CallableAdapter
    chosen = kind or inferred
    if chosen is None:
        raise ValueError(
            f"kind could not be inferred for {type(model).__name__}; pass kind= one of {KINDS}"
        )
    if cls is CallableAdapter and chosen == "seq2seq":
        raise ValueError(
            "kind='seq2seq' needs a transformers encoder-decoder model or qkv's Transformer; a "
            "plain callable is called as model(input_ids, attention_mask=...)"
        )
    if inferred is not None and (chosen == "seq2seq") != (inferred == "seq2seq"):
        raise ValueError(f"kind={kind!r} contradicts the model, which is a {inferred} model")
    return cls(model, chosen)
