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


def _attn_mask(T: int, S: int, seed: int) -> torch.Tensor:
    """A random bool attn_mask [T, S] (True = not allowed) that leaves key 0 to every query."""
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(T, S, generator=g) > 0.6
    m[:, 0] = False
    return m


def _to_form(m: torch.Tensor | None, form: str) -> torch.Tensor | None:
    """bool as is; float: PyTorch's additive sense with non-trivial finite values, which both
    libraries add to the scores."""
    if m is None or form == "bool":
        return m
    return torch.randn(m.shape).masked_fill(m, float("-inf"))


def _layout(x: torch.Tensor, batch_first: bool) -> torch.Tensor:
    return x if batch_first else x.transpose(0, 1)  # [L, B, D] when not batch first


# B == S (a [S, S] src_mask looked like key padding) and S == T (seq-first read batch-first)
SIZES = [(3, 3, 3), (2, 5, 4)]  # (B, S, T)
FORMS = ["none", "bool", "float"]


def _transformer_args(B: int, S: int, T: int, form: str) -> dict[str, torch.Tensor | None]:
    if form == "none":
        return {}
    src_pad, tgt_pad = _is_pad([S, *[S - 1] * (B - 1)], S), _is_pad([T - 1, *[T] * (B - 1)], T)
    bool_masks = {
        "src_mask": _attn_mask(S, S, 0),
        "tgt_mask": _causal(T),
        "memory_mask": _attn_mask(T, S, 1),
        "src_key_padding_mask": src_pad,
        "tgt_key_padding_mask": tgt_pad,
        "memory_key_padding_mask": src_pad,
    }
    return {name: _to_form(m, form) for name, m in bool_masks.items()}


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("sizes", SIZES, ids=["B=S=T", "B<T<S"])
@pytest.mark.parametrize("call", ["positional", "keyword"])
def test_transformer_is_a_drop_in(
    batch_first: bool, form: str, sizes: tuple[int, int, int], call: str
) -> None:
    B, S, T = sizes
    ref = nn.Transformer(D, H, 2, 2, FF, dropout=0.1, batch_first=batch_first).eval()
    ours = from_torch_transformer(ref).eval()
    assert ours.batch_first is batch_first
    src = _layout(torch.randn(B, S, D), batch_first)
    tgt = _layout(torch.randn(B, T, D), batch_first)
    kw = _transformer_args(B, S, T, form)
    # grad enabled: PyTorch's eval fast path (nested tensors) is then off, all positions compare
    if call == "positional":
        got, expected = ours(src, tgt, *kw.values()), ref(src, tgt, *kw.values())
    else:
        got, expected = ours(src, tgt, **kw), ref(src, tgt, **kw)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)
    # the stacks alone, with their own (nn.TransformerEncoder / Decoder) argument names
    enc_kw = {"mask": kw.get("src_mask"), "src_key_padding_mask": kw.get("src_key_padding_mask")}
    memory = ref.encoder(src, **enc_kw)
    torch.testing.assert_close(ours.encoder(src, **enc_kw), memory, atol=ATOL, rtol=RTOL)
    dec_kw = {k: v for k, v in kw.items() if not k.startswith("src")}
    torch.testing.assert_close(
        ours.decoder(tgt, memory, **dec_kw),
        ref.decoder(tgt, memory, **dec_kw),
        atol=ATOL,
        rtol=RTOL,
    )


def test_transformer_causal_hint_and_unbatched_input() -> None:
    ref = nn.Transformer(D, H, 1, 1, FF, batch_first=True).eval()
    ours = from_torch_transformer(ref).eval()
    src, tgt = torch.randn(2, 6, D), torch.randn(2, 4, D)
    causal = ours.generate_square_subsequent_mask(4)
    torch.testing.assert_close(causal, nn.Transformer.generate_square_subsequent_mask(4))
    torch.testing.assert_close(
        ours(src, tgt, tgt_mask=causal, tgt_is_causal=True),
        ref(src, tgt, tgt_mask=causal, tgt_is_causal=True),
        atol=ATOL,
        rtol=RTOL,
    )
    # tgt_is_causal=True alone: PyTorch refuses (it is only a hint), qkv applies it
    torch.testing.assert_close(
        ours(src, tgt, tgt_is_causal=True), ref(src, tgt, tgt_mask=causal), atol=ATOL, rtol=RTOL
    )
    torch.testing.assert_close(ours(src[0], tgt[0]), ref(src[0], tgt[0]), atol=ATOL, rtol=RTOL)
    with pytest.raises(ValueError, match=r"src and tgt must share the batch size"):
        ours(src, tgt[:1])
    seq_first = from_torch_transformer(nn.Transformer(D, H, 1, 1, FF))
    with pytest.raises(ValueError, match=r"batch_first=False"):
        seq_first(torch.randn(6, 2, D), torch.randn(4, 3, D))


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("form", ["bool", "float"])
@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_layers_are_drop_ins(
    batch_first: bool, form: str, norm_first: bool, activation: str
) -> None:
    B, S, T = 3, 3, 4
    kw = {"batch_first": batch_first, "norm_first": norm_first}
    enc = nn.TransformerEncoderLayer(D, H, FF, 0.1, activation, **kw).eval()
    dec = nn.TransformerDecoderLayer(D, H, FF, 0.1, activation, **kw).eval()
    ours_enc, ours_dec = from_torch_encoder_layer(enc).eval(), from_torch_decoder_layer(dec).eval()
    src = _layout(torch.randn(B, S, D), batch_first)
    tgt = _layout(torch.randn(B, T, D), batch_first)
    m = _transformer_args(B, S, T, form)
    enc_args = (src, m["src_mask"], m["src_key_padding_mask"])
    torch.testing.assert_close(ours_enc(*enc_args), enc(*enc_args), atol=ATOL, rtol=RTOL)
    dec_args = (tgt, src, m["tgt_mask"], m["memory_mask"])
    dec_args += (m["tgt_key_padding_mask"], m["memory_key_padding_mask"])
    torch.testing.assert_close(ours_dec(*dec_args), dec(*dec_args), atol=ATOL, rtol=RTOL)
    # no implicit causal mask in a decoder layer, as in PyTorch
    torch.testing.assert_close(ours_dec(tgt, src), dec(tgt, src), atol=ATOL, rtol=RTOL)


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
