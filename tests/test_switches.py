"""The process-wide opt-ins: off by default, bools only, restored after a block."""

import pytest

from qkv.switches import Switch


def test_a_switch_is_off_until_set_and_takes_only_bools() -> None:
    s = Switch("allowed")
    assert s.on is False
    s.set(True)
    assert s.on is True
    with pytest.raises(TypeError, match=r"allowed must be a bool, got 1"):
        s.set(1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"allowed must be a bool, got 'no'"), s.scoped("no"):  # type: ignore[arg-type]
        pass
    assert s.on is True  # a refused value changes nothing


def test_scoped_restores_the_outer_state_also_after_an_error() -> None:
    s = Switch("allowed")
    with s.scoped():
        assert s.on
        with s.scoped(False):
            assert not s.on
        assert s.on
        with pytest.raises(RuntimeError), s.scoped(False):
            raise RuntimeError("inside")
        assert s.on
    assert not s.on
