"""Argument validation (pyro_distributed.checks): TypeError for a wrong type,
ValueError for a value out of range, both naming the argument."""

from __future__ import annotations

import math

import pytest

from pyro_distributed.checks import check_bool, check_choice, check_int, check_number


def test_check_bool_takes_bools_and_none_only_when_optional() -> None:
    check_bool("overlap", True)
    check_bool("multi_tensor", None, optional=True)
    with pytest.raises(TypeError, match="overlap must be True or False, got 1"):
        check_bool("overlap", 1)
    with pytest.raises(TypeError, match="overlap must be True or False, got None"):
        check_bool("overlap", None)
    with pytest.raises(TypeError, match="must be True, False or None, got 'yes'"):
        check_bool("multi_tensor", "yes", optional=True)


def test_check_int_refuses_bools_floats_and_values_below_the_minimum() -> None:
    check_int("n", 0, minimum=0)
    check_int("check_every", None, minimum=1, optional=True)
    with pytest.raises(TypeError, match="check_every must be an int or None, got True"):
        check_int("check_every", True, minimum=1, optional=True)
    with pytest.raises(TypeError, match=r"n must be an int, got 2\.0"):
        check_int("n", 2.0)
    with pytest.raises(ValueError, match="check_every must be a positive int, got 0"):
        check_int("check_every", 0, minimum=1)
    with pytest.raises(ValueError, match="seed must be a non-negative int, got -1"):
        check_int("seed", -1, minimum=0)
    with pytest.raises(ValueError, match="k must be at least 3, got 2"):
        check_int("k", 2, minimum=3)


def test_check_number_states_every_condition_it_needs() -> None:
    check_number("bucket_cap_mb", 0.5, positive=True)
    check_number("ratio", math.inf, finite=False)
    with pytest.raises(TypeError, match="bucket_cap_mb must be a number, got False"):
        check_number("bucket_cap_mb", False, positive=True)
    with pytest.raises(TypeError, match="must be a number, got '1'"):
        check_number("bucket_cap_mb", "1")
    with pytest.raises(ValueError, match="bucket_cap_mb must be positive and finite, got 0"):
        check_number("bucket_cap_mb", 0, positive=True)
    with pytest.raises(ValueError, match="must be positive and finite, got inf"):
        check_number("bucket_cap_mb", math.inf, positive=True)
    with pytest.raises(ValueError, match=r"must be finite and less than 1\.0, got 1\.0"):
        check_number("smoothing", 1.0, below=1.0)


def test_check_choice_lists_the_choices() -> None:
    check_choice("nonfinite", "skip", ("skip", "raise"))
    with pytest.raises(ValueError, match="nonfinite must be 'skip' or 'raise', got 'ignore'"):
        check_choice("nonfinite", "ignore", ("skip", "raise"))
    with pytest.raises(ValueError, match="uneven must be 'split', 'drop' or 'pad', got 'x'"):
        check_choice("uneven", "x", ("split", "drop", "pad"))
    with pytest.raises(TypeError, match="nonfinite must be 'skip' or 'raise', got 1"):
        check_choice("nonfinite", 1, ("skip", "raise"))
