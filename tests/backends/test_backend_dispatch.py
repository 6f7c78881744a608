"""auto picks a backend from facts about the call and says why; forced backends never switch."""

import pytest
import torch

import qkv
from qkv.masks import Causal, MaskMod, Padding, SlidingWindow


def _qkv(T: int, S: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    # Expanded views: explain_backend computes nothing, so big lengths cost no memory here.
    return (
        torch.zeros(1, 1, 1, 1, dtype=dtype).expand(1, 8, T, 64),
        torch.zeros(1, 1, 1, 1, dtype=dtype).expand(1, 8, S, 64),
        torch.zeros(1, 1, 1, 1, dtype=dtype).expand(1, 8, S, 64),
    )


def test_weights_need_reference() -> None:
    why = qkv.explain_backend(*_qkv(8, 8), mask=Causal(), need_weights=True)
    assert why.startswith("reference:") and "weights" in why


def test_dense_goes_fused_and_sdpa_causal_only_when_square() -> None:
    assert qkv.explain_backend(*_qkv(64, 64)).startswith("fused:")
    assert "SDPA's own causal kernel" in qkv.explain_backend(*_qkv(64, 64), is_causal=True)
    small = qkv.explain_backend(*_qkv(4, 64), is_causal=True)
    assert small.startswith("fused:") and "bottom-right causal mask is materialized" in small


def test_large_structured_masks_go_blockwise_with_the_skipped_fraction() -> None:
    why = qkv.explain_backend(*_qkv(4096, 4096), mask=Causal())
    assert why.startswith("blockwise:") and "fully masked" in why
    why = qkv.explain_backend(*_qkv(16384, 16384), mask=SlidingWindow(256))
    assert why.startswith("blockwise:") and "materializing" in why
    why = qkv.explain_backend(*_qkv(2048, 2048), mask=MaskMod(lambda b, h, q, k: q >= k))
    assert why.startswith("blockwise:") and "mask_mod" in why


def test_dense_structured_mask_is_materialized_for_fused_and_says_so() -> None:
    why = qkv.explain_backend(*_qkv(2048, 2048), mask=Padding(torch.tensor([2000])))
    assert why.startswith("fused:") and "materialized" in why
    half = qkv.explain_backend(*_qkv(64, 64, torch.float16), mask=Causal())
    assert "upcast to float32" in half and "materialized" in half


def test_forced_backend_that_cannot_serve_raises_and_explains() -> None:
    q, k, v = (torch.randn(1, 2, 4, 8) for _ in range(3))
    for backend in ("fused", "blockwise"):
        why = qkv.explain_backend(q, k, v, need_weights=True, backend=backend)  # type: ignore[arg-type]
        assert why.startswith("no backend:") and "cannot return weights" in why
        with pytest.raises(ValueError, match="cannot return weights"):
            qkv.attention(q, k, v, need_weights=True, backend=backend)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="backend must be one of"):
        qkv.attention(q, k, v, backend="flash")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="block_q"):
        qkv.attention(q, k, v, backend="blockwise", block_q=0)


def test_structured_mask_that_does_not_fit_is_refused() -> None:
    q, k, v = (torch.randn(2, 2, 4, 8) for _ in range(3))
    with pytest.raises(ValueError, match="Padding lengths"):
        qkv.attention(q, k, v, mask=Padding(torch.tensor([4])))


@pytest.mark.parametrize("backend", ["fused", "blockwise"])
def test_multihead_passes_its_backend(backend: str) -> None:
    mha = qkv.MultiHeadAttention(16, 4, num_kv_heads=2, backend=backend)  # type: ignore[arg-type]
    assert mha.backend == backend
    x = torch.randn(2, 5, 16)
    with pytest.raises(ValueError, match="weights"):
        mha(x, need_weights=True)  # only the reference backend returns weights
    out, weights = mha(x, need_weights=False, is_causal=True)
    assert weights is None
    mha.backend = "reference"
    ref, _ = mha(x, need_weights=False, is_causal=True)
    torch.testing.assert_close(out, ref)
