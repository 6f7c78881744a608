"""Blockwise's two masking paths and its grouped-query matmuls, against the float64 reference.

With every input finite, blockwise masks a tile by adding -inf and leaves keys that a tile
blocks for every row alone; otherwise it fills blocked scores with -inf and zeroes those keys,
so a NaN or inf at a blocked position reaches no output. Grouped-query keys are never
repeated: each key head meets its query heads' rows in one matmul.
"""

import pytest
import torch

import qkv
from qkv.backends import blockwise
from qkv.masks import Causal, MaskMod

B, H, HKV, T, S, DH, DV = 2, 4, 2, 8, 8, 8, 5
TOL = {"atol": 1e-5, "rtol": 1.3e-6}


def _inputs(h: int = H, hkv: int = HKV) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [
        torch.randn(B, h, T, DH, generator=g),
        torch.randn(B, hkv, S, DH, generator=g),
        torch.randn(B, hkv, S, DV, generator=g),
    ]


def _out_and_grads(
    backend: str, inputs: list[torch.Tensor], **kw: object
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    leaves = [x.detach().requires_grad_() for x in inputs]
    out, _ = qkv.attention(*leaves, backend=backend, **kw)  # type: ignore[arg-type]
    d_out = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)
    return out, torch.autograd.grad(out, leaves, d_out)


def _first_two_heads_skip_key_2(
    b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor
) -> torch.Tensor:
    """Query heads 0 and 1 (key head 0's group) never see key 2; the others see every key."""
    return ~((h < 2) & (kv == 2)) & (q >= 0)


@pytest.mark.parametrize("finite", [True, False])
@pytest.mark.parametrize("name", ["causal", "head_mask"])
def test_both_masking_paths_match_the_reference(
    monkeypatch: pytest.MonkeyPatch, finite: bool, name: str
) -> None:
    """The same finite inputs through either path (the safe one forced) give the reference."""
    monkeypatch.setattr(blockwise, "_finite_inputs", lambda *a: finite)
    mask = Causal() if name == "causal" else MaskMod(_first_two_heads_skip_key_2)
    inputs = _inputs()
    kw: dict[str, object] = {"mask": mask, "block_q": 3, "block_k": 4}
    out, grads = _out_and_grads("blockwise", inputs, **kw)
    want, want_grads = _out_and_grads("reference", [x.double() for x in inputs], mask=mask)
    torch.testing.assert_close(out, want.float(), **TOL)
    for g, w in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g, w.float(), **TOL)


def test_a_nan_future_key_inside_a_partial_tile_reaches_only_later_rows() -> None:
    """Key 5 is NaN; under Causal rows 0-4 never see it, though the 4 x 4 tile holding rows
    4-7 and keys 4-7 is only partly blocked (no key of it is dead for the whole tile).

    Only the output is clean: row 4's dq is ``0 · NaN`` through key 5, as in the reference
    and SDPA (a key is zeroed only where a whole tile blocks it, as padding does).
    """
    q, k, v = _inputs()
    k = k.clone()
    k[:, :, 5] = float("nan")
    out, _ = qkv.attention(q, k, v, mask=Causal(), backend="blockwise", block_q=4, block_k=4)
    want, _ = qkv.attention(*[x.double() for x in _inputs()], mask=Causal(), backend="reference")
    torch.testing.assert_close(out[:, :, :5], want[:, :, :5].float(), **TOL)
    assert out[:, :, 5:].isnan().all()  # the NaN is real data for them


def test_a_nan_key_hidden_from_its_whole_group_never_leaks() -> None:
    """Key 2 of key head 0 is NaN, and the mask hides key 2 from both query heads of that
    group (only): every output and gradient is the reference's on clean inputs, except dk and
    dv of the hidden key, which are 0."""
    q, k, v = _inputs()
    k, v = k.clone(), v.clone()
    k[:, 0, 2] = float("nan")
    v[:, 0, 2] = float("inf")
    mask = MaskMod(_first_two_heads_skip_key_2)
    out, grads = _out_and_grads("blockwise", [q, k, v], mask=mask, block_q=4, block_k=4)
    want, want_grads = _out_and_grads("reference", [x.double() for x in _inputs()], mask=mask)
    torch.testing.assert_close(out, want.float(), **TOL)
    for g, w in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g, w.float(), **TOL)


def test_grouped_keys_are_not_repeated(monkeypatch: pytest.MonkeyPatch) -> None:
    """Blockwise never builds [B, H, S, ·] keys for grouped-query attention."""
    seen: list[tuple[int, ...]] = []
    real = blockwise._BlockwiseFunction.apply

    def spy(q: torch.Tensor, k: torch.Tensor, *rest: object) -> object:
        seen.append(tuple(k.shape))
        return real(q, k, *rest)

    monkeypatch.setattr(blockwise._BlockwiseFunction, "apply", spy)
    q, k, v = _inputs()
    qkv.attention(q, k, v, mask=Causal(), backend="blockwise")
    assert seen == [(B, HKV, S, DH)]


def test_strided_inputs_match_the_reference() -> None:
    """Inputs in [B, T, H, D] memory, transposed to [B, H, T, D] (as projections give them)."""
    g = torch.Generator().manual_seed(4)
    q = torch.randn(B, T, H, DH, generator=g).transpose(1, 2)
    k = torch.randn(B, S, HKV, DH, generator=g).transpose(1, 2)
    v = torch.randn(B, S, HKV, DV, generator=g).transpose(1, 2)
    out, grads = _out_and_grads("blockwise", [q, k, v], mask=Causal(), block_q=3, block_k=5)
    want, want_grads = _out_and_grads("reference", [x.double() for x in (q, k, v)], mask=Causal())
    torch.testing.assert_close(out, want.float(), **TOL)
    for g_, w in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g_, w.float(), **TOL)
