"""Each seeded bug is caught with the right kind, at the right module; the clean layer is not."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from buggy import BUGS, CachedStep, Tiny, attention_mask
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from qkv import doctor

EXPECTED = {
    "inverted": ("inverted_mask", "error"),
    "fp16_nan": ("nonfinite_mask", "error"),
    "weak": ("weak_mask", "error"),
    "broadcast": ("mask_broadcast", "error"),
    "dropped": ("padding_leak", "error"),
    "off_by_one": ("all_blocked_rows", "error"),
    "nan_value": ("nonfinite_output", "error"),
    "dense_causal": ("hint", "hint"),
}


def _watch(bug: str | None) -> doctor.Report:
    model = Tiny(bug)
    ids = torch.randint(0, 50, (3, 3), generator=torch.Generator().manual_seed(0))
    with doctor.watch(model) as report:
        model(ids, attention_mask=attention_mask())
    return report


@pytest.mark.parametrize("bug", BUGS)
def test_each_bug_is_found_at_its_layer(bug: str) -> None:
    report = _watch(bug)
    kind, severity = EXPECTED[bug]
    found = report.by_kind(kind)
    assert found, f"{bug}: expected {kind}, got\n{report}"
    assert found[0].severity == severity
    assert found[0].where.startswith("layers.1 (buggy.py:"), found[0].where
    assert all(f.where.startswith("layers.1 ") for f in report.findings), str(report)
    assert report.ok == (severity == "hint")
    assert report.unread == []


def test_the_clean_model_has_no_finding() -> None:
    report = _watch(None)
    assert report.calls == 2 and report.findings == [] and report.ok, str(report)


def test_is_causal_with_a_cache_is_misaligned_and_an_empty_cache_is_not() -> None:
    q = torch.randn(1, 2, 2, 8)
    filled = torch.randn(1, 2, 6, 8)
    with doctor.watch(CachedStep()) as report:
        CachedStep()(q, filled, filled)
    (f,) = report.findings
    assert (f.kind, f.severity) == ("causal_misaligned", "error")
    assert f.evidence["T"] == 2 and f.evidence["S"] == 6
    empty = torch.cat([torch.randn(1, 2, 2, 8), torch.zeros(1, 2, 4, 8)], 2)  # prefill slots
    with doctor.watch() as report:
        CachedStep()(q, empty, empty)
    assert report.findings == [], str(report)


def test_nn_multihead_attention_nan_rows_are_found() -> None:
    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(2, 4, 8)
    padding = torch.tensor([[False] * 4, [True] * 4])  # sample 1 is all padding
    with doctor.watch(mha) as report:
        out, _ = mha(x, x, x, key_padding_mask=padding)
    assert bool(out[1].isnan().all())
    (f,) = report.findings
    assert (f.kind, f.where.split(" ")[0]) == ("all_blocked_rows", "MultiheadAttention")
    assert f.evidence["rows"] == 4


def test_a_mask_without_the_models_padding_is_judged_on_its_own() -> None:
    """No model given: an inverted [B, 1, 1, S] padding mask still shows, as a warning (a
    sample without padding has every key blocked; SDPA returns finite values there)."""
    q = torch.randn(2, 2, 4, 8)
    keep = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]]).bool()
    with doctor.watch() as report:
        torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=~keep[:, None, None])
    (f,) = report.findings
    assert (f.kind, f.severity) == ("all_blocked_rows", "warning")
    assert "inverted" in f.message and f.evidence["sample"] == 0


class _Flex(torch.nn.Module):
    """Bidirectional flex attention whose ``mask_mod`` may forget the padding."""

    def __init__(self, uses_padding: bool) -> None:
        super().__init__()
        self.uses_padding = uses_padding

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        lengths = attention_mask.sum(1)

        def keep(b: Any, h: Any, q: Any, k: Any) -> Any:
            return k < lengths[b] if self.uses_padding else k >= 0

        B, _, T, _ = x.shape
        block_mask = create_block_mask(keep, B, 1, T, T, device="cpu")
        return flex_attention(x, x, x, block_mask=block_mask)


@pytest.mark.parametrize("uses_padding", [True, False])
def test_flex_attention_mask_mod_is_read(uses_padding: bool) -> None:
    x = torch.randn(2, 2, 128, 8)
    mask = (torch.arange(128)[None] < torch.tensor([[128], [60]])).long()
    model = _Flex(uses_padding)
    with torch.no_grad():
        unwatched = model(x, mask)
        with doctor.watch(model) as report:
            watched = model(x, mask)
    assert torch.equal(unwatched, watched) and report.calls == 1 and report.unread == []
    if uses_padding:
        assert report.findings == [], str(report)
    else:
        (f,) = report.findings
        assert (f.kind, f.where.split(" ")[0]) == ("padding_leak", "_Flex")
        assert "test_watch_bugs.py" in f.where


class _Mixing(torch.nn.Module):
    """Masks laid out across the batch: a [B*H] mask built with repeat, a [B, T, S] to SDPA."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.mha = torch.nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        pad = attention_mask == 0  # [B, S], True = padding
        B, T = pad.shape
        per_query = pad[:, None, :].expand(B, T, T)  # [B, T, S]
        if self.how == "repeat":  # nn.MultiheadAttention wants index b * H + h
            return self.mha(x, x, x, attn_mask=per_query.repeat(2, 1, 1))[0]
        q = x.view(B, T, 2, 4).transpose(1, 2)  # [B, H, T, Dh]
        return F.scaled_dot_product_attention(q, q, q, attn_mask=~per_query)  # read as [H, T, S]


@pytest.mark.parametrize("how", ["repeat", "three_d"])
def test_a_mask_laid_out_across_the_batch_is_mask_broadcast(how: str) -> None:
    model = _Mixing(how)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])  # B == H == 2
    with torch.no_grad(), doctor.watch(model) as report:
        model(torch.randn(2, 4, 8), mask)
    found = report.by_kind("mask_broadcast")
    assert found, str(report)
    assert found[0].evidence["mask_of_sample"] == 1 and found[0].evidence["sample"] == 0
