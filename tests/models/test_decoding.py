"""The decoding options against transformers' own logits processors on the same inputs, greedy
generation with a repetition penalty and two stop ids against transformers.generate on
left-padded batches, sampled distributions (seeded, not against HF's random numbers),
streaming, and the errors of bad values."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

from pathlib import Path

import pytest
import torch
import transformers as tr
from transformers.generation import logits_process as hf

from qkv.convert import load_hf
from qkv.models import DecoderOnlyConfig, DecoderOnlyLM
from qkv.models.decoding import DecodingOptions, seen_tokens

V = 128
PROMPTS = [[1, 15, 30, 44, 51], [0, 0, 1, 7, 9], [0, 3, 3, 60, 3]]
PAD = [[False] * 5, [True, True, False, False, False], [True, False, False, False, False]]


def _logits(seed: int, B: int = 4, Vs: int = 50) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, Vs, generator=g) * 3  # [B, V]
    logits[0, :5] = logits[0, 5]  # ties at the k-th value
    ids = torch.randint(0, Vs, (B, 9), generator=g)  # [B, T] with repeats
    return logits, ids


def _ours(logits: torch.Tensor, ids: torch.Tensor, step: int = 0, **kw: object) -> torch.Tensor:
    opts = DecodingOptions.check(vocab_size=logits.shape[1], max_new_tokens=8, **kw)
    seen = seen_tokens(ids, None, logits.shape[1]) if opts.tracks_seen else None
    return opts.process(logits, seen, step)


@pytest.mark.parametrize("seed", [0, 1])
def test_processors_equal_transformers_on_the_same_logits(seed: int) -> None:
    logits, ids = _logits(seed)
    cases = [
        ({"greedy": True, "repetition_penalty": 1.3}, [hf.RepetitionPenaltyLogitsProcessor(1.3)]),
        ({"greedy": True, "repetition_penalty": 0.7}, [hf.RepetitionPenaltyLogitsProcessor(0.7)]),
        ({"greedy": False, "temperature": 0.6}, [hf.TemperatureLogitsWarper(0.6)]),
        ({"greedy": False, "top_k": 5}, [hf.TopKLogitsWarper(5)]),
        ({"greedy": False, "top_k": 500}, [hf.TopKLogitsWarper(500)]),
        ({"greedy": False, "top_p": 0.8}, [hf.TopPLogitsWarper(0.8)]),
        ({"greedy": False, "top_p": 0.05}, [hf.TopPLogitsWarper(0.05)]),
        ({"greedy": False, "min_p": 0.1}, [hf.MinPLogitsWarper(0.1)]),
        (
            {
                "greedy": False,
                "repetition_penalty": 1.2,
                "temperature": 1.5,
                "top_k": 20,
                "top_p": 0.9,
                "min_p": 0.05,
            },
            [
                hf.RepetitionPenaltyLogitsProcessor(1.2),
                hf.TemperatureLogitsWarper(1.5),
                hf.TopKLogitsWarper(20),
                hf.TopPLogitsWarper(0.9),
                hf.MinPLogitsWarper(0.05),
            ],
        ),
    ]
    for kw, processors in cases:
        want = logits.clone()
        for p in processors:
            want = p(ids, want)
        got = _ours(logits, ids, **kw)
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=str(kw))
        assert torch.equal(got, logits) == (kw.get("top_k") == 500)  # each case changes something


def test_min_new_tokens_bans_the_stop_ids_as_transformers_does() -> None:
    logits, ids = _logits(3)
    ban = hf.MinNewTokensLengthLogitsProcessor(9 - 2, 3, [4, 7])  # 2 tokens generated of 3
    got = _ours(logits, ids, step=2, eos_id=[4, 7], min_new_tokens=3)
    torch.testing.assert_close(got, ban(ids, logits.clone()), rtol=0, atol=0)
    assert torch.equal(_ours(logits, ids, step=3, eos_id=[4, 7], min_new_tokens=3), logits)


def _llama() -> tr.PreTrainedModel:
    torch.manual_seed(0)
    cfg = tr.LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        initializer_range=0.2, bos_token_id=1, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    return tr.LlamaForCausalLM(cfg).eval()


def _gpt2() -> tr.PreTrainedModel:
    torch.manual_seed(1)
    cfg = tr.GPT2Config(
        vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64, initializer_range=0.2,
        bos_token_id=1, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    return tr.GPT2LMHeadModel(cfg).eval()


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_greedy_with_penalty_and_two_stop_ids_equals_transformers(
    kind: str, tmp_path: Path
) -> None:
    ref = {"llama": _llama, "gpt2": _gpt2}[kind]()
    ref.save_pretrained(tmp_path)
    model = load_hf(tmp_path)
    assert isinstance(model, DecoderOnlyLM)
    ids, pad = torch.tensor(PROMPTS), torch.tensor(PAD)
    am = (~pad).long()
    kw = {"max_new_tokens": 16, "do_sample": False, "repetition_penalty": 1.3}
    with torch.no_grad():
        free = ref.generate(ids, attention_mask=am, **kw)[:, 5:]  # [B, 16]
    # two stop ids that the rows really produce, at different steps: rows stop at different times
    stops = [int(free[0, 3]), int(free[1, 9])]
    assert stops[0] != stops[1]
    for extra in ({}, {"min_new_tokens": 6}):
        with torch.no_grad():
            want = ref.generate(ids, attention_mask=am, eos_token_id=stops, **kw, **extra)
        got = model.generate(
            ids, 16, padding_mask=pad, greedy=True, repetition_penalty=1.3, eos_id=stops,
            min_new_tokens=extra.get("min_new_tokens", 0),
        )  # fmt: skip
        assert got.tolist() == want.tolist(), extra
        assert got.shape[1] < 5 + 16 or extra  # the stop ids did stop it


def _tiny(**kw: object) -> DecoderOnlyLM:
    torch.manual_seed(0)
    cfg = DecoderOnlyConfig(
        24, num_layers=1, d_model=16, num_heads=2, dim_feedforward=32, dropout=0.0,
        max_positions=32, **kw,
    )  # fmt: skip
    return DecoderOnlyLM(cfg).eval()


@pytest.mark.parametrize(
    "kw",
    [{"temperature": 0.7}, {"top_k": 4}, {"top_p": 0.6}, {"min_p": 0.2, "temperature": 1.5}],
)
def test_samples_follow_the_processed_distribution(kw: dict[str, object]) -> None:
    logits, _ = _logits(5, B=1, Vs=12)  # [1, V]
    opts = DecodingOptions.check(vocab_size=12, max_new_tokens=1, greedy=False, **kw)
    want = torch.softmax(opts.process(logits, None, 0), dim=-1)[0]  # [V]
    N = 40000
    g = torch.Generator().manual_seed(0)
    draws = opts.choose(logits.expand(N, -1), None, 0, g)  # [N]
    freq = torch.bincount(draws, minlength=12).double() / N  # [V]
    assert torch.all(freq[want == 0] == 0)  # a filtered token is never drawn
    se = (want.double() * (1 - want.double()) / N).sqrt()  # standard error of each frequency
    assert torch.all((freq - want.double()).abs() <= 5 * se + 1e-12), (freq, want)


def test_seeded_sampling_repeats_and_streams_the_same_tokens() -> None:
    model = _tiny()
    ids = torch.tensor([[3, 4, 5], [6, 7, 8]])
    kw = {"greedy": False, "top_p": 0.9, "temperature": 1.3}

    def run(seed: int) -> torch.Tensor:
        return model.generate(ids, 10, generator=torch.Generator().manual_seed(seed), **kw)

    assert torch.equal(run(0), run(0)) and not torch.equal(run(0), run(1))
    seen: list[torch.Tensor] = []
    out = model.generate(
        ids, 10, generator=torch.Generator().manual_seed(0), streamer=seen.append, **kw
    )
    assert torch.equal(out, run(0)) and torch.equal(torch.stack(seen, 1), out[:, 3:])
    steps = model.stream(ids, 10, generator=torch.Generator().manual_seed(0), **kw)
    assert torch.equal(torch.stack(list(steps), 1), out[:, 3:])


def test_stream_stops_when_every_row_stopped() -> None:
    model = _tiny()
    ids = torch.tensor([[3, 4, 5]])
    first = int(model.generate(ids, 1, greedy=True)[0, -1])
    assert len(list(model.stream(ids, 10, greedy=True, eos_id=[first, 23]))) == 1


@pytest.mark.parametrize(
    ("kw", "error", "match"),
    [
        ({"top_p": 0.0}, ValueError, r"top_p must lie in \(0, 1\], got 0.0"),
        ({"top_p": 1.5}, ValueError, r"top_p must lie in \(0, 1\], got 1.5"),
        ({"min_p": -0.1}, ValueError, r"min_p must lie in \[0, 1\]"),
        ({"repetition_penalty": 0.0}, ValueError, "repetition_penalty must be > 0"),
        ({"repetition_penalty": -1.0}, ValueError, "repetition_penalty must be > 0"),
        ({"temperature": 0.0}, ValueError, "temperature must be > 0"),
        ({"top_k": 0}, ValueError, "top_k must be a positive int"),
        ({"top_k": True}, TypeError, "top_k must be an int"),
        ({"top_p": "0.9"}, TypeError, "top_p must be a float"),
        ({"eos_id": [3, 24]}, ValueError, r"eos_id must lie in \[0, vocab_size=24\), got 24"),
        ({"eos_id": []}, ValueError, "non-empty list"),
        ({"eos_id": [3, True]}, TypeError, "eos_id must be an int or a list of ints"),
        ({"min_new_tokens": 5}, ValueError, "min_new_tokens=5 exceeds max_new_tokens=4"),
        ({"greedy": True, "top_p": 0.9}, ValueError, "top_p=0.9 only shape sampling"),
        ({"streamer": 3}, TypeError, "streamer must be a callable"),
    ],
)
def test_bad_values_are_clear_errors(
    kw: dict[str, object], error: type[Exception], match: str
) -> None:
    model = _tiny()
    with pytest.raises(error, match=match):
        model.generate(torch.tensor([[3, 4]]), 4, **kw)  # type: ignore[arg-type]
    kw.pop("streamer", None)
    if kw:
        with pytest.raises(error, match=match):
            model.stream(torch.tensor([[3, 4]]), 4, **kw)  # type: ignore[arg-type]  # eager
