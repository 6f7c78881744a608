"""scaled_dot_product_attention against PyTorch's SDPA and a float64 recomputation."""

import torch
import torch.nn.functional as F

import qkv
from qkv.masks import causal_mask, combine, padding_mask, to_sdpa_bool


def test_matches_torch_sdpa_cross_attention_with_mask() -> None:
    q = torch.randn(2, 3, 4, 8)
    k = torch.randn(2, 3, 7, 8)
    v = torch.randn(2, 3, 7, 5)
    blocked = combine(
        padding_mask(torch.tensor([7, 5]), 7), causal_mask(4, 7, align="bottom_right")
    )
    assert blocked is not None
    out, weights = qkv.scaled_dot_product_attention(q, k, v, blocked)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=to_sdpa_bool(blocked))
    torch.testing.assert_close(out, ref)
    assert weights.shape == (2, 3, 4, 7)
    assert bool((weights[blocked.expand_as(weights)] == 0).all())
