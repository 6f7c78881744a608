"""qkv.DecoderOnlyLM: shapes, padding, KV-cache equivalence, greedy and sampled generation."""

import pytest
import torch

from qkv import DecoderOnlyConfig, DecoderOnlyLM, KVCache
from qkv.models.decoder_only import upgrade_state_dict
from qkv.nn.stacks import Encoder

ATOL, RTOL = 1e-5, 1.3e-6


def _model(**overrides: object) -> DecoderOnlyLM:
    kw: dict[str, object] = {
        "vocab_size": 17,
        "d_model": 16,
        "num_heads": 4,
        "num_layers": 2,
        "dim_feedforward": 32,
        "dropout": 0.0,
        "max_positions": 32,
    }
    kw.update(overrides)
    return DecoderOnlyLM(DecoderOnlyConfig(**kw)).eval()  # type: ignore[arg-type]


def test_shapes_tied_head_and_causality() -> None:
    model = _model()
    ids = torch.randint(0, 17, (2, 6))
    logits = model(ids)
    assert logits.shape == (2, 6, 17)
    assert model.lm_head.weight is model.embed.weight
    changed = ids.clone()
    changed[:, 4] = (changed[:, 4] + 1) % 17
    # a later token never changes earlier logits
    torch.testing.assert_close(model(changed)[:, :4], logits[:, :4], atol=0, rtol=0)
    assert not torch.allclose(model(changed)[:, 4:], logits[:, 4:])


@pytest.mark.parametrize("positional", ["rotary", "sinusoidal", "learned", "alibi", "none"])
@pytest.mark.parametrize("num_kv_heads", [None, 1])
def test_cached_decoding_equals_full_forward(positional: str, num_kv_heads: int | None) -> None:
    model = _model(positional=positional, num_kv_heads=num_kv_heads)
    prompt = torch.randint(0, 17, (3, 4))
    n = 8
    out = prompt
    steps = []
    for _ in range(n):  # greedy without a cache: recompute the whole prefix
        logits = model(out)[:, -1]
        steps.append(logits)
        out = torch.cat([out, logits.argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(model.generate(prompt, n, greedy=True), out)
    cache = model.new_cache()
    first = model(prompt, kv_cache=cache)[:, -1]
    torch.testing.assert_close(first, steps[0], atol=ATOL, rtol=RTOL)
    for t in range(1, n):
        step = model(out[:, 3 + t : 4 + t], kv_cache=cache)[:, -1]
        torch.testing.assert_close(step, steps[t], atol=ATOL, rtol=RTOL, msg=f"step {t}")
    assert cache.length == 4 + n - 1


def test_chunked_prefill_equals_one_pass() -> None:
    model = _model()
    ids = torch.randint(0, 17, (2, 9))
    cache = model.new_cache()
    parts = [model(ids[:, :3], kv_cache=cache), model(ids[:, 3:7], kv_cache=cache),
             model(ids[:, 7:], kv_cache=cache)]  # fmt: skip
    torch.testing.assert_close(torch.cat(parts, 1), model(ids), atol=ATOL, rtol=RTOL)


def test_generate_n_equals_generate_n_minus_one_then_one_step() -> None:
    model = _model(num_kv_heads=2)
    prompt = torch.randint(0, 17, (2, 3))
    for n in (2, 5):
        shorter = model.generate(prompt, n - 1, greedy=True)
        longer = model.generate(prompt, n, greedy=True)
        one_more = model.generate(shorter, 1, greedy=True)
        assert torch.equal(longer, one_more)


@pytest.mark.parametrize("positional", ["rotary", "learned"])
def test_padded_batch_equals_each_sequence_alone(positional: str) -> None:
    model = _model(positional=positional, pad_id=0)
    lengths = [7, 3, 5]
    ids = torch.randint(1, 17, (3, 7))
    for b, n in enumerate(lengths):
        ids[b, n:] = 0
    batch = model(ids)
    for b, n in enumerate(lengths):
        torch.testing.assert_close(batch[b, :n], model(ids[b : b + 1, :n])[0], atol=ATOL,
                                   rtol=RTOL)  # fmt: skip
    # padding stays blocked in the cache: decoding after a padded chunk
    cache = model.new_cache()
    model(ids, kv_cache=cache)
    nxt = torch.randint(1, 17, (3, 1))
    step = model(nxt, kv_cache=cache)[:, -1]
    explicit = torch.cat([ids, nxt], 1)
    torch.testing.assert_close(step, model(explicit)[:, -1], atol=ATOL, rtol=RTOL)


def test_sampling_is_reproducible_and_respects_top_k() -> None:
    model = _model()
    prompt = torch.randint(0, 17, (4, 3))

    def run(seed: int, **kw: object) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed)
        return model.generate(prompt, 10, generator=gen, **kw)  # type: ignore[arg-type]

    assert torch.equal(run(5, temperature=0.8), run(5, temperature=0.8))
    assert not torch.equal(run(5), run(6))
    # top_k=1 is greedy whatever the temperature
    assert torch.equal(run(1, top_k=1, temperature=3.0), model.generate(prompt, 10, greedy=True))
    # with top_k=3 every sampled token is among the 3 most likely at its step
    out = run(2, top_k=3)
    logits = model(out[:, :-1])[:, 2:]  # [B, 10, V] predictions for the sampled positions
    top3 = logits.topk(3, dim=-1).indices
    assert torch.all((top3 == out[:, 3:, None]).any(-1))
    # a very low temperature concentrates on the argmax
    assert torch.equal(run(3, temperature=1e-4), model.generate(prompt, 10, greedy=True))


def test_eos_stops_rows_and_pads() -> None:
    model = _model(pad_id=0)
    prompt = torch.randint(1, 17, (3, 2))
    free = model.generate(prompt, 6, greedy=True)
    eos = int(free[0, 3])  # row 0 produces this token at its second step
    out = model.generate(prompt, 6, greedy=True, eos_id=eos)
    for b, row in enumerate(out.tolist()):
        gen = free[b, 2:].tolist()
        stop = gen.index(eos) + 1 if eos in gen else len(gen)
        assert row[: 2 + stop] == free[b, : 2 + stop].tolist()
        assert all(t == 0 for t in row[2 + stop :])
    assert eos in out[0, 2:].tolist()
    if all(eos in free[b, 2:].tolist() for b in range(3)):
        assert out.shape[1] < free.shape[1]  # everyone stopped: no wasted steps


def test_errors() -> None:
    model = _model()
    ids = torch.randint(0, 17, (2, 4))
    with pytest.raises(ValueError, match="max_positions"):
        model.generate(ids, 29)
    with pytest.raises(ValueError, match="temperature"):
        model.generate(ids, 2, temperature=0.0)
    with pytest.raises(ValueError, match="top_k"):
        model.generate(ids, 2, top_k=0)
    with pytest.raises(ValueError, match="max_positions"):
        model(torch.randint(0, 17, (1, 33)))
    with pytest.raises(ValueError, match="padding_mask"):
        model(ids, padding_mask=torch.zeros(2, 3, dtype=torch.bool))
    cache = KVCache(2, 5)
    model(ids, kv_cache=cache)
    with pytest.raises(RuntimeError, match="overflow"):
        model(ids, kv_cache=cache)


@pytest.mark.parametrize("norm_first", [True, False])
def test_blocks_are_the_shared_stack(norm_first: bool) -> None:
    model = _model(norm_first=norm_first)
    assert isinstance(model.blocks, Encoder) and len(model.blocks.layers) == 2
    keys = set(model.state_dict())
    assert "blocks.layers.1.self_attn.q_proj.weight" in keys
    assert ("blocks.norm.weight" in keys) == norm_first  # post-norm: each layer ends in one
    assert not any(k.startswith(("layers.", "norm.")) for k in keys)


def test_0_1_state_dict_keys_load_through_the_pre_hook() -> None:
    model = _model()
    legacy = {k.replace("blocks.", "", 1): v.clone() + 0.5 for k, v in model.state_dict().items()}
    assert "layers.0.ffn.fc1.weight" in legacy and "norm.bias" in legacy
    assert set(upgrade_state_dict(legacy)) == set(model.state_dict())
    assert upgrade_state_dict(upgrade_state_dict(legacy)) == upgrade_state_dict(legacy)
    other = _model()
    other.load_state_dict(legacy)  # strict
    for k, v in other.state_dict().items():
        assert torch.equal(v, legacy[k.replace("blocks.", "", 1)])
    wrapped = torch.nn.ModuleDict({"lm": _model()})  # the upgrade respects the prefix
    wrapped.load_state_dict({f"lm.{k}": v for k, v in legacy.items()})
    assert torch.equal(wrapped["lm"].blocks.norm.weight, legacy["norm.weight"])


def test_cache_keyword_is_a_deprecated_alias_of_kv_cache() -> None:
    model = _model()
    ids = torch.randint(0, 17, (2, 5))
    new, old = model.new_cache(), model.new_cache(capacity=8)
    assert old.capacity == 8 and new.capacity == 32
    expected = model(ids, kv_cache=new)
    with pytest.warns(DeprecationWarning, match="kv_cache"):
        got = model(ids, cache=old)
    torch.testing.assert_close(got, expected, atol=0.0, rtol=0.0)
    assert old.length == 5
    with pytest.raises(TypeError, match="kv_cache only"), pytest.warns(DeprecationWarning):
        model(ids, kv_cache=new, cache=old)
