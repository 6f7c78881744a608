"""The one-sentence AOTInductor program against the eager unpadded path, on a tiny random BERT.

The pure function and its weight list run eagerly (cheap); one test compiles the real programs
with AOTInductor (the frozen one, then the one that reads the weights: about 10 s each here)
and checks them, their dynamic token count and the change from one to the other when the
weights change, through :class:`CompiledEmbedder`.
"""

import dataclasses
from collections.abc import Callable

import pytest
import torch
from torch import nn

from one_sentence_stand_in import eager_program
from qkv.apps import embed_one
from qkv.apps.embed_compiled import CompiledEmbedder
from qkv.apps.embed_one import OneSentenceProgram, _laid_out, encode_one
from qkv.apps.pooling import l2_normalize, mean_pool
from qkv.models.bert import BertConfig, BertEncoder

CONFIG = BertConfig(
    vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    intermediate_size=64, max_position_embeddings=24,
)  # fmt: skip


def make(seed: int = 0, **overrides: object) -> BertEncoder:
    torch.manual_seed(seed)
    config = BertConfig(**{**CONFIG.__dict__, **overrides})
    model = BertEncoder(config).eval()
    for p in model.parameters():  # LayerNorms and biases away from their 1s and 0s
        p.data.add_(0.1 * torch.randn_like(p))
    return model


def sentence(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, CONFIG.vocab_size, (n,), generator=g)  # [N]
    return ids, torch.randint(0, 2, (n,), generator=g)


def eager(model: BertEncoder, ids: torch.Tensor, types: torch.Tensor) -> torch.Tensor:
    mask = torch.ones(1, ids.shape[0], dtype=torch.long)
    with torch.no_grad():
        return l2_normalize(mean_pool(model(ids[None], mask, types[None], unpad=True), mask))


StandIn = Callable[..., Callable[[list[torch.Tensor]], list[torch.Tensor]]]


def recording(
    program: OneSentenceProgram, seen: list[tuple[bool, embed_one.Span | None]]
) -> StandIn:
    """An eager stand-in for ``program._compile`` (:func:`eager_program`) that appends each
    call's ``(frozen, span)`` to ``seen`` and checks the example a span's export would get:
    the sentence cycled or cut to the span's own length."""

    def stand_in(
        ids: torch.Tensor,
        types: torch.Tensor,
        weights: list[torch.Tensor],
        *,
        frozen: bool,
        span: embed_one.Span | None = None,
    ) -> Callable[[list[torch.Tensor]], list[torch.Tensor]]:
        seen.append((frozen, span))
        if span is not None:
            low, high, hint = span
            ids, types = embed_one._example(ids, hint), embed_one._example(types, hint)
            assert hint is None or (low <= hint <= high and ids.shape == types.shape == (1, hint))
        return eager_program(program, ids, types, weights, frozen=frozen, span=span)

    return stand_in


@pytest.mark.parametrize("activation", ["gelu", "relu"])
@pytest.mark.parametrize("n", [2, 5, 24])
def test_the_function_equals_the_eager_path(activation: str, n: int) -> None:
    model = make(hidden_act=activation)
    program = OneSentenceProgram(model)
    ids, types = sentence(n, seed=n)
    with torch.no_grad():
        got = encode_one(program.weights(), ids, types, program.plan())  # [1, D]
    assert got.shape == (1, CONFIG.hidden_size)
    torch.testing.assert_close(got, eager(model, ids, types), atol=1e-6, rtol=0)
    # the frozen program's form: row-major weights, F.linear
    tensors, _ = program._fingerprinted()
    frozen_plan = dataclasses.replace(program.plan(), frozen=True)
    with torch.no_grad():
        got = encode_one(_laid_out(tensors, column_major=False), ids, types, frozen_plan)
    torch.testing.assert_close(got, eager(model, ids, types), atol=1e-6, rtol=0)


def test_weights_are_remade_only_when_a_source_changed() -> None:
    model = make()
    program = OneSentenceProgram(model)
    ids, types = sentence(6)
    first = program.weights()
    assert program.weights() is first  # nothing changed: no copy
    qkv = first[5]
    assert qkv.shape == (3 * CONFIG.hidden_size, CONFIG.hidden_size) and qkv.stride() == (1, 96)

    def check() -> None:
        with torch.no_grad():
            got = encode_one(program.weights(), ids, types, program.plan())
        torch.testing.assert_close(got, eager(model, ids, types), atol=1e-6, rtol=0)

    layer = model._layers()[1]
    with torch.no_grad():
        layer.self_attn.k_proj.weight.mul_(-1.5)  # in place: the version counter moves
    assert program.weights() is not first
    check()
    layer.ffn.fc2.weight = nn.Parameter(torch.randn_like(layer.ffn.fc2.weight))  # replaced
    check()
    layer.self_attn.out_proj = nn.Linear(CONFIG.hidden_size, CONFIG.hidden_size)  # new module
    check()
    model.embeddings.norm.weight.data = torch.rand(CONFIG.hidden_size)  # storage swapped
    check()
    # replaced by its own transpose: the same storage address and version counter, another
    # object (only the identity tells)
    q = layer.self_attn.q_proj
    before, old = program.weights(), (q.weight.data_ptr(), q.weight._version)
    q.weight = nn.Parameter(q.weight.detach().t())
    assert (q.weight.data_ptr(), q.weight._version) == old
    assert program.weights() is not before
    check()


def test_supports_and_refusals() -> None:
    model = make()
    assert OneSentenceProgram.supports(model)
    assert not OneSentenceProgram.supports(nn.Linear(2, 2))
    hooked = make()
    handle = hooked._layers()[0].register_forward_hook(lambda *a: None)
    assert not OneSentenceProgram.supports(hooked)
    handle.remove()
    no_bias = make()
    no_bias._layers()[0].ffn.fc1.bias = None  # type: ignore[assignment]
    assert not OneSentenceProgram.supports(no_bias)
    with pytest.raises(ValueError, match="biases"):
        OneSentenceProgram(no_bias)
    program = OneSentenceProgram(model)
    for n in (1, CONFIG.max_position_embeddings + 1):
        with pytest.raises(ValueError, match=r"2 <= N <= 24"):
            program(*(t[None] for t in sentence(n)))
    with pytest.raises(ValueError, match=r"\[1, 4\] and \[1, 3\]"):
        program(sentence(4)[0][None], sentence(3)[1][None])
    with pytest.raises(
        ValueError, match=r"must both be \[1, N\] with 2 <= N <= 24, got \[4\] and \[4\]"
    ):
        program(*sentence(4))  # one sentence is a batch of one
    with pytest.raises(ValueError, match=r"got \[2, 4\]"):
        program(*(torch.stack([t, t]) for t in sentence(4)))
    model._layers()[0].ffn.fc1.bias = None  # type: ignore[assignment]
    with pytest.raises(ValueError, match="removed"):
        program.weights()


def test_the_program_gets_int64_contiguous_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tokenizer's ``[1, N]`` int64 row goes to the program as it is (no copy: two tensors
    made per call cost ~100 us of a ~1.9 ms sentence); other dtypes and strided rows are
    copied to what the program is compiled for, with the same embedding."""
    model = make(seed=2)
    program = OneSentenceProgram(model)
    sent: list[list[torch.Tensor]] = []

    record = recording(program, [])

    def stand_in(
        *args: object, **kwargs: object
    ) -> Callable[[list[torch.Tensor]], list[torch.Tensor]]:
        run = record(*args, **kwargs)
        return lambda flat: (sent.append(flat[:2]), run(flat))[1]

    monkeypatch.setattr(program, "_compile", stand_in)
    ids, types = (t[None] for t in sentence(7, seed=1))  # [1, 7]
    want = eager(model, ids[0], types[0])
    strided = torch.stack([ids, ids + 1], dim=2)[..., 0]  # [1, 7], strides (14, 2)
    assert not strided.is_contiguous()
    for i, t in [(ids, types), (ids.int(), types.int()), (strided, types)]:
        with torch.no_grad():
            torch.testing.assert_close(program(i, t), want, atol=1e-6, rtol=0)
        got_ids, got_types = sent[-1]
        assert got_ids.dtype == got_types.dtype == torch.int64
        assert got_ids.is_contiguous() and torch.equal(got_ids, ids)
        assert (got_ids is i) == (i.dtype == torch.int64 and i.is_contiguous())
        assert (got_types is t) == (t.dtype == torch.int64)


@pytest.mark.parametrize(
    "policy",
    ["mkl", "inductor", "inductor, timed", "inductor, too large", "inductor, timed, too large"],
)
def test_which_program_runs(policy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Frozen first off MKL's fast path, then the program that reads the weights once they
    change; with MKL's fast path, or weights too large to freeze, that one from the start.
    Where the products are timed while compiling, short and long sentences get a frozen
    program each, compiled at its span's own length on the span's first sentence, and a long
    one that comes after the weights changed gets none. Programs stood in for by
    :func:`encode_one` run eagerly (a frozen one on copies of its weights, as a compiled one
    holds): the choice, not the compiler, is under test here."""
    if policy == "mkl" and not torch.backends.mkl.is_available():
        pytest.skip("this torch has no MKL")
    monkeypatch.setenv("QKV_CPU_PRODUCTS", policy.split(",")[0])
    timed = {"max_autotune_gemm": True} if "timed" in policy else {}
    monkeypatch.setattr(embed_one, "frozen_configs", lambda mkl: {"freezing": True} | timed)
    model = make(seed=5)
    program = OneSentenceProgram(model)
    size = sum(t.numel() * t.element_size() for t in program._fingerprinted()[0])
    monkeypatch.setattr(embed_one, "FROZEN_MAX_BYTES", size - 1 if "large" in policy else size)
    reads_at_once = "mkl" in policy or "large" in policy
    compiled: list[tuple[bool, embed_one.Span | None]] = []
    monkeypatch.setattr(program, "_compile", recording(program, compiled))

    def check(n: int) -> None:
        ids, types = sentence(n, seed=n)
        with torch.no_grad():
            got = program(ids[None], types[None])
        torch.testing.assert_close(got, eager(model, ids, types), atol=1e-6, rtol=0)

    limit = CONFIG.max_position_embeddings
    short, long = (2, embed_one.LONG_TOKENS - 1, 5), (embed_one.LONG_TOKENS, limit, 16)
    frozen_ones = [(True, short), (True, long)] if timed else [(True, (2, limit, None))]
    for n in (4, 9, 2, embed_one.LONG_TOKENS - 1, embed_one.LONG_TOKENS, limit):
        check(n)
    assert compiled == ([(False, None)] if reads_at_once else frozen_ones)
    assert program.reads_weights == reads_at_once
    with torch.no_grad():
        model._layers()[1].ffn.fc2.bias.add_(0.5)
    check(6)
    model.embeddings.norm.weight.data = torch.rand(CONFIG.hidden_size)  # storage swapped
    check(12)
    check(5)
    assert compiled == ([(False, None)] if reads_at_once else [*frozen_ones, (False, None)])
    assert program.reads_weights


def test_a_long_sentence_after_new_weights_reads_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """With two spans, the long span's program is not frozen from weights that changed after
    the short one was: the call goes to the program that reads the weights."""
    monkeypatch.setenv("QKV_CPU_PRODUCTS", "inductor")
    configs = {"freezing": True, "max_autotune_gemm": True}
    monkeypatch.setattr(embed_one, "frozen_configs", lambda mkl: configs)
    model = make(seed=6)
    program = OneSentenceProgram(model)
    compiled: list[tuple[bool, embed_one.Span | None]] = []
    monkeypatch.setattr(program, "_compile", recording(program, compiled))
    for n, change in ((3, False), (20, True), (4, False)):
        if change:
            with torch.no_grad():
                model._layers()[0].self_attn.v_proj.weight.mul_(1.5)
        ids, types = sentence(n, seed=n)
        with torch.no_grad():
            got = program(ids[None], types[None])
        torch.testing.assert_close(got, eager(model, ids, types), atol=1e-6, rtol=0)
    assert [frozen for frozen, _ in compiled] == [True, False]
    assert program.reads_weights and program._frozen == {}


def test_example_sentences() -> None:
    """An export's example is the sentence cycled or cut to the span's length."""
    ids = torch.tensor([[5, 6, 7]])
    assert embed_one._example(ids, None) is ids and embed_one._example(ids, 3) is ids
    assert embed_one._example(ids, 7).tolist() == [[5, 6, 7, 5, 6, 7, 5]]
    assert embed_one._example(ids, 2).tolist() == [[5, 6]]


def test_the_compiled_program(monkeypatch: pytest.MonkeyPatch) -> None:
    """AOTInductor for real: one frozen program for every token count, then, once the weights
    change, one program that reads them; :class:`CompiledEmbedder` sends a batch of one
    sentence (N >= 2) to it."""
    monkeypatch.setenv("QKV_CPU_PRODUCTS", "inductor")  # the frozen program on every CPU
    # freezing alone: with oneDNN's products timed against the C++ GEMM template (an AVX2 CPU,
    # frozen_configs) this test took 74 s on a 2-core EPYC, 37-42 s without; the timed program
    # is checked by benchmarks/embed.py on all-MiniLM-L6-v2, within 1e-5 of the eager path
    monkeypatch.setattr(embed_one, "frozen_configs", lambda mkl: {"freezing": True})
    model = make(seed=3)
    embedder = CompiledEmbedder(model)
    assert embedder._one is not None
    one = embedder._one
    graphs: list[object] = []
    frozen: list[bool] = []
    compile_ = one._compile

    def packed_graph(*args: object) -> None:  # the packed rows' graph: must not be called
        graphs.append(args)

    def spied(*args: torch.Tensor | list[torch.Tensor], **kwargs: bool) -> object:
        frozen.append(kwargs["frozen"])
        return compile_(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(embedder, "_run", packed_graph)
    monkeypatch.setattr(one, "_compile", spied)

    def check(n: int) -> None:
        ids, types = sentence(n, seed=n)
        pad = torch.zeros(min(3, CONFIG.max_position_embeddings - n), dtype=torch.long)
        mask = torch.cat([torch.ones_like(ids), pad])[None]  # [1, T]: right padding, if any
        with torch.no_grad():  # the program gets the real tokens only
            got = embedder(torch.cat([ids, pad])[None], mask, torch.cat([types, pad])[None])
        torch.testing.assert_close(got, eager(model, ids, types), atol=1e-5, rtol=0)

    for n in (5, 2, 24, 9):
        check(n)
    assert embedder.graphs == one.compiled == 1 and embedder.compile_seconds > 0
    assert frozen == [True] and not one.reads_weights and one._weights == []  # no copies made
    with torch.no_grad():
        model._layers()[0].ffn.fc1.weight.mul_(2.0)  # the frozen program cannot follow this
    check(7)
    assert frozen == [True, False] and one.reads_weights and embedder.graphs == 2
    model._layers()[1].self_attn.q_proj.weight = nn.Parameter(torch.randn(32, 32))  # replaced
    for n in (7, 3):
        check(n)
    assert frozen == [True, False] and one.compiled == 2 and graphs == []
