"""``Engine.all_gather`` and ``Engine.reduce_scatter`` on every engine, on real workers.

One worker function (:func:`tensor_collectives`) makes every call and the
parent checks what came back: one run per engine and world size (the torch
engine over gloo and the mpi engine under ``mpiexec``, at two and three
workers; Horovod under ``horovodrun --gloo``; the local engine in this
process). A gather must return every worker's bits; a reduce-scatter must
return exactly this worker's rows of what ``allreduce_`` gives, and refuse a
first dimension the world size does not divide before it communicates.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import pyro_distributed as pd

from ..support.harness import (
    CountingEngine,
    HorovodSuites,
    one_pytest_worker,
    run_workers,
    with_engines,
)

#: Rows of every worker's share in the reduce-scatters, and columns of every row.
ROWS, COLUMNS = 2, 3
#: Rows per worker of the large reduce-scatter: a few megabytes, past the size
#: where transports change how they add.
LARGE_ROWS = 100_000
GATHERED_DTYPES = (torch.float32, torch.float64, torch.int64, torch.bfloat16, torch.bool)
REDUCED = [
    *((dtype, op) for dtype in (torch.float32, torch.float64) for op in ("sum", "mean", "max")),
    (torch.int64, "sum"),
    (torch.float16, "sum"),
]


def contribution(rank: int, world_size: int, dtype: torch.dtype) -> torch.Tensor:
    """What worker ``rank`` sends: ``arange`` plus ``100 * rank`` (small integers,
    so every sum, mean and maximum is exact in every dtype used)."""
    values = torch.arange(world_size * ROWS * COLUMNS).reshape(world_size * ROWS, COLUMNS)
    values = values + 100 * rank
    return values % (rank + 2) == 0 if dtype == torch.bool else values.to(dtype)


def spread(rank: int, world_size: int, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """Values from 1e-8 to 1e8 in magnitude (1e-2 to 1e2 in float16), whose
    sum depends on the order in which the workers' values are added."""
    generator = torch.Generator().manual_seed(1000 + rank)
    shape = (world_size * rows, COLUMNS)
    decades = 2 if dtype == torch.float16 else 8
    scale = 10.0 ** torch.randint(-decades, decades + 1, shape, generator=generator)
    return (torch.randn(shape, generator=generator, dtype=torch.float64) * scale).to(dtype)


def special_values(rank: int) -> torch.Tensor:
    """Values whose bits a gather must keep: a negative zero, a NaN with its
    sign, an infinity and a subnormal."""
    return torch.tensor([-0.0, -float("nan"), float("inf"), 1e-45, float(rank)])


def tensor_collectives() -> dict[str, Any]:
    """Every check's call, on the running engine; what the parent checks."""
    engine = pd.current_engine()
    rank, world = engine.rank, engine.world_size
    out: dict[str, Any] = {"rank": rank, "world": world, "engine": engine.name}

    out["gathered"] = {
        str(dtype): engine.all_gather(contribution(rank, world, dtype), name=f"rows.{dtype}")
        for dtype in GATHERED_DTYPES
    }
    out["special"] = engine.all_gather(special_values(rank), name="special")
    transposed = contribution(rank, world, torch.float32).t()  # not contiguous
    out["transposed"] = engine.all_gather(transposed, name="transposed")
    out["scalar"] = engine.all_gather(torch.tensor(float(rank)), name="scalar")
    out["empty"] = engine.all_gather(torch.empty(0, COLUMNS), name="empty")
    out["source_untouched"] = torch.equal(transposed, contribution(rank, world, torch.float32).t())

    out["scattered"] = {}
    for dtype, op in REDUCED:
        sent = contribution(rank, world, dtype)
        out["scattered"][f"{dtype} {op}"] = engine.reduce_scatter(sent, op, name=f"{dtype}.{op}")
        assert torch.equal(sent, contribution(rank, world, dtype)), "the input was changed"

    # Bit for bit what allreduce_ leaves in this worker's rows.
    out["as_allreduce"] = {}
    out["spread"] = {}
    cases = [
        (dtype, op, ROWS)
        for dtype in (torch.float32, torch.float64)
        for op in ("sum", "mean", "max")
    ]
    cases += [(torch.float16, "sum", ROWS), (torch.float32, "sum", LARGE_ROWS)]
    cases += [(torch.float64, "sum", LARGE_ROWS)]
    for dtype, op, rows in cases:
        sent = spread(rank, world, rows, dtype)
        mine = engine.reduce_scatter(sent, op, name=f"spread.{dtype}.{op}.{rows}")
        reduced = sent.clone()
        engine.allreduce_([reduced], op, [f"allreduce.{dtype}.{op}.{rows}"])
        key = f"{dtype} {op} {rows}"
        out["as_allreduce"][key] = (
            tuple(mine.shape) == (rows, COLUMNS)
            and mine.dtype == dtype
            and torch.equal(mine, reduced[rank * rows : (rank + 1) * rows])
        )
        if rows == ROWS:
            out["spread"][key] = (mine, reduced)

    refused = {}
    bad = {"scalar": torch.tensor(1.0)}
    if world > 1:
        bad["rows"] = torch.ones(2 * world + 1, COLUMNS)
    for label, tensor in bad.items():
        with pytest.raises(ValueError) as info:
            engine.reduce_scatter(tensor)
        refused[label] = str(info.value)
    with pytest.raises(ValueError) as info:
        engine.reduce_scatter(torch.ones(world, COLUMNS), op="min")  # type: ignore[arg-type]
    refused["op"] = str(info.value)
    out["refused"] = refused
    # Nothing was sent by the refused calls: the next collectives still pair up.
    out["after"] = engine.all_gather(torch.tensor([rank]), name="after")

    # What an engine that overrides neither inherits: broadcasts and an all-reduce.
    inherited = CountingEngine(engine)
    sent = spread(rank, world, ROWS, torch.float32)
    reduced = sent.clone()
    engine.allreduce_([reduced], "sum", ["allreduce.inherited"])
    out["inherited"] = {
        "gathered": inherited.all_gather(contribution(rank, world, torch.float64)),
        "special": inherited.all_gather(special_values(rank)),
        "as_allreduce": torch.equal(
            inherited.reduce_scatter(sent), reduced[rank * ROWS : (rank + 1) * ROWS]
        ),
        "calls": inherited.calls,
    }
    return out


def check(results: list[dict[str, Any]], world: int) -> None:
    """Every worker's results at world size ``world``."""
    assert [result["rank"] for result in results] == list(range(world))
    for rank, result in enumerate(results):
        assert result["world"] == world
        for dtype in GATHERED_DTYPES:
            gathered = result["gathered"][str(dtype)]
            expected = torch.stack([contribution(r, world, dtype) for r in range(world)])
            assert gathered.shape == (world, world * ROWS, COLUMNS)
            assert gathered.dtype == dtype
            assert torch.equal(gathered, expected), (rank, dtype)
        special = torch.stack([special_values(r) for r in range(world)])
        assert torch.equal(result["special"].view(torch.int32), special.view(torch.int32))
        transposed = torch.stack([contribution(r, world, torch.float32).t() for r in range(world)])
        assert torch.equal(result["transposed"], transposed)
        assert torch.equal(result["scalar"], torch.arange(world, dtype=torch.float32))
        assert result["empty"].shape == (world, 0, COLUMNS)
        assert result["source_untouched"]

        mine = slice(rank * ROWS, (rank + 1) * ROWS)
        for dtype, op in REDUCED:
            everyone = torch.stack([contribution(r, world, dtype).double() for r in range(world)])
            reduced = {
                "sum": everyone.sum(0),
                "mean": everyone.sum(0) / world,
                "max": everyone.amax(0),
            }[op]
            scattered = result["scattered"][f"{dtype} {op}"]
            assert scattered.shape == (ROWS, COLUMNS)
            assert scattered.dtype == dtype
            assert torch.equal(scattered, reduced[mine].to(dtype)), (rank, dtype, op)

        assert result["as_allreduce"] and all(result["as_allreduce"].values()), result[
            "as_allreduce"
        ]
        for key, (scattered, reduced) in result["spread"].items():
            # Every worker reduced to the same bits, and holds its rows of them.
            assert torch.equal(reduced, results[0]["spread"][key][1]), key
            dtype = scattered.dtype
            everyone = torch.stack([spread(r, world, ROWS, dtype).double() for r in range(world)])
            op = key.split()[1]
            exact = {"sum": everyone.sum(0), "mean": everyone.mean(0), "max": everyone.amax(0)}
            bound = everyone.abs().sum(0)[mine] * world * torch.finfo(dtype).eps
            assert torch.all((scattered.double() - exact[op][mine]).abs() <= bound), key

        refused = result["refused"]
        assert "shape ()" in refused["scalar"] and f"world size {world}" in refused["scalar"]
        if world > 1:
            shape = f"shape ({2 * world + 1}, {COLUMNS})"
            assert shape in refused["rows"] and f"world size {world}" in refused["rows"]
        assert "no reduction 'min'" in refused["op"]
        assert torch.equal(result["after"], torch.arange(world).reshape(world, 1))

        inherited = result["inherited"]
        expected = torch.stack([contribution(r, world, torch.float64) for r in range(world)])
        assert torch.equal(inherited["gathered"], expected)
        assert torch.equal(inherited["special"].view(torch.int32), special.view(torch.int32))
        assert inherited["as_allreduce"]
        assert inherited["calls"] == [("broadcast", 1)] * (2 * world) + [("allreduce_sum", 1)]
    # Every worker's rows together are the whole reduction.
    for key in results[0]["spread"]:
        whole = torch.cat([result["spread"][key][0] for result in results])
        assert torch.equal(whole, results[0]["spread"][key][1]), key


@pytest.mark.parametrize(("engine", "workers"), with_engines([2, 3], on_mpi=[2, 3]))
def test_all_gather_and_reduce_scatter_on_real_workers(engine: str, workers: int) -> None:
    check(run_workers(tensor_collectives, world_size=workers, engine=engine), workers)


def test_all_gather_and_reduce_scatter_on_one_local_worker() -> None:
    assert pd.init("local").name == "local"
    check([tensor_collectives()], 1)


HOROVOD = HorovodSuites({"main": [("collectives", tensor_collectives, ())]})


@pytest.mark.horovod
@one_pytest_worker(__name__)
@pytest.mark.parametrize("workers", [2, 3])
def test_all_gather_and_reduce_scatter_on_horovod(workers: int) -> None:
    results = HOROVOD.outcome("collectives", world_size=workers)
    assert {result["engine"] for result in results} == {"horovod"}
    check(results, workers)
