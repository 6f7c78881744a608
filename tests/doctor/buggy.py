"""Seeded-bug models for the doctor: each makes one of the attention bugs people report.

``Tiny(bug)`` is a plain PyTorch model of two attention layers calling
``F.scaled_dot_product_attention``; its ``bug`` names what its layer 1 (``layers.1``) gets
wrong. Layer 0 is always right, so a finding must name ``layers.1``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

B, T, D, H = 3, 3, 16, 2
LENGTHS = (3, 2, 1)  # B == T: a [B, S] mask read as [T, S] broadcasts silently
BUGS = (
    "inverted",
    "fp16_nan",
    "weak",
    "broadcast",
    "dropped",
    "off_by_one",
    "nan_value",
    "dense_causal",
)


def attention_mask() -> Tensor:
    """``[B, T]`` Hugging Face convention, 1 = token, right padded."""
    return (torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None]).long()


class Layer(nn.Module):
    def __init__(self, bug: str | None) -> None:
        super().__init__()
        self.bug = bug
        self.qkv = nn.Linear(D, 3 * D)

    def forward(self, x: Tensor, attention_mask: Tensor) -> Tensor:
        q, k, v = self.qkv(x).view(B, T, 3, H, D // H).permute(2, 0, 3, 1, 4)  # [B, H, T, Dh]
        keep = attention_mask.bool()  # [B, S]
        causal = torch.ones(T, T, dtype=torch.bool).tril()  # [T, S] True = attend
        mask: Tensor | None = keep[:, None, None, :] & causal  # [B, 1, T, S]
        if self.bug == "inverted":  # nn.MultiheadAttention's sense given to SDPA
            mask = ~mask
        elif self.bug == "fp16_nan":  # 0 * -inf = NaN
            mask = ((~mask).half() * float("-inf")).float()
        elif self.bug == "weak":  # -1 does not block at this scale
            q = q * 40
            mask = (~mask).float() * -1.0
        elif self.bug == "broadcast":  # [B, S] read as [T, S]
            mask = keep
        elif self.bug == "dropped":  # (a right-padded causal layer would not leak)
            mask = None
        elif self.bug == "off_by_one":  # query t may not see itself: row 0 sees nothing
            mask = keep[:, None, None, :] & torch.ones(T, T, dtype=torch.bool).tril(-1)
        elif self.bug == "nan_value":
            v = v.clone()
            v[:, :, -1] = float("nan")  # a padding position of sample 1 and 2 holds NaN
        elif self.bug == "dense_causal":  # correct but slow: a dense causal mask
            mask = causal.expand(B, 1, T, T)
            x = x.clone()
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, H, T, Dh]
        return out.transpose(1, 2).reshape(B, T, D)


class Tiny(nn.Module):
    """Two layers; ``layers.1`` has the bug."""

    def __init__(self, bug: str | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(50, D)
        self.layers = nn.ModuleList([Layer(None), Layer(bug)])

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        x = self.embed(input_ids)  # [B, T, D]
        for layer in self.layers:
            x = x + layer(x, attention_mask)
        return x


class CachedStep(nn.Module):
    """A decode step with a KV cache that passes ``is_causal=True`` (PyTorch aligns top-left)."""

    def forward(self, q: Tensor, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        return F.scaled_dot_product_attention(q, k_cache, v_cache, is_causal=True)
