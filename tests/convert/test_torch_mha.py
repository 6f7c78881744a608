"""qkv.MultiHeadAttention against nn.MultiheadAttention holding the same weights."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from qkv import masks
from qkv.convert import from_torch_mha, to_torch_mha
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
