"""load_hf on hostile BART, Marian and T5 directories (issue 27, as for the decoders in
test_hf_hostile.py): sizes bounded, heads > 0, values of the wrong type named with key and value,
layer counts checked against the weights before anything is built, files inside the directory.
Each case starts from a tiny sharded model saved by ``transformers`` itself."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import json
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as tr

import qkv.convert.hf_seq2seq as hf_seq2seq
import qkv.convert.hf_t5 as hf_t5
from qkv.convert import load_hf
from qkv.convert.hf_tokens import required_ids
from qkv.models import Transformer

KINDS = ("bart", "marian", "t5")


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny 2-layer BART, Marian and T5, each saved as shards with an index."""
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("hostile_seq2seq")
    sizes = {
        "vocab_size": 64, "d_model": 16, "encoder_layers": 2, "decoder_layers": 2,
        "encoder_attention_heads": 2, "decoder_attention_heads": 2, "encoder_ffn_dim": 24,
        "decoder_ffn_dim": 24, "max_position_embeddings": 32,
    }  # fmt: skip
    t5_sizes = {
        "vocab_size": 64, "d_model": 16, "d_kv": 8, "d_ff": 24, "num_layers": 2, "num_heads": 2,
        "relative_attention_num_buckets": 8, "relative_attention_max_distance": 20,
    }  # fmt: skip
    models = {
        "bart": tr.BartForConditionalGeneration(tr.BartConfig(**sizes)),
        "marian": tr.MarianMTModel(
            tr.MarianConfig(**sizes, pad_token_id=63, decoder_start_token_id=63, eos_token_id=0)
        ),
        "t5": tr.T5ForConditionalGeneration(tr.T5Config(**t5_sizes)),
    }
    for kind, model in models.items():
        model.save_pretrained(root / kind, max_shard_size="8KB")
    return {kind: root / kind for kind in KINDS}


def _copy(src: Path, dst: Path, **change: Any) -> Path:
    shutil.copytree(src, dst)
    if change:
        cfg = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**cfg, **change}))
    return dst


@pytest.mark.parametrize("kind", KINDS)
def test_the_sharded_originals_load(saved: dict[str, Path], kind: str) -> None:
    assert (saved[kind] / "model.safetensors.index.json").is_file()
    assert isinstance(load_hf(saved[kind]), Transformer)


# each kind's keys: the width, the heads (every head key set to 0), an int, the layer counts
WIDTH = {"bart": "d_model", "marian": "d_model", "t5": "d_model"}
HEADS = {
    "bart": ("encoder_attention_heads", "decoder_attention_heads"),
    "marian": ("encoder_attention_heads", "decoder_attention_heads"),
    "t5": ("num_heads",),
}
AN_INT = {"bart": "encoder_layers", "marian": "vocab_size", "t5": "d_ff"}
LAYERS = {
    "bart": ("encoder_layers", "decoder_layers"),
    "marian": ("decoder_layers",),
    "t5": ("num_layers", "num_decoder_layers"),
}


@pytest.mark.parametrize("kind", KINDS)
def test_a_huge_width_is_refused(saved: dict[str, Path], tmp_path: Path, kind: str) -> None:
    key = WIDTH[kind]
    root = _copy(saved[kind], tmp_path / "ckpt", **{key: 2**40})
    with pytest.raises(ValueError, match=rf"{key} must be an int in \[1, 16777216\], got 1099"):
        load_hf(root)


@pytest.mark.parametrize("kind", KINDS)
def test_zero_heads_are_refused(saved: dict[str, Path], tmp_path: Path, kind: str) -> None:
    root = _copy(saved[kind], tmp_path / "ckpt", **dict.fromkeys(HEADS[kind], 0))
    with pytest.raises(ValueError, match=rf"{HEADS[kind][0]} must be an int in \[1, .*got 0"):
        load_hf(root)


@pytest.mark.parametrize("kind", ["bart", "marian"])
def test_heads_that_do_not_divide_the_width_are_named(
    saved: dict[str, Path], tmp_path: Path, kind: str
) -> None:
    heads = dict.fromkeys(HEADS[kind], 3)
    root = _copy(saved[kind], tmp_path / "ckpt", **heads)
    with pytest.raises(ValueError, match=r"d_model=16 .*encoder_attention_heads=3"):
        load_hf(root)


@pytest.mark.parametrize("kind", KINDS)
def test_a_string_for_an_int_names_key_and_value(
    saved: dict[str, Path], tmp_path: Path, kind: str
) -> None:
    key = AN_INT[kind]
    root = _copy(saved[kind], tmp_path / "ckpt", **{key: "2"})
    with pytest.raises(ValueError, match=rf"{key} must be an int in \[1, \d+\], got '2' \(str\)"):
        load_hf(root)


@pytest.mark.parametrize(
    ("kind", "key", "value", "want"),
    [
        # T5's one float: before, TransformerConfig's message without the key
        ("t5", "layer_norm_epsilon", [1e-6], "a finite number > 0"),
        # BART and Marian read no float (their eps is fixed); their flags were read as
        # Python truth: a list turned the embedding scale on, silently
        ("bart", "scale_embedding", [1.0], "true or false"),
        ("marian", "scale_embedding", [1.0], "true or false"),
        ("marian", "share_encoder_decoder_embeddings", [1.0], "true or false"),
        ("t5", "scale_decoder_outputs", [1.0], "true or false"),
        # before: loaded as "tied" (anything but false)
        ("t5", "tie_word_embeddings", "no", "true or false"),
        # before: an unhashable list reached a dict lookup (TypeError)
        ("bart", "activation_function", ["gelu"], "a string"),
        ("t5", "feed_forward_proj", ["relu"], "a string"),
    ],
)
def test_a_list_or_string_for_a_float_or_flag_names_key_and_value(
    saved: dict[str, Path], tmp_path: Path, kind: str, key: str, value: object, want: str
) -> None:
    root = _copy(saved[kind], tmp_path / "ckpt", **{key: value})
    shown = repr(value).replace("[", r"\[")
    with pytest.raises(ValueError, match=rf"{key} must be {want}, got {shown}"):
        load_hf(root)


@pytest.mark.parametrize("kind", KINDS)
def test_many_layers_are_refused_before_anything_is_built(
    saved: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """A 20,000-layer config over a 2-layer checkpoint: refused from the headers, fast."""
    for module in (hf_seq2seq, hf_t5):
        monkeypatch.setattr(module, "Transformer", lambda *a, **k: pytest.fail("built"))
    keys = LAYERS[kind]
    root = _copy(saved[kind], tmp_path / "ckpt", **dict.fromkeys(keys, 20_000))
    start = time.perf_counter()
    with pytest.raises(ValueError, match=f"{keys[0]}=20000 but the checkpoint holds 2 layer"):
        load_hf(root)
    assert time.perf_counter() - start < 2.0


def test_a_huge_marian_position_table_is_refused(saved: dict[str, Path]) -> None:
    """Marian's sinusoids are computed, not read, so the weights do not bound them: 2**24
    positions x 512 wide would be 64 GiB of float64. Before: accepted."""
    hf = json.loads((saved["marian"] / "config.json").read_text())
    hf.update(max_position_embeddings=2**24, d_model=512)
    with pytest.raises(ValueError, match=r"max_position_embeddings=16777216 \* d_model=512"):
        hf_seq2seq.config_from_hf(hf)


# --- files ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_a_shard_outside_is_refused(saved: dict[str, Path], tmp_path: Path, kind: str) -> None:
    root = _copy(saved[kind], tmp_path / "a" / "ckpt")
    index = json.loads((root / "model.safetensors.index.json").read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    shutil.copy(root / first, tmp_path / "a" / "x.safetensors")
    index["weight_map"] = {
        k: "../x.safetensors" if v == first else v for k, v in index["weight_map"].items()
    }
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"'\.\./x\.safetensors'.* outside the checkpoint"):
        load_hf(root)


@pytest.mark.parametrize("kind", KINDS)
def test_a_generation_config_linked_outside_is_refused(
    saved: dict[str, Path], tmp_path: Path, kind: str
) -> None:
    """Before: read (forced_token_ids opened it without the inside-the-directory check)."""
    root = _copy(saved[kind], tmp_path / "ckpt")
    outside = tmp_path / "elsewhere.json"
    outside.write_text(json.dumps({"forced_bos_token_id": 5}))
    (root / "generation_config.json").unlink(missing_ok=True)
    (root / "generation_config.json").symlink_to(outside)
    with pytest.raises(ValueError, match=r"generation_config\.json.* outside the checkpoint"):
        load_hf(root)


def test_a_generation_config_nested_too_deep_names_the_file(
    saved: dict[str, Path], tmp_path: Path
) -> None:
    """Before: RecursionError."""
    root = _copy(saved["bart"], tmp_path / "ckpt")
    (root / "generation_config.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match=r"generation_config\.json is not valid JSON: nested"):
        load_hf(root)


def test_the_special_tokens_a_seq2seq_model_needs_are_named_when_missing() -> None:
    assert required_ids("cfg", 64, pad=0, eos=1, decoder_start=2) == (0, 1, 2)
    with pytest.raises(
        ValueError,
        match=r"cfg: needs pad_token_id, decoder_start_token_id in "
        r"\[0, 64\)",
    ):
        required_ids("cfg", 64, pad=None, eos=1, decoder_start=None)
