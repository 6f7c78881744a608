"""nn.Transformer and its layers against qkv holding the same weights (eval mode, float32)."""

import pytest
import torch
from torch import nn

import qkv
from qkv.convert import (
    from_torch_decoder_layer,
    from_torch_encoder_layer,
    from_torch_transformer,
    to_torch_decoder_layer,
    to_torch_encoder_layer,
    to_torch_transformer,
)
from qkv.masks import padding_mask

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*nested tensor:UserWarning"),
    pytest.mark.filterwarnings("ignore:enable_nested_tensor:UserWarning"),
]

ATOL, RTOL = 1e-5, 1.3e-6
D, H, FF = 16, 4, 32


def _is_pad(lengths: list[int], L: int) -> torch.Tensor:
    return torch.arange(L)[None, :] >= torch.tensor(lengths)[:, None]  # [B, L]


def _causal(T: int) -> torch.Tensor:
    """PyTorch's bool attn_mask sense: True = not allowed."""
    return torch.ones(T, T, dtype=torch.bool).triu(1)  # [T, T]


def _real(x: torch.Tensor, is_pad: torch.Tensor) -> torch.Tensor:
    return x[~is_pad]  # [N_real, D]


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_transformer_matches_torch(norm_first: bool, activation: str) -> None:
    ref = nn.Transformer(
        D, H, 2, 2, FF, dropout=0.1, activation=activation, batch_first=True, norm_first=norm_first
    ).eval()
    ours = from_torch_transformer(ref).eval()
    src, tgt = torch.randn(3, 7, D), torch.randn(3, 5, D)
    src_pad, tgt_pad = _is_pad([7, 4, 6], 7), _is_pad([5, 3, 4], 5)
    causal = _causal(5)
    with torch.no_grad():
        expected = ref(
            src,
            tgt,
            tgt_mask=causal,
            src_key_padding_mask=src_pad,
            tgt_key_padding_mask=tgt_pad,
            memory_key_padding_mask=src_pad,
            tgt_is_causal=True,
        )
        got = ours(src, tgt, src_pad, tgt_pad, src_pad)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_encoder_layer_matches_torch(norm_first: bool, activation: str) -> None:
    ref = nn.TransformerEncoderLayer(
        D, H, FF, 0.1, activation, batch_first=True, norm_first=norm_first
    ).eval()
    ours = from_torch_encoder_layer(ref).eval()
    x, is_pad = torch.randn(3, 6, D), _is_pad([6, 2, 5], 6)
    with torch.no_grad():
        expected = ref(x, src_key_padding_mask=is_pad)
        got = ours(x, padding_mask(is_pad))
        expected_causal = ref(x, src_mask=_causal(6), is_causal=True)
        got_causal = ours(x, is_causal=True)
    # PyTorch's eval fast path may leave anything at padded positions: compare real ones
    torch.testing.assert_close(_real(got, is_pad), _real(expected, is_pad), atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(got_causal, expected_causal, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_decoder_layer_matches_torch(norm_first: bool, activation: str) -> None:
    ref = nn.TransformerDecoderLayer(
        D, H, FF, 0.1, activation, batch_first=True, norm_first=norm_first
    ).eval()
    ours = from_torch_decoder_layer(ref).eval()
    x, memory = torch.randn(3, 5, D), torch.randn(3, 7, D)
    tgt_pad, src_pad = _is_pad([5, 3, 4], 5), _is_pad([7, 4, 6], 7)
    with torch.no_grad():
        expected = ref(
            x,
            memory,
            tgt_mask=_causal(5),
            tgt_key_padding_mask=tgt_pad,
            memory_key_padding_mask=src_pad,
            tgt_is_causal=True,
        )
        got = ours(x, memory, padding_mask(tgt_pad), padding_mask(src_pad))
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("norm_first", [False, True])
def test_round_trip_is_exact(norm_first: bool) -> None:
    ref = nn.Transformer(D, H, 2, 1, FF, activation="gelu", batch_first=True, norm_first=norm_first)
    back = to_torch_transformer(from_torch_transformer(ref))
    assert back.state_dict().keys() == ref.state_dict().keys()
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(back.state_dict()[name], value, atol=0, rtol=0, msg=name)
    enc = nn.TransformerEncoderLayer(D, H, FF, batch_first=True, norm_first=norm_first)
    dec = nn.TransformerDecoderLayer(D, H, FF, batch_first=True, norm_first=norm_first)
    for orig, again in (
        (enc, to_torch_encoder_layer(from_torch_encoder_layer(enc))),
        (dec, to_torch_decoder_layer(from_torch_decoder_layer(dec))),
    ):
        for name, value in orig.state_dict().items():
            torch.testing.assert_close(again.state_dict()[name], value, atol=0, rtol=0, msg=name)


def test_model_body_exports_and_loads() -> None:
    cfg = qkv.TransformerConfig(
        src_vocab_size=11, tgt_vocab_size=11, d_model=D, num_heads=H, num_encoder_layers=2,
        num_decoder_layers=2, dim_feedforward=FF, dropout=0.0, positional="sinusoidal",
    )  # fmt: skip
    model = qkv.Transformer(cfg).eval()
    ref = to_torch_transformer(model).eval()
    src = torch.randint(3, 11, (2, 6))
    tgt = torch.randint(3, 11, (2, 4))
    with torch.no_grad():
        src_x = model.positional(model.src_embed(src) * model.embed_scale)  # type: ignore[misc]
        tgt_x = model.positional(model.tgt_embed(tgt) * model.embed_scale)  # type: ignore[misc]
        expected = model.lm_head(ref(src_x, tgt_x, tgt_is_causal=True, tgt_mask=_causal(4)))
        got = model(src, tgt)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)
    # and back into a fresh model
    other = qkv.Transformer(cfg).eval()
    body = from_torch_transformer(ref)
    other.encoder.load_state_dict(body.encoder.state_dict())
    other.decoder.load_state_dict(body.decoder.state_dict())
    for name, value in body.state_dict().items():
        torch.testing.assert_close(other.state_dict()[name], value, atol=0, rtol=0)


def test_export_refuses_what_torch_cannot_express() -> None:
    base = {"src_vocab_size": 7, "tgt_vocab_size": 7, "d_model": D, "num_heads": H,
            "num_encoder_layers": 1, "num_decoder_layers": 1, "dim_feedforward": FF}  # fmt: skip
    for extra, words in (
        ({"num_kv_heads": 2}, "grouped-query"),
        ({"activation": "swiglu"}, "swiglu"),
        ({"norm": "rms"}, "LayerNorm"),
    ):
        model = qkv.Transformer(qkv.TransformerConfig(**base, **extra))  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=words):
            to_torch_transformer(model)
    with pytest.raises(TypeError, match=r"nn\.Transformer"):
        from_torch_transformer(nn.Linear(2, 2))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="activation"):
        from_torch_encoder_layer(nn.TransformerEncoderLayer(D, H, FF, activation=nn.SiLU()))
