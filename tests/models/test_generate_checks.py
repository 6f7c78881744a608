"""Decoding arguments are checked before any decoding: a bool beam width, a NaN or infinite
length penalty and an ``eos_id`` outside the vocabulary are refused, naming the argument."""

from __future__ import annotations

import pytest
import torch

from qkv.models.config import DecoderOnlyConfig, TransformerConfig
from qkv.models.decoder_only import DecoderOnlyLM
from qkv.models.transformer import Transformer


def _seq2seq() -> Transformer:
    cfg = TransformerConfig(
        src_vocab_size=11,
        tgt_vocab_size=11,
        d_model=8,
        num_heads=2,
        num_encoder_layers=1,
        num_decoder_layers=1,
        dim_feedforward=16,
        max_positions=8,
    )
    return Transformer(cfg).eval()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"beam_size": True}, TypeError, "beam_size must be an int, got True"),
        ({"beam_size": 3, "length_penalty": float("nan")}, ValueError, "length_penalty"),
        ({"beam_size": 3, "length_penalty": float("inf")}, ValueError, "length_penalty"),
        ({"beam_size": 1, "length_penalty": "x"}, TypeError, "length_penalty must be a float"),
    ],
)
def test_beam_arguments_are_checked(
    kwargs: dict[str, object], error: type[Exception], match: str
) -> None:
    src = torch.randint(3, 11, (2, 4))
    with pytest.raises(error, match=match):
        _seq2seq().generate(src, 4, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("eos_id", [11, -1, 10**9])
def test_an_eos_id_outside_the_vocabulary_is_refused(eos_id: int) -> None:
    cfg = DecoderOnlyConfig(
        vocab_size=11, d_model=8, num_heads=2, num_layers=1, dim_feedforward=16, max_positions=8
    )
    model = DecoderOnlyLM(cfg).eval()
    with pytest.raises(ValueError, match=rf"eos_id must lie in \[0, vocab_size=11\), got {eos_id}"):
        model.generate(torch.randint(0, 11, (1, 2)), 3, eos_id=eos_id)


@pytest.mark.parametrize("beam_size", [1, 3])
def test_a_keyword_that_is_no_option_is_refused(beam_size: int) -> None:
    cfg = DecoderOnlyConfig(
        vocab_size=11, d_model=8, num_heads=2, num_layers=1, dim_feedforward=16, max_positions=8
    )
    model = DecoderOnlyLM(cfg).eval()
    ids = torch.randint(0, 11, (1, 2))
    with pytest.raises(TypeError, match=r"unexpected keyword\(s\) \['temprature'\]"):
        model.generate(ids, 3, beam_size=beam_size, temprature=0.5)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="temprature"):
        model.stream(ids, 3, temprature=0.5)  # type: ignore[call-arg]
