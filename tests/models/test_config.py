"""Config dataclasses: validation errors name the field, dicts round-trip through JSON."""

import dataclasses
import json

import pytest

from qkv import DecoderOnlyConfig, TransformerConfig


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
    cfg = DecoderOnlyConfig(vocab_size=5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.d_model = 3  # type: ignore[misc]


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
        ("positional", "relative", "positional"),
        ("dropout", 1.0, "dropout"),
        ("dropout", -0.1, "dropout"),
        ("num_heads", 0, "num_heads"),
        ("src_vocab_size", 0, "src_vocab_size"),
        ("num_decoder_layers", 0, "num_decoder_layers"),
        ("num_encoder_layers", -1, "num_encoder_layers"),
        ("eos_id", 10, "eos_id"),
        ("bos_id", 0, "bos_id and pad_id"),
        ("layer_norm_eps", 0.0, "layer_norm_eps"),
        ("max_len", 0, "max_len"),
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
