"""Scaling advice: the cost fit on real workers, and the projection's arithmetic.

Timings are not asserted (that is the benchmarks' job,
``benchmarks/validate_cost_model.py``): here the fit must recover a line it
is given, the engine's timings must reach every worker alike, and the
projection must follow S(W) = S_min (1 + B_simple / W) times the step time.
"""

from __future__ import annotations

import io
import math
from typing import Any

import pyro
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO

import pyro_distributed as pd
from pyro_distributed.scaling import DEFAULT_WORKERS

from .support.harness import run_workers
from .support.noise_scale import BATCH, N, dataset, model, normal_guide


def test_the_fit_recovers_the_line_it_is_given() -> None:
    latency, bandwidth = 2e-4, 3e9
    timings = [(size, latency + size / bandwidth) for size in (1e3, 1e5, 1e6, 8e6)]
    cost = pd.scaling.CollectiveCost.fit(timings, world_size=2)  # type: ignore[arg-type]
    assert cost.latency_s == pytest.approx(latency, rel=1e-9)
    assert cost.bandwidth == pytest.approx(bandwidth, rel=1e-9)
    assert cost.seconds(4e6) == pytest.approx(latency + 4e6 / bandwidth)
    # Ring extrapolation: W=2 is the fitted cost itself; W=1 sends nothing.
    assert cost.at(2, 4e6) == pytest.approx(cost.seconds(4e6))
    assert cost.at(1, 4e6) == 0.0
    assert cost.at(8, 0) == pytest.approx(7 * latency)


def test_the_fit_needs_two_sizes() -> None:
    with pytest.raises(ValueError, match="two or more sizes"):
        pd.scaling.CollectiveCost.fit([(100, 1e-4), (100, 2e-4)], world_size=2)


def test_in_step_puts_what_the_step_costs_beyond_compute_into_the_latency() -> None:
    cost = pd.scaling.CollectiveCost(1e-4, 1e9, world_size=2).in_step(
        step_s=0.012, compute_s=0.010, gradient_bytes=1e6
    )
    assert cost.latency_s == pytest.approx(0.002 - 1e-3)
    assert cost.bandwidth == 1e9


def timings_on_workers() -> list[tuple[int, float]]:
    return pd.scaling.measure_collective(sizes=[4096, 2**20], repeats=3)


def test_every_worker_gets_the_same_timings_of_real_all_reduces() -> None:
    results = run_workers(timings_on_workers, world_size=2)
    assert results[0] == results[1]
    assert [size for size, _ in results[0]] == [4096, 2**20]
    assert all(seconds > 0 for _, seconds in results[0])
    cost = pd.scaling.CollectiveCost.fit(results[0], world_size=2)
    assert cost.latency_s >= 0 and 0 < cost.bandwidth < math.inf


def test_the_projection_follows_steps_times_step_time() -> None:
    noise = pd.NoiseScale(1.0, 4.0, 4.0, world_size=2, steps=50)
    cost = pd.scaling.CollectiveCost(1e-3, 1e9, world_size=2)
    projection = pd.scaling.project_scaling(
        noise, 0.010, 1e6, cost, steps_to_target=3000, network_latency_s=1e-4
    )
    rows = {row.workers: row for row in projection.rows}
    assert tuple(rows) == DEFAULT_WORKERS
    min_steps = 3000 / (1 + 4.0 / 2)  # this run, at W=2, takes 3000 steps
    for count, row in rows.items():
        assert row.steps == pytest.approx(min_steps * (1 + 4.0 / count))
        assert row.time == pytest.approx(row.steps * row.step_s)
        assert row.worker_time == pytest.approx(count * row.time)
    assert rows[1].step_s == 0.010
    assert rows[2].step_s == pytest.approx(0.010 + 1e-3 + 1e6 / 1e9)
    # Beyond W=2 the given hop latency and the fitted link bandwidth (1e9 at W=2).
    assert rows[8].step_s == pytest.approx(0.010 + 14 * 1e-4 + 14 / 8 * 1e6 / 1e9)
    fastest = min(row.time for row in projection.rows)
    assert rows[projection.recommended].time <= 1.1 * fastest
    assert all(
        row.time > 1.1 * fastest for row in projection.rows if row.workers < projection.recommended
    )
    table = projection.table()
    assert "B_simple = 4 worker batches" in table and "100 us per hop" in table
    assert f"recommended: {projection.recommended} workers" in table


def test_a_projection_without_a_usable_noise_scale_is_refused() -> None:
    buried = pd.NoiseScale(-1.0, 4.0, math.inf, world_size=2, steps=5)
    with pytest.raises(ValueError, match="not usable yet"):
        pd.scaling.project_scaling(buried, 0.01, 1e6, pd.scaling.CollectiveCost(1e-3, 1e9, 2))


def advise() -> dict[str, Any]:
    pyro.clear_param_store()
    x, y, w = dataset(1.0)
    pyro.param("w_loc", w.clone())
    optim = pd.DistributedOptimizer(pyro.optim.Adam({"lr": 1e-3}), noise_scale=True)
    svi = SVI(model, normal_guide, optim, Trace_ELBO())
    draws = torch.Generator().manual_seed(pd.rank())

    def step() -> float:
        return svi.step(x, y, torch.randint(N, (BATCH,), generator=draws))

    for _ in range(30):
        step()
    out = io.StringIO()
    projection = pd.scaling.scaling_advice(optim, step, measure_steps=5, file=out)
    return {"printed": out.getvalue(), "projection": projection}


def test_scaling_advice_prints_one_table_on_worker_zero() -> None:
    first, second = run_workers(advise)
    assert second["printed"] == ""
    printed = first["printed"]
    assert "gradient noise scale over 35 steps" in printed
    assert printed.count("assumed:") == 4 and "recommended:" in printed
    assert first["projection"] == second["projection"]
    assert first["projection"].relative
    here = next(row for row in first["projection"].rows if row.workers == 2)
    assert here.time == pytest.approx(1.0)  # relative to this run
