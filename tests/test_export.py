"""Deployable forward paths: torch.export, torch.compile(fullgraph=True), ONNX (issue 13).

Every model is exported once with a dynamic batch and length (``Dim``) and then run on inputs
of *another* shape than the example's, against eager. Graph breaks are counted with
``torch._dynamo.explain`` (dynamo only, no inductor: fast). Tiny models keep the file well
under a minute; ``benchmarks/compile.py`` measures the speed.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import Tensor, nn
from torch.export import Dim, export

import qkv
from qkv.models.bert import BertConfig, BertEncoder
from qkv.models.config import DecoderOnlyConfig, TransformerConfig
from qkv.models.decoder_only import DecoderOnlyLM
from qkv.models.transformer import Transformer

SMALL = {"d_model": 16, "num_heads": 2, "dim_feedforward": 32, "dropout": 0.0}
BATCH = Dim("B", min=1, max=8)
LENGTH = Dim("L", min=2, max=16)
TGT_LENGTH = Dim("T", min=2, max=16)
EXPORT_TOL = {"atol": 1e-6, "rtol": 1e-6}
ONNX_TOL = {"atol": 1e-5, "rtol": 1e-5}


@pytest.fixture(autouse=True)
def _no_grad() -> Iterator[None]:
    with torch.no_grad():
        yield


def _ids(vocab: int, B: int, L: int, pad_from: int | None = None) -> Tensor:
    """Token ids in ``[1, vocab)``; sample 1 padded (id 0) from ``pad_from`` on."""
    g = torch.Generator().manual_seed(B * 100 + L)
    ids = torch.randint(1, vocab, (B, L), generator=g)  # [B, L]
    if pad_from is not None:
        ids[1, pad_from:] = 0
    return ids


def _lm(backend: str = "fused") -> DecoderOnlyLM:
    cfg = DecoderOnlyConfig(vocab_size=13, num_layers=1, pad_id=0, max_positions=32, **SMALL)
    return _set_backend(DecoderOnlyLM(cfg), backend)


def _transformer() -> Transformer:
    cfg = TransformerConfig(
        src_vocab_size=11,
        tgt_vocab_size=12,
        num_encoder_layers=1,
        num_decoder_layers=1,
        max_positions=32,
        **SMALL,
    )
    return _set_backend(Transformer(cfg), "fused")


def _bert() -> BertEncoder:
    cfg = BertConfig(
        vocab_size=20,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        hidden_act="gelu",
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        max_position_embeddings=32,
        type_vocab_size=2,
        layer_norm_eps=1e-12,
        pad_token_id=0,
    )
    return BertEncoder(cfg).eval()


def _set_backend(model: nn.Module, backend: str) -> nn.Module:
    for m in model.modules():
        if isinstance(m, qkv.MultiHeadAttention):
            m.backend = backend  # type: ignore[assignment]
    return model.eval()


class _MHA(nn.Module):
    """Self-attention with a key-padding mask and a causal mask, the weightless call."""

    def __init__(self, backend: str) -> None:
        super().__init__()
        self.mha = qkv.MultiHeadAttention(16, 2, backend=backend)  # type: ignore[arg-type]

    def forward(self, x: Tensor, key_padding_mask: Tensor) -> Tensor:
        out, _ = self.mha(x, key_padding_mask=key_padding_mask, is_causal=True, need_weights=False)
        return out  # [B, T, D]


class _Encode(nn.Module):
    def __init__(self, model: Transformer) -> None:
        super().__init__()
        self.model = model

    def forward(self, src: Tensor) -> Tensor:
        return self.model.encode(src)  # [B, S, D]


class _CachedStep(nn.Module):
    """Prefill a KV cache with the prompt, then one cached decoding step of ``new`` tokens.

    The cache is a Python object, not a tensor, so it lives inside the exported graph.
    """

    def __init__(self, model: DecoderOnlyLM) -> None:
        super().__init__()
        self.model = model

    def forward(self, prompt: Tensor, new: Tensor) -> Tensor:
        cache = self.model.new_cache(32)
        self.model(prompt, kv_cache=cache)
        return self.model(new, kv_cache=cache)  # [B, 1, V]


def _padding(B: int, L: int) -> Tensor:
    is_pad = torch.zeros(B, L, dtype=torch.bool)  # [B, L]
    is_pad[1, L - 2 :] = True
    return is_pad


Case = tuple[Callable[[], nn.Module], Callable[[int, int], tuple[Tensor, ...]], tuple[dict, ...]]


def _mha_inputs(B: int, L: int) -> tuple[Tensor, ...]:
    return torch.randn(B, L, 16), _padding(B, L)


CASES: dict[str, Case] = {
    "mha_fused": (
        lambda: _MHA("fused").eval(),
        _mha_inputs,
        ({0: BATCH, 1: LENGTH}, {0: BATCH, 1: LENGTH}),
    ),
    "lm_reference": (
        lambda: _lm("reference"),
        lambda B, L: (_ids(13, B, L, L - 2),),
        ({0: BATCH, 1: LENGTH},),
    ),
    "lm_fused": (
        lambda: _lm("fused"),
        lambda B, L: (_ids(13, B, L, L - 2),),
        ({0: BATCH, 1: LENGTH},),
    ),
    "lm_cached_step": (
        lambda: _CachedStep(_lm()),
        lambda B, L: (_ids(13, B, L), _ids(13, B, 1)),
        ({0: BATCH, 1: LENGTH}, {0: BATCH}),
    ),
    "transformer": (
        _transformer,
        lambda B, L: (_ids(11, B, L, L - 2), _ids(12, B, L + 1)),
        ({0: BATCH, 1: LENGTH}, {0: BATCH, 1: TGT_LENGTH}),
    ),
    "transformer_encode": (
        lambda: _Encode(_transformer()),
        lambda B, L: (_ids(11, B, L, L - 2),),
        ({0: BATCH, 1: LENGTH},),
    ),
    "bert": (
        _bert,
        lambda B, L: (_ids(20, B, L), (~_padding(B, L)).long()),
        ({0: BATCH, 1: LENGTH}, {0: BATCH, 1: LENGTH}),
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_export_with_dynamic_batch_and_length_matches_eager(name: str) -> None:
    build, inputs, dynamic = CASES[name]
    torch.manual_seed(0)
    model = build()
    program = export(model, inputs(3, 7), dynamic_shapes=dynamic)
    for B, L in ((2, 5), (4, 12)):  # shapes the example did not have
        args = inputs(B, L)
        torch.testing.assert_close(program.module()(*args), model(*args), **EXPORT_TOL)


@pytest.mark.parametrize("name", ["mha_fused", "lm_fused", "lm_cached_step", "transformer", "bert"])
def test_compile_fullgraph_has_no_graph_break(name: str) -> None:
    build, inputs, _ = CASES[name]
    model = build()
    explained = torch._dynamo.explain(model)(*inputs(3, 7))
    assert explained.graph_break_count == 0, explained.break_reasons


@pytest.mark.parametrize("backend", ["reference", "fused"])
def test_attention_compiles_fullgraph(backend: str) -> None:
    q, k, v = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 9, 8), torch.randn(2, 2, 9, 8)
    mask = qkv.masks.padding_mask(torch.tensor([9, 4]), 9)  # [B, 1, 1, S]

    def f(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
        return qkv.attention(q, k, v, mask=mask, is_causal=True, backend=backend)[0]  # type: ignore[arg-type]

    compiled = torch.compile(f, fullgraph=True, backend="eager", dynamic=True)
    torch.testing.assert_close(compiled(q, k, v, mask), f(q, k, v, mask), **EXPORT_TOL)
    assert torch._dynamo.explain(f)(q, k, v, mask).graph_break_count == 0


def _blockwise(mask: object, is_causal: bool) -> Callable[..., Tensor]:
    def f(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        out, _ = qkv.attention(
            q, k, v, mask=mask, is_causal=is_causal, backend="blockwise", block_q=4, block_k=4
        )  # type: ignore[arg-type]
        return out  # [B, H, T, Dh]

    return f


BLOCKWISE_RULES: dict[str, Callable[[], object]] = {
    "padding_lengths": lambda: qkv.masks.Padding(torch.tensor([5])),
    "padding_is_pad": lambda: qkv.masks.Padding(torch.arange(8)[None] >= 5),
    "causal_or_padding": lambda: qkv.masks.Causal() | qkv.masks.Padding(torch.tensor([5])),
    "documents": lambda: qkv.masks.Documents(torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2]])),
    "mask_mod": lambda: qkv.masks.MaskMod(lambda b, h, q, kv: (q - kv).abs() <= 2),
    "dense": lambda: qkv.masks.Dense(torch.rand(1, 1, 8, 8) < 0.3),
}


@pytest.mark.parametrize(
    ("name", "is_causal"), [(name, name in ("padding_is_pad", "dense")) for name in BLOCKWISE_RULES]
)
def test_blockwise_compiles_fullgraph_for_every_rule(name: str, is_causal: bool) -> None:
    """Blockwise plans its tiles in Python. Eagerly a rule may skip a tile from its values
    (``bool(tile.all())``); under tracing such a tile is computed with its own mask instead, so
    the tile loop unrolls into one graph for every rule, with the eager result. Gradients too."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 4, generator=g, requires_grad=True) for _ in range(3))
    f = _blockwise(BLOCKWISE_RULES[name](), is_causal)
    explained = torch._dynamo.explain(f)(q, k, v)
    assert explained.graph_break_count == 0, explained.break_reasons
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    with torch.enable_grad():  # this module runs under no_grad (the _no_grad fixture)
        got, want = compiled(q, k, v), f(q, k, v)
        got_grads = torch.autograd.grad(got.sum(), (q, k, v))
        want_grads = torch.autograd.grad(want.sum(), (q, k, v))
    torch.testing.assert_close(got, want, **EXPORT_TOL)
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, **EXPORT_TOL)


def test_model_value_checks_run_eagerly_and_can_be_switched_off() -> None:
    lm = _lm()
    bad = torch.tensor([[1, 2, 99]])
    with pytest.raises(ValueError, match=r"ids holds ids in \[1, 99\], outside the vocabulary"):
        lm(bad)
    good = _ids(13, 2, 5, 3)
    torch.testing.assert_close(lm(good, validate=False), lm(good))


ONNX_CASES = ["lm_fused", "transformer", "bert"]


@pytest.mark.parametrize("name", ONNX_CASES)
def test_onnx_dynamo_export_runs_in_onnxruntime(name: str) -> None:
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    build, inputs, dynamic = CASES[name]
    torch.manual_seed(0)
    model = build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)
        try:
            onnx_program = torch.onnx.export(
                model, inputs(3, 7), dynamo=True, dynamic_shapes=dynamic, optimize=False
            )
        finally:
            logging.disable(logging.NOTSET)
    assert onnx_program is not None
    session = ort.InferenceSession(
        onnx_program.model_proto.SerializeToString(), providers=["CPUExecutionProvider"]
    )
    for B, L in ((2, 5), (4, 12)):
        args = inputs(B, L)
        feeds = {i.name: a.numpy() for i, a in zip(session.get_inputs(), args, strict=True)}
        got = torch.from_numpy(session.run(None, feeds)[0])
        torch.testing.assert_close(got, model(*args), **ONNX_TOL)
