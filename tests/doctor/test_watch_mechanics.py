"""The watch itself: nothing left behind, threads and nesting, capture, bad arguments."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import hf_models as hm
import pytest
import torch
import torch.nn.functional as F
from buggy import Tiny, attention_mask
from transformers.modeling_utils import AttentionInterface

import qkv
from qkv import doctor


def test_nothing_outlives_the_block() -> None:
    before_get = AttentionInterface.get_interface
    before_hooks = (
        dict(torch.nn.modules.module._global_forward_pre_hooks),
        dict(torch.nn.modules.module._global_forward_hooks),
        dict(torch.nn.modules.module._global_forward_hooks_with_kwargs),
        dict(torch.nn.modules.module._global_forward_hooks_always_called),
    )
    with doctor.watch(Tiny()):
        assert AttentionInterface.get_interface is not before_get
        assert torch._C._len_torch_function_stack() == 1
    assert AttentionInterface.get_interface is before_get
    assert torch._C._len_torch_function_stack() == 0
    after_hooks = (
        dict(torch.nn.modules.module._global_forward_pre_hooks),
        dict(torch.nn.modules.module._global_forward_hooks),
        dict(torch.nn.modules.module._global_forward_hooks_with_kwargs),
        dict(torch.nn.modules.module._global_forward_hooks_always_called),
    )
    assert after_hooks == before_hooks


def test_the_block_cleans_up_when_the_model_raises() -> None:
    with pytest.raises(RuntimeError, match="boom"), doctor.watch():
        raise RuntimeError("boom")
    assert torch._C._len_torch_function_stack() == 0


def test_watches_nest_and_threads_are_separate() -> None:
    q = torch.randn(1, 1, 3, 4)
    seen_in_thread: list[int] = []

    def other_thread() -> None:  # no watch here: its calls belong to nobody
        F.scaled_dot_product_attention(q, q, q)
        seen_in_thread.append(torch._C._len_torch_function_stack())

    with doctor.watch() as outer:
        F.scaled_dot_product_attention(q, q, q)
        with doctor.watch() as inner:
            F.scaled_dot_product_attention(q, q, q)
            t = threading.Thread(target=other_thread)
            t.start()
            t.join()
    assert (outer.calls, inner.calls) == (2, 1)
    assert seen_in_thread == [0]


def test_capture_matches_the_float64_reference_in_row_blocks() -> None:
    """One head of a 600-token call is recomputed in blocks of 256 rows, exactly."""
    q, k, v = (torch.randn(2, 3, 600, 8) for _ in range(3))
    with doctor.watch(capture="scaled_dot", heads=[1], samples=[1]) as report:
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
    weights = report.attention("F.scaled_dot_product_attention")
    assert weights.shape == (1, 1, 600, 600) and weights.dtype == torch.float32
    _, expected = qkv.attention(
        q[1:, 1:2].double(),
        k[1:, 1:2].double(),
        v[1:, 1:2].double(),
        mask=qkv.masks.causal_mask(600),
        need_weights=True,
        backend="reference",
    )
    torch.testing.assert_close(weights.double(), expected, atol=1e-5, rtol=1.3e-6)
    assert json.loads(report.to_json())["captured"][0]["shape"] == [1, 1, 600, 600]


def test_capture_keeps_the_nan_rows_the_model_returned() -> None:
    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(2, 4, 8)
    padding = torch.tensor([[False] * 4, [True] * 4])
    with doctor.watch(mha, capture=".*", samples=[0, 1]) as report:
        mha(x, x, x, key_padding_mask=padding)
    w = report.attention("MultiheadAttention")  # [2, H, T, S]
    assert bool(w[1].isnan().all()) and bool(w[0].isfinite().all())
    torch.testing.assert_close(w[0].sum(-1), torch.ones(2, 4))


def test_report_renders_and_serializes() -> None:
    model = Tiny("dropped")
    with doctor.watch(model) as report:
        model(torch.randint(0, 50, (3, 3)), attention_mask=attention_mask())
    text = str(report)
    assert "padding_leak" in text and "layers.1" in text.splitlines()[2]
    data = json.loads(report.to_json())
    assert data["ok"] is False and data["findings"][0]["kind"] == "padding_leak"
    assert set(doctor.KINDS) >= {f["kind"] for f in data["findings"]}


def test_every_required_kind_is_documented() -> None:
    required = {
        "nonfinite_output",
        "nonfinite_mask",
        "weak_mask",
        "all_blocked_rows",
        "inverted_mask",
        "causal_misaligned",
        "mask_broadcast",
        "padding_leak",
        "hint",
    }
    assert required <= set(doctor.KINDS)
    assert all(d.symptom and d.cause and d.fix for d in doctor.KINDS.values())


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"model": "bert"}, TypeError, "model must be a torch.nn.Module"),
        ({"capture": "(unclosed"}, ValueError, "capture='\\(unclosed' is not a valid"),
        ({"heads": [-1]}, ValueError, "heads must be non-negative"),
    ],
)
def test_bad_arguments_are_clear(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match), doctor.watch(**kwargs):
        pass


def test_the_readme_documents_every_kind_as_the_code_does() -> None:
    readme = (Path(__file__).parents[2] / "README.md").read_text(encoding="utf-8")
    for kind, doc in doctor.KINDS.items():
        assert f"| `{kind}` | {doc.symptom} | {doc.cause} | {doc.fix} |" in readme, kind


def test_threads_with_their_own_watches_see_their_own_calls() -> None:
    """Two threads watch at once, start and end out of step: each report holds its calls."""
    reports: dict[str, doctor.Report] = {}
    barrier = threading.Barrier(2)
    original = AttentionInterface.get_interface

    def run(name: str, bug: str | None, rounds: int) -> None:
        model = Tiny(bug)
        ids = torch.randint(0, 50, (3, 3))
        barrier.wait()
        with doctor.watch(model) as report:
            for _ in range(rounds):
                model(ids, attention_mask=attention_mask())
        reports[name] = report

    threads = [
        threading.Thread(target=run, args=("clean", None, 3)),
        threading.Thread(target=run, args=("buggy", "dropped", 5)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert reports["clean"].calls == 6 and reports["clean"].findings == []
    assert reports["buggy"].calls == 10
    assert [f.kind for f in reports["buggy"].findings] == ["padding_leak"]
    assert torch._C._len_torch_function_stack() == 0
    assert AttentionInterface.get_interface is original


def test_a_transformers_model_is_watched_only_inside_its_attention_functions() -> None:
    """Every attention of a tiny Llama goes through AttentionInterface: no mode outside those
    calls (the rest of the model pays nothing per torch call), and the calls are still seen."""
    model = hm.build("llama", "sdpa")
    with doctor.watch(model) as report:
        assert torch._C._len_torch_function_stack() == 0
        hm.run(model, "llama", "left")
    assert report.calls == 4 and report.ok
    with doctor.watch(Tiny()):  # a plain torch model: the mode for the whole block
        assert torch._C._len_torch_function_stack() == 1
