"""``qkv generate DIR PROMPT`` on Hugging Face save_pretrained directories: the same greedy
tokens as transformers' own ``generate``, with a tokenizer.json or with token ids."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

from pathlib import Path

import pytest
import torch
import transformers as tr
from tokenizers import Tokenizer, models, pre_tokenizers

from qkv.apps.cli import main
from qkv.train.inference import generate_hf, load_hf_decoder

V, NEW = 48, 12
WORDS = [f"w{i}" for i in range(V)]


def _llama() -> tr.PreTrainedModel:
    torch.manual_seed(0)
    cfg = tr.LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        initializer_range=0.2, bos_token_id=None, eos_token_id=5, pad_token_id=0,
    )  # fmt: skip
    return tr.LlamaForCausalLM(cfg).eval()


def _gpt2() -> tr.PreTrainedModel:
    torch.manual_seed(1)
    cfg = tr.GPT2Config(
        vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64, initializer_range=0.2,
        bos_token_id=None, eos_token_id=5, pad_token_id=0,
    )  # fmt: skip
    return tr.GPT2LMHeadModel(cfg).eval()


MODELS = {"llama": _llama, "gpt2": _gpt2}


def _save(model: tr.PreTrainedModel, root: Path, tokenizer: bool) -> Tokenizer | None:
    model.save_pretrained(root)
    if not tokenizer:
        return None
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="w1"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(root / "tokenizer.json"))
    return tok


def _hf_greedy(model: tr.PreTrainedModel, ids: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False)
    return [int(i) for i in out[0, len(ids) :]]


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_generate_with_tokenizer_matches_transformers(
    kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ref = MODELS[kind]()
    tok = _save(ref, tmp_path, tokenizer=True)
    assert tok is not None
    prompt = "w3 w17 w9 w40 w22"
    expected = _hf_greedy(ref, tok.encode(prompt).ids)
    model, loaded = load_hf_decoder(tmp_path)
    assert loaded is not None
    gen = generate_hf(model, loaded, prompt, max_new_tokens=NEW)
    assert gen.ids == expected
    assert main(["generate", str(tmp_path), prompt, "--max-new-tokens", str(NEW)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == tok.decode(expected)
    assert "greedy, KV cache" in out[1]


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_generate_with_token_ids_matches_transformers(
    kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ref = MODELS[kind]()
    _save(ref, tmp_path, tokenizer=False)
    ids = [7, 30, 2, 44, 11, 19]
    expected = _hf_greedy(ref, ids)
    assert main(["generate", str(tmp_path), " ".join(map(str, ids)), "--max-new-tokens", "12"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == " ".join(map(str, expected))


def test_threads_default_to_torchs_own_count(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A Hugging Face directory decodes on torch's own thread count unless ``--threads`` is
    given (a qkv checkpoint on one: ``test_generate_prints_output_and_speed``)."""
    _save(_gpt2(), tmp_path, tokenizer=False)
    torch.set_num_threads(2)  # (the conftest fixture restores the worker's count)
    assert main(["generate", str(tmp_path), "7 30 2", "--max-new-tokens", "2"]) == 0
    assert ", 2 threads)" in capsys.readouterr().out and torch.get_num_threads() == 2
    assert (
        main(["generate", str(tmp_path), "7 30 2", "--max-new-tokens", "2", "--threads", "1"]) == 0
    )
    assert ", 1 thread)" in capsys.readouterr().out and torch.get_num_threads() == 1


def test_sampling_is_seeded(tmp_path: Path) -> None:
    _save(_llama(), tmp_path, tokenizer=False)
    model, _ = load_hf_decoder(tmp_path)
    runs = [
        generate_hf(model, None, "3 4 5", greedy=False, temperature=5.0, seed=s).ids
        for s in (0, 0, 1)
    ]
    assert runs[0] == runs[1] != runs[2]


def test_bad_directories_and_prompts_are_one_line_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    llama = tmp_path / "llama"
    _save(_llama(), llama, tokenizer=False)
    empty = tmp_path / "empty"
    empty.mkdir()
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text('{"hidden_size": 4}')
    capsys.readouterr()  # save_pretrained's progress bar
    cases = {
        (str(empty), "1 2"): "neither a qkv checkpoint nor a Hugging Face save_pretrained "
        "directory: it has no config.json",
        (str(other), "1 2"): "its config.json has neither 'format'",
        (str(llama), "1 two 3"): "space-separated token ids in [0, 48)",
        (str(llama), f"1 {V}"): f"(bad: {V})",
        (str(llama), "1 2", "--beam", "2", "--top-k", "3"): "got top_k=3",
    }
    for argv, message in cases.items():
        assert main(["generate", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("qkv generate: error:"), err
        assert message in err, err


def test_decoding_flags_match_transformers_and_stream(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ref = _llama()
    tok = _save(ref, tmp_path, tokenizer=True)
    assert tok is not None
    prompt = "w3 w17 w9 w40 w22"
    ids = tok.encode(prompt).ids
    with torch.no_grad():
        free = ref.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False)
    stops = [int(free[0, len(ids) + 4]), 47]  # the 5th token stops it (unless banned)
    with torch.no_grad():
        want = ref.generate(
            torch.tensor([ids]), max_new_tokens=NEW, do_sample=False, repetition_penalty=1.3,
            eos_token_id=stops, min_new_tokens=2,
        )[0, len(ids) :].tolist()  # fmt: skip
    pieces: list[str] = []
    model, loaded = load_hf_decoder(tmp_path)
    gen = generate_hf(
        model, loaded, prompt, max_new_tokens=NEW, repetition_penalty=1.3,
        eos_ids=tuple(stops), min_new_tokens=2, on_text=pieces.append,
    )  # fmt: skip
    assert gen.ids == want and "".join(pieces) == gen.text == tok.decode(want)
    assert len(pieces) > 1  # streamed, not printed at the end
    capsys.readouterr()
    argv = ["generate", str(tmp_path), prompt, "--max-new-tokens", str(NEW)]
    argv += ["--repetition-penalty", "1.3", "--min-new-tokens", "2"]
    argv += [x for s in stops for x in ("--eos-id", str(s))]
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == tok.decode(want) and "streamed" in out[1]
    sampled = ["generate", str(tmp_path), prompt, "--sample", "--top-p", "0.9", "--min-p", "0.1"]
    assert main([*sampled, "--temperature", "0.8", "--seed", "3"]) == 0
    for bad in (["--top-p", "1.5"], ["--repetition-penalty", "0"], ["--eos-id", "-1"]):
        with pytest.raises(SystemExit):
            main(["generate", str(tmp_path), prompt, *bad])
    capsys.readouterr()
    assert main(["generate", str(tmp_path), prompt, "--top-p", "0.5"]) == 2  # needs --sample
    assert "only shape sampling" in capsys.readouterr().err
    assert main(["generate", str(tmp_path), prompt, "--eos-id", str(V)]) == 2
    assert f"eos_id must lie in [0, vocab_size={V})" in capsys.readouterr().err


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_beam_search_matches_transformers(
    kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ref = MODELS[kind]()
    tok = _save(ref, tmp_path, tokenizer=True)
    assert tok is not None
    prompt = {"gpt2": "w13 w27 w28 w3 w38", "llama": "w35 w22 w42 w4 w40"}[kind]
    ids = tok.encode(prompt).ids
    with torch.no_grad():
        out = ref.generate(torch.tensor([ids]), max_new_tokens=NEW, num_beams=3, do_sample=False)
    want = out[0, len(ids) :].tolist()
    assert want != _hf_greedy(ref, ids)  # beams and greedy differ here: the test tells them apart
    model, loaded = load_hf_decoder(tmp_path)
    pieces: list[str] = []
    gen = generate_hf(model, loaded, prompt, beam_size=3, max_new_tokens=NEW, on_text=pieces.append)
    assert gen.ids == want and "".join(pieces) == gen.text == tok.decode(want)
    capsys.readouterr()
    assert main(["generate", str(tmp_path), prompt, "--beam", "3", "--max-new-tokens", "12"]) == 0
    out_lines = capsys.readouterr().out.splitlines()
    assert out_lines[0] == tok.decode(want)
    assert "beam 3, KV cache, printed at the end" in out_lines[1]
    for flags, named in (
        (["--sample"], "greedy=False"),
        (["--repetition-penalty", "1.3"], "repetition_penalty=1.3"),
        (["--compile"], "compile=True"),
    ):
        assert main(["generate", str(tmp_path), prompt, "--beam", "2", *flags]) == 2
        err = capsys.readouterr().err
        assert "beam_size=2 decodes greedily and takes max_new_tokens and eos_ids only" in err
        assert named in err, err


def test_compile_flag_decodes_on_the_compiled_static_cache(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--compile`` with dynamo's eager backend (inductor's code generation is what
    benchmarks/decode.py times): the same tokens as transformers, the step compiled once."""
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, backend="eager"))
    torch._dynamo.utils.counters.clear()
    ref = _llama()
    _save(ref, tmp_path, tokenizer=False)
    ids = [7, 30, 2, 44, 11, 19]
    expected = _hf_greedy(ref, ids)
    argv = ["generate", str(tmp_path), " ".join(map(str, ids)), "--max-new-tokens", str(NEW)]
    assert main([*argv, "--compile"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == " ".join(map(str, expected))
    assert "static KV cache, compiled step" in out[1] and "compiled the step" in out[1]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1  # warm-up and timed run
