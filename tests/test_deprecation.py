"""qkv._deprecation: every shim warns in one wording, at the user's line, and still works."""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

import qkv
from qkv import DecoderOnlyConfig, DecoderOnlyLM, KVCache, TransformerConfig, masks
from qkv._deprecation import RenamedAttribute, renamed_keyword, warn_deprecated


def _warned(fn: Callable[[], Any]) -> tuple[Any, warnings.WarningMessage]:
    """``fn()``'s result and the one DeprecationWarning it raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn()
    deprecations = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert len(deprecations) == 1, [str(w.message) for w in caught]
    return result, deprecations[0]


def test_helpers_word_the_message_and_point_at_the_caller() -> None:
    _, w = _warned(lambda: warn_deprecated("old()", "new()", hint="why"))
    assert str(w.message) == "old() is deprecated; use new() (why)" and w.filename == __file__
    assert renamed_keyword("a", None, "b", 2) == 2  # the old name not given: no warning
    got, w = _warned(lambda: renamed_keyword("a", 1, "b", None, owner="f"))
    assert got == 1 and str(w.message) == "f(a=) is deprecated; use b=" and w.filename == __file__
    both = r"^f: got both b and its deprecated alias a; pass b only$"
    with pytest.raises(TypeError, match=both), pytest.warns(DeprecationWarning):
        renamed_keyword("a", 1, "b", 2, owner="f")

    class Box:
        size = 3
        length = RenamedAttribute[int]("size")

    got, w = _warned(lambda: Box().length)
    assert got == 3 and str(w.message) == "Box.length is deprecated; use Box.size"
    assert w.filename == __file__
    assert "Deprecated alias of :attr:`size`" in (vars(Box)["length"].__doc__ or "")


def test_renamed_keywords_and_attributes_warn_and_still_work() -> None:
    cache, w = _warned(lambda: KVCache(2, max_len=5))
    assert cache.capacity == 5 and w.filename == __file__
    assert str(w.message) == "KVCache(max_len=) is deprecated; use capacity="
    capacity, w = _warned(lambda: cache.max_len)
    assert capacity == 5 and str(w.message) == "KVCache.max_len is deprecated; use KVCache.capacity"

    cfg, w = _warned(lambda: TransformerConfig(src_vocab_size=4, tgt_vocab_size=4, max_len=9))
    assert cfg.max_positions == 9 and w.filename == __file__
    assert str(w.message) == "TransformerConfig(max_len=) is deprecated; use max_positions="
    positions, w = _warned(lambda: cfg.max_len)
    assert positions == 9 and w.filename == __file__
    assert str(w.message) == (
        "TransformerConfig.max_len is deprecated; use TransformerConfig.max_positions"
    )

    q = k = v = torch.randn(1, 1, 2, 4)
    attn_bias = torch.randn(1, 1, 2, 2)
    want, _ = qkv.attention(q, k, v, attn_bias=attn_bias, backend="reference")
    (got, _), w = _warned(lambda: qkv.attention(q, k, v, bias=attn_bias, backend="reference"))
    assert torch.equal(got, want) and w.filename == __file__
    assert str(w.message) == (
        "bias= is deprecated; use attn_bias= (the score tensor added before the softmax)"
    )

    model = DecoderOnlyLM(
        DecoderOnlyConfig(vocab_size=5, d_model=8, num_heads=2, num_layers=1)
    ).eval()
    ids = torch.tensor([[1, 2, 3]])
    new, old = model.new_cache(), model.new_cache()
    want = model(ids, kv_cache=new)
    got, w = _warned(lambda: model(ids, cache=old))
    assert torch.equal(got, want) and old.length == 3
    assert str(w.message) == "cache= is deprecated; use kv_cache="


@pytest.mark.parametrize(
    ("module", "message"),
    [
        (
            "qkv.structured_masks",
            "qkv.structured_masks is deprecated; use qkv.masks "
            "(e.g. from qkv.masks import Causal, Padding)",
        ),
        (
            "qkv.embed",
            "qkv.embed is deprecated; use qkv.apps.embed "
            "(e.g. from qkv.apps.embed import SentenceEmbedder)",
        ),
        (
            "qkv.checks",
            "qkv.checks is deprecated; use qkv._checks (argument checks are internal to qkv)",
        ),
    ],
)
def test_moved_modules_warn_and_still_work(module: str, message: str) -> None:
    sys.modules.pop(module, None)
    old, w = _warned(lambda: importlib.import_module(module))
    assert str(w.message) == message
    assert old.__all__ and all(getattr(old, name) is not None for name in old.__all__)


def test_union_warns_and_is_any_of() -> None:
    union, w = _warned(lambda: masks.Union)
    assert union is masks.AnyOf and w.filename == __file__
    assert str(w.message) == (
        "qkv.masks.Union is deprecated; use qkv.masks.AnyOf "
        "(it shadowed typing.Union; or combine rules with |)"
    )
