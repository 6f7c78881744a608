"""The compiled embedding graph against the eager unpadded path, on a tiny random BERT.

Cheap by construction: the model is 2 layers of width 32, and the tests trace with dynamo's
``"eager"`` backend (the graph, its dynamic shapes, fullgraph and recompiles, without generating
code); inductor's code generation (tens of seconds here) is what ``benchmarks/embed.py`` times,
and checks against the eager path within 1e-5.
"""

import pytest
import torch

from one_sentence_stand_in import eager_program
from qkv.apps.cli import main
from qkv.apps.embed import SentenceEmbedder
from qkv.apps.embed_compiled import FEW_TOKENS, CompiledEmbedder
from qkv.apps.embed_one import OneSentenceProgram
from qkv.apps.pooling import l2_normalize, mean_pool
from qkv.models.bert import BertConfig, BertEncoder

CONFIG = BertConfig(
    vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    intermediate_size=64, max_position_embeddings=24,
)  # fmt: skip


@pytest.fixture(scope="module")
def model() -> BertEncoder:
    torch.manual_seed(0)
    return BertEncoder(CONFIG).eval()


def batch(lengths: list[int], T: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Right-padded ids, mask and token types of the given lengths."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, CONFIG.vocab_size, (len(lengths), T), generator=g)  # [B, T]
    mask = (torch.arange(T) < torch.tensor(lengths)[:, None]).long()  # [B, T]
    types = torch.randint(0, 2, (len(lengths), T), generator=g) * mask  # [B, T]
    return ids * mask, mask, types


def eager(
    model: BertEncoder, ids: torch.Tensor, mask: torch.Tensor, types: torch.Tensor
) -> torch.Tensor:
    with torch.no_grad():
        return l2_normalize(mean_pool(model(ids, mask, types, unpad=True), mask))  # [B, D]


@pytest.mark.parametrize(
    "lengths, T",
    [([5], 5), ([3, 7, 1, 7], 9), ([0, 4, 0], 6), ([0, 0], 3), ([2], 8), ([6, 6], 6)],
)
def test_equals_the_eager_unpadded_path(model: BertEncoder, lengths: list[int], T: int) -> None:
    compiled = CompiledEmbedder(model, compiler="eager")
    ids, mask, types = batch(lengths, T)
    got = compiled(ids, mask, types)  # [B, D]
    want = eager(model, ids, mask, types)  # [B, D]
    assert got.shape == want.shape
    assert torch.allclose(got, want, atol=1e-6, rtol=0)
    assert not got[torch.tensor(lengths) == 0].any()  # a sentence without a token is 0


def test_one_graph_for_many_shapes_and_sees_new_weights(model: BertEncoder) -> None:
    torch._dynamo.reset()
    compiled = CompiledEmbedder(model, compiler="eager")
    for lengths, T in ([3, 7, 1], 9), ([4, 2], 4), ([8, 8, 2, 5, 1], 8):
        ids, mask, types = batch(lengths, T, seed=T)
        assert torch.allclose(compiled(ids, mask, types), eager(model, ids, mask, types), atol=1e-5)
    assert compiled.graphs == 1  # batch sizes and lengths vary; a batch of 1 would add one
    assert compiled.compile_seconds > 0
    for lengths, T in ([4], 4), ([7], 9):
        ids, mask, types = batch(lengths, T, seed=T)
        assert torch.allclose(compiled(ids, mask, types), eager(model, ids, mask, types), atol=1e-5)
    assert compiled.graphs == 2  # one sentence: its own graph, for every length
    with torch.no_grad():
        weight = model._layers()[0].ffn.fc1.weight
        weight.mul_(2.0)
    try:
        ids, mask, types = batch([3, 5], 6)
        assert torch.allclose(compiled(ids, mask, types), eager(model, ids, mask, types), atol=1e-5)
    finally:
        with torch.no_grad():
            weight.div_(2.0)


def test_few_tokens_run_the_cpp_wrapper_graphs(
    model: BertEncoder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inductor is asked for a C++ wrapper for batches of at most FEW_TOKENS real tokens only
    (traced here with dynamo's eager backend, each compiled function recording its calls)."""
    compile_ = torch.compile
    calls: list[dict[str, object] | None] = []

    def recording(fn, **kw):  # type: ignore[no-untyped-def]
        compiled = compile_(fn, **{**kw, "backend": "eager", "options": None})
        options = kw.get("options")

        def call(*args):  # type: ignore[no-untyped-def]
            calls.append(options)
            return compiled(*args)

        return call

    monkeypatch.setattr(torch, "compile", recording)
    compiled = CompiledEmbedder(model)
    T = CONFIG.max_position_embeddings
    full, rest = divmod(FEW_TOKENS, T)
    edge = [T] * full + [rest]  # exactly FEW_TOKENS tokens
    many = [T] * (full + 1)  # more
    for lengths in ([5, 3], edge, many):
        ids, mask, types = batch(lengths, T)
        assert torch.allclose(compiled(ids, mask, types), eager(model, ids, mask, types), atol=1e-5)
    cpp = {"cpp_wrapper": True}
    assert calls == [cpp, cpp, None]
    assert sum(edge) == FEW_TOKENS < sum(many)


def test_refusals(model: BertEncoder) -> None:
    compiled = CompiledEmbedder(model, compiler="eager")
    ids, mask, types = batch([3, 2], 4)
    with pytest.raises(ValueError, match="input_ids must lie in"):
        compiled(ids + CONFIG.vocab_size, mask, types)
    with pytest.raises(ValueError, match="token_type_ids must lie in"):
        compiled(ids, mask, types + 2)
    with pytest.raises(ValueError, match="padding on the right"):
        compiled(ids, mask.flip(1), types)
    with pytest.raises(ValueError, match="attention_mask must be"):
        compiled(ids, mask[:, :2], types)
    with pytest.raises(TypeError, match="BertEncoder"):
        CompiledEmbedder(torch.nn.Linear(2, 2))  # type: ignore[arg-type]
    model.train()
    try:
        with pytest.raises(RuntimeError, match="eval"):
            compiled(ids, mask, types)
    finally:
        model.eval()


def test_one_sentence_is_checked_on_the_host(
    model: BertEncoder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch of one sentence goes to the one-sentence program after list checks; whatever
    those checks do not pass goes to the packed graph, which answers or refuses as before."""
    monkeypatch.setattr(OneSentenceProgram, "_compile", eager_program)
    compiled = CompiledEmbedder(model, compiler="eager")
    compiled._one = OneSentenceProgram(model)  # the eager compiler leaves it out
    packed: list[int] = []
    run = compiled._run

    def counted(rows: tuple[torch.Tensor, ...], *args: torch.Tensor) -> torch.Tensor:
        packed.append(rows[0].shape[0])
        return run(rows, *args)

    monkeypatch.setattr(compiled, "_run", counted)
    ids, mask, types = batch([5], 8, seed=4)
    want = eager(model, ids, mask, types)  # [1, D]
    for m, i, t in [
        (mask, ids, types),
        (mask.bool(), ids.int(), types.int()),  # other integer and mask dtypes
        (mask.float(), ids, types),
    ]:
        torch.testing.assert_close(compiled(i, m, t), want, atol=1e-6, rtol=0)
    assert packed == [] and compiled._one.compiled == 1
    # without padding the caller's row itself goes on (the program copies it only if it must)
    given: list[torch.Tensor] = []
    run_one = compiled._run_one
    monkeypatch.setattr(compiled, "_run_one", lambda i, t: (given.append(i), run_one(i, t))[1])
    full = batch([6], 6, seed=2)
    torch.testing.assert_close(compiled(*full), eager(model, *full), atol=1e-6, rtol=0)
    assert given[-1] is full[0]
    compiled(ids, mask, types)  # padded: the real tokens only, a new [1, 5] row
    assert given[-1].shape == (1, 5) and torch.equal(given[-1], ids[:, :5])
    one_token = batch([1], 4)
    torch.testing.assert_close(compiled(*one_token), eager(model, *one_token), atol=1e-6, rtol=0)
    assert packed == [1]  # fewer than 2 tokens: the packed graph
    refusals = [
        ((ids + CONFIG.vocab_size, mask, types), "input_ids must lie in"),
        ((ids - ids - 1, mask, types), "input_ids must lie in"),
        ((ids, mask, types + 2), "token_type_ids must lie in"),
        ((ids, mask.flip(1), types), "padding on the right"),
        ((ids, mask * 2, types), "padding on the right"),
        ((ids, mask[:, :4], types), "attention_mask must be"),
        ((ids[:, :1].expand(1, 30), torch.ones(1, 30), types[:, :1].expand(1, 30)), "truncate"),
    ]
    for args, message in refusals:
        with pytest.raises(ValueError, match=message):
            compiled(*args)
    assert packed == [1] and compiled._one.compiled == 1


def test_sentence_embedder_runs_the_compiled_graph() -> None:
    eager_embedder = SentenceEmbedder(batch_size=3)
    embedder = SentenceEmbedder(batch_size=3, compile=True)
    assert isinstance(embedder.compiled, CompiledEmbedder)
    embedder.compiled = CompiledEmbedder(embedder.model, compiler="eager")  # no codegen: quick
    sentences = ["a cat", "", "the quick brown fox jumps over the lazy dog", "hi", "a b c d"]
    got, want = embedder.encode(sentences), eager_embedder.encode(sentences)  # [5, D]
    assert torch.allclose(got, want, atol=1e-6, rtol=0)
    assert embedder.compiled.graphs >= 1


def test_qkv_embed_compile(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    compile_ = torch.compile
    monkeypatch.setattr(
        torch, "compile", lambda fn, **kw: compile_(fn, **{**kw, "backend": "eager"})
    )
    # one sentence runs the AOTInductor program: its function, eagerly (no codegen: quick)
    monkeypatch.setattr(OneSentenceProgram, "_compile", eager_program)
    assert main(["embed", "A cat sits.", "A cat sat down.", "--compile"]) == 0
    compiled = capsys.readouterr().out
    assert main(["embed", "A cat sits.", "A cat sat down."]) == 0
    plain = capsys.readouterr().out
    assert "cosine similarity" in compiled
    matrix = [line for line in compiled.splitlines() if line.startswith("  [")]
    assert matrix == [line for line in plain.splitlines() if line.startswith("  [")]
