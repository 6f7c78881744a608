"""Bugs in a ``transformers`` attention function registered through ``AttentionInterface``.

Each buggy function is registered under its own name and set on a tiny Llama; the doctor must
name the kind and the module path (``model.layers.N.self_attn``).
"""

from __future__ import annotations

from typing import Any

import hf_models as hm
import pytest
import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from qkv import doctor


def _sdpa(module: Any, q: Any, k: Any, v: Any, mask: Any, **kw: Any) -> tuple[Any, None]:
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    is_causal = kw.pop("is_causal", False)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal)
    return out.transpose(1, 2).contiguous(), None


def drops_mask(module: Any, q: Any, k: Any, v: Any, mask: Any, **kw: Any) -> Any:
    return _sdpa(module, q, k, v, None, is_causal=q.shape[2] > 1)


def inverts_mask(module: Any, q: Any, k: Any, v: Any, mask: Any, **kw: Any) -> Any:
    return _sdpa(module, q, k, v, None if mask is None else ~mask)


def weak_mask(module: Any, q: Any, k: Any, v: Any, mask: Any, **kw: Any) -> Any:
    additive = None if mask is None else (~mask).float() * -1.0
    return _sdpa(module, q, k, v, additive)


def causal_with_cache(module: Any, q: Any, k: Any, v: Any, mask: Any, **kw: Any) -> Any:
    return _sdpa(module, q, k, v, None, is_causal=True)


def float16_mask(module: Any, q: Any, k: Any, v: Any, mask: Any, **kw: Any) -> Any:
    additive = None if mask is None else ((~mask).half() * float("-inf")).float()  # 0 * -inf
    return _sdpa(module, q, k, v, additive)


def swaps_samples(module: Any, q: Any, k: Any, v: Any, mask: Any, **kw: Any) -> Any:
    return _sdpa(module, q, k, v, None if mask is None else mask.flip(0))


def off_by_one(module: Any, q: Any, k: Any, v: Any, mask: Any, **kw: Any) -> Any:
    if mask is None or q.shape[2] == 1:
        return _sdpa(module, q, k, v, mask)
    T = q.shape[2]
    return _sdpa(module, q, k, v, mask & ~torch.eye(T, dtype=torch.bool))  # no query sees itself


def nan_in_value(module: Any, q: Any, k: Any, v: Any, mask: Any, **kw: Any) -> Any:
    v = v.clone()
    v[:, :, 0] = float("nan")
    return _sdpa(module, q, k, v, mask)


BUGS = {
    "float16_mask": (float16_mask, "nonfinite_mask"),
    "swaps_samples": (swaps_samples, "mask_broadcast"),
    "off_by_one": (off_by_one, "all_blocked_rows"),
    "nan_in_value": (nan_in_value, "nonfinite_output"),
    "drops_mask": (drops_mask, "padding_leak"),
    "inverts_mask": (inverts_mask, "inverted_mask"),
    "weak_mask": (weak_mask, "weak_mask"),
    "causal_with_cache": (causal_with_cache, "causal_misaligned"),
}


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_a_buggy_registered_function_is_caught(bug: str) -> None:
    fn, kind = BUGS[bug]
    name = f"doctor_test_{bug}"
    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, sdpa_mask)
    model = hm.build("llama", name)
    with doctor.watch(model) as report:
        hm.run(model, "llama", "left")
    found = report.by_kind(kind)
    assert found, f"{bug}: expected {kind}, got\n{report}"
    assert found[0].severity == "error"
    assert found[0].where.startswith("model.layers.0.self_attn ("), found[0].where
    assert {f.where.split(" ")[0] for f in found} == {
        "model.layers.0.self_attn",
        "model.layers.1.self_attn",
    }
    assert not report.ok


def test_the_eager_path_is_judged_from_its_arguments() -> None:
    """eager calls no kernel: its additive float mask is read as transformers builds it."""
    model = hm.build("gpt2", "eager")
    with doctor.watch(model) as report:
        hm.run(model, "gpt2", "left")
    assert report.calls == 4 and report.ok, str(report)
