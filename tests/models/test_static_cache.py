"""The static KV cache and the compiled decode step: the same tokens as the growing KVCache on
left-padded batches (rotary GQA and learned positions, greedy and seeded sampling), one graph
over 256 steps with no graph break and no recompile, and the misuses it refuses."""

import pytest
import torch

import qkv.models.static_decode as static_decode
from qkv.models import DecoderOnlyConfig, DecoderOnlyLM
from qkv.nn.static_kv_cache import StaticKVCache

V = 97
KINDS = {
    "llama": {"positional": "rotary", "norm": "rms", "activation": "swiglu", "num_kv_heads": 2},
    "gpt2": {"positional": "learned", "norm": "layer", "activation": "gelu_tanh"},
}


def _model(kind: str, max_positions: int = 128) -> DecoderOnlyLM:
    torch.manual_seed(0)
    cfg = DecoderOnlyConfig(
        vocab_size=V, d_model=32, num_heads=4, num_layers=2, dim_feedforward=64, dropout=0.0,
        pad_id=0, max_positions=max_positions, **KINDS[kind],
    )  # fmt: skip
    return DecoderOnlyLM(cfg).eval()


def _prompts(T0: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(1, V, (3, T0), generator=torch.Generator().manual_seed(1))
    pad = torch.zeros_like(ids, dtype=torch.bool)
    pad[1, :3] = True
    pad[2, :1] = True
    return ids.masked_fill(pad, 0), pad


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_static_cache_gives_the_dynamic_cache_tokens(kind: str) -> None:
    model = _model(kind)
    ids, pad = _prompts()
    options = [
        {"greedy": True},
        {"greedy": True, "repetition_penalty": 1.3, "eos_id": [5, 17]},
        {"top_k": 20, "top_p": 0.9, "temperature": 0.8},
    ]
    for opts in options:
        runs = [
            model.generate(
                ids,
                20,
                padding_mask=pad,
                static_cache=static,
                generator=torch.Generator().manual_seed(2),
                **opts,
            )
            for static in (False, True)
        ]
        assert torch.equal(runs[0], runs[1]), opts


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_forward_static_logits_match_forward(kind: str) -> None:
    model = _model(kind)
    ids, pad = _prompts()
    with torch.no_grad():
        want = model(ids, pad)  # [B, T0, V]
        cache = model.new_static_cache(3, 64)
        cache.start(pad)
        head = model.forward_static(ids[:, :4], cache, torch.arange(4))
        tail = [
            model.forward_static(ids[:, t : t + 1], cache, torch.tensor([t])) for t in (4, 5, 6)
        ]
        last = model(ids, pad, logits_to_keep=2)  # [B, 2, V]: the prefill's head on 2 rows
    got = torch.cat([head, *tail], dim=1)
    real = ~pad
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1.3e-6)
    torch.testing.assert_close(last, want[:, -2:], atol=1e-5, rtol=1.3e-6)


def test_compiled_step_is_one_graph_over_256_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dynamo's view (fullgraph, guards, recompiles) with its eager backend: inductor's code
    generation (tens of seconds on this CPU) is what benchmarks/decode.py times."""
    compile_ = torch.compile
    monkeypatch.setattr(static_decode, "_COMPILED", {})
    monkeypatch.setattr(
        torch, "compile", lambda fn, **kw: compile_(fn, **{**kw, "backend": "eager", "mode": None})
    )
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = _model("llama", max_positions=512)
    ids, pad = _prompts()
    with torch._dynamo.config.patch(error_on_recompile=True):
        got = model.generate(ids, 256, padding_mask=pad, greedy=True, compile=True)
        shorter = model.generate(ids[:, 2:], 256, padding_mask=pad[:, 2:], compile=True)
    assert got.shape == (3, 263)
    assert torch.equal(got[:, :27], model.generate(ids, 20, padding_mask=pad, greedy=True))
    assert shorter.shape == (3, 261)  # another prompt length, the same capacity: no recompile
    counters = torch._dynamo.utils.counters
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"]


def test_misuse_is_refused() -> None:
    model = _model("llama")
    cache = model.new_static_cache(2, 8)
    with pytest.raises(RuntimeError, match="before prepare"):
        cache.update(0, torch.zeros(2, 2, 1, 8), torch.zeros(2, 2, 1, 8))
    with pytest.raises(ValueError, match="batch_size"):
        StaticKVCache(1, 8, batch_size=0, num_kv_heads=1, head_dim=4)
    with pytest.raises(ValueError, match="B=2 and T0 <= capacity=8"):
        cache.start(torch.zeros(2, 9, dtype=torch.bool))
    with pytest.raises(TypeError, match="forward_static"):
        model(torch.ones(2, 1, dtype=torch.long), kv_cache=cache)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="self-attention only"):
        cache.get_cross(0)
    alibi = DecoderOnlyLM(DecoderOnlyConfig(vocab_size=V, d_model=16, positional="alibi"))
    with pytest.raises(ValueError, match="positional='alibi'"):
        alibi.generate(torch.ones(1, 3, dtype=torch.long), 2, compile=True)
    with pytest.raises(TypeError, match="compile"):
        model.generate(torch.ones(1, 3, dtype=torch.long), 2, compile=1)  # type: ignore[arg-type]


def test_fingerprint_moves_with_every_kind_of_weight_change() -> None:
    model = _model("gpt2")
    ids, pad = _prompts()
    first = next(model.parameters())
    before = static_decode.fingerprint(model)
    model(ids, pad)  # (the tests of this folder run without grad)
    assert static_decode.fingerprint(model) == before  # a forward pass writes nothing
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with torch.enable_grad():
        model(ids, pad).sum().backward()

    def in_place() -> None:
        with torch.no_grad():
            first.add_(0.0)

    def new_storage() -> None:
        first.data = first.data.clone()

    seen = {before}
    reload = lambda: model.load_state_dict(model.state_dict())  # noqa: E731
    for change in (in_place, reload, new_storage, opt.step):
        change()
        now = static_decode.fingerprint(model)
        assert now not in seen, change
        seen.add(now)


def test_cpu_step_is_shared_until_the_weights_change(monkeypatch: pytest.MonkeyPatch) -> None:
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, backend="eager"))
    model, other = _model("gpt2"), _model("llama")
    cpu = torch.device("cpu")
    step = static_decode.compiled_step(model, cpu, 2)
    assert static_decode.compiled_step(model, cpu, 2) is step
    assert static_decode.compiled_step(other, cpu, 2) is not step
    copies = static_decode._RELAID
    static_decode.compiled_step(model, cpu, 1)
    relaid = copies[model][1]
    assert set(relaid) == {f"model.{n}" for n in static_decode.column_major_weights(model)}
    static_decode.compiled_step(model, cpu, 1)
    assert copies[model][1] is relaid  # the same weights: the same copies
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    assert static_decode.compiled_step(model, cpu, 2) is not step
    static_decode.compiled_step(model, cpu, 1)
    assert copies[model][1] is not relaid
    with pytest.raises(TypeError, match=r"torch\.nn\.Module, got object"):
        static_decode.compiled_step(object(), cpu, 2)  # type: ignore[arg-type]


def test_column_major_copies_hold_every_linear_weight_tied_head_included() -> None:
    model = _model("gpt2")
    weights = static_decode.column_major_weights(model)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    params = dict(model.named_parameters())
    assert len(weights) == len({id(m.weight) for m in linears}) > 0
    for name, w in weights.items():
        N = params[name].shape[0]
        assert torch.equal(w, params[name]) and w.stride() == (1, N)
        assert w.data_ptr() != params[name].data_ptr()


def test_one_row_compiled_step_runs_on_the_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """B=1 with dynamo's eager backend: the tokens of the eager path; copies that differ from
    the weights change the logits (so the step reads them); a weight change makes new copies."""
    compile_ = torch.compile
    monkeypatch.setattr(static_decode, "_COMPILED", {})
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, backend="eager"))
    model = _model("llama")
    ids = _prompts()[0][:1]  # [1, T0]
    assert torch.equal(
        model.generate(ids, 8, greedy=True, compile=True), model.generate(ids, 8, greedy=True)
    )
    decoder = static_decode.StaticDecoder(model, 1, 64, compile=True)
    decoder.prefill(ids, None)
    want = decoder.step(ids[:, -1], ids.shape[1])  # [1, V]
    for w in static_decode._RELAID[model][1].values():
        w.mul_(2.0)
    decoder.prefill(ids, None)
    assert not torch.allclose(decoder.step(ids[:, -1], ids.shape[1]), want)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-1.0)
    assert torch.equal(
        model.generate(ids, 8, greedy=True, compile=True), model.generate(ids, 8, greedy=True)
    )


def test_frozen_inductor_step_follows_weight_changes() -> None:
    """The real thing (inductor, weights frozen into the graph: ~10 s here): after an in-place
    change of every weight, compile=True decodes with the new weights, as the eager path does."""
    model = _model("gpt2")
    ids, pad = _prompts()
    first = model.generate(ids, 4, padding_mask=pad, greedy=True, compile=True)
    assert torch.equal(first, model.generate(ids, 4, padding_mask=pad, greedy=True))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-1.0)
    again = model.generate(ids, 4, padding_mask=pad, greedy=True, compile=True)
    assert torch.equal(again, model.generate(ids, 4, padding_mask=pad, greedy=True))
    assert not torch.equal(again, first)
