"""qkv.MultiHeadAttention against nn.MultiheadAttention holding the same weights."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from qkv import masks
from qkv.convert import accept_qkv_state_dict, from_torch_mha, to_torch_mha
from qkv.nn.multihead import MultiHeadAttention

B, T, S, D, H = 3, 5, 7, 8, 2
ATOL = RTOL = 1e-6  # float32, as the issue asks


def _inputs(kdim: int, vdim: int, batch_first: bool) -> tuple[Tensor, Tensor, Tensor]:
    q, k, v = torch.randn(B, T, D), torch.randn(B, S, kdim), torch.randn(B, S, vdim)
    if not batch_first:
        q, k, v = (x.transpose(0, 1) for x in (q, k, v))
    return q, k, v


def _masks(form: str) -> tuple[Tensor, Tensor]:
    """PyTorch-convention masks: key padding [B, S] and a bottom-right causal [T, S]."""
    kpm = masks.to_mha_bool(masks.padding_mask(torch.tensor([7, 4, 6]), S)[:, 0, 0])  # [B, S]
    am = masks.to_mha_bool(masks.causal_mask(T, S, align="bottom_right")[0, 0])  # [T, S]
    if form == "float":
        return masks.to_additive(kpm), masks.to_additive(am)
    return kpm, am


@pytest.mark.parametrize("direction", ["from_torch", "to_torch"])
@pytest.mark.parametrize("dims", [(D, D), (5, 3)], ids=["packed", "separate"])
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("form", ["bool", "float"])
@pytest.mark.parametrize("average", [True, False])
def test_matches_nn_multihead_attention(
    direction: str, dims: tuple[int, int], batch_first: bool, form: str, average: bool
) -> None:
    kdim, vdim = dims
    if direction == "from_torch":
        ref = nn.MultiheadAttention(D, H, kdim=kdim, vdim=vdim, batch_first=batch_first)
        mine = from_torch_mha(ref)
    else:
        mine = MultiHeadAttention(D, H, kdim=kdim, vdim=vdim, batch_first=batch_first)
        ref = to_torch_mha(mine)
    assert (ref.in_proj_weight is not None) == (kdim == vdim == D)
    ref.eval()
    mine.eval()
    q, k, v = _inputs(kdim, vdim, batch_first)
    kpm, am = _masks(form)
    with torch.no_grad():
        out, w = mine(q, k, v, key_padding_mask=kpm, attn_mask=am, average_attn_weights=average)
        ref_out, ref_w = ref(
            q, k, v, key_padding_mask=kpm, attn_mask=am, average_attn_weights=average
        )
    torch.testing.assert_close(out, ref_out, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(w, ref_w, atol=ATOL, rtol=RTOL)
    assert w is not None and w.shape == ((B, T, S) if average else (B, H, T, S))


def test_three_d_attn_mask_and_no_weights() -> None:
    ref = nn.MultiheadAttention(D, H, batch_first=True).eval()
    mine = from_torch_mha(ref).eval()
    x = torch.randn(B, T, D)
    am = torch.rand(B * H, T, T) > 0.6
    am[..., 0] = False  # every query keeps one key: PyTorch would give NaN otherwise
    with torch.no_grad():
        out, w = mine(x, x, x, attn_mask=am, need_weights=False)
        ref_out, ref_w = ref(x, x, x, attn_mask=am, need_weights=False)
    assert w is None and ref_w is None
    torch.testing.assert_close(out, ref_out, atol=ATOL, rtol=RTOL)


def test_is_causal_square_matches_torch() -> None:
    ref = nn.MultiheadAttention(D, H, batch_first=True).eval()
    mine = from_torch_mha(ref).eval()
    x = torch.randn(B, T, D)
    tri = nn.Transformer.generate_square_subsequent_mask(T)
    with torch.no_grad():
        out, w = mine(x, is_causal=True)
        ref_out, ref_w = ref(x, x, x, attn_mask=tri, is_causal=True)
    torch.testing.assert_close(out, ref_out, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(w, ref_w, atol=ATOL, rtol=RTOL)


def test_fully_padded_sample_zero_in_qkv_nan_in_pytorch() -> None:
    """The documented difference: PyTorch's module returns NaN for a sample with no keys."""
    ref = nn.MultiheadAttention(D, H, batch_first=True).eval()
    mine = from_torch_mha(ref).eval()
    x = torch.randn(2, T, D)
    kpm = torch.zeros(2, T, dtype=torch.bool)
    kpm[1] = True  # sample 1 is all padding
    with torch.no_grad():
        out, w = mine(x, x, x, key_padding_mask=kpm)
        ref_out, ref_w = ref(x, x, x, key_padding_mask=kpm)
    assert torch.isnan(ref_out[1]).all() and torch.isnan(ref_w[1]).all()
    assert w is not None and bool((w[1] == 0).all())
    # The attention result is 0, so the sample's output is out_proj(0) = out_proj.bias.
    torch.testing.assert_close(out[1], mine.out_proj.bias.expand(T, D), atol=0, rtol=0)
    torch.testing.assert_close(out[0], ref_out[0], atol=ATOL, rtol=RTOL)


def test_no_bias_round_trip() -> None:
    mine = MultiHeadAttention(D, H, bias=False)
    ref = to_torch_mha(mine)
    assert ref.in_proj_bias is None and ref.out_proj.bias is None
    back = from_torch_mha(ref)
    for name, p in mine.state_dict().items():
        torch.testing.assert_close(back.state_dict()[name], p, atol=0, rtol=0)


def test_conversion_errors() -> None:
    with pytest.raises(ValueError, match="num_kv_heads=1 != num_heads=2"):
        to_torch_mha(MultiHeadAttention(D, H, num_kv_heads=1))
    with pytest.raises(ValueError, match="add_zero_attn have no qkv equivalent"):
        from_torch_mha(nn.MultiheadAttention(D, H, add_bias_kv=True))
    with pytest.raises(TypeError, match=r"expected nn\.MultiheadAttention, got Linear"):
        from_torch_mha(nn.Linear(2, 2))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"expected qkv\.MultiHeadAttention, got Linear"):
        to_torch_mha(nn.Linear(2, 2))  # type: ignore[arg-type]


def test_positional_call_order_is_torchs() -> None:
    """``m(q, k, v, kpm, need_weights, attn_mask, average, is_causal)``, as in PyTorch."""
    ref = nn.MultiheadAttention(D, H, batch_first=True).eval()
    mine = from_torch_mha(ref).eval()
    q, k, v = _inputs(D, D, True)
    kpm, am = _masks("bool")
    for args in ((q, k, v, kpm, True, am), (q, k, v, kpm, True, am, False), (q, k, v, None, False)):
        with torch.no_grad():
            out, w = mine(*args)
            ref_out, ref_w = ref(*args)
        torch.testing.assert_close(out, ref_out, atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(w, ref_w, atol=ATOL, rtol=RTOL)
    with pytest.raises(TypeError, match=r"need_weights must be a bool, got a Tensor"):
        mine(q, k, v, kpm, am)  # the pre-0.3 order: attn_mask where need_weights stands


def test_positional_constructor_order_is_torchs() -> None:
    args = (D, H, 0.25, False, False, False, 5, 3, False)  # ..., kdim, vdim, batch_first
    ref, mine = nn.MultiheadAttention(*args), MultiHeadAttention(*args)
    for name in ("embed_dim", "num_heads", "dropout", "kdim", "vdim", "batch_first"):
        assert getattr(mine, name) == getattr(ref, name), name
    assert mine.out_proj.bias is None and ref.out_proj.bias is None
    assert mine.state_dict().keys() == from_torch_mha(ref).state_dict().keys()
    with pytest.raises(ValueError, match=r"add_bias_kv=True has no qkv equivalent"):
        MultiHeadAttention(D, H, 0.0, True, True)
    with pytest.raises(TypeError, match=r"add_zero_attn must be a bool"):
        MultiHeadAttention(D, H, 0.0, True, False, 1)  # type: ignore[arg-type]


@pytest.mark.parametrize("batch_first", [True, False])
def test_converters_keep_the_layout(batch_first: bool) -> None:
    ref = nn.MultiheadAttention(D, H, batch_first=batch_first)
    assert from_torch_mha(ref).batch_first is batch_first
    assert (
        to_torch_mha(MultiHeadAttention(D, H, batch_first=batch_first)).batch_first is batch_first
    )
    assert MultiHeadAttention(D, H).batch_first is True  # qkv's default, stated in the README


@pytest.mark.parametrize("form", ["bool", "float"])
@pytest.mark.parametrize("heads_mask", [False, True], ids=["mask_TS", "mask_HTS"])
def test_unbatched_input_matches_torch(form: str, heads_mask: bool) -> None:
    ref = nn.MultiheadAttention(D, H, kdim=5, vdim=3).eval()
    mine = from_torch_mha(ref).eval()
    q, k, v = torch.randn(T, D), torch.randn(S, 5), torch.randn(S, 3)
    kpm, am = _masks(form)
    kpm0 = kpm[2]  # [S], sample 2 keeps six keys
    am_in = am.expand(H, T, S).clone() if heads_mask else am  # [H, T, S] or [T, S]
    for average in (True, False):
        with torch.no_grad():
            out, w = mine(q, k, v, kpm0, True, am_in, average)
            ref_out, ref_w = ref(q, k, v, kpm0, True, am_in, average)
        assert out.shape == (T, D) and w is not None
        assert w.shape == ((T, S) if average else (H, T, S))
        torch.testing.assert_close(out, ref_out, atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(w, ref_w, atol=ATOL, rtol=RTOL)


def test_float_attn_mask_is_added_to_the_scores_as_in_torch() -> None:
    """Any float mask (not only 0 / -inf) is a score bias in PyTorch: the same in qkv."""
    ref = nn.MultiheadAttention(D, H, batch_first=True).eval()
    mine = from_torch_mha(ref).eval()
    q, k, v = _inputs(D, D, True)
    am = torch.randn(B * H, T, S)  # e.g. ALiBi passed as attn_mask
    kpm = torch.randn(B, S)
    with torch.no_grad():
        out, w = mine(q, k, v, kpm, True, am, False)
        ref_out, ref_w = ref(q, k, v, kpm, True, am, False)
    torch.testing.assert_close(out, ref_out, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(w, ref_w, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("dims", [(D, D), (5, 3)], ids=["packed", "separate"])
@pytest.mark.parametrize("bias", [True, False])
def test_state_dicts_load_both_ways(dims: tuple[int, int], bias: bool) -> None:
    kdim, vdim = dims
    ref = nn.MultiheadAttention(D, H, bias=bias, kdim=kdim, vdim=vdim, batch_first=True).eval()
    mine = MultiHeadAttention(D, H, bias=bias, kdim=kdim, vdim=vdim).eval()
    mine.load_state_dict(ref.state_dict())  # torch keys into qkv, strict
    other = accept_qkv_state_dict(
        nn.MultiheadAttention(D, H, bias=bias, kdim=kdim, vdim=vdim, batch_first=True)
    ).eval()
    other.load_state_dict(mine.state_dict())  # qkv keys into torch, strict
    other.load_state_dict(ref.state_dict())  # and its own keys still
    mine.load_state_dict(mine.state_dict())
    q, k, v = _inputs(kdim, vdim, True)
    with torch.no_grad():
        expected = ref(q, k, v)[0]
        torch.testing.assert_close(mine(q, k, v)[0], expected, atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(other(q, k, v)[0], expected, atol=0, rtol=0)
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(other.state_dict()[name], value, atol=0, rtol=0, msg=name)
    with pytest.raises(ValueError, match=r"bias_k.*add_bias_kv=True"):
        MultiHeadAttention(D, H).load_state_dict(
            nn.MultiheadAttention(D, H, add_bias_kv=True).state_dict()
        )


def _encoder_layer_runs(
    layer: nn.TransformerEncoderLayer, x: Tensor, am: Tensor, kpm: Tensor
) -> list[Tensor]:
    """The layer's output in train and eval mode, each with and without autograd."""
    outs = []
    for training in (True, False):
        layer.train(training)
        for grad in (True, False):
            with torch.set_grad_enabled(grad):
                outs.append(layer(x, am, kpm).detach())
    return outs


@pytest.mark.parametrize("batch_first", [True, False])
def test_works_as_self_attn_of_nn_transformer_encoder_layer(batch_first: bool) -> None:
    """PyTorch's eval no-grad fast path reads attributes of self_attn: it must decline and call
    the qkv module, with the numbers of the torch module it replaced, in every mode."""
    layer = nn.TransformerEncoderLayer(D, H, 16, dropout=0.0, batch_first=batch_first)
    x = torch.randn(B, T, D) if batch_first else torch.randn(T, B, D)
    kpm = masks.to_mha_bool(masks.padding_mask(torch.tensor([5, 3, 4]), T)[:, 0, 0])  # [B, T]
    am = torch.ones(T, T, dtype=torch.bool).triu(1)  # [T, T], True = not allowed
    expected = _encoder_layer_runs(layer, x, am, kpm)
    layer.self_attn = from_torch_mha(layer.self_attn)  # type: ignore[assignment]
    got = _encoder_layer_runs(layer, x, am, kpm)
    real = ~kpm if batch_first else ~kpm.T  # the fast path may leave anything at padding
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g[real], e[real], atol=1e-5, rtol=1.3e-6)
