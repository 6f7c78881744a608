"""Each seeded bug fails the property made to catch it, far above a bound measured on the model;
the properties it does not touch still pass."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

import qkv
from qkv.doctor.examination import Examination
from qkv.doctor.examine import examine

# bug -> the property that must catch it (others may fail too where the bug reaches them)
CATCHES = {
    "off_by_one": "causality",
    "unshifted_positions": "padding_invariance",
    "dropped_mask": "pad_value_invariance",
    "broadcast_mask": "batch_invariance",
    "nan_rows": "finite_gradients",
}
# properties each plain bug leaves alone (they must still pass: no false alarm beside the bug)
UNTOUCHED = {
    "off_by_one": ("batch_invariance", "padding_invariance", "pad_value_invariance"),
    "unshifted_positions": ("batch_invariance", "pad_value_invariance", "causality"),
    "dropped_mask": ("batch_invariance", "causality", "finite_gradients"),
    "broadcast_mask": ("causality", "finite_gradients"),
    "nan_rows": ("batch_invariance", "padding_invariance", "pad_value_invariance", "causality"),
}


def _far_above(e: Examination, name: str) -> None:
    p = e[name]
    assert p.passed is False, str(e)
    assert p.bound is not None and p.error is not None
    if name != "finite_gradients":  # counts non-finite values against an exact bound of 0
        assert p.error > 1e4 * p.bound.value, str(e)


@pytest.mark.parametrize("bug", list(CATCHES))
def test_plain_bug_fails_its_property(bug: str, tiny_lm, batch: tuple[Tensor, Tensor]) -> None:  # type: ignore[no-untyped-def]
    e = examine(tiny_lm(bug), *batch, kind="causal-lm")
    _far_above(e, CATCHES[bug])
    for name in UNTOUCHED[bug]:
        assert e[name].passed is True, f"{name}\n{e}"


def test_nan_rows_names_a_padded_position(tiny_lm, batch: tuple[Tensor, Tensor]) -> None:  # type: ignore[no-untyped-def]
    p = examine(tiny_lm("nan_rows"), *batch, kind="causal-lm")["finite_gradients"]
    assert "(padding)" in p.detail and "output of embed" in p.detail


def test_attention_function_that_ignores_its_mask(hf_model, registered, batch) -> None:  # type: ignore[no-untyped-def]
    model = hf_model("llama")
    model.set_attn_implementation(registered[0])
    e = examine(model, *batch)
    _far_above(e, "implementation_equivalence")
    _far_above(e, "pad_value_invariance")  # the padding it attends to changes its outputs
    assert e["causality"].passed is True
    assert model.config._attn_implementation == registered[0]  # restored


def test_top_left_causal_cache_fails_cache_equivalence(hf_model, registered, batch) -> None:  # type: ignore[no-untyped-def]
    model = hf_model("llama")
    model.set_attn_implementation(registered[1])
    e = examine(model, *batch)
    _far_above(e, "cache_equivalence")
    assert e["causality"].passed is True


class DriftingCache(qkv.KVCache):
    """Keeps keys and values in bfloat16: every cached step reads rounded keys."""

    def update(self, layer_idx: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return super().update(layer_idx, k.bfloat16().to(k.dtype), v.bfloat16().to(v.dtype))


class DriftingLM(qkv.DecoderOnlyLM):
    def new_cache(self, capacity: int | None = None) -> qkv.KVCache:
        return DriftingCache(self.config.num_layers, capacity or self.config.max_positions)


def test_drifting_kv_cache_fails_cache_equivalence_only(batch) -> None:  # type: ignore[no-untyped-def]
    cfg = qkv.DecoderOnlyConfig(100, num_layers=2, d_model=32, num_heads=4, dim_feedforward=64)
    e = examine(DriftingLM(cfg), *batch)
    p = e["cache_equivalence"]
    assert p.passed is False and p.bound is not None and p.error is not None
    assert p.error > 100 * p.bound.value, str(e)  # bfloat16 keys: ~1e-3 against ~1e-7
    assert e.failed == ["cache_equivalence"], str(e)


def test_a_model_that_raises_fails_every_property_without_crashing(batch) -> None:  # type: ignore[no-untyped-def]
    def broken(input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        raise RuntimeError("shape mismatch in layer 3")

    e = examine(broken, *batch, kind="causal-lm")
    assert not e.passed
    applicable = [p for p in e.properties.values() if p.passed is not None]
    assert applicable and all(p.passed is False for p in applicable)
    assert all("shape mismatch in layer 3" in p.detail for p in applicable)


def test_a_model_that_returns_nan_for_padded_batches_fails_with_the_place(tiny_lm, batch) -> None:  # type: ignore[no-untyped-def]
    clean = tiny_lm()

    def nan_when_padded(input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        out = clean(input_ids, attention_mask)
        if attention_mask is not None and not bool(attention_mask.all()):
            out = out.clone()
            out[:, -1] = math.nan
        return out

    e = examine(nan_when_padded, *batch, kind="causal-lm")
    p = e["padding_invariance"]
    assert p.passed is False and p.error is not None and math.isnan(p.error)
    assert "non-finite output" in p.detail
    assert "nan" in str(e)


def test_wrong_output_shape_fails_with_a_clear_message(batch) -> None:  # type: ignore[no-untyped-def]
    e = examine(lambda ids, attention_mask=None: torch.zeros(2), *batch, kind="encoder")
    assert "expected [B, T, ...]" in e["batch_invariance"].detail
