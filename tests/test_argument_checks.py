"""qkv._checks: each check accepts its values unchanged and names the argument when it refuses."""

from __future__ import annotations

import pytest

from qkv._checks import check_bool, check_nonnegative_int, check_positive_int, check_probability


def test_positive_int() -> None:
    assert check_positive_int("n", 1) == 1
    assert check_positive_int("n", 7) == 7
    with pytest.raises(ValueError, match=r"n must be a positive int, got 0"):
        check_positive_int("n", 0)
    with pytest.raises(ValueError, match=r"got -3"):
        check_positive_int("n", -3)
    for bad in (True, 2.0, "2", None):
        with pytest.raises(TypeError, match=r"n must be an int"):
            check_positive_int("n", bad)


def test_nonnegative_int() -> None:
    assert check_nonnegative_int("k", 0) == 0
    assert check_nonnegative_int("k", 5) == 5
    with pytest.raises(ValueError, match=r"k must be a non-negative int, got -1"):
        check_nonnegative_int("k", -1)
    with pytest.raises(TypeError, match=r"k must be an int, got False"):
        check_nonnegative_int("k", False)


def test_bool() -> None:
    assert check_bool("flag", True) is True
    assert check_bool("flag", False) is False
    for bad in (0, 1, "yes", None):
        with pytest.raises(TypeError, match=r"flag must be a bool"):
            check_bool("flag", bad)


def test_probability() -> None:
    assert check_probability("p", 0) == 0.0
    assert isinstance(check_probability("p", 0), float)
    assert check_probability("p", 0.25) == 0.25
    assert check_probability("p", 1.0) == 1.0
    with pytest.raises(ValueError, match=r"p must lie in \[0, 1\), got 1.0"):
        check_probability("p", 1.0, inclusive_one=False)
    assert check_probability("p", 0.999, inclusive_one=False) == 0.999
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"p must lie in \[0, 1\]"):
            check_probability("p", bad)
    for bad_type in (True, "0.1", None):
        with pytest.raises(TypeError, match=r"p must be a float"):
            check_probability("p", bad_type)
