"""gather_pieces: every worker's pieces joined in rank order, streamed one piece at a time."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import pyro_distributed as pd
from pyro_distributed.gather import gather_pieces

from .support.harness import CountingEngine, run_workers


def gathered(to: str) -> tuple[Any, list[tuple[str, int]]]:
    engine = CountingEngine(pd.current_engine())
    rank = engine.rank
    pieces = {
        "rows": torch.full((rank + 1, 2), float(rank)),
        "flags": torch.tensor([rank % 2 == 0] * (rank + 1)),
        "shared": torch.arange(3),
    }
    result = gather_pieces(engine, pieces, {"rows": 0, "flags": 0, "shared": None}, to)
    return result, engine.calls


def test_gather_pieces_streams_one_broadcast_per_piece_in_rank_order() -> None:
    (result, calls), (nothing, _) = run_workers(gathered, "main", world_size=2)
    assert nothing is None
    assert result["rows"].tolist() == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]
    assert result["flags"].tolist() == [True, False, False]
    assert result["shared"].tolist() == [0, 1, 2]
    # One object all-gather for the shapes, then a broadcast per worker's piece
    # (two joined results); the shared result, checked by digest, does not travel.
    assert calls == [("allgather_object", 1)] + [("broadcast", 1)] * 4


def gathered_everywhere() -> tuple[dict[str, torch.Tensor] | None, list[tuple[str, int]]]:
    engine = CountingEngine(pd.current_engine())
    rank = engine.rank
    pieces = {
        # Columns joined along the last axis; worker 1 holds none of them.
        "columns": torch.full((2, 0 if rank == 1 else rank + 1), float(rank)),
        "doubles": torch.full((1, 2), rank, dtype=torch.float64),
    }
    result = gather_pieces(engine, pieces, {"columns": -1, "doubles": 0}, to="all")
    return result, engine.calls


def test_gather_to_all_joins_along_any_axis_and_skips_empty_pieces() -> None:
    results = run_workers(gathered_everywhere, world_size=3)
    for result, calls in results:
        assert result is not None
        assert result["columns"].tolist() == [[0.0, 2.0, 2.0, 2.0]] * 2
        assert result["doubles"].dtype == torch.float64
        assert result["doubles"].tolist() == [[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]]
        # Worker 1's empty piece of "columns" does not travel: 2 + 3 broadcasts.
        assert calls == [("allgather_object", 1)] + [("broadcast", 1)] * 5


def refused(case: str) -> str:
    rank = pd.rank()
    pieces: dict[str, torch.Tensor]
    axes: dict[str, Any]
    if case == "names":
        pieces = {"a": torch.zeros(1)} if rank == 0 else {"a": torch.zeros(1), "b": torch.zeros(1)}
        axes = {"a": 0, "b": 0}
    elif case == "dtype":
        pieces = {"a": torch.zeros(1, dtype=torch.float32 if rank == 0 else torch.float64)}
        axes = {"a": 0}
    elif case == "shared":
        pieces, axes = {"a": torch.tensor([float(rank)])}, {"a": None}
    elif case == "shapes":
        pieces, axes = {"a": torch.zeros(2, 3 + rank)}, {"a": 0}
    else:  # "scalar"
        pieces, axes = {"a": torch.tensor(1.0)}, {"a": 0}
    with pytest.raises(pd.PyroDistributedError) as info:
        gather_pieces(pd.current_engine(), pieces, axes)
    return str(info.value)


REFUSALS = {
    "names": "workers disagree on the result 'b' to gather (worker 0: no such result; "
    "worker 1: torch.float32)",
    "dtype": "workers disagree on the result 'a' to gather (worker 0: torch.float32; "
    "worker 1: torch.float64)",
    "shared": "'a' should be identical on every worker but differs (worker 0: digest ",
    "shapes": "the pieces of 'a' do not fit together along axis 0: shape (2, 3) on "
    "worker 0, (2, 4) on worker 1",
    "scalar": "'a' is a scalar on worker 0; it cannot be joined",
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_pieces_that_do_not_fit_are_refused_on_every_worker(case: str) -> None:
    messages = run_workers(refused, case)
    assert messages[0] == messages[1]
    assert REFUSALS[case] in messages[0]
