"""load_hf on hostile directories (issue 27): a checkpoint is data someone else wrote.

Shards must resolve inside the directory (relative ``..``, absolute paths and links that lead
out are refused, naming the key), JSON nested too deep is a ValueError naming the file, sizes
are bounded and checked against the weights before anything is built, and a value of the wrong
type is a ValueError naming its key and value. Each case starts from a tiny model saved by
``transformers`` itself.
"""

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

import qkv.convert.hf_load as hf_load
from qkv.apps.embed import default_model_dir, load_tokenizer
from qkv.convert import load_bert, load_hf
from qkv.models import DecoderOnlyLM


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny Llama (sharded), GPT-2 and BERT checkpoints saved by transformers."""
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("hostile")
    llama = tr.LlamaForCausalLM(
        tr.LlamaConfig(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=24,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=32,
        )
    )
    llama.save_pretrained(root / "llama", max_shard_size="8KB")
    gpt2 = tr.GPT2LMHeadModel(tr.GPT2Config(vocab_size=64, n_embd=16, n_layer=2, n_head=2))
    gpt2.save_pretrained(root / "gpt2")
    bert = tr.BertModel(
        tr.BertConfig(
            vocab_size=64,
            hidden_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=24,
            max_position_embeddings=32,
        )
    )
    bert.save_pretrained(root / "bert")
    return {"llama": root / "llama", "gpt2": root / "gpt2", "bert": root / "bert"}


def _copy(src: Path, dst: Path, **change: Any) -> Path:
    shutil.copytree(src, dst)
    if change:
        cfg = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**cfg, **change}))
    return dst


def _index(root: Path) -> dict:
    return json.loads((root / "model.safetensors.index.json").read_text())


def _rename_shard(root: Path, name: str) -> str:
    """Point the index's first shard at ``name``; return the first key that named it."""
    index = _index(root)
    first = sorted(set(index["weight_map"].values()))[0]
    keys = [k for k, v in index["weight_map"].items() if v == first]
    for k in keys:
        index["weight_map"][k] = name
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    return keys[0]


def test_the_sharded_original_loads(saved: dict[str, Path]) -> None:
    assert (saved["llama"] / "model.safetensors.index.json").is_file()
    assert isinstance(load_hf(saved["llama"]), DecoderOnlyLM)


# --- traversal -----------------------------------------------------------------------------


def test_a_relative_shard_outside_is_refused(saved: dict[str, Path], tmp_path: Path) -> None:
    """Before: ``../decoy.safetensors`` was loaded (a valid file, out of the directory)."""
    root = _copy(saved["llama"], tmp_path / "a" / "ckpt")
    first = sorted(set(_index(root)["weight_map"].values()))[0]
    shutil.copy(root / first, tmp_path / "a" / "decoy.safetensors")
    key = _rename_shard(root, "../decoy.safetensors")
    with pytest.raises(ValueError, match="outside the checkpoint directory") as err:
        load_hf(root)
    assert key in str(err.value) and "../decoy.safetensors" in str(err.value)


@pytest.mark.parametrize("target", ["decoy", "/etc/passwd"])
def test_an_absolute_shard_is_refused(saved: dict[str, Path], tmp_path: Path, target: str) -> None:
    """Before: an absolute path was opened (``/etc/passwd`` too)."""
    root = _copy(saved["llama"], tmp_path / "ckpt")
    if target == "decoy":
        first = sorted(set(_index(root)["weight_map"].values()))[0]
        target = str(shutil.copy(root / first, tmp_path / "decoy.safetensors"))
    key = _rename_shard(root, target)
    with pytest.raises(ValueError, match="an absolute path") as err:
        load_hf(root)
    assert key in str(err.value)


def test_a_shard_linked_outside_is_refused(saved: dict[str, Path], tmp_path: Path) -> None:
    root = _copy(saved["llama"], tmp_path / "ckpt")
    first = sorted(set(_index(root)["weight_map"].values()))[0]
    outside = tmp_path / "elsewhere.safetensors"
    (root / first).rename(outside)
    (root / first).symlink_to(outside)
    with pytest.raises(ValueError, match="outside the checkpoint directory") as err:
        load_hf(root)
    assert first in str(err.value)


@pytest.mark.parametrize("kind", ["gpt2", "bert"])
def test_weights_or_config_linked_outside_are_refused(
    saved: dict[str, Path], tmp_path: Path, kind: str
) -> None:
    for name in ("model.safetensors", "config.json"):
        root = _copy(saved[kind], tmp_path / name / "ckpt")
        outside = tmp_path / name / "elsewhere"
        (root / name).rename(outside)
        (root / name).symlink_to(outside)
        with pytest.raises(ValueError, match=f"{name}.* outside the checkpoint directory"):
            load_hf(root)


def test_links_inside_and_the_hub_cache_layout_load(saved: dict[str, Path], tmp_path: Path) -> None:
    """What stays allowed: a link to a file inside the directory, and the Hugging Face cache's
    ``snapshots/<rev>/file -> ../../blobs/<hash>``."""
    root = _copy(saved["gpt2"], tmp_path / "inside")
    (root / "model.safetensors").rename(root / "real.safetensors")
    (root / "model.safetensors").symlink_to("real.safetensors")
    load_hf(root)
    repo = tmp_path / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    for i, name in enumerate(("config.json", "model.safetensors")):
        shutil.copy(saved["gpt2"] / name, repo / "blobs" / f"hash{i}")
        (snapshot / name).symlink_to(Path("..", "..", "blobs", f"hash{i}"))
    assert isinstance(load_hf(snapshot), DecoderOnlyLM)


@pytest.mark.parametrize("value", [3, None, ""])
def test_a_shard_name_that_is_no_name_is_refused(
    saved: dict[str, Path], tmp_path: Path, value: object
) -> None:
    root = _copy(saved["llama"], tmp_path / "ckpt")
    key = _rename_shard(root, value)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=f"weight_map\\['{key}'\\] must be a shard file name"):
        load_hf(root)


# --- deep JSON ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json"])
def test_json_nested_too_deep_names_the_file(
    saved: dict[str, Path], tmp_path: Path, name: str
) -> None:
    """Before: ``RecursionError``."""
    root = _copy(saved["llama"], tmp_path / "ckpt")
    (root / name).write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match=f"{name} is not valid JSON: nested too deep"):
        load_hf(root)


# --- sizes ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "change", "message"),
    [
        # before: RuntimeError: Storage size calculation overflowed
        ("llama", {"hidden_size": 2**40}, r"hidden_size must be an int in \[1, 16777216\]"),
        ("gpt2", {"n_embd": 2**40}, r"n_embd must be an int in \[1, 16777216\]"),
        ("bert", {"hidden_size": 2**40}, r"hidden_size must be an int in \[1, 16777216\]"),
        ("llama", {"vocab_size": 2**70}, r"vocab_size must be an int in \[1, 16777216\]"),
        # before: ZeroDivisionError
        ("llama", {"num_attention_heads": 0, "head_dim": 8}, r"num_attention_heads .* got 0"),
        # before: loaded, as if the key were absent (transformers would build 0 heads / width)
        ("llama", {"num_key_value_heads": 0}, r"num_key_value_heads .* got 0"),
        ("gpt2", {"n_inner": 0}, r"n_inner .* got 0"),
        # before: over 8 s (a rotary table of 2**40 positions)
        ("llama", {"max_position_embeddings": 2**40}, r"max_position_embeddings .*2097152"),
    ],
)
def test_sizes_are_bounded(
    saved: dict[str, Path], tmp_path: Path, kind: str, change: dict, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        load_hf(_copy(saved[kind], tmp_path / "ckpt", **change))


@pytest.mark.parametrize(("kind", "key"), [("llama", "num_hidden_layers"), ("gpt2", "n_layer")])
def test_many_layers_are_refused_before_anything_is_built(
    saved: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    kind: str,
    key: str,
) -> None:
    """Before: a 20,000-layer config over a 2-layer checkpoint took over 20 s to refuse (every
    layer built on the meta device first)."""
    monkeypatch.setattr(hf_load, "DecoderOnlyLM", lambda *a, **k: pytest.fail("built"))
    root = _copy(saved[kind], tmp_path / "ckpt", **{key: 20_000})
    start = time.perf_counter()
    with pytest.raises(ValueError, match=f"{key}=20000 but the checkpoint holds 2 layer"):
        load_hf(root)
    assert time.perf_counter() - start < 2.0


# --- types ----------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["rope_scaling", "rope_parameters"])
@pytest.mark.parametrize("value", [["linear", 2.0], "linear", 3])
def test_rope_options_of_the_wrong_type(
    saved: dict[str, Path], tmp_path: Path, key: str, value: object
) -> None:
    """Before: ``AttributeError: 'list' object has no attribute 'get'``."""
    root = _copy(saved["llama"], tmp_path / "ckpt", **{key: value})
    with pytest.raises(ValueError, match=f"{key} must be a JSON object or null, got"):
        load_hf(root)


@pytest.mark.parametrize(
    ("kind", "key", "value"),
    [
        ("llama", "rms_norm_eps", "x"),  # before: could not convert string to float: 'x'
        ("llama", "rope_theta", "x"),
        ("llama", "rope_theta", -1.0),
        ("llama", "hidden_size", None),  # before: TypeError: unsupported operand
        ("llama", "vocab_size", [1]),  # before: '<' not supported between 'int' and 'list'
        ("llama", "hidden_act", 3),
        ("llama", "tie_word_embeddings", "yes"),
        ("llama", "sliding_window", "x"),
        ("llama", "head_dim", 2.5),
        ("gpt2", "layer_norm_epsilon", "x"),
        ("gpt2", "n_embd", None),  # before: TypeError: unsupported operand
        ("gpt2", "activation_function", ["gelu"]),
        ("gpt2", "scale_attn_weights", "no"),
        ("bert", "layer_norm_eps", True),  # before: loaded, as eps = 1
        ("bert", "hidden_size", None),  # before: missing 1 required positional argument
        ("bert", "pad_token_id", True),  # before: loaded, as pad id 1
    ],
)
def test_a_value_of_the_wrong_type_names_key_and_value(
    saved: dict[str, Path], tmp_path: Path, kind: str, key: str, value: object
) -> None:
    change = {key: value}
    if key == "rope_theta":  # transformers 5 writes it into rope_parameters, read first
        change["rope_parameters"] = None
    root = _copy(saved[kind], tmp_path / "ckpt", **change)
    with pytest.raises(ValueError, match=f"{key} must be .*got {value!r}".replace("[", r"\[")):
        load_hf(root)


def test_rope_theta_inside_rope_parameters(saved: dict[str, Path], tmp_path: Path) -> None:
    params = {"rope_type": "default", "rope_theta": "x"}
    root = _copy(saved["llama"], tmp_path / "ckpt", rope_parameters=params)
    with pytest.raises(ValueError, match=r"rope_parameters: rope_theta must be .* got 'x'"):
        load_hf(root)


def test_rope_type_of_the_wrong_type(saved: dict[str, Path], tmp_path: Path) -> None:
    root = _copy(saved["llama"], tmp_path / "ckpt", rope_scaling={"rope_type": ["linear"]})
    with pytest.raises(ValueError, match=r"rope_scaling.rope_type must be a string"):
        load_hf(root)


def test_a_tokenizer_linked_outside_is_refused(saved: dict[str, Path], tmp_path: Path) -> None:
    root = _copy(saved["bert"], tmp_path / "ckpt")
    outside = tmp_path / "tokenizer.json"
    shutil.copy(default_model_dir() / "tokenizer.json", outside)
    (root / "tokenizer.json").symlink_to(outside)
    config = load_bert(root).config
    with pytest.raises(ValueError, match=r"tokenizer\.json.* outside the checkpoint directory"):
        load_tokenizer(root, config)
