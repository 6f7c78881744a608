"""Checkpoint loading: key map, prefixes, ignored heads, and a clear error for every broken copy.

A small random ``BertForPreTraining`` saved by ``transformers`` itself is the known-good
checkpoint (its keys carry the ``bert.`` prefix and it has the pooler, masked-LM and
next-sentence heads); each test writes a broken copy of it into ``tmp_path``.
"""

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # the reference must never reach for a network
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from qkv.apps.embed import default_model_dir
from qkv.convert import hf_bert, load_bert
from qkv.convert.hf_bert import (
    IGNORED_PREFIXES,
    KEY_MAP,
    bert_config_from_hf,
    check_checkpoint_dir,
    convert_bert_state_dict,
    read_bert_checkpoint,
)

TINY = {
    "vocab_size": 60,
    "hidden_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 32,
    "max_position_embeddings": 20,
    "initializer_range": 0.2,  # larger than BERT's 0.02 so attention is far from uniform
}


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, transformers.BertModel]:
    """A tiny checkpoint saved by transformers, and the BertModel inside it."""
    torch.manual_seed(0)
    model = transformers.BertForPreTraining(transformers.BertConfig(**TINY)).eval()
    root = tmp_path_factory.mktemp("tiny_bert")
    model.save_pretrained(root)
    shutil.copy(default_model_dir() / "tokenizer.json", root / "tokenizer.json")
    return root, model.bert


def _copy(src: Path, dst: Path, *, tensors: dict | None = None, config: dict | None = None) -> Path:
    dst.mkdir(exist_ok=True)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        shutil.copy(src / name, dst / name)
    if tensors is not None:
        save_file(tensors, dst / "model.safetensors")
    if config is not None:
        (dst / "config.json").write_text(json.dumps(config))
    return dst


def _tensors(root: Path) -> dict[str, torch.Tensor]:
    return dict(load_file(root / "model.safetensors"))


def _config(root: Path) -> dict:
    return json.loads((root / "config.json").read_text())


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids = torch.randint(1, TINY["vocab_size"], (3, 7))  # [B, T]
    attention_mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3, [1] * 2 + [0] * 5])
    type_ids = torch.tensor([[0] * 4 + [1] * 3, [0] * 7, [0, 1] + [0] * 5])
    return ids * attention_mask, attention_mask, type_ids


def _check_same(root: Path, reference: transformers.BertModel) -> None:
    ids, attention_mask, type_ids = _inputs()
    model = load_bert(root)
    with torch.no_grad():
        expected = reference(
            input_ids=ids, attention_mask=attention_mask, token_type_ids=type_ids
        ).last_hidden_state
        got = model(ids, attention_mask, type_ids)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1.3e-6)


def test_prefixed_pretraining_checkpoint_loads_and_matches(good: tuple) -> None:
    root, reference = good
    assert all(k.startswith(("bert.", "cls.")) for k in _tensors(root))
    _check_same(root, reference)


def test_unprefixed_checkpoint_loads_and_matches(good: tuple, tmp_path: Path) -> None:
    root, reference = good
    plain = {k.removeprefix("bert."): v for k, v in _tensors(root).items()}
    _check_same(_copy(root, tmp_path, tensors=plain), reference)


def test_legacy_gamma_beta_norm_names_load(good: tuple, tmp_path: Path) -> None:
    root, reference = good
    legacy = {
        k.replace("LayerNorm.weight", "LayerNorm.gamma").replace(
            "LayerNorm.bias", "LayerNorm.beta"
        ): v
        for k, v in _tensors(root).items()
    }
    _check_same(_copy(root, tmp_path, tensors=legacy), reference)


def test_heads_are_ignored_and_listed_with_a_reason(good: tuple) -> None:
    root, _ = good
    _, state_dict, ignored = read_bert_checkpoint(root)
    heads = sorted(k for k in _tensors(root) if k.startswith(("cls.", "bert.pooler.")))
    assert sorted(ignored) == heads
    assert any(k.startswith("cls.seq_relationship.") for k in heads)
    assert any(k.startswith("cls.predictions.") for k in heads)
    assert ignored["bert.pooler.dense.weight"] == IGNORED_PREFIXES["pooler."]
    assert len(state_dict) == 5 + 16 * TINY["num_hidden_layers"]


def test_key_map_covers_every_model_key() -> None:
    from qkv.models.bert import BertEncoder

    config = bert_config_from_hf(TINY)
    model_keys = set(BertEncoder(config, device="meta").state_dict())
    mapped = {ours.format(i) for ours in KEY_MAP.values() for i in range(config.num_hidden_layers)}
    assert mapped == model_keys


@pytest.mark.parametrize("name", ["config.json", "model.safetensors"])
def test_missing_file_is_named(good: tuple, tmp_path: Path, name: str) -> None:
    broken = _copy(good[0], tmp_path)
    (broken / name).unlink()
    with pytest.raises(FileNotFoundError, match=f"lacks {name}"):
        load_bert(broken)


def test_missing_directory() -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        check_checkpoint_dir("/no/such/checkpoint")


class _Boom:
    """Unpickling this runs code: it would create the file named in the instance."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (Path.touch, (Path(self.path),))


def test_pickle_is_refused_and_never_opened(good: tuple, tmp_path: Path) -> None:
    sentinel = tmp_path / "unpickled"
    broken = _copy(good[0], tmp_path / "ckpt")
    (broken / "pytorch_model.bin").write_bytes(pickle.dumps(_Boom(str(sentinel))))
    load_bert(broken)  # safetensors is there: the pickle beside it is not touched
    (broken / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="reads safetensors only"):
        load_bert(broken)
    assert not sentinel.exists()


def test_unknown_key_is_named(good: tuple, tmp_path: Path) -> None:
    tensors = _tensors(good[0])
    tensors["bert.encoder.layer.0.attention.self.rotary.weight"] = torch.zeros(4)
    with pytest.raises(ValueError, match=r"1 unknown key\(s\): bert\.encoder\.layer\.0\.attention"):
        load_bert(_copy(good[0], tmp_path, tensors=tensors))


def test_missing_key_is_named(good: tuple, tmp_path: Path) -> None:
    tensors = _tensors(good[0])
    del tensors["bert.encoder.layer.1.output.dense.bias"]
    with pytest.raises(ValueError, match=r"1 missing key\(s\): encoder\.layer\.1\.output\.dense"):
        load_bert(_copy(good[0], tmp_path, tensors=tensors))


def test_misshaped_key_is_named(good: tuple, tmp_path: Path) -> None:
    tensors = _tensors(good[0])
    tensors["bert.encoder.layer.0.intermediate.dense.weight"] = torch.zeros(33, 16)
    with pytest.raises(
        ValueError,
        match=r"intermediate\.dense\.weight has shape \[33, 16\], expected \[32, 16\]",
    ):
        load_bert(_copy(good[0], tmp_path, tensors=tensors))


def test_same_weight_twice_is_an_error(good: tuple, tmp_path: Path) -> None:
    tensors = _tensors(good[0])
    tensors["embeddings.word_embeddings.weight"] = tensors[
        "bert.embeddings.word_embeddings.weight"
    ].clone()
    with pytest.raises(ValueError, match=r"both hold embeddings\.word_embeddings\.weight"):
        load_bert(_copy(good[0], tmp_path, tensors=tensors))


def test_position_ids_buffer_is_checked(good: tuple, tmp_path: Path) -> None:
    tensors = _tensors(good[0])
    tensors["bert.embeddings.position_ids"] = torch.arange(20)[None]
    _, _, ignored = read_bert_checkpoint(_copy(good[0], tmp_path / "ok", tensors=tensors))
    assert "bert.embeddings.position_ids" in ignored
    tensors["bert.embeddings.position_ids"] = torch.arange(1, 21)[None]
    with pytest.raises(ValueError, match=r"position_ids is not the positions 0\.\.19"):
        load_bert(_copy(good[0], tmp_path / "bad", tensors=tensors))


def test_integer_weight_is_a_type_error(good: tuple) -> None:
    tensors = _tensors(good[0])
    tensors["bert.embeddings.LayerNorm.bias"] = torch.zeros(16, dtype=torch.int64)
    with pytest.raises(TypeError, match=r"LayerNorm\.bias must be floating point"):
        convert_bert_state_dict(tensors, bert_config_from_hf(TINY))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_hidden_layers": 1}, r"layers \[1\] lie beyond config.json's num_hidden_layers=1"),
        (
            {"num_hidden_layers": 3},
            r"num_hidden_layers=3 but the checkpoint holds 2 layer\(s\) .*: 1 layer\(s\) missing",
        ),
        (
            {"hidden_size": 32, "num_attention_heads": 4},
            r"word_embeddings\.weight has shape \[60, 16\], expected \[60, 32\]",
        ),
        ({"vocab_size": 61}, r"word_embeddings\.weight has shape \[60, 16\], expected \[61, 16\]"),
        ({"num_attention_heads": 5}, "hidden_size=16 is not divisible by num_attention_heads=5"),
        ({"model_type": "roberta"}, "model_type must be 'bert'"),
        ({"position_embedding_type": "relative_key"}, "position_embedding_type must be"),
        ({"is_decoder": True}, "is_decoder=true"),
        ({"hidden_act": "gelu_new"}, "hidden_act must be one of"),
    ],
)
def test_config_not_matching_the_weights(
    good: tuple, tmp_path: Path, change: dict, message: str
) -> None:
    config = {**_config(good[0]), **change}
    with pytest.raises(ValueError, match=message):
        load_bert(_copy(good[0], tmp_path, config=config))


@pytest.mark.parametrize(
    "change",
    [
        {"num_hidden_layers": 20_000},
        {"num_hidden_layers": 20_000, "hidden_size": 2**20, "intermediate_size": 2**22},
        {"vocab_size": 16_000_000},  # within hf_values.MAX_SIZE, refused by the headers
    ],
)
def test_huge_config_is_refused_from_the_headers_before_building_anything(
    good: tuple, tmp_path: Path, change: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """config.json is not hashed: its sizes are compared with the weights' safetensors headers
    before any tensor is read or model built (a 20,000-layer config took 30 s to refuse, building
    every layer on the meta device). Only a one-layer encoder on meta may be built to know the
    shapes."""
    built: list[tuple[int, object]] = []
    real = hf_bert.BertEncoder

    def spy(config: object, **kwargs: object) -> object:
        device = kwargs.get("device", torch.get_default_device().type)  # (built under on_meta)
        built.append((config.num_hidden_layers, device))  # type: ignore[attr-defined]
        return real(config, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(hf_bert, "BertEncoder", spy)
    monkeypatch.setattr(hf_bert, "read_tensors", lambda *a: pytest.fail("read before checked"))
    config = {**_config(good[0]), **change}
    root = _copy(good[0], tmp_path, config=config)
    with pytest.raises(ValueError, match="does not fit its config") as err:
        read_bert_checkpoint(root)
    assert built == [(1, "meta")]
    if "num_hidden_layers" in change:
        assert "num_hidden_layers=20000 but the checkpoint holds 2 layer(s)" in str(err.value)
    else:
        assert "expected [16000000, 16]" in str(err.value)


def test_config_without_a_size_names_it(good: tuple, tmp_path: Path) -> None:
    config = _config(good[0])
    del config["intermediate_size"]
    with pytest.raises(ValueError, match=r"config\.json lacks intermediate_size"):
        load_bert(_copy(good[0], tmp_path, config=config))


def test_unreadable_files(good: tuple, tmp_path: Path) -> None:
    broken = _copy(good[0], tmp_path / "json")
    (broken / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="is not valid JSON"):
        load_bert(broken)
    broken = _copy(good[0], tmp_path / "st")
    (broken / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match="is not a readable safetensors file"):
        load_bert(broken)


def test_weights_load_without_tokenizer_but_embed_still_needs_it(
    good: tuple, tmp_path: Path
) -> None:
    root = _copy(good[0], tmp_path)
    (root / "tokenizer.json").unlink()
    model = load_bert(root)
    ids = torch.randint(0, TINY["vocab_size"], (2, 5))
    with torch.no_grad():
        torch.testing.assert_close(
            model(ids), good[1](ids).last_hidden_state, atol=1e-5, rtol=1.3e-6
        )
    with pytest.raises(FileNotFoundError, match=r"lacks tokenizer\.json"):
        check_checkpoint_dir(root)
