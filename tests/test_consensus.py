"""Finding and naming workers that disagree (pyro_distributed.consensus),
on real worker processes."""

from __future__ import annotations

import pytest

import pyro_distributed as pd
from pyro_distributed.consensus import (
    ABSENT,
    describe_split,
    describe_workers,
    first_disagreement,
    require_agreement,
)

from .support.harness import WorkerFailure, run_workers


def test_workers_are_named_in_one_format() -> None:
    assert describe_workers([1]) == "worker 1"
    assert describe_workers({2, 0}) == "workers 0, 2"
    assert describe_split([10, 12, 10]) == "workers 0, 2: 10; worker 1: 12"
    assert describe_split(["a", ABSENT], lambda v: "none" if v is ABSENT else v) == (
        "worker 0: a; worker 1: none"
    )


def test_first_disagreement_finds_the_first_item_in_sorted_order() -> None:
    views = [{"b": 1, "a": 1, "c": 5}, {"b": 2, "a": 1}, {"b": 1, "a": 1, "c": 5}]
    assert first_disagreement(views) == ("b", [1, 2, 1])
    assert first_disagreement([{"c": 5}, {}]) == ("c", [5, ABSENT])
    assert first_disagreement([{"a": 1}, {"a": 1}]) is None


def _agree(sizes: list[int]) -> str:
    try:
        require_agreement(
            pd.current_engine(),
            {"plate 'data'": sizes[pd.rank()]},
            message=lambda item, split: f"workers disagree on {item} ({split})",
            describe=lambda size: f"size {size}",
        )
    except pd.PyroDistributedError as exc:
        return str(exc)
    return "agreed"


def test_require_agreement_raises_the_same_message_on_every_worker() -> None:
    messages = run_workers(_agree, [10, 12, 10], world_size=3)
    expected = "workers disagree on plate 'data' (workers 0, 2: size 10; worker 1: size 12)"
    assert messages == [expected] * 3


def test_require_agreement_is_silent_when_all_agree() -> None:
    messages = run_workers(_agree, [7, 7], world_size=2)
    assert messages == ["agreed", "agreed"]


def test_a_worker_that_skips_the_check_fails_the_others_instead_of_hanging() -> None:
    # Worker 1 leaves without calling it: worker 0 must get an error, not hang.
    with pytest.raises(WorkerFailure) as info:
        run_workers(_agree_on_rank_zero_only, world_size=2)
    assert "worker 1 leaves" in info.value.reports[1]
    assert "failed on worker 0 of 2" in info.value.results[0]


def _agree_on_rank_zero_only() -> str:
    if pd.rank() == 0:
        return _agree([1, 1])
    raise RuntimeError("worker 1 leaves")
