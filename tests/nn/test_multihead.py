"""MultiHeadAttention: construction errors, self/cross attention, GQA, gradcheck."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

import qkv
from qkv import masks
from qkv.masks import SlidingWindow
from qkv.nn.multihead import MultiHeadAttention
from reference_f64 import attention_f64


def test_embed_dim_not_divisible_names_the_numbers() -> None:
    with pytest.raises(ValueError, match=r"embed_dim=10 is not divisible by num_heads=3"):
        MultiHeadAttention(10, 3)


def test_num_heads_not_divisible_by_kv_heads() -> None:
    with pytest.raises(ValueError, match=r"num_heads=4 is not divisible by num_kv_heads=3"):
        MultiHeadAttention(8, 4, num_kv_heads=3)


def test_bad_input_width_is_rejected() -> None:
    mha = MultiHeadAttention(8, 2, kdim=5)
    with pytest.raises(ValueError, match=r"key must be \[B, L, D\] with D=5, got \(2, 3, 8\)"):
        mha(torch.randn(2, 4, 8), torch.randn(2, 3, 8))


def _projected(mha: MultiHeadAttention, x: Tensor, src: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Queries (from ``x``), keys and values (from ``src``) projected by hand in float64, split
    into heads: ``[B, H, T, Dh]``, ``[B, H, S, Dh]`` twice."""
    H, Dh = mha.num_heads, mha.head_dim
    q = (x @ mha.q_proj.weight.T + mha.q_proj.bias).double()  # [B, T, D]
    k = (src @ mha.k_proj.weight.T + mha.k_proj.bias).double()  # [B, S, D]
    v = (src @ mha.v_proj.weight.T + mha.v_proj.bias).double()  # [B, S, D]
    q, k, v = (t.unflatten(-1, (H, Dh)).transpose(1, 2) for t in (q, k, v))  # [B, H, L, Dh]
    return q, k, v


def _manual(mha: MultiHeadAttention, x: Tensor, src: Tensor, blocked: Tensor | None) -> Tensor:
    """Projections spelled out, the heads split by hand, attention by the float64 formula."""
    heads, _ = attention_f64(*_projected(mha, x, src), blocked)  # [B, H, T, Dh]
    merged = heads.transpose(1, 2).flatten(2)  # [B, T, D]
    return merged @ mha.out_proj.weight.T.double() + mha.out_proj.bias.double()


@pytest.mark.parametrize("batch_first", [True, False])
def test_self_and_cross_attention_match_manual_computation(batch_first: bool) -> None:
    mha = MultiHeadAttention(8, 2, kdim=5, vdim=5, batch_first=batch_first).eval()
    x = torch.randn(2, 3, 8)
    src = torch.randn(2, 7, 5)
    blocked = masks.padding_mask(torch.tensor([7, 4]), 7)
    args = (x, src, src) if batch_first else (x.transpose(0, 1), src.transpose(0, 1))
    with torch.no_grad():
        out, w = mha(*args, mask=blocked, average_attn_weights=False)
        ref = _manual(mha, x, src, blocked)
    assert w is not None and w.shape == (2, 2, 3, 7)
    got = out if batch_first else out.transpose(0, 1)
    torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1.3e-6)
    self_mha = MultiHeadAttention(8, 2).eval()
    with torch.no_grad():
        out_self, _ = self_mha(x)  # key = value = query
        torch.testing.assert_close(
            out_self.double(), _manual(self_mha, x, x, None), atol=1e-5, rtol=1.3e-6
        )


def test_gqa_with_as_many_kv_heads_equals_standard() -> None:
    standard = MultiHeadAttention(8, 4).eval()
    gqa = MultiHeadAttention(8, 4, num_kv_heads=4).eval()
    gqa.load_state_dict(standard.state_dict())
    x = torch.randn(2, 5, 8)
    tri = masks.causal_mask(5)
    with torch.no_grad():
        a, wa = standard(x, mask=tri, average_attn_weights=False)
        b, wb = gqa(x, mask=tri, average_attn_weights=False)
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    torch.testing.assert_close(wa, wb, atol=0, rtol=0)


def test_gqa_equals_standard_with_repeated_kv_projections() -> None:
    H, Hkv, Dh = 4, 2, 3
    gqa = MultiHeadAttention(H * Dh, H, num_kv_heads=Hkv).eval()
    standard = MultiHeadAttention(H * Dh, H).eval()
    state = dict(gqa.state_dict())
    for name in ("k_proj", "v_proj"):  # head h of the standard module uses kv head h // 2
        w = state[f"{name}.weight"].view(Hkv, Dh, -1).repeat_interleave(H // Hkv, dim=0)
        state[f"{name}.weight"] = w.reshape(H * Dh, -1)
        state[f"{name}.bias"] = state[f"{name}.bias"].view(Hkv, Dh).repeat_interleave(2, dim=0)
        state[f"{name}.bias"] = state[f"{name}.bias"].reshape(-1)
    standard.load_state_dict(state)
    x = torch.randn(2, 5, H * Dh)
    with torch.no_grad():
        torch.testing.assert_close(gqa(x, is_causal=True)[0], standard(x, is_causal=True)[0])


def test_fully_padded_sample_gives_zero_attention() -> None:
    mha = MultiHeadAttention(8, 2, bias=False).eval()
    x = torch.randn(2, 4, 8)
    kpm = torch.tensor([[False, False, True, True], [True, True, True, True]])  # sample 1 all pad
    with torch.no_grad():
        out, w = mha(x, key_padding_mask=kpm)
    assert w is not None and bool((w[1] == 0).all()) and bool((out[1] == 0).all())
    assert torch.isfinite(out).all()


def test_record_weights_keeps_per_head_weights() -> None:
    mha = MultiHeadAttention(8, 2).eval()
    mha.record_weights = True
    x, y = torch.randn(2, 3, 8), torch.randn(2, 3, 8)
    for inp in (x, y):  # each forward replaces the record with its own weights
        _, w = mha(inp, need_weights=False)
        assert w is None
        kept = mha.last_weights
        assert kept is not None and not kept.requires_grad
        _, want = attention_f64(*_projected(mha, inp, inp))  # [B, H, T, S]
        torch.testing.assert_close(kept.double(), want, atol=1e-6, rtol=1e-6)


def test_dropout_only_in_training() -> None:
    mha = MultiHeadAttention(8, 2, dropout=0.5)
    x = torch.randn(2, 6, 8)
    mha.eval()
    with torch.no_grad():
        torch.testing.assert_close(mha(x)[0], mha(x)[0], atol=0, rtol=0)
        mha.train()
        _, w = mha(x, average_attn_weights=False)
    assert w is not None and bool((w == 0).any())


def test_gradcheck_module_float64() -> None:
    mha = MultiHeadAttention(6, 2, kdim=4, vdim=3, dtype=torch.float64).eval()
    x = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    src = torch.randn(2, 4, 4, dtype=torch.float64, requires_grad=True)
    val = torch.randn(2, 4, 3, dtype=torch.float64, requires_grad=True)
    kpm = torch.tensor([[False, False, False, True], [True, True, True, True]])  # sample 1 dead

    def fn(x: Tensor, src: Tensor, val: Tensor, wq: Tensor) -> Tensor:
        out, _ = torch.func.functional_call(
            mha, {"q_proj.weight": wq}, (x, src, val), {"key_padding_mask": kpm}
        )
        return out

    wq = mha.q_proj.weight.detach().clone().requires_grad_()
    assert torch.autograd.gradcheck(fn, (x, src, val, wq))


def test_module_uses_qkv_attention() -> None:
    """The module only projects and reshapes: its heads equal qkv.attention on the projections."""
    mha = MultiHeadAttention(8, 2).eval()
    x = torch.randn(1, 4, 8)
    with torch.no_grad():
        _, w = mha(x, is_causal=True, average_attn_weights=False)
        q = mha.q_proj(x).view(1, 4, 2, 4).transpose(1, 2)
        k = mha.k_proj(x).view(1, 4, 2, 4).transpose(1, 2)
        _, ref_w = qkv.attention(q, k, k, is_causal=True, need_weights=True)
    torch.testing.assert_close(w, ref_w)


@pytest.mark.parametrize("backend", ["reference", "fused", "blockwise"])
def test_structured_mask_joins_pytorch_style_masks(backend: str) -> None:
    """A structured mask keeps its structure and ORs with key_padding_mask, on every backend."""
    B, T, D, H = 2, 7, 16, 4
    mha = MultiHeadAttention(D, H, backend=backend).eval()  # type: ignore[arg-type]
    x = torch.randn(B, T, D)
    key_padding = torch.tensor([[False] * 7, [False] * 5 + [True] * 2])  # [B, S], True = ignore
    window = SlidingWindow(3)
    dense = window.materialize(B, H, T, T) | key_padding[:, None, None, :]  # [B, 1, T, S]
    out, _ = mha(x, key_padding_mask=key_padding, mask=window, need_weights=False)
    mha.backend = "reference"
    ref, _ = mha(x, mask=dense, need_weights=False)
    torch.testing.assert_close(out, ref)
