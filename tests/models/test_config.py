"""Config dataclasses: validation errors name the field, dicts round-trip through JSON."""

import dataclasses
import json
from pathlib import Path

import pytest

from qkv import DecoderOnlyConfig, TransformerConfig
from qkv.models.config import ModelConfig

FIXTURES = Path(__file__).parents[1] / "fixtures" / "qkv_0_1"


def test_round_trip_through_json() -> None:
    for cfg in (
        TransformerConfig(
            src_vocab_size=10, tgt_vocab_size=12, num_kv_heads=2, positional="rotary"
        ),
        DecoderOnlyConfig(vocab_size=50, pad_id=0, eos_id=3, activation="swiglu", norm="rms"),
    ):
        again = type(cfg).from_dict(json.loads(json.dumps(cfg.to_dict())))
        assert again == cfg


def test_frozen() -> None:
    # a config is checked once, in __post_init__: it must not be changed afterwards, and a
    # changed copy (dataclasses.replace) is checked again
    cfg = DecoderOnlyConfig(vocab_size=5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.d_model = 3  # type: ignore[misc]
    assert cfg.d_model != 3
    with pytest.raises(ValueError, match="divisible by num_heads"):
        dataclasses.replace(cfg, d_model=cfg.num_heads * 8 + 1)
    assert dataclasses.replace(cfg, vocab_size=7).vocab_size == 7


def test_unknown_key_is_named() -> None:
    d = TransformerConfig(src_vocab_size=4, tgt_vocab_size=4).to_dict()
    d["n_layers"] = 3
    with pytest.raises(ValueError, match="n_layers"):
        TransformerConfig.from_dict(d)
    with pytest.raises(ValueError, match="hidden"):
        DecoderOnlyConfig.from_dict({"vocab_size": 3, "hidden": 1})


BASE = {"src_vocab_size": 10, "tgt_vocab_size": 10}


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("d_model", 30, "divisible by num_heads"),
        ("num_kv_heads", 3, "num_kv_heads=3"),
        ("num_kv_heads", 0, "num_kv_heads"),
        ("activation", "tanh", "activation"),
        ("norm", "batch", "norm"),
        ("positional", "t5_relative", "positional"),
        ("attn_scale", 0.0, "attn_scale"),
        ("output_scale", -1.0, "output_scale"),
        ("forced_eos_id", 10, "forced_eos_id"),
        ("relative_buckets", 0, "relative_buckets"),
        ("dropout", 1.0, "dropout"),
        ("dropout", -0.1, "dropout"),
        ("num_heads", 0, "num_heads"),
        ("src_vocab_size", 0, "src_vocab_size"),
        ("num_decoder_layers", 0, "num_decoder_layers"),
        ("num_encoder_layers", -1, "num_encoder_layers"),
        ("eos_id", 10, "eos_id"),
        ("layer_norm_eps", 0.0, "layer_norm_eps"),
        ("max_positions", 0, "max_positions"),
    ],
)
def test_transformer_config_errors(field: str, value: object, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        TransformerConfig(**{**BASE, field: value})  # type: ignore[arg-type]


def test_rotary_needs_even_head_width() -> None:
    with pytest.raises(ValueError, match="even head width"):
        DecoderOnlyConfig(vocab_size=9, d_model=12, num_heads=4, positional="rotary")
    DecoderOnlyConfig(vocab_size=9, d_model=12, num_heads=4, positional="sinusoidal")


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("vocab_size", -1, "vocab_size"),
        ("num_layers", 0, "num_layers"),
        ("pad_id", 9, "pad_id"),
        ("num_kv_heads", 3, "num_kv_heads"),
    ],
)
def test_decoder_only_config_errors(field: str, value: object, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        DecoderOnlyConfig(**{"vocab_size": 9, field: value})  # type: ignore[arg-type]


def test_both_configs_share_the_base_fields() -> None:
    base = {f.name for f in dataclasses.fields(ModelConfig)}
    for cls in (TransformerConfig, DecoderOnlyConfig):
        assert issubclass(cls, ModelConfig)
        assert base <= {f.name for f in dataclasses.fields(cls)}
    assert "max_positions" in base and "max_len" not in base


def test_only_vocab_sizes_are_positional() -> None:
    assert TransformerConfig(5, 6).tgt_vocab_size == 6
    with pytest.raises(TypeError):
        TransformerConfig(5, 6, 64)  # type: ignore[misc]
    with pytest.raises(TypeError):
        DecoderOnlyConfig(5, 64)  # type: ignore[misc]


def test_non_int_sizes_are_type_errors() -> None:
    with pytest.raises(TypeError, match="d_model"):
        DecoderOnlyConfig(vocab_size=9, d_model=16.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="norm_first"):
        DecoderOnlyConfig(vocab_size=9, norm_first=1)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["reverse", "text"])
def test_qkv_0_1_config_reads_max_len_as_max_positions(name: str) -> None:
    manifest = json.loads((FIXTURES / name / "config.json").read_text())
    saved = manifest["model_config"]
    assert "max_len" in saved and "max_positions" not in saved
    cls = DecoderOnlyConfig if manifest["model_type"] == "decoder_only" else TransformerConfig
    cfg = cls.from_dict(saved)
    assert cfg.max_positions == saved["max_len"]
    again = cfg.to_dict()
    assert "max_len" not in again and again["max_positions"] == saved["max_len"]
    assert cls.from_dict(again) == cfg


def test_legacy_key_next_to_its_new_name_is_refused() -> None:
    with pytest.raises(ValueError, match=r"max_positions.*max_len"):
        DecoderOnlyConfig.from_dict({"vocab_size": 3, "max_len": 8, "max_positions": 8})


def test_max_len_keyword_and_attribute_are_deprecated_aliases() -> None:
    with pytest.warns(DeprecationWarning, match="max_positions"):
        cfg = TransformerConfig(src_vocab_size=4, tgt_vocab_size=4, max_len=9)
    assert cfg.max_positions == 9
    with pytest.warns(DeprecationWarning, match="max_positions"):
        assert cfg.max_len == 9
    with pytest.raises(TypeError, match="max_positions only"), pytest.warns(DeprecationWarning):
        DecoderOnlyConfig(vocab_size=4, max_len=9, max_positions=9)
