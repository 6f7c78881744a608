"""Mask builders and converters, each checked against the real PyTorch API it converts for."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention.bias import causal_lower_right, causal_upper_left

import qkv
from qkv import masks
from qkv.convert import from_torch_mha

B, H, T, S, D = 2, 2, 4, 6, 8


def _qkv() -> tuple[Tensor, Tensor, Tensor]:
    return torch.randn(B, H, T, 8), torch.randn(B, H, S, 8), torch.randn(B, H, S, 5)


def _blocked() -> Tensor:
    """A mask with padding and a causal part, no fully blocked row."""
    out = masks.combine(
        masks.padding_mask(torch.tensor([6, 3]), S), masks.causal_mask(T, S, align="bottom_right")
    )
    assert out is not None
    return out


# --- builders -------------------------------------------------------------------------------


def test_padding_mask_from_lengths() -> None:
    m = masks.padding_mask(torch.tensor([3, 0, 5]), 5)
    assert m.shape == (3, 1, 1, 5) and m.dtype == torch.bool
    expected = torch.tensor([[j >= n for j in range(5)] for n in (3, 0, 5)])
    assert torch.equal(m[:, 0, 0], expected)


def test_padding_mask_from_bool_and_from_hf_agree_with_lengths() -> None:
    lengths = torch.tensor([4, 2])
    from_lengths = masks.padding_mask(lengths, 4)
    is_pad = torch.tensor([[False] * 4, [False, False, True, True]])
    assert torch.equal(masks.padding_mask(is_pad), from_lengths)
    hf = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    assert torch.equal(masks.from_hf(hf), from_lengths)


def test_padding_mask_errors() -> None:
    with pytest.raises(ValueError, match="needs S"):
        masks.padding_mask(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match=r"lengths must lie in \[0, S=3\], got \[1, 4\]"):
        masks.padding_mask(torch.tensor([1, 4]), 3)
    with pytest.raises(TypeError, match=r"goes through qkv\.masks\.from_hf"):
        masks.padding_mask(torch.tensor([[1, 1, 0]]))
    with pytest.raises(TypeError, match="from_additive"):
        masks.padding_mask(torch.tensor([1.0, 2.0]), 3)
    with pytest.raises(ValueError, match=r"must be \[B, S\]"):
        masks.padding_mask(torch.zeros(2, 1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="attention_mask must hold only 0"):
        masks.from_hf(torch.tensor([[1, 2]]))


@pytest.mark.filterwarnings("ignore:Lower right causal bias will produce NaNs")  # T > S rows
@pytest.mark.parametrize(("t", "s"), [(4, 4), (3, 7), (7, 3), (1, 5)])
def test_causal_mask_alignments_match_torch(t: int, s: int) -> None:
    upper_left = ~causal_upper_left(t, s)._materialize()  # torch: True = may attend
    lower_right = ~causal_lower_right(t, s)._materialize()
    assert torch.equal(masks.causal_mask(t, s, align="top_left")[0, 0], upper_left)
    assert torch.equal(masks.causal_mask(t, s, align="bottom_right")[0, 0], lower_right)
    assert torch.equal(masks.causal_mask(t, s)[0, 0], lower_right)  # the default
    assert torch.equal(
        masks.causal_mask(t, s, offset=s - t), masks.causal_mask(t, s, align="bottom_right")
    )


def test_causal_mask_square_matches_generate_square_subsequent_mask() -> None:
    ref = nn.Transformer.generate_square_subsequent_mask(5)  # float, -inf above the diagonal
    mine = masks.causal_mask(5)
    assert mine.shape == (1, 1, 5, 5)
    assert torch.equal(masks.from_additive(ref), mine[0, 0])
    assert torch.equal(masks.to_additive(mine[0, 0]), ref)
    assert torch.equal(masks.causal_mask(5, align="bottom_right"), mine)


def test_causal_sdpa_is_causal_is_top_left() -> None:
    q, k, v = _qkv()
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # T != S
    top_left = masks.causal_mask(T, S, align="top_left")
    out, _ = qkv.scaled_dot_product_attention(q, k, v, top_left)
    torch.testing.assert_close(out, ref)


def test_causal_mask_errors() -> None:
    with pytest.raises(ValueError, match="align must be 'top_left' or 'bottom_right'"):
        masks.causal_mask(3, align="middle")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not both"):
        masks.causal_mask(3, 5, offset=1, align="bottom_right")
    with pytest.raises(ValueError, match="T must be a positive int, got 0"):
        masks.causal_mask(0)


def test_sliding_window_mask() -> None:
    m = masks.sliding_window_mask(4, 6, window=2, align="bottom_right")[0, 0]
    expected = torch.tensor([[not (0 <= (i + 2) - j < 2) for j in range(6)] for i in range(4)])
    assert torch.equal(m, expected)
    wide = masks.sliding_window_mask(4, 6, window=100, offset=1)
    assert torch.equal(wide, masks.causal_mask(4, 6, offset=1))
    with pytest.raises(ValueError, match="window must be a positive int, got 0"):
        masks.sliding_window_mask(4, window=0)


def test_combine() -> None:
    pad = masks.padding_mask(torch.tensor([2, 3]), 3)
    tri = masks.causal_mask(3)
    both = masks.combine(pad, None, tri)
    assert both is not None and both.shape == (2, 1, 3, 3)
    assert torch.equal(both, pad | tri)
    assert masks.combine(None, None) is None
    with pytest.raises(ValueError, match=r"do not broadcast together: shapes \[\(2, 1, 1, 3\)"):
        masks.combine(pad, masks.causal_mask(3, 4))
    with pytest.raises(TypeError, match=r"masks\[1\] must be a bool tensor"):
        masks.combine(pad, tri.float())
    with pytest.raises(ValueError, match=r"different devices: \['cpu', 'meta'\]"):
        masks.combine(tri, masks.causal_mask(3, device=torch.device("meta")))


# --- converters: round trips ----------------------------------------------------------------


def test_round_trips() -> None:
    blocked = torch.rand(B, H, T, S) > 0.5
    assert torch.equal(masks.from_sdpa_bool(masks.to_sdpa_bool(blocked)), blocked)
    # MHA's bool sense (True = ignore) is the opposite of SDPA's (True = may attend); a round
    # trip of the MHA pair would pass for any two inverse functions, so compare senses instead
    assert torch.equal(masks.to_mha_bool(blocked), ~masks.to_sdpa_bool(blocked))
    assert torch.equal(masks.from_mha_bool(blocked), masks.from_sdpa_bool(~blocked))
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        assert torch.equal(masks.from_additive(masks.to_additive(blocked, dtype)), blocked)
    pad = masks.padding_mask(torch.tensor([6, 2]), S)
    hf = masks.to_hf(pad)
    assert hf.dtype == torch.int64 and hf.shape == (B, S)
    assert torch.equal(masks.from_hf(hf), pad)
    assert torch.equal(masks.to_hf(masks.from_hf(hf)), hf)


def test_converter_errors() -> None:
    with pytest.raises(ValueError, match="score bias, not a mask"):
        masks.from_additive(torch.tensor([0.0, -1.5]))
    with pytest.raises(ValueError, match=r"only a key-padding mask \[B, 1, 1, S\]"):
        masks.to_hf(masks.causal_mask(3))
    with pytest.raises(TypeError, match="must be a bool tensor"):
        masks.to_sdpa_bool(torch.zeros(3))
    with pytest.raises(TypeError, match=r"needs a floating dtype .* got torch\.int64"):
        masks.to_additive(masks.causal_mask(3), torch.int64)
    with pytest.raises(ValueError, match=r"\[B \* H, T, S\] = \[4, T, S\], got \(3, 4, 6\)"):
        masks.from_mha_attn_mask(torch.zeros(3, 4, 6, dtype=torch.bool), 2, 2)


# --- converters against the real PyTorch APIs -----------------------------------------------


def test_sdpa_bool_and_additive_masks_in_torch_sdpa() -> None:
    q, k, v = _qkv()
    blocked = _blocked()
    out, _ = qkv.scaled_dot_product_attention(q, k, v, blocked)
    torch.testing.assert_close(
        F.scaled_dot_product_attention(q, k, v, attn_mask=masks.to_sdpa_bool(blocked)), out
    )
    torch.testing.assert_close(
        F.scaled_dot_product_attention(q, k, v, attn_mask=masks.to_additive(blocked)), out
    )
    sdpa_mask = torch.rand(B, H, T, S) > 0.3
    sdpa_mask[..., 0] = True  # every row attends somewhere
    torch.testing.assert_close(
        qkv.scaled_dot_product_attention(q, k, v, masks.from_sdpa_bool(sdpa_mask))[0],
        F.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_mask),
    )


def test_hf_mask_built_the_hf_way_in_torch_sdpa() -> None:
    q, k, v = _qkv()
    attention_mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]])  # 1 = keep
    dtype = q.dtype
    hf_additive = (1.0 - attention_mask[:, None, None, :].to(dtype)) * torch.finfo(dtype).min
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=hf_additive)
    out, _ = qkv.scaled_dot_product_attention(q, k, v, masks.from_hf(attention_mask))
    torch.testing.assert_close(out, ref)
    assert torch.equal(masks.from_additive(hf_additive), masks.from_hf(attention_mask))


@pytest.mark.parametrize("form", ["bool", "float"])
def test_mha_masks_in_nn_multihead_attention(form: str) -> None:
    torch_mha = nn.MultiheadAttention(D, H, batch_first=True).eval()
    mine = from_torch_mha(torch_mha).eval()
    x = torch.randn(B, T, D)
    blocked_pad = masks.padding_mask(torch.tensor([4, 2]), T)  # [B, 1, 1, T]
    blocked_causal = masks.causal_mask(T)  # [1, 1, T, T]
    kpm = masks.to_mha_bool(blocked_pad[:, 0, 0])  # [B, T], True = ignore
    am = masks.to_mha_bool(blocked_causal[0, 0])  # [T, T], True = ignore
    if form == "float":
        kpm, am = masks.to_additive(kpm), masks.to_additive(am)
    with torch.no_grad():
        ref, ref_w = torch_mha(x, x, x, key_padding_mask=kpm, attn_mask=am)
        out, w = mine(x, mask=masks.combine(blocked_pad, blocked_causal))
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(w, ref_w, atol=1e-6, rtol=1e-6)
    # and back: torch's own key_padding_mask (True = ignore), built by hand, reads as padding
    torch_kpm = torch.arange(T) >= torch.tensor([4, 2])[:, None]  # [B, T]
    assert torch.equal(masks.from_mha_bool(torch_kpm)[:, None, None, :], blocked_pad)
