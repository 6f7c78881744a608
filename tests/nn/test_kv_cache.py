"""KVCache: appends, shared length, reorder, reset and clear misuse errors."""

import pytest
import torch

from qkv import KVCache


def test_update_appends_and_returns_everything() -> None:
    cache = KVCache(num_layers=2, capacity=6)
    k1, v1 = torch.randn(2, 3, 4, 5), torch.randn(2, 3, 4, 7)
    k_all, v_all = cache.update(0, k1, v1)
    assert torch.equal(k_all, k1) and torch.equal(v_all, v1)
    assert cache.length == 0  # layer 1 has not seen this step yet
    cache.update(1, k1, v1)
    assert cache.length == len(cache) == 4
    k2, v2 = torch.randn(2, 3, 1, 5), torch.randn(2, 3, 1, 7)
    k_all, v_all = cache.update(0, k2, v2)
    assert k_all.shape == (2, 3, 5, 5)
    assert torch.equal(k_all, torch.cat([k1, k2], 2)) and torch.equal(v_all, torch.cat([v1, v2], 2))


def test_misuse_errors() -> None:
    cache = KVCache(1, 3)
    k = torch.randn(1, 2, 2, 4)
    with pytest.raises(RuntimeError, match="out of range"):
        cache.update(1, k, k)
    cache.update(0, k, k)
    with pytest.raises(RuntimeError, match="overflow"):
        cache.update(0, k, k)
    with pytest.raises(RuntimeError, match="do not match"):
        cache.update(0, torch.randn(1, 1, 1, 4), torch.randn(1, 1, 1, 4))
    with pytest.raises(RuntimeError, match="equal B"):
        cache.update(0, torch.randn(1, 2, 1, 4), torch.randn(1, 2, 2, 4))
    two = KVCache(2, 8)
    two.update(0, k, k)
    with pytest.raises(RuntimeError, match="twice"):
        two.update(0, k, k)
    with pytest.raises(ValueError, match="capacity"):
        KVCache(1, 0)
    with pytest.raises(TypeError, match="capacity"):
        KVCache(1, True)
    with pytest.raises(ValueError, match="num_layers"):
        KVCache(0, 4)


def test_max_len_is_a_deprecated_alias_of_capacity() -> None:
    with pytest.warns(DeprecationWarning, match="capacity"):
        cache = KVCache(2, max_len=5)
    assert cache.capacity == 5
    with pytest.warns(DeprecationWarning, match="capacity"):
        assert cache.max_len == 5
    with pytest.raises(TypeError, match="capacity only"), pytest.warns(DeprecationWarning):
        KVCache(2, 5, max_len=5)
    assert "capacity=5" in repr(cache)


def test_padding_reorder_and_reset() -> None:
    cache = KVCache(1, 8)
    assert cache.append_padding(None, 2) is None
    cache.update(0, torch.randn(3, 1, 2, 4), torch.randn(3, 1, 2, 4))
    pad = torch.tensor([[False], [True], [False]])
    full = cache.append_padding(pad, 1)
    assert full is not None
    assert full.tolist() == [[False, False, False], [False, False, True], [False, False, False]]
    with pytest.raises(RuntimeError, match="twice"):
        cache.append_padding(None, 1)
    k_new = torch.randn(3, 1, 1, 4)
    cache.update(0, k_new, k_new)
    cache.set_cross(0, torch.arange(3.0)[:, None, None, None], torch.zeros(3, 1, 1, 1))
    cache.reorder(torch.tensor([1, 1, 0]))
    k_all, _ = cache.update(0, torch.zeros(3, 1, 1, 4), torch.zeros(3, 1, 1, 4))
    assert torch.equal(k_all[0, :, 2], k_new[1, :, 0]) and torch.equal(
        k_all[2, :, 2], k_new[0, :, 0]
    )
    cross = cache.get_cross(0)
    assert cross is not None and cross[0].flatten().tolist() == [1.0, 1.0, 0.0]
    cache.reset()
    assert cache.length == 0 and cache.get_cross(0) is None
    assert cache.append_padding(None, 1) is None
