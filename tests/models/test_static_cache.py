"""The static KV cache and the compiled decode step: the same tokens as the growing KVCache on
left-padded batches (rotary GQA and learned positions, greedy and seeded sampling), one graph
over 256 steps and across capacities with no graph break and no recompile, the window of
written slots, and the misuses it refuses."""

import mmap
import threading

import pytest
import torch
from torch._inductor.utils import run_and_get_code
from torch.func import functional_call
from tqdm import tqdm
from tqdm._monitor import TMonitor

import qkv.models.static_decode as static_decode
import qkv.models.weight_copies as weight_copies
from qkv.models import DecoderOnlyConfig, DecoderOnlyLM
from qkv.models.cpu_products import LeanRowProducts, ProductsAsReductions
from qkv.models.direct_step import DirectCall, Record, RecordingBackend
from qkv.nn import MultiHeadAttention
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


def _static_logits(
    model: DecoderOnlyLM, ids: torch.Tensor, cache: StaticKVCache, windowed: bool
) -> torch.Tensor:
    """The logits of ``ids`` ``[B, 7]`` through ``cache``: a 4-token prompt, then 3 single steps,
    each given the window of the slots written so far (``windowed``) or all slots."""

    def window(n: int) -> torch.Tensor | None:
        return cache.window(n) if windowed else None

    head = model.forward_static(ids[:, :4], cache, torch.arange(4), window=window(4))
    tail = [
        model.forward_static(ids[:, t : t + 1], cache, torch.tensor([t]), window=window(t + 1))
        for t in (4, 5, 6)
    ]
    return torch.cat([head, *tail], dim=1)  # [B, 7, V]


def _started(
    kind: str,
) -> tuple[DecoderOnlyLM, torch.Tensor, torch.Tensor, torch.Tensor, StaticKVCache]:
    """``(model, ids, pad, forward's logits [B, T0, V], a 64-slot cache started on pad)``."""
    model = _model(kind)
    ids, pad = _prompts()
    with torch.no_grad():
        want = model(ids, pad)  # [B, T0, V]
    cache = model.new_static_cache(3, 64)
    cache.start(pad)
    return model, ids, pad, want, cache


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_forward_static_logits_match_forward(kind: str) -> None:
    model, ids, pad, want, cache = _started(kind)
    with torch.no_grad():
        got = _static_logits(model, ids, cache, windowed=False)
        last = model(ids, pad, logits_to_keep=2)  # [B, 2, V]: the prefill's head on 2 rows
    real = ~pad
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1.3e-6)
    torch.testing.assert_close(last, want[:, -2:], atol=1e-5, rtol=1.3e-6)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_window_reads_only_the_slots_written(kind: str) -> None:
    """Each step given the window of the slots written so far: the logits of all ``C`` slots,
    and the slots after the window are never read (NaN there changes nothing)."""
    model, ids, pad, want, cache = _started(kind)
    with torch.no_grad():
        for layer in range(cache.num_layers):
            cache.keys[layer][:, :, 7:] = float("nan")
            cache.values[layer][:, :, 7:] = float("nan")
        got = _static_logits(model, ids, cache, windowed=True)
        new = torch.zeros(3, cache.keys[0].shape[1], 1, 8)  # [B, Hkv, 1, Dh]
        k, v = cache.update(0, new, new)
    real = ~pad
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1.3e-6)
    assert k.shape[2] == v.shape[2] == 7  # the last step's window: 7 of 64 slots


@pytest.mark.parametrize("mkl", [True, False])
@pytest.mark.parametrize("rows", [3, 1])
def test_compiled_step_is_one_graph_over_256_steps(
    monkeypatch: pytest.MonkeyPatch, rows: int, mkl: bool
) -> None:
    """Dynamo's view (fullgraph, guards, recompiles) with its eager backend: inductor's code
    generation (tens of seconds on this CPU) is what benchmarks/decode.py times. One row runs on
    the relaid copies (packed projections set on the modules inside the graph). A streamer
    keeps dynamo's guard check on every step (``generate`` without one checks the first step
    only), so that a recompile at any step would raise. Off Intel (``mkl`` False) one row is
    compiled with the products pass and several rows with a symbolic batch: fewer rows then
    reuse the graph too."""
    compile_ = torch.compile
    options: list[object] = []

    def recording(fn, **kw):  # type: ignore[no-untyped-def]
        backend = kw.get("backend")
        options.append(backend.options if isinstance(backend, RecordingBackend) else None)
        return compile_(fn, **{**kw, "backend": "eager", "mode": None, "options": None})

    monkeypatch.setattr(static_decode, "_COMPILED", {})
    monkeypatch.setattr(static_decode, "mkl_reads_fast", lambda: mkl)
    monkeypatch.setattr(torch, "compile", recording)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = _model("llama", max_positions=512)
    ids, pad = _prompts()
    ids, pad = ids[:rows], pad[:rows]  # [rows, T0]; row 0 has no padding
    checked = {"streamer": lambda t: None, "compile": True}  # every step's guards checked
    with torch._dynamo.config.patch(error_on_recompile=True):
        got = model.generate(ids, 256, padding_mask=pad, greedy=True, **checked)
        shorter = model.generate(ids[:, 2:], 256, padding_mask=pad[:, 2:], **checked)
        bigger = model.generate(ids, 20, padding_mask=pad, greedy=True, **checked)  # C=64
        if rows > 1 and not mkl:  # one row fewer: the same graph (B is dynamic)
            fewer = model.generate(ids[1:], 20, padding_mask=pad[1:], greedy=True, **checked)
            assert torch.equal(
                fewer, model.generate(ids[1:], 20, padding_mask=pad[1:], greedy=True)
            )
    assert torch.equal(bigger, got[:, :27])  # another capacity: the same graph (C is dynamic)
    assert got.shape == (rows, 263)
    assert torch.equal(got[:, :27], model.generate(ids, 20, padding_mask=pad, greedy=True))
    assert shorter.shape == (rows, 261)  # another prompt length: no recompile
    counters = torch._dynamo.utils.counters
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"]
    # one row: inductor writes the step's wrapper in C++; frozen batches keep the Python one
    assert len(options) == 1
    if rows > 1:
        assert options[0] is None
    else:
        assert isinstance(options[0], dict) and options[0].pop("cpp_wrapper") is True
        rows_pass = LeanRowProducts if mkl else ProductsAsReductions
        assert [type(p) for p in options[0].values()] == [rows_pass]


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
    with pytest.raises(ValueError, match=r"length must be in \[1, capacity=8\], got 9"):
        cache.window(9)
    with pytest.raises(ValueError, match="got 0"):
        cache.window(0)
    with pytest.raises(TypeError, match="length must be an int, got Tensor"):
        cache.window(torch.tensor(3))  # type: ignore[arg-type]
    position = torch.tensor([2])
    with pytest.raises(ValueError, match=r"window must be bool \[B=2, n\].*torch.int64 \(2, 3\)"):
        cache.prepare(position, torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"window must be bool.*\(1, 3\)"):
        cache.prepare(position, torch.zeros(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="covers 9 slots, the cache has capacity=8"):
        cache.prepare(position, torch.zeros(2, 9, dtype=torch.bool))
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
    fused, covered = weight_copies.fused_qkv_weights(model)
    plain = weight_copies.linear_weights(model, covered)
    assert set(relaid) == {f"model.{n}" for n in [*plain, *fused]}
    static_decode.compiled_step(model, cpu, 1)
    assert copies[model][1] is relaid  # the same weights: the same copies
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    assert static_decode.compiled_step(model, cpu, 2) is not step
    static_decode.compiled_step(model, cpu, 1)
    assert copies[model][1] is not relaid
    with pytest.raises(TypeError, match=r"torch\.nn\.Module, got object"):
        static_decode.compiled_step(object(), cpu, 2)  # type: ignore[arg-type]


@pytest.mark.parametrize("column_major", [True, False])
def test_linear_weight_copies_hold_every_linear_weight_tied_head_included(
    column_major: bool,
) -> None:
    model = _model("gpt2")
    weights = weight_copies.linear_weights(model, column_major=column_major)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    params = dict(model.named_parameters())
    assert len(weights) == len({id(m.weight) for m in linears}) > 0
    for name, w in weights.items():
        N, K = params[name].shape
        assert torch.equal(w, params[name]) and w.stride() == ((1, N) if column_major else (K, 1))
        assert w.data_ptr() != params[name].data_ptr()


@pytest.mark.parametrize("column_major", [True, False])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_fused_qkv_copies_stack_the_three_projections(kind: str, column_major: bool) -> None:
    model = _model(kind)
    fused, covered = weight_copies.fused_qkv_weights(model, column_major=column_major)
    attns = [(p, m) for p, m in model.named_modules() if isinstance(m, MultiHeadAttention)]
    assert len(covered) == 3 * len(attns) > 0
    for path, m in attns:
        projs = (m.q_proj, m.k_proj, m.v_proj)
        w = fused[f"{path}.fused_qkv_weight"]
        assert torch.equal(w, torch.cat([p.weight for p in projs]))
        assert w.stride() == ((1, w.shape[0]) if column_major else (w.shape[1], 1))
        bias = fused.get(f"{path}.fused_qkv_bias")
        if m.q_proj.bias is None:
            assert bias is None
        else:
            assert bias is not None and torch.equal(bias, torch.cat([p.bias for p in projs]))
        assert {f"{path}.{p}.weight" for p in ("q_proj", "k_proj", "v_proj")} <= covered
    assert not set(weight_copies.linear_weights(model, covered)) & covered


def test_column_major_copies_lie_in_one_aligned_map() -> None:
    torch.manual_seed(0)
    w = torch.randn(48, 32)  # [N, K]
    given = {"col": w.t().contiguous().t(), "row": w.clone(), "bias": torch.randn(7)}
    copies = weight_copies.column_major_copies(given)
    assert list(copies) == list(given)
    for name, t in given.items():
        got = copies[name]
        assert torch.equal(got, t) and got.data_ptr() != t.data_ptr()
    assert copies["col"].stride() == copies["row"].stride() == (1, 48)  # column-major
    assert copies["bias"].stride() == (1,)
    storages = {t.untyped_storage().data_ptr() for t in copies.values()}
    assert len(storages) == 1  # one memory map
    if hasattr(mmap, "MADV_HUGEPAGE"):
        assert copies["col"].data_ptr() % weight_copies.HUGE_PAGE == 0
    copies["row"].add_(1.0)
    assert torch.equal(copies["col"], given["col"])  # no overlap between copies
    meta = weight_copies.column_major_copies({"w": torch.empty(4, 6, device="meta")})
    assert meta["w"].stride() == (1, 4)  # off the CPU: a tensor of its own, same layout
    rows = weight_copies.huge_page_copies(given, column_major=False)
    assert rows["col"].stride() == rows["row"].stride() == (32, 1)  # row-major
    assert all(torch.equal(rows[n], t) for n, t in given.items())
    assert len({t.untyped_storage().data_ptr() for t in rows.values()}) == 1
    meta = weight_copies.huge_page_copies(
        {"w": torch.empty(4, 6, device="meta")}, column_major=False
    )
    assert meta["w"].stride() == (6, 1)
    with pytest.raises(ValueError, match=r"'cube' must be a vector or a matrix.*\(2, 2, 2\)"):
        weight_copies.column_major_copies({"cube": torch.randn(2, 2, 2)})


def test_fused_qkv_weights_give_the_projections_output() -> None:
    """Self-attention through the packed weights equals the three projections (GQA, rotary,
    biases); the separate projections are then not read (NaN there changes nothing);
    cross-attention and a module with biases on some projections only keep them."""
    torch.manual_seed(0)
    mha = MultiHeadAttention(32, 4, num_kv_heads=2).eval()
    x, src = torch.randn(2, 5, 32), torch.randn(2, 3, 32)  # [B, T, D], [B, S, D]
    rope = (torch.randn(5, 8), torch.randn(5, 8))  # [T, Dh] x 2
    fused, covered = weight_copies.fused_qkv_weights(mha)
    assert covered == {"q_proj.weight", "k_proj.weight", "v_proj.weight"}
    nan = {name: torch.full_like(mha.get_parameter(name), float("nan")) for name in covered}
    want = mha(x, x, x, need_weights=False, rope=rope)[0]  # [B, T, D]
    got = functional_call(mha, {**fused, **nan}, (x, x, x), {"need_weights": False, "rope": rope})
    torch.testing.assert_close(got[0], want, rtol=1e-5, atol=1e-6)
    assert mha.fused_qkv_weight is None  # only for the duration of the call
    cross = functional_call(mha, {**fused, **nan}, (x, src, src), {"need_weights": False})
    assert cross[0].isnan().all()  # the projections are read: nothing packed for a key != query
    mha.k_proj.bias = None
    assert weight_copies.fused_qkv_weights(mha) == ({}, frozenset())


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


@pytest.mark.parametrize("mkl", [True, False])
@pytest.mark.parametrize(("rows", "new"), [(3, 4), (1, 6)])
def test_inductor_step_follows_weight_changes(
    monkeypatch: pytest.MonkeyPatch, rows: int, new: int, mkl: bool
) -> None:
    """The real thing (inductor: ~8-10 s each here): B > 1 with the weights frozen into the
    graph (off Intel, ``mkl`` False: with a symbolic batch, so packed for oneDNN, and the
    wrapper in C++: 35 s instead of 25 for (3, 4, False) on a 2-core Zen 1 EPYC), B = 1 with
    its C++ wrapper on the column-major copies, each bias added outside its product (off Intel:
    on row-major copies, its products rewritten as reductions). After an in-place change of
    every weight, compile=True decodes with the new weights, as the eager path does.

    Frozen without timing each product shape against inductor's C++ GEMM template (what
    ``frozen_configs`` adds on an AVX2 CPU: 45 s instead of 25 for (3, 4, False) on a 2-core
    Zen 1 EPYC); ``test_a_frozen_timed_product_equals_eager`` compiles that timing."""
    monkeypatch.setattr(static_decode, "_COMPILED", {})
    monkeypatch.setattr(static_decode, "mkl_reads_fast", lambda: mkl)
    monkeypatch.setattr(static_decode, "frozen_configs", lambda mkl: {"freezing": True})
    model = _model("gpt2")
    ids, pad = _prompts()
    ids, pad = ids[:rows], pad[:rows]  # [rows, T0]; row 0 has no padding
    torch._dynamo.reset()  # the products' form is decided when the step compiles
    first, codes = run_and_get_code(
        model.generate, ids, new, padding_mask=pad, greedy=True, compile=True
    )
    assert torch.equal(first, model.generate(ids, new, padding_mask=pad, greedy=True))
    code = "\n".join(codes)
    if rows > 1:  # off MKL's fast path the frozen step's wrapper is C++, as one row's always is
        assert ("inductor_entry_impl" in code) is not mkl
    if rows > 1 and torch.backends.mkl.is_available():  # the weights' packing
        assert ("_mkl_linear" in code) is mkl
        assert ("_linear_pointwise" in code) is not mkl  # off MKL: oneDNN's, packed
    elif rows == 1:  # MKL's product (its bias added outside, LeanRowProducts), or reductions
        assert ("mm_out(" in code) is mkl
        assert "addmm" not in code
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-1.0)
    again = model.generate(ids, new, padding_mask=pad, greedy=True, compile=True)
    assert torch.equal(again, model.generate(ids, new, padding_mask=pad, greedy=True))
    assert not torch.equal(again, first)


def _stances(decoder: static_decode.StaticDecoder, steps: int) -> list[bool]:
    """Whether dynamo's guard check was skipped during each of ``steps`` steps of ``decoder``
    (its compiled step replaced by the eager one, which records the stance it runs under)."""
    seen: list[bool] = []

    def recording(*args):  # type: ignore[no-untyped-def]
        seen.append(torch._dynamo.eval_frame._stance.skip_guard_eval_unsafe)
        return static_decode._step(*args)

    decoder._step = recording
    ids = _prompts()[0][:1]  # [1, T0]
    decoder.prefill(ids, None)
    for s in range(steps):
        decoder.step(ids[:, -1], ids.shape[1] + s)
    return seen


def _threads(monkeypatch: pytest.MonkeyPatch, *others: threading.Thread) -> None:
    """Let the decoder see this thread and ``others`` alive, whatever threads earlier tests of
    this process left behind (idle pools, tqdm's monitor)."""
    monkeypatch.setattr(threading, "enumerate", lambda: [threading.current_thread(), *others])


def test_only_an_unattended_decoder_skips_the_guards_after_its_first_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """skip_guards: the first step is checked in full, the later ones skip the check; without
    it every step is checked; while another thread is alive (tqdm's monitor aside), or under a
    stance of the caller's own (force_eager), every step is checked too."""
    model = _model("llama")
    _threads(monkeypatch)
    on = static_decode.StaticDecoder(model, 1, 64, compile=True, skip_guards=True)
    assert _stances(on, 3) == [False, True, True]
    off = static_decode.StaticDecoder(model, 1, 64, compile=True, skip_guards=False)
    assert _stances(off, 3) == [False, False, False]
    eager = static_decode.StaticDecoder(model, 1, 64, compile=False, skip_guards=True)
    assert _stances(eager, 2) == [False, False]  # nothing compiled: no guards to skip
    monitor = TMonitor(tqdm, 10)  # tqdm's monitor thread (transformers' loading bars start it)
    done = threading.Event()
    other = threading.Thread(target=done.wait)  # another thread: the stance would reach it
    other.start()
    try:
        _threads(monkeypatch, monitor)
        monitored = static_decode.StaticDecoder(model, 1, 64, compile=True, skip_guards=True)
        assert _stances(monitored, 3) == [False, True, True]
        _threads(monkeypatch, monitor, other)
        kept = static_decode.StaticDecoder(model, 1, 64, compile=True, skip_guards=True)
        assert _stances(kept, 2) == [False, False]
    finally:
        monitor.exit()
        done.set()
        other.join()
    _threads(monkeypatch)
    with torch.compiler.set_stance("force_eager"):
        kept = static_decode.StaticDecoder(model, 1, 64, compile=True, skip_guards=True)
        assert _stances(kept, 2) == [False, False]
        assert torch._dynamo.eval_frame._stance.stance == "force_eager"  # not overridden
    assert torch._dynamo.eval_frame._stance == torch._dynamo.eval_frame.DynamoStance()


def test_generate_skips_the_guards_only_without_a_streamer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """generate() runs no user code between steps; a streamer and stream() do."""
    made: list[bool] = []
    init = static_decode.StaticDecoder.__init__

    def recording(self, *args, skip_guards: bool = False, **kw):  # type: ignore[no-untyped-def]
        made.append(skip_guards)
        init(self, *args, skip_guards=skip_guards, **kw)

    monkeypatch.setattr(static_decode.StaticDecoder, "__init__", recording)
    model = _model("llama")
    ids = _prompts()[0][:1]  # [1, T0]
    model.generate(ids, 3, greedy=True, static_cache=True)
    model.generate(ids, 3, greedy=True, static_cache=True, streamer=lambda t: None)
    list(model.stream(ids, 3, greedy=True, static_cache=True))
    assert made == [True, False, False]


def test_skipped_guards_still_tell_models_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """B = 1 shares one compiled step among models (dynamo's eager backend): with the later
    steps' guards skipped, two models of different shapes decoded in turn each still give the
    eager path's tokens (each generation's first step is checked in full and picks its graph)."""
    compile_ = torch.compile
    monkeypatch.setattr(static_decode, "_COMPILED", {})
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, backend="eager"))
    torch._dynamo.reset()
    _threads(monkeypatch)  # the later steps skip the check, whatever else this process runs
    ids = _prompts()[0][:1]  # [1, T0]
    models = [_model("llama"), _model("gpt2")]
    want = [m.generate(ids, 12, greedy=True) for m in models]
    for m, w in [*zip(models, want, strict=True)] * 2:
        assert torch.equal(m.generate(ids, 12, greedy=True, compile=True), w)


def test_each_products_policy_has_its_own_step_and_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """B = 1: a changed policy (QKV_CPU_PRODUCTS set between generations) compiles a step of its
    own and relays the copies (column-major for MKL, row-major for inductor's products)."""
    compile_ = torch.compile
    monkeypatch.setattr(static_decode, "_COMPILED", {})
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, backend="eager"))
    model, cpu = _model("llama"), torch.device("cpu")
    name = "model.blocks.layers.0.ffn.fc1.weight"
    strides = []
    for mkl in (True, False, True):
        monkeypatch.setattr(static_decode, "mkl_reads_fast", lambda mkl=mkl: mkl)
        static_decode.compiled_step(model, cpu, 1)
        strides.append(static_decode._RELAID[model][1][name].stride())
    N, K = model.get_parameter(name.removeprefix("model.")).shape
    assert strides == [(1, N), (K, 1), (1, N)]
    assert len(static_decode._COMPILED) == 2  # one step per policy, reused on the way back


def _direct_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """B = 1 steps compiled by a RecordingBackend around dynamo's graph itself (no inductor)."""
    monkeypatch.setattr(static_decode, "_COMPILED", {})
    monkeypatch.setattr(
        static_decode,
        "RecordingBackend",
        lambda options: RecordingBackend(options, compile=lambda gm, _: gm),
    )
    torch._dynamo.reset()


def _counted(decoder: static_decode.StaticDecoder) -> list[int]:
    """Count the calls of ``decoder``'s compiled step (through dynamo) in the returned list."""
    calls, step = [0], decoder._step

    def counting(*args):  # type: ignore[no-untyped-def]
        calls[0] += 1
        return step(*args)

    decoder._step = counting
    return calls


def _decode(decoder: static_decode.StaticDecoder, ids: torch.Tensor, steps: int) -> torch.Tensor:
    """Each step's logits ``[steps, V]`` after the ``[1, T0]`` prompt, greedy."""
    logits = [decoder.prefill(ids, None)]
    for s in range(steps):
        token = logits[-1].argmax(-1)  # [1]
        logits.append(decoder.step(token, ids.shape[1] + s))
    return torch.cat(logits[1:])  # [steps, V]


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_later_steps_call_the_graph_without_dynamo(
    monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """B = 1, unattended: the first step goes through dynamo (guards checked); the later ones
    call the graph it recorded with that step's tokens, position, window and window length
    replaced, and give the eager step's logits; generate gives the eager tokens."""
    _direct_backend(monkeypatch)
    _threads(monkeypatch)
    model, ids = _model(kind), _prompts()[0][:1]  # [1, T0]
    want = _decode(static_decode.StaticDecoder(model, 1, 64, compile=False), ids, 9)
    decoder = static_decode.StaticDecoder(model, 1, 64, compile=True, skip_guards=True)
    calls = _counted(decoder)
    got = _decode(decoder, ids, 9)
    assert calls == [1] and decoder._direct is not None
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for prompt in (ids, ids[:, 3:]):  # another prompt length, another generation
        tokens = model.generate(prompt, 20, greedy=True, compile=True)
        assert torch.equal(tokens, model.generate(prompt, 20, greedy=True))


def test_steps_go_through_dynamo_where_guards_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    """No direct call for a decoder that checks every step (a streamer), while another thread
    is alive, under a stance of the caller's (force_eager: nothing recorded), or for a step in
    another grad mode than the first (dynamo then checks its guards and compiles another
    graph)."""
    _direct_backend(monkeypatch)
    model, ids = _model("llama"), _prompts()[0][:1]  # [1, T0]
    want = _decode(static_decode.StaticDecoder(model, 1, 64, compile=False), ids, 4)
    _threads(monkeypatch)
    checked = static_decode.StaticDecoder(model, 1, 64, compile=True, skip_guards=False)
    calls = _counted(checked)
    torch.testing.assert_close(_decode(checked, ids, 4), want, atol=1e-5, rtol=1e-5)
    assert calls == [4] and checked._direct is None
    done = threading.Event()
    other = threading.Thread(target=done.wait)
    other.start()
    try:
        _threads(monkeypatch, other)
        crowded = static_decode.StaticDecoder(model, 1, 64, compile=True, skip_guards=True)
        calls = _counted(crowded)
        torch.testing.assert_close(_decode(crowded, ids, 4), want, atol=1e-5, rtol=1e-5)
        assert calls == [4]  # every step through dynamo, its guards checked
    finally:
        done.set()
        other.join()
    _threads(monkeypatch)
    with torch.compiler.set_stance("force_eager"):
        forced = static_decode.StaticDecoder(model, 1, 64, compile=True, skip_guards=True)
        torch.testing.assert_close(_decode(forced, ids, 4), want, atol=1e-5, rtol=1e-5)
        assert forced._direct is None
    decoder = static_decode.StaticDecoder(model, 1, 64, compile=True, skip_guards=True)
    calls = _counted(decoder)
    got = [decoder.prefill(ids, None), decoder.step(ids[:, -1], ids.shape[1])]
    assert decoder._direct is not None
    with torch.enable_grad():  # checked in full (a recompile), not the direct call
        got.append(decoder.step(ids[:, -2], ids.shape[1] + 1))
    assert calls == [2]
    eager = static_decode.StaticDecoder(model, 1, 64, compile=False)
    eager.prefill(ids, None)
    for s, token in enumerate((ids[:, -1], ids[:, -2])):
        torch.testing.assert_close(
            got[s + 1], eager.step(token, ids.shape[1] + s), atol=1e-5, rtol=1e-5
        )


def test_a_record_becomes_a_direct_call_only_when_it_can() -> None:
    """DirectCall.of: each of the step's tensors once among the inputs, every size readable from
    a tensor (here a window's length and its row stride), the logits first among the outputs
    and nothing but sizes after them; the call replaces the three tensors and their sizes."""
    weight, padding = torch.randn(4), torch.zeros(1, 16, dtype=torch.bool)  # [4], [1, C]

    def fn(weight, ids, pos, window, n, stride):  # type: ignore[no-untyped-def]
        assert window.shape[1] == n and window.stride(0) == stride
        return [weight[ids[0]] + pos + n, n]  # [1]

    ids, pos, window = torch.tensor([[1]]), torch.tensor([5]), padding[:, :6]
    args = (weight, ids, pos, window, 6, 16)
    sizes = ((4, 3, 1), (5, 3, -1))  # n: window's dim 1; its row stride: window's stride 0
    out = fn(*args)
    step = (ids, pos, window)
    direct = DirectCall.of(Record(fn, args, out, sizes), step, out[0])
    assert direct is not None
    got = direct(torch.tensor([[2]]), torch.tensor([6]), padding[:, :7])
    torch.testing.assert_close(got, weight[2:3] + 6 + 7)
    refused = [
        Record(fn, args, out, None),  # a size found in no tensor
        Record(fn, args, out, ((4, 3, 0),)),  # a size that is not what its tensor says
        Record(fn, (weight, ids, pos, window, window, 6, 16), out, sizes),  # the window twice
        Record(fn, (weight, pos, window, 6, 16), out, sizes),  # no ids
        Record(fn, args, [out[0], weight], sizes),  # another tensor out
        Record(fn, args, [out[0].clone(), 6], sizes),  # not the logits dynamo returned
    ]
    for record in refused:
        assert DirectCall.of(record, step, out[0]) is None
