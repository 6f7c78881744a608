"""Encoder/decoder layers: norm placement, RMSNorm, GQA, cache and bias pass-through."""

import pytest
import torch

from qkv import KVCache, MultiHeadAttention
from qkv.masks import padding_mask
from qkv.nn import DecoderLayer, EncoderLayer
from qkv.nn.positional import rotary_cos_sin

ATOL, RTOL = 1e-5, 1.3e-6


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


@pytest.mark.parametrize("norm_first", [False, True])
def test_rms_encoder_layer_matches_a_float64_recomputation(norm_first: bool) -> None:
    layer = EncoderLayer(8, 2, 16, 0.0, "swiglu", norm_first=norm_first, norm="rms").eval()
    x = torch.randn(2, 5, 8)
    mask = padding_mask(torch.tensor([5, 3]), 5)
    with torch.no_grad():
        got = layer(x, mask)
        ref = layer.double()
        x64 = x.double()

        def attn(h: torch.Tensor) -> torch.Tensor:
            return ref.self_attn(h, need_weights=False, mask=mask)[0]

        n1 = lambda h: _rms(h, ref.norm1.weight, 1e-5)  # noqa: E731
        n2 = lambda h: _rms(h, ref.norm2.weight, 1e-5)  # noqa: E731
        if norm_first:
            h = x64 + attn(n1(x64))
            expected = h + ref.ffn(n2(h))
        else:
            h = n1(x64 + attn(x64))
            expected = n2(h + ref.ffn(h))
    torch.testing.assert_close(got, expected.float(), atol=ATOL, rtol=RTOL)


def test_gqa_equals_mha_with_repeated_key_value_heads() -> None:
    D, H, Hkv = 16, 4, 2
    gqa = MultiHeadAttention(D, H, num_kv_heads=Hkv)
    mha = MultiHeadAttention(D, H)
    Dh = D // H
    with torch.no_grad():
        mha.q_proj.load_state_dict(gqa.q_proj.state_dict())
        mha.out_proj.load_state_dict(gqa.out_proj.state_dict())
        for full, shared in ((mha.k_proj, gqa.k_proj), (mha.v_proj, gqa.v_proj)):
            w = shared.weight.view(Hkv, Dh, D).repeat_interleave(H // Hkv, 0)  # [H, Dh, D]
            full.weight.copy_(w.reshape(D, D))
            full.bias.copy_(shared.bias.view(Hkv, Dh).repeat_interleave(H // Hkv, 0).reshape(D))
    x = torch.randn(2, 6, D)
    torch.testing.assert_close(
        gqa(x, is_causal=True)[0], mha(x, is_causal=True)[0], atol=ATOL, rtol=RTOL
    )
    assert gqa.k_proj.weight.shape == (Hkv * Dh, D)
    with pytest.raises(ValueError, match="num_kv_heads=3"):
        MultiHeadAttention(D, H, num_kv_heads=3)


def test_causal_encoder_layer_with_cache_and_rope_equals_full() -> None:
    layer = EncoderLayer(16, 4, 32, 0.0, "gelu", norm_first=True, num_kv_heads=2).eval()
    x = torch.randn(2, 7, 16)
    cos, sin = rotary_cos_sin(torch.arange(7), 4)
    with torch.no_grad():
        full = layer(x, is_causal=True, rope=(cos, sin))
        cache = KVCache(1, 7)
        parts = [layer(x[:, :4], is_causal=True, rope=(cos[:4], sin[:4]), kv_cache=cache)]
        for t in range(4, 7):
            rope = (cos[t : t + 1], sin[t : t + 1])
            parts.append(layer(x[:, t : t + 1], is_causal=True, rope=rope, kv_cache=cache))
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=ATOL, rtol=RTOL)


def test_decoder_layer_with_cache_equals_full() -> None:
    layer = DecoderLayer(16, 4, 32, 0.0).eval()
    x, memory = torch.randn(2, 5, 16), torch.randn(2, 6, 16)
    mem_mask = padding_mask(torch.tensor([6, 2]), 6)
    with torch.no_grad():
        full = layer(x, memory, None, mem_mask, tgt_is_causal=True)
        cache = KVCache(1, 5)
        step = {"tgt_is_causal": True, "kv_cache": cache}
        parts = [layer(x[:, t : t + 1], memory, None, mem_mask, **step) for t in range(5)]
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=ATOL, rtol=RTOL)
    cross = cache.get_cross(0)
    assert cross is not None and cross[0].shape == (2, 4, 6, 4)  # projected once, kept


def test_bias_passes_through_and_acts_like_a_soft_mask() -> None:
    layer = EncoderLayer(8, 2, 16, 0.0).eval()
    x = torch.randn(1, 4, 8)
    with torch.no_grad():
        torch.testing.assert_close(layer(x, attn_bias=torch.zeros(1, 2, 4, 4)), layer(x))
        huge = torch.zeros(1, 2, 4, 4)
        huge[..., 3] = -1e9
        torch.testing.assert_close(
            layer(x, attn_bias=huge),
            layer(x, padding_mask(torch.tensor([3]), 4)),
            atol=ATOL,
            rtol=RTOL,
        )


def test_dropout_only_in_training() -> None:
    layer = DecoderLayer(8, 2, 16, dropout=0.3)
    x, memory = torch.randn(2, 3, 8), torch.randn(2, 4, 8)
    assert not torch.equal(layer(x, memory), layer(x, memory))
    layer.eval()
    assert torch.equal(layer(x, memory), layer(x, memory))
