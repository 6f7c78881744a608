"""The examination as an object (table, JSON, verdicts), what examine leaves on the model, the
texts helper, the argument checks and the bound's provenance."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from torch import Tensor

from qkv.doctor.batches import Samples
from qkv.doctor.examination import PROPERTIES, Bound, Examination, Property
from qkv.doctor.examine import examine, examine_texts
from qkv.doctor.probes import adapter_for


@pytest.fixture(scope="module")
def buggy(tiny_lm, batch: tuple[Tensor, Tensor]) -> Examination:  # type: ignore[no-untyped-def]
    return examine(tiny_lm("off_by_one"), *batch, kind="causal-lm")


def test_table_names_every_property_its_result_and_the_bound_source(buggy: Examination) -> None:
    text = str(buggy)
    for name in PROPERTIES:
        assert name in text
    assert "FAIL" in text and "pass" in text and "n/a" in text
    assert "bound of batch_invariance, padding_invariance, pad_value_invariance: 2 x " in text
    assert "vs the model in float64" in text
    assert "bound of causality: " in text and "each run's own rounding" in text
    assert text.splitlines()[-1] == "examination FAILED: causality"
    assert buggy.failed == ["causality"] and buggy.passed is False


def test_json_is_strict_and_complete(buggy: Examination) -> None:
    data = json.loads(buggy.to_json())
    assert data["passed"] is False
    assert list(data["properties"]) == list(PROPERTIES)
    causal = data["properties"]["causality"]
    assert causal["passed"] is False and causal["error"] > causal["bound"]["value"]
    assert data["properties"]["cache_equivalence"] == {
        "passed": None,
        "error": None,
        "bound": None,
        "detail": "a plain callable takes no cache",
    }
    assert set(data["seconds"]) == {"reference", *PROPERTIES}


def test_non_finite_numbers_serialise_as_strings() -> None:
    p = Property(False, math.nan, Bound(math.inf, "x"), "non-finite output")
    e = Examination({"causality": p})
    data = json.loads(e.to_json())["properties"]["causality"]
    assert data["error"] == "nan" and data["bound"]["value"] == "inf"
    assert "nan" in str(e)


def test_property_is_frozen_and_none_does_not_fail() -> None:
    p = Property(None, None, None, "does not apply")
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.passed = True  # type: ignore[misc]
    assert Examination({"causality": p}).passed is True


def test_model_state_is_restored(hf_model, batch: tuple[Tensor, Tensor]) -> None:  # type: ignore[no-untyped-def]
    model = hf_model("gpt2").train()
    model.set_attn_implementation("eager")
    model.transformer.h[0].attn.c_attn.weight.requires_grad_(False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    examine(model, *batch)
    assert model.training and all(m.training for m in model.modules())
    assert model.config._attn_implementation == "eager"
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags
    assert all(p.grad is None for p in model.parameters())
    for k, v in model.state_dict().items():
        assert v.dtype == before[k].dtype and torch.equal(v, before[k]), k


class _Tokenizer:
    """A tokenizer with no pad token (as GPT-2's): ids are characters' codes."""

    pad_token_id = None
    eos_token_id = 2
    padding_side = "left"

    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": [3 + ord(c) % 90 for c in text]}


def test_examine_texts_pads_with_eos_on_the_tokenizers_side(tiny_lm) -> None:  # type: ignore[no-untyped-def]
    e = examine_texts(tiny_lm(), _Tokenizer(), ["hello there", "hi"], kind="causal-lm")
    assert e.passed and e["padding_invariance"].passed is True
    with pytest.raises(TypeError, match="sequence of strings"):
        examine_texts(tiny_lm(), _Tokenizer(), "hello", kind="causal-lm")
    with pytest.raises(ValueError, match="gives no token"):
        examine_texts(tiny_lm(), _Tokenizer(), ["hello", ""], kind="causal-lm")
    with pytest.raises(ValueError, match="at least one"):
        examine_texts(tiny_lm(), _Tokenizer(), [], kind="causal-lm")


def test_single_text_gets_a_second_sample(tiny_lm) -> None:  # type: ignore[no-untyped-def]
    e = examine(tiny_lm(), torch.arange(5, 15)[None], kind="causal-lm")
    assert e.passed
    assert any("second sample" in n for n in e.notes)
    assert e["batch_invariance"].passed is True  # two rows, one padded: both are compared


def test_equal_lengths_get_padding_added(tiny_lm) -> None:  # type: ignore[no-untyped-def]
    e = examine(tiny_lm(), torch.arange(5, 23).view(2, 9), kind="causal-lm")
    assert e.passed
    assert e.notes == ("no padding in the input: sample i was given i padding tokens (0)",)


@pytest.mark.parametrize(
    ("ids", "mask", "error", "match"),
    [
        (torch.ones(2, 3), None, TypeError, "int32/int64"),
        (torch.ones(3, dtype=torch.long), None, ValueError, r"\[B, T\]"),
        (torch.ones(2, 3, dtype=torch.long), torch.ones(2, 4), ValueError, "shape of input_ids"),
        (torch.ones(2, 3, dtype=torch.long), torch.full((2, 3), 2), ValueError, "1 .token."),
        (
            torch.ones(2, 3, dtype=torch.long),
            torch.tensor([[1, 1, 1], [0, 0, 0]]),
            ValueError,
            "row 1 has no token",
        ),
        (
            torch.ones(2, 3, dtype=torch.long),
            torch.tensor([[1, 1, 1], [1, 0, 1]]),
            ValueError,
            "not padding",
        ),
    ],
)
def test_bad_arguments_raise(tiny_lm, ids, mask, error, match) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(error, match=match):
        examine(tiny_lm(), ids, mask, kind="causal-lm")


def test_kind_is_inferred_or_asked_for(hf_model, tiny_lm) -> None:  # type: ignore[no-untyped-def]
    assert adapter_for(hf_model("llama"), None).kind == "causal-lm"
    assert adapter_for(hf_model("gpt2").transformer, None).kind == "causal-lm"
    assert adapter_for(hf_model("bert"), None).kind == "encoder"
    assert adapter_for(hf_model("t5"), None).kind == "seq2seq"
    with pytest.raises(ValueError, match="kind could not be inferred"):
        adapter_for(tiny_lm(), None)
    with pytest.raises(ValueError, match="kind must be one of"):
        adapter_for(tiny_lm(), "decoder")
    with pytest.raises(ValueError, match="contradicts"):
        adapter_for(hf_model("bart"), "causal-lm")
    with pytest.raises(ValueError, match="plain callable"):
        adapter_for(tiny_lm(), "seq2seq")
    with pytest.raises(TypeError, match="callable"):
        adapter_for(3, "encoder")


class _Hidden:
    """A callable whose module sits in an attribute, where examine does not look."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.inner = model

    def __call__(self, ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        return self.inner(ids, attention_mask)


def test_bound_without_float64_rerun_says_it_is_an_estimate(tiny_lm, batch) -> None:  # type: ignore[no-untyped-def]
    e = examine(_Hidden(tiny_lm()), *batch, kind="causal-lm")
    bound = e["causality"].bound
    assert bound is not None and bound.source.startswith("estimate")
    assert "no nn.Module found" in bound.source
    assert e["finite_gradients"].passed is None
    assert e.passed


def test_float64_model_bound_is_scaled_from_a_float32_rerun(tiny_lm, batch) -> None:  # type: ignore[no-untyped-def]
    model = tiny_lm().double()
    e = examine(model, *batch, kind="causal-lm")
    bound = e["causality"].bound
    assert bound is not None and "eps64/eps32" in bound.source and bound.value < 1e-12
    assert e.passed, str(e)
    assert all(p.dtype == torch.float64 for p in model.parameters())


class _NoisyAlone(torch.nn.Module):
    """Correct, but a single sample runs with internals one precision below the model's dtype
    (as eager attention in bfloat16 is noisier than SDPA): bfloat16 rounding in float32 runs,
    none in float64 runs."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        out = self.inner(ids, attention_mask)
        if ids.shape[0] == 1 and out.dtype == torch.float32:
            out = out.bfloat16().float()
        return out


def test_noisier_path_is_proven_against_its_own_float64_noise(tiny_lm, batch) -> None:  # type: ignore[no-untyped-def]
    e = examine(_NoisyAlone(tiny_lm()), *batch, kind="causal-lm")
    p = e["batch_invariance"]
    assert p.passed is True and p.bound is not None and p.error is not None
    assert "each run's own rounding" in p.bound.source
    assert p.error > 1e3 * e["pad_value_invariance"].bound.value  # far above the screen
    assert e.passed, str(e)


def test_texts_of_one_length_run_unpadded_in_one_call() -> None:
    ids = torch.tensor([[5, 6, 7], [8, 9, 0], [3, 4, 2]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1]])
    samples, notes = Samples.from_batch(ids, mask, pad_id=None)
    assert notes == [] and samples.pad_id == 0 and samples.pads == (0, 1, 0)
    batch, row = samples.unpadded(2)
    assert batch.ids.tolist() == [[5, 6, 7], [3, 4, 2]] and row == 1
    assert batch.name == "the 2 texts of 3 tokens, unpadded" and bool(batch.mask.all())
    alone, row = samples.unpadded(1)
    assert alone.ids.tolist() == [[8, 9]] and alone.name == "text 1 alone, unpadded"
    assert samples.padded("left").ids.tolist() == [[5, 6, 7], [0, 8, 9], [3, 4, 2]]
