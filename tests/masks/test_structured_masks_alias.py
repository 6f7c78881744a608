"""qkv.structured_masks: the 0.1 module path of the rules, kept for one release with a warning."""

from __future__ import annotations

import importlib
import sys

import pytest

from qkv import masks


def test_structured_masks_reexports_the_rules_and_warns() -> None:
    sys.modules.pop("qkv.structured_masks", None)
    with pytest.warns(DeprecationWarning, match=r"use qkv\.masks"):
        old = importlib.import_module("qkv.structured_masks")
    for name in ("Causal", "SlidingWindow", "Padding", "Documents", "MaskMod", "Dense"):
        assert getattr(old, name) is getattr(masks, name), name
    assert old.StructuredMask is masks.StructuredMask
    assert old.Union is masks.AnyOf and old.AnyOf is masks.AnyOf
    assert old.FULL is masks.FULL and old.EMPTY is masks.EMPTY
    for name in old.__all__:
        assert getattr(old, name) is not None, name
    assert "Causal" in dir(old)
