"""qkv.Transformer: shapes, masks, KV-cache equivalence, greedy and beam decoding."""

import itertools
import math

import pytest
import torch

import qkv
from qkv import Transformer, TransformerConfig

ATOL, RTOL = 1e-5, 1.3e-6
PAD, BOS, EOS = 0, 1, 2


def _model(**overrides: object) -> Transformer:
    kw: dict[str, object] = {
        "src_vocab_size": 13,
        "tgt_vocab_size": 11,
        "d_model": 16,
        "num_heads": 4,
        "num_encoder_layers": 2,
        "num_decoder_layers": 2,
        "dim_feedforward": 32,
        "dropout": 0.0,
        "max_positions": 32,
    }
    kw.update(overrides)
    return Transformer(TransformerConfig(**kw)).eval()  # type: ignore[arg-type]


def _src(B: int = 3, S: int = 7) -> tuple[torch.Tensor, list[int]]:
    lengths = [S, S - 3, S - 1][:B]
    src = torch.randint(3, 13, (B, S))
    for b, n in enumerate(lengths):
        src[b, n:] = PAD
    return src, lengths


def _greedy_without_cache(
    model: Transformer, src: torch.Tensor, n: int
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Recompute the whole prefix every step (the definition of greedy decoding)."""
    out = torch.full((src.shape[0], 1), BOS)
    finished = torch.zeros(src.shape[0], dtype=torch.bool)
    steps = []
    for _ in range(n):
        logits = model(src, out)[:, -1]  # [B, V]
        steps.append(logits)
        nxt = torch.where(finished, torch.full_like(finished, PAD, dtype=torch.long),
                          logits.argmax(-1))  # fmt: skip
        out = torch.cat([out, nxt[:, None]], dim=1)
        finished |= nxt == EOS
        if finished.all():
            break
    return out, steps


def test_shapes_and_weights_for_plots() -> None:
    model = _model()
    src, _ = _src()
    tgt = torch.randint(3, 11, (3, 5))
    assert model(src, tgt).shape == (3, 5, 11)
    assert model.encode(src).shape == (3, 7, 16)
    attns = [m for m in model.modules() if isinstance(m, qkv.MultiHeadAttention)]
    assert len(attns) == 2 + 2 * 2
    for m in attns:
        m.record_weights = True
    model(src, tgt)
    cross = model.decoder.layers[0].cross_attn.last_weights
    assert cross is not None and cross.shape == (3, 4, 5, 7)
    # source padding gets weight 0, rows sum to 1
    assert torch.all(cross[1, :, :, 4:] == 0)
    torch.testing.assert_close(cross.sum(-1), torch.ones(3, 4, 5))
    self_w = model.decoder.layers[1].self_attn.last_weights
    assert self_w is not None and torch.all(self_w.triu(1) == 0)


def test_derived_padding_equals_explicit_masks() -> None:
    model = _model()
    src, _ = _src()
    tgt = torch.randint(3, 11, (3, 5))
    tgt[2, 3:] = PAD
    explicit = model(src, tgt, src == PAD, tgt == PAD)
    torch.testing.assert_close(model(src, tgt), explicit, atol=0, rtol=0)
    no_mask = model(src, tgt, torch.zeros_like(src, dtype=torch.bool))
    assert not torch.allclose(no_mask[1], explicit[1])  # the padding mask does something


@pytest.mark.parametrize("positional", ["sinusoidal", "rotary", "learned", "alibi"])
@pytest.mark.parametrize("num_kv_heads", [None, 2, 1])
def test_cached_decoding_equals_full_forward(positional: str, num_kv_heads: int | None) -> None:
    model = _model(positional=positional, num_kv_heads=num_kv_heads, norm_first=True)
    src, _ = _src()
    n = 8
    expected_tokens, expected_logits = _greedy_without_cache(model, src, n)
    assert torch.equal(model.generate(src, n), expected_tokens)
    memory = model.encode(src)
    cache = model.new_cache()
    for t, logits in enumerate(expected_logits):
        step = model.decode(expected_tokens[:, t : t + 1], memory, src == PAD, kv_cache=cache)
        torch.testing.assert_close(step[:, -1], logits, atol=ATOL, rtol=RTOL, msg=f"step {t}")
    assert cache.length == len(expected_logits)


def test_generate_n_equals_generate_n_minus_one_then_one_step() -> None:
    model = _model(positional="rotary")
    src, _ = _src()
    for n in (3, 6):
        longer, shorter = model.generate(src, n), model.generate(src, n - 1)
        finished = (shorter == EOS).any(1)
        if bool(finished.all()):  # every row ended: one more step adds nothing
            assert torch.equal(longer, shorter)
            continue
        assert longer.shape[1] == shorter.shape[1] + 1
        assert torch.equal(longer[:, :-1], shorter)
        one_more = model(src, shorter)[:, -1].argmax(-1)  # the extra step, without a cache
        assert torch.equal(longer[:, -1], torch.where(finished, PAD, one_more))


def test_generate_stops_at_eos_and_pads() -> None:
    model = _model()
    with torch.no_grad():  # make EOS the favourite after the first token
        model.lm_head.weight[EOS] = 0
    src, _ = _src()
    out, _ = _greedy_without_cache(model, src, 6)
    got = model.generate(src, 6)
    assert torch.equal(got, out)
    assert torch.all(got[:, 0] == BOS)
    for row in got.tolist():
        if EOS in row:
            assert all(t == PAD for t in row[row.index(EOS) + 1 :])


@pytest.mark.parametrize("positional", ["sinusoidal", "rotary"])
def test_padded_batch_equals_each_sequence_alone(positional: str) -> None:
    model = _model(positional=positional)
    src, lengths = _src()
    tgt = torch.randint(3, 11, (3, 6))
    tgt_lengths = [6, 4, 2]
    for b, n in enumerate(tgt_lengths):
        tgt[b, n:] = PAD
    batch = model(src, tgt)
    for b in range(3):
        alone = model(src[b : b + 1, : lengths[b]], tgt[b : b + 1, : tgt_lengths[b]])
        torch.testing.assert_close(batch[b, : tgt_lengths[b]], alone[0], atol=ATOL, rtol=RTOL)
    gen = model.generate(src, 5)
    for b in range(3):
        alone = model.generate(src[b : b + 1, : lengths[b]], 5)
        assert torch.equal(gen[b, : alone.shape[1]], alone[0])


def _exhaustive_best(model: Transformer, src: torch.Tensor, n: int, lp: float) -> list[int]:
    """Score every possible output (ending at its first EOS, or after n tokens).

    One teacher-forced pass over all ``V**n`` token strings gives the log-probability of every
    prefix (the decoder is causal), so every candidate is scored exactly once.
    """
    V = model.config.tgt_vocab_size
    strings = torch.tensor(list(itertools.product(range(V), repeat=n)))  # [V**n, n]
    ids = torch.cat([torch.full((len(strings), 1), BOS), strings], dim=1)  # [V**n, n + 1]
    memory = model.encode(src).expand(len(strings), -1, -1)  # [V**n, S, D]
    logp = torch.log_softmax(model.decode(ids[:, :-1], memory).float(), -1)  # [V**n, n, V]
    cum = logp.gather(2, strings[:, :, None])[:, :, 0].cumsum(1)  # [V**n, n]
    best: tuple[float, list[int]] = (-math.inf, [])
    for i, row in enumerate(strings.tolist()):
        L = row.index(EOS) + 1 if EOS in row else n
        score = float(cum[i, L - 1]) / L**lp
        if score > best[0]:
            best = (score, [BOS, *row[:L]])
    return best[1]


@pytest.mark.parametrize("lp", [0.0, 1.0])
def test_beam_search_with_enough_beams_is_exhaustive(lp: float) -> None:
    model = _model(tgt_vocab_size=4, d_model=8, num_heads=2, dim_feedforward=16)
    with torch.no_grad():  # make EOS competitive so both endings occur
        model.lm_head.weight[EOS] *= 0.2
    n, V = 3, 4
    beams = (V - 1) ** (n - 1)  # every live prefix survives
    for seed in range(3):
        torch.manual_seed(seed)
        src = torch.randint(3, 13, (1, 5))
        got = model.generate(src, n, beam_size=beams, length_penalty=lp)[0].tolist()
        got = [t for i, t in enumerate(got) if not (t == PAD and EOS in got[:i])]
        assert got == _exhaustive_best(model, src, n, lp)


def test_beam_machinery_with_one_beam_and_no_length_penalty_is_greedy() -> None:
    from qkv.models.generate import beam_search

    model = _model(positional="rotary", num_kv_heads=2)
    src, _ = _src()
    greedy = model.generate(src, 7)
    beam = beam_search(model, src, 7, None, 1, 0.0)
    assert torch.equal(beam, greedy)
    assert torch.equal(model.generate(src, 7, beam_size=1), greedy)


def test_beam_search_batch_and_padding() -> None:
    model = _model()
    src, lengths = _src()
    out = model.generate(src, 5, beam_size=3)
    assert out.shape[0] == 3 and out.shape[1] <= 6 and torch.all(out[:, 0] == BOS)
    for b in range(3):
        alone = model.generate(src[b : b + 1, : lengths[b]], 5, beam_size=3)
        assert torch.equal(out[b, : alone.shape[1]], alone[0])


def test_errors() -> None:
    model = _model()
    src, _ = _src()
    with pytest.raises(ValueError, match="max_positions"):
        model.generate(src, 40)
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate(src, 0)
    with pytest.raises(ValueError, match="beam_size"):
        model.generate(src, 3, beam_size=0)
    with pytest.raises(ValueError, match="vocabulary"):
        model(src, torch.full((3, 2), 11))
    with pytest.raises(TypeError, match="integer"):
        model.encode(src.float())
    with pytest.raises(ValueError, match="src_padding_mask"):
        model.encode(src, torch.zeros(3, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="memory"):
        model.decode(src[:, :2] % 11, torch.randn(3, 7, 8))
    with pytest.raises(TypeError, match="TransformerConfig"):
        Transformer({"src_vocab_size": 3})  # type: ignore[arg-type]


def test_tied_embeddings_share_one_matrix() -> None:
    model = _model(tie_embeddings=True)
    assert model.lm_head.weight is model.tgt_embed.weight
    names = [n for n, _ in model.named_parameters()]
    assert "lm_head.weight" not in names


def test_cache_keyword_is_a_deprecated_alias_of_kv_cache() -> None:
    model = _model()
    src, _ = _src()
    memory = model.encode(src)
    tgt = torch.full((src.shape[0], 1), BOS)
    expected = model.decode(tgt, memory, src == PAD, kv_cache=model.new_cache())
    with pytest.warns(DeprecationWarning, match="kv_cache"):
        got = model.decode(tgt, memory, src == PAD, cache=model.new_cache(4))
    torch.testing.assert_close(got, expected, atol=0.0, rtol=0.0)


def test_an_explicit_no_padding_mask_is_kept_by_generate() -> None:
    """The caller's src_padding_mask wins over pad_id, in forward and in generate alike."""
    model = _model()
    src, _ = _src()  # rows end in PAD tokens
    none_padded = torch.zeros_like(src, dtype=torch.bool)
    assert model.source_padding(src, none_padded) is None
    assert torch.equal(model.source_padding(src), src == PAD)
    memory = model.encode(src, none_padded)  # [B, S, D]: PAD tokens attended to
    cache = model.new_cache()
    out = torch.full((src.shape[0], 1), BOS)
    finished = torch.zeros(src.shape[0], dtype=torch.bool)
    for _ in range(4):
        logits = model.decode(out[:, -1:], memory, none_padded, kv_cache=cache)[:, -1]
        nxt = torch.where(finished, PAD, logits.argmax(-1))  # [B]
        finished |= nxt == EOS
        out = torch.cat([out, nxt[:, None]], dim=1)
    got = model.generate(src, 4, src_padding_mask=none_padded)
    assert torch.equal(got, out[:, : got.shape[1]])
