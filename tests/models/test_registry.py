"""qkv.models.registry: model types by name, and load_weights' upgrade, checks and strict load."""

import pytest
import torch

from qkv import DecoderOnlyConfig, DecoderOnlyLM, Transformer, TransformerConfig
from qkv.models.registry import (
    MODEL_TYPES,
    load_weights,
    model_from_config,
    model_type_of,
    upgrade_weights,
)
from qkv.nn.stacks import Encoder

SMALL = {"d_model": 8, "num_heads": 2, "dim_feedforward": 16, "dropout": 0.0}


def _lm() -> DecoderOnlyLM:
    return DecoderOnlyLM(DecoderOnlyConfig(vocab_size=11, num_layers=2, **SMALL)).eval()


def test_model_from_config_round_trips_every_type() -> None:
    configs = {
        "transformer": TransformerConfig(7, 9, num_encoder_layers=1, num_decoder_layers=1, **SMALL),
        "decoder_only": DecoderOnlyConfig(vocab_size=11, num_layers=1, **SMALL),
    }
    assert set(configs) == set(MODEL_TYPES)
    for name, cfg in configs.items():
        model = model_from_config(name, cfg.to_dict())
        assert type(model) is MODEL_TYPES[name].model and model.config == cfg
        assert model_type_of(model) == name


def test_unknown_types_and_keys_are_named() -> None:
    with pytest.raises(ValueError, match=r"'gpt'.*decoder_only"):
        model_from_config("gpt", {})
    with pytest.raises(ValueError, match="widht"):
        model_from_config("decoder_only", {"vocab_size": 5, "widht": 3})
    with pytest.raises(TypeError, match="Encoder is not a registered"):
        model_type_of(Encoder([]))


def test_load_weights_upgrades_0_1_keys_then_loads_strictly() -> None:
    model, source = _lm(), _lm()
    legacy = {k.replace("blocks.", "", 1): v for k, v in source.state_dict().items()}
    assert set(upgrade_weights(model, legacy)) == set(model.state_dict())
    assert load_weights(model, legacy, "ckpt") is model
    ids = torch.tensor([[1, 2, 3]])
    torch.testing.assert_close(model(ids), source(ids), atol=0.0, rtol=0.0)


def test_load_weights_names_the_key_and_both_shapes() -> None:
    model = _lm()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    bad = dict(before)
    bad["blocks.layers.0.ffn.fc1.weight"] = torch.zeros(3, 8)
    with pytest.raises(
        ValueError,
        match=r"in ckpt: 'blocks.layers.0.ffn.fc1.weight' has shape "
        r"\(3, 8\) torch.float32 in the weights but \(16, 8\)",
    ):
        load_weights(model, bad, "ckpt")
    missing = {k: v for k, v in before.items() if k != "embed.weight"}
    with pytest.raises(ValueError, match=r"'embed\.weight' is missing"):
        load_weights(model, missing, "ckpt")
    with pytest.raises(ValueError, match=r"'extra' .* is not in the model"):
        load_weights(model, {**before, "extra": torch.zeros(1)}, "ckpt")
    for k, v in model.state_dict().items():  # nothing was copied
        assert torch.equal(v, before[k])


def test_transformer_weights_load_as_they_are() -> None:
    cfg = TransformerConfig(7, 9, num_encoder_layers=1, num_decoder_layers=1, **SMALL)
    source, model = Transformer(cfg).eval(), Transformer(cfg).eval()
    load_weights(model, source.state_dict())
    for k, v in model.state_dict().items():
        assert torch.equal(v, source.state_dict()[k])
