"""``qkv embed`` for many sentences (issue 27): from a file or stdin in batches, printed as
embeddings or nearest neighbours in memory linear in N, and text that is not valid UTF-8 named.

Before, the only output was the N x N similarity matrix (2,000 sentences: 32 MB printed, 534
MB peak), sentences came only as arguments, and invalid UTF-8 gave the tokenizer's
"TextEncodeInput must be Union[...]"."""

import io
import re
import sys
from pathlib import Path

import pytest
import torch

from qkv.apps.cli import main
from qkv.apps.embed import SentenceEmbedder, cosine_similarity_matrix
from qkv.apps.embed_many import MAX_MATRIX, nearest

SENTENCES = [
    "A man is playing a guitar.",
    "Someone plays an instrument.",
    "The stock market fell sharply today.",
    "Shares dropped on Wall Street.",
    "A cat sleeps on the sofa.",
]


@pytest.fixture(scope="module")
def embedder() -> SentenceEmbedder:
    return SentenceEmbedder()


def _file(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "sentences.txt"
    path.write_text("\n".join(lines) + "\n\n", encoding="utf-8")  # a blank line is skipped
    return path


def test_embeddings_from_a_file_equal_encode(
    tmp_path: Path, embedder: SentenceEmbedder, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _file(tmp_path, SENTENCES)
    assert main(["embed", "--input", str(path), "--embeddings", "--batch-size", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    printed = torch.tensor([[float(x) for x in line.split()] for line in lines])  # [N, D]
    torch.testing.assert_close(printed, embedder.encode(SENTENCES), atol=1e-6, rtol=0)


def test_top_k_from_stdin_are_the_nearest(
    monkeypatch: pytest.MonkeyPatch, embedder: SentenceEmbedder, capsys: pytest.CaptureFixture[str]
) -> None:
    data = ("\n".join(SENTENCES) + "\n").encode()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
    assert main(["embed", "--input", "-", "--top-k", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    sim = cosine_similarity_matrix(embedder.encode(SENTENCES)).fill_diagonal_(-2.0)  # [N, N]
    for i, s in enumerate(SENTENCES):
        at = out.index(f"[{i + 1}] {s}")
        shown = [int(line.split("[")[1].split("]")[0]) - 1 for line in out[at + 1 : at + 3]]
        assert shown == sim[i].topk(2).indices.tolist(), (s, out[at : at + 3])


def test_nearest_compares_blocks_never_the_whole_matrix(monkeypatch: pytest.MonkeyPatch) -> None:
    """Memory ``block x N``: the largest similarity ever formed has ``block`` rows."""
    g = torch.Generator().manual_seed(0)
    e = torch.nn.functional.normalize(torch.randn(300, 16, generator=g), dim=1)  # [N, D]
    sims, idx = nearest(e, 3, block=64)
    full = (e @ e.T).fill_diagonal_(float("-inf")).topk(3, dim=1)  # [N, 3]
    torch.testing.assert_close(sims, full.values)
    assert torch.equal(idx, full.indices)


def test_the_matrix_is_refused_for_many_sentences(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _file(tmp_path, [f"sentence {i}" for i in range(MAX_MATRIX + 5)])
    assert main(["embed", "--input", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"more than {MAX_MATRIX} sentences" in err and "--top-k" in err


@pytest.mark.parametrize(
    ("argument", "message"),
    [
        ("caf\udce9 \udcff", r"sentence argument 1 is not valid UTF-8 text: the byte 0xe9 at"),
        ("lone \ud800 surrogate", r"sentence argument 1 is not valid UTF-8 text: '\\ud800' at"),
    ],
)
def test_invalid_text_names_the_argument(
    argument: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``$'caf\\xe9 \\xff'`` reaches Python as ``'caf\\udce9 \\udcff'`` (surrogateescape)."""
    assert main(["embed", argument, "fine"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert re.search(message, err), err


def test_invalid_utf8_in_a_file_names_file_and_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.txt"
    path.write_bytes(b"fine\ncaf\xe9 \xff\n")
    assert main(["embed", "--input", str(path), "--embeddings"]) == 2
    assert f"{path} line 2 is not valid UTF-8: the byte 0xe9 at column 4" in capsys.readouterr().err


def test_sentences_and_input_are_one_or_the_other(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["embed"]) == 2
    assert main(["embed", "a", "--input", str(_file(tmp_path, ["b"]))]) == 2
    with pytest.raises(SystemExit, match="2"):
        main(["embed", "a", "--top-k", "2", "--embeddings"])
    assert capsys.readouterr().err.count("error") == 3


def test_no_bar_into_a_log(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["embed", "--input", str(_file(tmp_path, SENTENCES[:2])), "--embeddings"]) == 0
    assert "\r" not in capsys.readouterr().err
