"""block_range: one contiguous block per worker, every row on exactly one worker."""

from __future__ import annotations

import pytest

import pyro_distributed as pd
from pyro_distributed.partition import block_range

from .support.harness import run_workers


def blocks(sizes: list[int]) -> list[range]:
    return [block_range(n) for n in sizes]


@pytest.mark.parametrize("workers", [2, 3])
def test_blocks_cover_every_row_once_in_rank_order(workers: int) -> None:
    sizes = [0, 1, 2, 7, 10, 12]
    per_worker = run_workers(blocks, sizes, world_size=workers)
    for index, n in enumerate(sizes):
        mine = [per_worker[rank][index] for rank in range(workers)]
        assert [row for block in mine for row in block] == list(range(n)), n
        lengths = [len(block) for block in mine]
        assert max(lengths) - min(lengths) <= 1, (n, lengths)
        assert all(block.step == 1 for block in mine)


def test_three_workers_get_the_documented_blocks() -> None:
    per_worker = run_workers(blocks, [10, 2], world_size=3)
    assert [r[0] for r in per_worker] == [range(0, 3), range(3, 6), range(6, 10)]
    assert [r[1] for r in per_worker] == [range(0, 0), range(0, 1), range(1, 2)]


def test_one_process_holds_everything() -> None:
    try:
        assert block_range(5) == range(5)
    finally:
        pd.shutdown()


def test_a_count_that_is_not_a_non_negative_int_is_refused_by_name() -> None:
    try:
        with pytest.raises(TypeError, match="n must be an int, got '5'"):
            pd.block_range("5")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="n must be an int"):
            pd.block_range(True)
        with pytest.raises(ValueError, match="n must be a non-negative int, got -1"):
            pd.block_range(-1)
    finally:
        pd.shutdown()
